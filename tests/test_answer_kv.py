"""An answer's KV for the next turn (issue 44): an agent's next prompt re-sends the last answer, whose KV came from
decode steps. "prefill" (the server's default) prefills a parked answer again while the server is idle, in a cold
prefill's forwards, chunk by chunk: the next turn's cache hit reaches into the answer and its numbers stay a cold
prefill's, bit for bit on llama.cpp, and a request that comes mid-way prefills only what is left. "lend" (opt-in)
lends the decode-computed KV at once: hits reach the answer, numbers equal up to float rounding."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode import AutoregressiveGenerator
from specdecode.errors import OptionError
from specdecode.backends.prefix_cache import PrefixCache
from specdecode.server import ServerSettings
from test_server_helpers import metric, metric_values, openai_client, wait_until


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _run(gen, prompt, budget=None, max_new_tokens=16):
    """One greedy request of its own, run to the end (as a server's), its logprobs and 2 alternatives kept."""
    session = gen.session(prefill_tokens_per_step=budget)
    session.add(gen.request(prompt, max_new_tokens=max_new_tokens, logprobs=2, temperature=0, ignore_eos=True))
    while not session.idle:
        session.step()
    return session.result()


def _idle(gen, budget=None, chunks: int | None = None) -> list[int]:
    """The idle work a server does between requests: prefill chunks (all of them, or this many); their sizes."""
    session, done = gen.session(prefill_tokens_per_step=budget), []
    while chunks is None or len(done) < chunks:
        n = session.idle_prefill()
        if not n:
            break
        done.append(n)
    return done


def _assert_same(warm, cold):
    assert warm.token_ids == cold.token_ids
    assert warm.logprobs == cold.logprobs  # bit for bit: the same forwards computed the same numbers
    assert warm.top_logprobs == cold.top_logprobs


# ---------------------------------------------------------------------------------------------- llama.cpp
def _llama(path, rows=1, cache=0, answers="off"):
    from specdecode.backends.llamacpp import LlamaCppBackend

    gen = AutoregressiveGenerator(LlamaCppBackend(path, n_ctx=2048, max_rows=rows, n_threads=1))
    gen.set_prefix_cache(cache)
    if gen.prefix_cache is not None:
        gen.prefix_cache.answers = answers
    return gen


# the prompt and answer of a turn below n_batch (512), prefilled in 256-token chunks, and one that crosses n_batch in
# one prefill (the two other combinations repeated these: 76 s of the suite)
@pytest.mark.parametrize("prompt, answer, budget", [(100, 150, 256), (450, 150, None)])
def test_llamacpp_an_answer_prefilled_while_idle_is_lent_bit_for_bit(smol_path, budget, prompt, answer):
    system = _tokens(prompt, 49000, seed=prompt)
    warm, off, cold = _llama(smol_path, 2, 100_000, "prefill"), _llama(smol_path, 2, 100_000), _llama(smol_path)
    said = _run(warm, system, budget, answer).token_ids[0]
    _run(off, system, budget, answer)
    chunks = _idle(warm, budget)
    assert sum(chunks) == warm.prefix_cache.stats.idle_prefilled_tokens > 0
    assert _idle(off, budget) == []  # "off": nothing to do while idle
    question = system + said + _tokens(60, 49000, seed=1)
    got, before = _run(warm, question, budget), _run(off, question, budget)
    hit = got.row_stats[0].cached_tokens
    assert before.row_stats[0].cached_tokens <= prompt < hit  # into the answer, where only the prompt was lent
    assert hit % 64 == 0 and hit >= (prompt + answer - 1) // 64 * 64 - 64
    _assert_same(got, _run(cold, question, budget))
    _assert_same(before, got)


def test_llamacpp_a_request_arriving_mid_prefill_prefills_what_is_left(smol_path):
    system = _tokens(100, 49000, seed=5)
    warm, cold = _llama(smol_path, 2, 100_000, "prefill"), _llama(smol_path)
    said = _run(warm, system, 64, 200).token_ids[0]
    assert _idle(warm, 64, chunks=1) == [64]  # [64, 128): the prompt's last block and the answer's first tokens
    question = system + said + _tokens(60, 49000, seed=6)
    got = _run(warm, question, 64)
    assert got.row_stats[0].cached_tokens == 128
    _assert_same(got, _run(cold, question, 64))
    assert _idle(warm, 64) == []  # the new turn's entry covers the old one, which went


def test_llamacpp_a_request_arriving_stops_the_chunk_under_way_and_the_answers_stay_the_cold_ones(smol_path):
    """A request must not wait for the idle prefill: once abort_when() is true llama.cpp stops the chunk between
    two graph nodes, the parked answer keeps what it had, and later chunks and turns compute a cold run's numbers."""
    from specdecode.backends.base import Interrupted

    system = _tokens(100, 49000, seed=8)
    warm, cold = _llama(smol_path, 2, 100_000, "prefill"), _llama(smol_path)
    said = _run(warm, system, 256, 300).token_ids[0]
    session, asked = warm.session(prefill_tokens_per_step=256), []

    def arrived():  # a request arrives a few graph nodes into the chunk
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(Interrupted):
        session.idle_prefill(arrived)
    assert len(asked) == 4  # asked between nodes, and stopped at the first true
    assert warm.prefix_cache.stats.idle_prefilled_tokens == 0
    question = system + said + _tokens(60, 49000, seed=9)
    stopped_at_once = warm.session(prefill_tokens_per_step=256)
    with pytest.raises(Interrupted):
        stopped_at_once.idle_prefill(lambda: True)
    chunks = _idle(warm, 256)  # done again once idle, from the prompt's last whole block, in a cold prefill's cuts
    assert chunks[0] == 256 - 64 and sum(chunks) == warm.prefix_cache.stats.idle_prefilled_tokens
    got = _run(warm, question, 256)
    assert got.row_stats[0].cached_tokens >= 384
    _assert_same(got, _run(cold, question, 256))


def test_llamacpp_an_answer_within_its_prompts_last_block_is_left_alone(smol_path):
    """An answer that does not reach the next 64-token block would be lent no further: no idle work for it."""
    system = _tokens(300, 49000, seed=7)
    warm = _llama(smol_path, 2, 100_000, "prefill")
    _run(warm, system, None, 10)  # 309 tokens held: 256 lendable either way
    assert _idle(warm) == [] and warm.prefix_cache.stats.idle_prefilled_tokens == 0


def test_llamacpp_prefills_a_parked_answer_in_its_own_sequence(smol_path):
    """In place: no spare sequence (this backend has one, the parked entry's) and no copy of the KV stream."""
    gen = _llama(smol_path, 1, 100_000, "prefill")
    _run(gen, _tokens(100, 49000, seed=10), None, 100)
    assert gen.target.free_rows() == 0
    assert _idle(gen) == [135] and gen.prefix_cache.entries[0].handle.length == 199


def test_llamacpp_an_answer_that_comes_back_otherwise_is_prefilled_as_it_comes_back(smol_path):
    """A chat's answer comes back as the client re-sends it (the template writes a tool call in its own form): the
    entry is prefilled to that (PrefixCache.resend), and lends it bit for bit."""
    system = _tokens(100, 49000, seed=11)
    warm, cold = _llama(smol_path, 2, 100_000, "prefill"), _llama(smol_path)
    said = _run(warm, system, 256, 150).token_ids[0]
    resent = _tokens(140, 49000, seed=12)  # not one token in common with what was said
    warm.prefix_cache.resend(system + said, len(system), lambda: system + resent)
    assert sum(_idle(warm, 256)) == 240 - 64  # from the prompt's last whole block [64, 100) on
    question = system + resent + _tokens(60, 49000, seed=13)
    got = _run(warm, question, 256)
    assert got.row_stats[0].cached_tokens == 192  # into the answer as re-sent; what was said would give 64
    _assert_same(got, _run(cold, question, 256))


def test_llamacpp_lent_answers_reach_the_answer_up_to_float_rounding(smol_path):
    system = _tokens(100, 49000, seed=8)
    lend, cold = _llama(smol_path, 2, 100_000, "lend"), _llama(smol_path)
    said = _run(lend, system, 256, 150).token_ids[0]
    assert _idle(lend, 256) == []  # lent as it is: nothing to prefill
    question = system + said + _tokens(60, 49000, seed=9)
    got, want = _run(lend, question, 256), _run(cold, question, 256)
    assert got.row_stats[0].cached_tokens == len(system) + len(said) - 1  # all it holds (the last was never fed)
    same = next((i for i, (a, b) in enumerate(zip(got.token_ids[0], want.token_ids[0])) if a != b),
                len(want.token_ids[0]))
    assert same >= 1
    drift = np.abs(np.subtract(got.logprobs[0][:same], want.logprobs[0][:same]))
    assert 0 < drift.max() < 0.5  # decode-shaped KV: other kernels' rounding (measured 0.04-0.21 here), not bits


# ---------------------------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("answers", ["prefill", "lend"])
def test_transformers_answers_are_lent_after_an_idle_prefill_or_at_once(tiny_pair, answers):
    """transformers' one-token forwards round otherwise than a prefill's on the CPU: "prefill" lends the answer
    once prefilled again (as a cold prefill's tokens, log-probabilities to rounding), "lend" at once."""
    target, _ = tiny_pair
    vocab = target.config.vocab_size
    warm, cold = AutoregressiveGenerator(target), AutoregressiveGenerator(target)
    warm.set_prefix_cache(10_000)
    warm.prefix_cache.answers = answers
    system = _tokens(40, vocab, seed=45)
    said = _run(warm, system, None, 12).token_ids[0]
    chunks = _idle(warm)
    assert chunks == ([11] if answers == "prefill" else [])  # the 11 fed answer tokens, in one forward
    question = system + said + [7, 8]
    got, want = _run(warm, question, None, 8), _run(cold, question, None, 8)
    assert got.row_stats[0].cached_tokens == 51  # the prompt and the fed answer
    assert got.token_ids == want.token_ids
    assert np.allclose(got.logprobs[0], want.logprobs[0], atol=1e-4)


def fenced_script(prompt: str) -> str:
    """A small model's habit: the call as fenced JSON, which the parser accepts and the template writes otherwise."""
    if "<tool_response>" in prompt:
        return "It is 21 C in Paris, and it will stay dry."
    return '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tool_servers(tokenizer):
    """Scripted tiny models (transformers) that write their calls as fenced JSON: each --answer-kv, and no cache."""
    from scripted_models import scripted_pair, tool_tokenizer
    from test_server_helpers import serve

    tok = tool_tokenizer(tokenizer)
    pair = scripted_pair(tok, fenced_script)
    servers = {mode: serve(pair, tok, k=3, answer_kv=mode, max_tokens_limit=200)
               for mode in ("prefill", "lend", "off")}
    servers["cold"] = serve(pair, tok, k=3, prefix_cache_tokens=0, max_tokens_limit=200)
    yield tok, servers
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("mode", ["prefill", "lend"])
def test_a_tool_call_written_otherwise_is_reused_as_the_template_writes_it(tool_servers, mode):
    from specdecode.structured.tool_calls import rendered_call
    from test_server_helpers import MODEL

    tok, servers = tool_servers
    turns = {}
    for name in (mode, "off", "cold"):
        server, client = servers[name], openai_client(servers[name].url)
        messages = [{"role": "system", "content": "You answer questions about the weather."},
                    {"role": "user", "content": f"What is the weather in Paris? ({mode})"}]  # a chat of its own
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, temperature=0,
                                               max_tokens=60)
        call = first.choices[0].message.tool_calls[0]
        assert (call.function.name, first.choices[0].message.content) == ("get_weather", None)
        messages += [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "21 C, dry"}]
        if name != "cold":
            assert wait_until(lambda: _idle_done(server), timeout=60)
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, temperature=0,
                                                max_tokens=60)
        turns[name] = (first, second)
    assistant = {**messages[-2], "tool_calls": [rendered_call(c) for c in messages[-2]["tool_calls"]]}  # as served
    resent = tok.apply_chat_template(messages[:-2] + [assistant], tools=WEATHER, tokenize=False)  # the template's call
    assert "<tool_call>" in resent and "```" not in resent
    hits = {name: second.usage.prompt_tokens_details.cached_tokens for name, (_, second) in turns.items()}
    assert hits["off"] <= turns["off"][0].usage.prompt_tokens  # the call as written matches nothing re-sent
    assert hits[mode] == len(tok(resent, add_special_tokens=False)["input_ids"])  # the call as re-sent, all of it
    assert turns[mode][1].choices[0].message.content == turns["cold"][1].choices[0].message.content
    assert metric(metric_values(servers[mode].url), "specdecode_prefix_cache_idle_prefilled_tokens") > 0


def test_the_setting_and_bad_values():
    with pytest.raises(ValueError, match="answers must be one of prefill, lend, off"):
        PrefixCache(answers="all")
    with pytest.raises(OptionError, match="answer_kv"):
        ServerSettings(answer_kv="yes")
    assert ServerSettings().answer_kv == "prefill"


# ---------------------------------------------------------------------------------------------- a live server
CHAT_SYSTEM = ("You are an assistant for a team of Python developers. Answer with a short explanation and a complete "
               "code example, and name the modules you use.")
QUESTIONS = ["How do I read a CSV file?", "And how do I write one back with a header row?",
             "How do I parse command-line options?", "How do I time a function call?"]


@pytest.fixture(scope="module")
def smol_servers(smol_path):
    """Three servers on SmolLM2 (llama.cpp, plain decoding): answers prefilled while idle (the default), lent, and
    no prefix cache."""
    from specdecode import load_model
    from specdecode.backends.llamacpp import LlamaCppBackend
    from specdecode.server import create_app
    from test_server_helpers import LiveServer

    tokenizer = load_model("smollm2-135m-instruct", backend="llamacpp", threads=1, progress=False,
                           backend_options={"n_ctx": 256}).tokenizer
    servers = {}
    for name, extra in (("prefill", {}), ("lend", {"answer_kv": "lend"}), ("cold", {"prefix_cache_tokens": 0})):
        settings = ServerSettings(max_batch_size=1, prefix_cache_rows=2, prefill_tokens_per_step=64, **extra)
        target = LlamaCppBackend(smol_path, n_ctx=2048, max_rows=settings.model_rows, n_threads=1)
        generator = AutoregressiveGenerator(target, tokenizer=tokenizer)
        servers[name] = LiveServer(create_app(generator, "smol", tokenizer, settings)).start()
    yield servers
    for server in servers.values():
        server.stop()


def _idle_done(server) -> bool:
    return all(e.exact >= e.goal for e in server.app.state.generator.prefix_cache.entries)


def _conversation(server, system: str = CHAT_SYSTEM, wait: bool = False) -> list:
    """Four turns, each re-sending the whole history with the answers as returned; each turn's response. wait:
    before each turn, until the server's idle work is done (an agent's tools took long enough)."""
    client, messages, responses = openai_client(server.url), [{"role": "system", "content": system}], []
    for question in QUESTIONS:
        if wait:
            assert wait_until(lambda: _idle_done(server), timeout=60)
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model="smol", messages=messages, max_tokens=96, temperature=0,
                                                  logprobs=True, top_logprobs=2)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        responses.append(response)
    return responses


def _hits_into_answers(responses) -> int:
    """Turns whose cache hit reached past the previous turn's prompt (into its answer)."""
    hits = [r.usage.prompt_tokens_details.cached_tokens for r in responses]
    return sum(h > before.usage.prompt_tokens for h, before in zip(hits[1:], responses))


def _assert_same_turns(got, want):
    for g, w in zip(got, want):
        assert g.choices[0].message.content == w.choices[0].message.content
        assert _logprobs(g) == _logprobs(w)


def _logprobs(response) -> list:
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in response.choices[0].logprobs.content]


def test_a_chat_reuses_its_answers_prefilled_while_idle_and_gets_the_cold_servers_answers(smol_servers):
    """The 4-turn chat with time between turns: the hits reach into the answers, bit for bit the cold server's."""
    warm = _conversation(smol_servers["prefill"], wait=True)
    _assert_same_turns(warm, _conversation(smol_servers["cold"]))
    assert _hits_into_answers(warm) >= 2
    assert metric(metric_values(smol_servers["prefill"].url), "specdecode_prefix_cache_idle_prefilled_tokens") > 0


def test_turns_that_come_at_once_or_mid_prefill_get_the_cold_servers_answers(smol_servers):
    """No time between turns: a turn arrives before or during the idle prefill (one 64-token chunk at a time) and
    prefills what is left itself."""
    system = "Be brief. " + CHAT_SYSTEM
    _assert_same_turns(_conversation(smol_servers["prefill"], system), _conversation(smol_servers["cold"], system))


def test_lent_answers_are_hit_at_once(smol_servers):
    """The decode KV is lent as far as an answer comes back as generated; only the rest is prefilled while idle."""
    lend = smol_servers["lend"]
    responses = _conversation(lend, "Answer in one paragraph. " + CHAT_SYSTEM, wait=True)
    assert _hits_into_answers(responses) >= 2
    idle = metric(metric_values(lend.url), "specdecode_prefix_cache_idle_prefilled_tokens")
    assert idle < sum(r.usage.completion_tokens for r in responses[:-1]) / 4

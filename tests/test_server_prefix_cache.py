"""The server's prefix cache on a live uvicorn over the tiny models: a second chat with the same system prompt
reuses the first one's KV (usage.prompt_tokens_details.cached_tokens, /metrics), answers exactly what a server
without the cache answers, and the switch and its limits are checked."""

from __future__ import annotations

import pytest

from specdecode.errors import OptionError
from specdecode.server import ServerSettings
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import metric, metric_values, openai_client, serve

SYSTEM = "You are a careful Python reviewer. " + " ".join(f"Rule {i}: name things for what they are." for i in range(8))


def _chat(client, user: str, **extra):
    extra = {"temperature": 0, **extra}
    return client.chat.completions.create(model="specdecode", max_tokens=12, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], **extra)


@pytest.fixture(scope="module")
def servers(tiny_pair, tokenizer):
    cached = serve(tiny_pair, tokenizer, k=3, max_batch_size=4)
    cold = serve(tiny_pair, tokenizer, k=3, max_batch_size=4, prefix_cache_tokens=0)
    yield cached, cold
    cached.stop()
    cold.stop()


def test_a_shared_system_prompt_is_prefilled_once_and_answers_stay_the_same(servers):
    cached, cold = servers
    client, plain = openai_client(cached.url), openai_client(cold.url)
    first = _chat(client, "Review: def f(x): return x")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    for user in ("Review: def g(y): return y * 2", "Review: class A: pass"):
        second = _chat(client, user)
        cached_tokens = second.usage.prompt_tokens_details.cached_tokens  # the OpenAI client's typed field
        assert cached_tokens >= 0.8 * first.usage.prompt_tokens
        assert second.choices[0].message.content == _chat(plain, user).choices[0].message.content
    assert _chat(plain, "Review: x = 1").usage.prompt_tokens_details.cached_tokens == 0  # the switch
    values = metric_values(cached.url)
    assert metric(values, "specdecode_prefix_cache_hit_tokens") >= 2 * 0.8 * first.usage.prompt_tokens
    assert metric(values, "specdecode_prefix_cache_hits") >= 2
    assert 0 < metric(values, "specdecode_prefix_cache_hit_rate") < 1
    assert metric(metric_values(cold.url), "specdecode_prefix_cache_hit_tokens") == 0


def test_streamed_and_sampled_requests_match_the_cold_server(servers):
    cached, cold = servers
    client, plain = openai_client(cached.url), openai_client(cold.url)
    _chat(client, "warm up")
    options = dict(temperature=0.9, seed=7)
    stream = _chat(client, "Review: y = [1, 2]", stream=True, stream_options={"include_usage": True}, **options)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert text == _chat(plain, "Review: y = [1, 2]", **options).choices[0].message.content


@pytest.mark.parametrize("field", ["prefix_cache_tokens", "prefix_cache_rows"])
def test_limits_are_checked(field):
    with pytest.raises(OptionError, match=field):
        ServerSettings(**{field: -1})
    assert ServerSettings(max_batch_size=8, prefix_cache_rows=4).model_rows == 12
    assert ServerSettings(max_batch_size=8, prefix_cache_tokens=0).model_rows == 8


# ---------------------------------------------------------------------------------------------- llama.cpp, a chat
CHAT_SYSTEM = ("You are an assistant for a team of Python developers. Answer with a short explanation and a complete "
               "code example, and name the modules you use.")
QUESTIONS = ["How do I read a CSV file?", "And how do I write one back with a header row?",
             "How do I parse command-line options?", "How do I time a function call?"]


@pytest.fixture(scope="module")
def smol_servers(smol_path):
    """Two servers on SmolLM2 (llama.cpp, plain decoding): the prefix cache on, and off. Answers are not prefilled
    while idle here (answer_kv "off", what a turn that comes at once sees): tests/test_answer_kv.py has the rest."""
    from specdecode import AutoregressiveGenerator, load_model
    from specdecode.backends.llamacpp import LlamaCppBackend
    from test_server_helpers import LiveServer

    from specdecode.server import create_app

    tokenizer = load_model("smollm2-135m-instruct", backend="llamacpp", threads=1, progress=False,
                           backend_options={"n_ctx": 256}).tokenizer
    servers = []
    for cache in (65536, 0):
        settings = ServerSettings(max_batch_size=1, prefix_cache_tokens=cache, prefix_cache_rows=2, answer_kv="off")
        target = LlamaCppBackend(smol_path, n_ctx=2048, max_rows=settings.model_rows, n_threads=1)
        generator = AutoregressiveGenerator(target, tokenizer=tokenizer)
        servers.append(LiveServer(create_app(generator, "smol", tokenizer, settings)).start())
    yield servers
    for server in servers:
        server.stop()


def _conversation(client) -> list:
    """Four turns, each re-sending the whole history with the answers as returned; each turn's response."""
    messages, responses = [{"role": "system", "content": CHAT_SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model="smol", messages=messages, max_tokens=96, temperature=0,
                                                  logprobs=True, top_logprobs=2)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        responses.append(response)
    return responses


def test_a_chat_that_resends_its_answers_gets_the_cold_servers_answers(smol_servers):
    """Later turns start with earlier answers, whose KV came from one-token decode steps: the cache lends only what
    was prefilled, so every turn's text and log-probabilities are the cache-off server's, bit for bit."""
    cached, cold = (openai_client(s.url) for s in smol_servers)
    warm, plain = _conversation(cached), _conversation(cold)
    hits = [r.usage.prompt_tokens_details.cached_tokens for r in warm]
    assert hits[0] == 0 and hits[-1] > 0
    assert all(h <= before.usage.prompt_tokens for h, before in zip(hits[1:], warm))  # never into an answer
    for w, p in zip(warm, plain):
        assert w.choices[0].message.content == p.choices[0].message.content
        assert [(t.token, t.logprob) for t in w.choices[0].logprobs.content] == \
            [(t.token, t.logprob) for t in p.choices[0].logprobs.content]

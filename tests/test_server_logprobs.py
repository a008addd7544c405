"""Logprobs on a live server: OpenAI's legacy completions shape and the chat shape parse into the openai client's
typed objects, their values are the engine's (and, greedy, the target model's own log-softmax), a position's
alternatives list the sampled token when it is among them, streamed chunks carry their tokens' logprobs, and the
tokens' bytes add up to the text."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from specdecode.server.logprobs import LOGPROB_FLOOR, TokenTexts
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import chat_ids, openai_client
from test_server_helpers import MODEL, make_generator, serve

PROMPT = "def quicksort(arr):"
MESSAGES = [{"role": "user", "content": "Sort a list."}]
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.8, top_k=40, seed=7), dict(temperature=1.0, top_p=0.9, seed=3)]


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    srv = serve(tiny_pair, tokenizer, max_tokens_limit=256, max_batch_size=8, request_timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    return make_generator(tiny_pair, tokenizer)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def texts(tokenizer):
    return TokenTexts(tokenizer)


def _openai_kwargs(sampling: dict) -> tuple[dict, dict]:
    """(the openai client's own arguments, extra_body) of a sampling setting."""
    own = {k: v for k, v in sampling.items() if k in ("temperature", "top_p", "seed")}
    return own, {k: v for k, v in sampling.items() if k == "top_k"}



def _listed(texts, token: int, logprob: float, top) -> dict[str, float]:
    """A legacy top_logprobs entry as it should read: the alternatives by text, then the sampled token if new."""
    listed = {}
    for alternative, value in (*top, (token, logprob)):
        listed.setdefault(texts(alternative)[0], value if math.isfinite(value) else LOGPROB_FLOOR)
    return listed


# ---------------------------------------------------------------------------------------------- completions
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "top-k", "top-p"])
def test_completion_logprobs_are_the_engines(client, engine, texts, sampling):
    own, extra = _openai_kwargs(sampling)
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=3, extra_body=extra, **own)
    solo = engine.generate(PROMPT, max_new_tokens=16, return_logprobs=3, **sampling)
    choice, ids = res.choices[0], solo.token_ids[0]
    assert choice.text == solo.texts[0]
    lp = choice.logprobs  # openai.types.completion_choice.Logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.tokens == [texts(t)[0] for t in ids]
    assert lp.token_logprobs == pytest.approx(solo.logprobs[0], abs=1e-4)
    assert all(value <= 0 for value in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    in_top = 0
    for token, logprob, top, listed in zip(ids, lp.token_logprobs, solo.top_logprobs[0], lp.top_logprobs):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        expected = _listed(texts, token, logprob, top)
        assert listed.keys() == expected.keys() and list(listed.values()) == pytest.approx(list(expected.values()),
                                                                                            abs=1e-4)
        if token in dict(top):  # the sampled token among the alternatives: the same logprob in both places
            in_top += 1
            assert listed[texts(token)[0]] == pytest.approx(logprob, abs=1e-6)
            assert dict(top)[token] == pytest.approx(logprob, abs=1e-4)
    assert in_top > 0
    if sampling["temperature"] == 0:  # greedy: the sampled token is the likeliest
        assert all(max(listed.values()) == pytest.approx(v, abs=1e-6) for listed, v in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))


def test_greedy_logprobs_are_the_target_models_log_softmax(client, engine, tiny_pair, tokenizer):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    ids = tokenizer(PROMPT)["input_ids"]
    new = engine.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids[0]
    with torch.no_grad():
        logits = tiny_pair[0](torch.tensor([ids + new[:-1]])).logits[0, len(ids) - 1:]
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(new)[:, None])[:, 0].tolist()
    assert res.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    # logprobs=0: each position lists the sampled token alone
    assert [len(listed) for listed in res.choices[0].logprobs.top_logprobs] == [1] * len(new)


def test_alternatives_that_top_k_excludes_read_the_floor(client):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=1, logprobs=5,
                                    extra_body={"top_k": 2})
    checked = 0
    for listed in res.choices[0].logprobs.top_logprobs:
        if len(listed) < 5:
            continue  # two tokens of the same text (e.g. byte pieces shown as '\ufffd') share one key in this shape
        values = sorted(listed.values(), reverse=True)
        assert all(v > LOGPROB_FLOOR for v in values[:2]) and all(v == LOGPROB_FLOOR for v in values[2:])
        assert math.log(sum(math.exp(v) for v in values[:2])) == pytest.approx(0.0, abs=1e-4)  # all the mass
        checked += 1
    assert checked >= 4


def test_completion_stream_carries_each_tokens_logprobs(server, client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=21, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        if lp is None:  # the last chunk: the finish reason alone
            assert chunk.choices[0].finish_reason is not None and chunk.choices[0].text == ""
            continue
        assert len(lp.tokens) == 1  # a chunk per token, even one that completes no character yet
        for name in streamed:
            streamed[name] += getattr(lp, name)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert streamed == whole.logprobs.model_dump()


def test_n_choices_and_several_prompts_each_get_their_logprobs(client, engine):
    prompts = ["import numpy", "Once upon a time"]
    res = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0.9, seed=4,
                                    logprobs=1)
    solo = engine.generate([p for p in prompts for _ in range(2)], max_new_tokens=6, temperature=0.9, seed=4,
                           return_logprobs=1)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    for choice, values in zip(res.choices, solo.logprobs):
        assert choice.logprobs.token_logprobs == pytest.approx(values, abs=1e-4)


# ---------------------------------------------------------------------------------------------- chat
def test_chat_logprobs_are_the_engines_with_their_bytes(client, engine, tokenizer):
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.7, seed=11,
                                         logprobs=True, top_logprobs=2)
    solo = engine.generate([chat_ids(tokenizer, MESSAGES)], max_new_tokens=24, temperature=0.7, seed=11,
                           return_logprobs=2)
    choice, ids = res.choices[0], solo.token_ids[0]
    content = choice.logprobs.content  # list[ChatCompletionTokenLogprob]
    assert choice.message.content == solo.texts[0] and len(content) == len(ids)
    assert [c.logprob for c in content] == pytest.approx(solo.logprobs[0], abs=1e-4)
    special = set(tokenizer.all_special_ids)
    for entry, token, top in zip(content, ids, solo.top_logprobs[0]):
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
        assert len(entry.top_logprobs) == 2
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
        assert [bytes(a.bytes) for a in entry.top_logprobs] == [_raw(tokenizer, t) for t, _ in top]
        if token in dict(top):
            listed = entry.top_logprobs[[t for t, _ in top].index(token)]
            assert listed.token == entry.token and listed.logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert token in special or bytes(entry.bytes) == _raw(tokenizer, token)
    # the tokens' own bytes add up to the answer (special tokens are not part of its text)
    raw = b"".join(bytes(e.bytes) for e, t in zip(content, ids) if t not in special)
    assert raw.decode("utf-8", errors="replace") == choice.message.content


def _raw(tokenizer, token: int) -> bytes:
    """A token's bytes from its byte-level BPE piece, as transformers' GPT-2 byte decoder reads it (the tiny
    vocabulary has a few unused ids, which have no piece and no text)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in tokenizer.convert_ids_to_tokens(token) or "")


def test_chat_logprobs_without_alternatives_and_off(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    assert len(res.choices[0].logprobs.content) == 4
    assert all(entry.top_logprobs == [] for entry in res.choices[0].logprobs.content)
    assert res.choices[0].message.content == plain.choices[0].message.content


def test_chat_stream_carries_each_tokens_logprobs(server, client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.9, seed=5, logprobs=True,
                  top_logprobs=3)
    # Both compared requests find the prompt in the prefix cache, whatever ran before (alone, the first one would
    # prefill it cold and the second reuse it: forwards of other shapes, logprobs that differ in the last bits)
    client.chat.completions.create(**kwargs)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    content = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in content] == [e.model_dump() for e in whole.logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    # raw SSE: every chunk is valid JSON (no Infinity or NaN)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0.9, "seed": 5, "logprobs": True,
            "top_logprobs": 20, "top_k": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    floors = [a["logprob"] for line in lines for c in json.loads(line)["choices"] if c["logprobs"]
              for e in c["logprobs"]["content"] for a in e["top_logprobs"]]
    assert len(floors) == 20 * 6 and floors.count(LOGPROB_FLOOR) == 18 * 6  # top_k 2 of the 20 alternatives


def test_token_texts_read_sentencepiece_byte_pieces():
    class Backend:  # a Llama-2-style fast tokenizer's decoders
        def to_str(self):
            return json.dumps({"decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}})

    class SentencePieceLike:  # its vocabulary, as TokenTexts reads it
        backend_tokenizer = Backend()
        added_tokens_decoder = {}
        pieces = {0: "\u2581the", 1: "<0xE2>", 2: "<0x82>", 3: "<0xAC>", 4: "x"}

        def convert_ids_to_tokens(self, token):
            return self.pieces[token]

    texts = TokenTexts(SentencePieceLike())
    assert texts.sentencepiece and not texts.byte_level
    assert texts(0) == (" the", b" the") and texts(4) == ("x", b"x")
    assert [texts(t)[1] for t in (1, 2, 3)] == [b"\xe2", b"\x82", b"\xac"]
    assert b"".join(texts(t)[1] for t in (1, 2, 3)).decode() == "\u20ac" and texts(1)[0] == "\ufffd"

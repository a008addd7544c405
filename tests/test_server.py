"""The HTTP server on a live uvicorn (loopback) over the tiny models: OpenAI client, raw HTTP, errors, auth, metrics,
timeouts, disconnects, shutdown, and the `specdecode serve` command."""

from __future__ import annotations

import copy
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from specdecode.text.chat import ChatTemplateError, NoChatTemplateError, encode_chat
from specdecode.server import ServerSettings, create_app, served_names
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import chat_ids, openai_client
from test_server_helpers import (MODEL, CLIServer, error_shape, free_port, make_generator, metric, metric_values,
                                 serve, serve_slow, tiny_serve_args, wait_until)

PROMPT = "def quicksort(arr):"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
C, CHAT, P = "/v1/completions", "/v1/chat/completions", "/predict"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    srv = serve(tiny_pair, tokenizer, max_tokens_limit=512, max_batch_size=8, request_timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    """The engine used directly, for the answers the server must reproduce."""
    return make_generator(tiny_pair, tokenizer)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def streamed_text(engine, prompt, **kwargs) -> str:
    return "".join(e.text or "" for e in engine.stream(prompt, **kwargs))


# ---------------------------------------------------------------------------------------------- discovery
def test_health_and_models(server, client):
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["model"] == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL, "specdecode"]  # the target's name, the alias
    for name in (MODEL, "specdecode"):
        card = client.models.retrieve(name)
        assert card.id == name and card.model_extra["max_model_len"] == 512
    missing = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert missing.status_code == 404 and error_shape(missing)["code"] == "model_not_found"
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/predict"} <= \
        set(schema["paths"])
    assert "422" not in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_model_ids_default_to_the_target_and_specdecode(server, client):
    named = client.completions.create(model="specdecode", prompt="a", max_tokens=2, temperature=0)
    assert named.model == "specdecode"  # a response names the model id its request asked for
    chat = client.chat.completions.create(model="specdecode", messages=MESSAGES, max_tokens=2, temperature=0)
    assert chat.model == "specdecode"
    unnamed = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL  # the first served name
    missing = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "model": "gpt-4"})
    error = error_shape(missing)
    assert missing.status_code == 404 and error["param"] == "model" and error["code"] == "model_not_found"
    assert repr(MODEL) in error["message"] and "'specdecode'" in error["message"]


def test_served_model_names_replace_the_defaults(tiny_pair, tokenizer):
    with serve(tiny_pair, tokenizer, served_model_names=("coder", "coder-fast"), max_tokens_limit=8) as srv:
        models = httpx.get(f"{srv.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["coder", "coder-fast"]
        assert httpx.get(f"{srv.url}/health").json()["model"] == "coder"
        for name in (MODEL, "specdecode"):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "model": name})
            assert r.status_code == 404 and error_shape(r)["code"] == "model_not_found"
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "model": "coder-fast", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "coder-fast"
        schema = httpx.get(f"{srv.url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert {"type": "string", "enum": ["coder", "coder-fast", ""]} in schema["properties"]["model"]["anyOf"]
    with pytest.raises(ValueError, match="served model names"):
        ServerSettings(served_model_names=("ok", " "))
    assert served_names("t", ()) == ("t", "specdecode") and served_names("specdecode") == ("specdecode",)
    assert served_names("t", ["a", "b", "a"]) == ("a", "b")


# ---------------------------------------------------------------------------------------------- OpenAI client
def test_completion_equals_engine(client, engine):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    solo = engine.generate(PROMPT, max_new_tokens=16, temperature=0)
    assert res.object == "text_completion" and res.model == MODEL
    assert res.choices[0].text == solo.texts[0]
    assert res.choices[0].finish_reason == solo.finish_reasons[0]
    assert res.usage.prompt_tokens == len(solo.prompt_token_ids[0])
    assert res.usage.completion_tokens == len(solo.token_ids[0])
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    spec = res.model_extra["speculative"]
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["mean_accepted_length"] >= 1.0
    assert spec["num_speculative_tokens"] == 4
    if spec["batch_size"] == 1:  # alone in its batch: exactly the engine's own statistics
        assert spec["acceptance_rate"] == pytest.approx(solo.stats.acceptance_rate)
        assert spec["mean_accepted_length"] == pytest.approx(solo.stats.mean_accepted_length)


def test_completion_stream(client, engine):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == streamed_text(engine, PROMPT, max_new_tokens=16, temperature=0)
    assert reasons == ["length"]
    assert chunks[-1].usage.completion_tokens == 16
    assert "acceptance_rate" in chunks[-1].model_extra["speculative"]


def test_multiple_prompts(client, engine):
    prompts = ["import numpy as np", "The quick brown fox", "Once upon a time"]
    res = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in res.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, res.choices):
        assert choice.text == engine.generate(prompt, max_new_tokens=10, temperature=0).texts[0]
    assert res.usage.completion_tokens == sum(len(engine.generate(p, max_new_tokens=10, temperature=0).token_ids[0])
                                              for p in prompts)


def test_chat_completion(client, engine, tokenizer):
    ids = chat_ids(tokenizer, MESSAGES)
    solo = engine.generate([ids], max_new_tokens=12, temperature=0)
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == solo.texts[0]
    assert res.usage.prompt_tokens == len(ids)

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == streamed_text(engine, [ids], max_new_tokens=12, temperature=0)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_and_content_parts(server, engine, tokenizer):
    # list-of-parts content is joined; without max_tokens the answer may fill the context, so ask for a stop
    messages = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "it."}]}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_completion_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Sort it."}])
    assert r.json()["choices"][0]["message"]["content"] == engine.generate([ids], max_new_tokens=8,
                                                                           temperature=0).texts[0]


def test_stop_strings(client, engine):
    free = engine.generate(PROMPT, max_new_tokens=24, temperature=0).texts[0]
    stop = next(free[i:i + 2] for i in range(3, len(free) - 2) if free[i:i + 2].isprintable()
                and "\ufffd" not in free[i:i + 2])
    expected = engine.generate(PROMPT, max_new_tokens=24, temperature=0, stop=[stop])
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert res.choices[0].text == expected.texts[0]
    assert res.choices[0].finish_reason == "stop" == expected.finish_reasons[0]
    assert stop not in res.choices[0].text


def test_seed_gives_same_sample(client, engine):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234)
    first = client.completions.create(**kwargs, extra_body={"top_k": 50})
    again = client.completions.create(**kwargs, extra_body={"top_k": 50})
    solo = engine.generate("Once upon a time", max_new_tokens=12, temperature=0.9, top_k=50, seed=1234)
    assert first.choices[0].text == again.choices[0].text == solo.texts[0]
    assert first.model_extra["speculative"]["batch_size"] == 1


def test_num_speculative_tokens_extension(client, engine):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"num_speculative_tokens": 2})
    assert res.choices[0].text == engine.generate(PROMPT, max_new_tokens=10, temperature=0).texts[0]
    assert res.model_extra["speculative"]["num_speculative_tokens"] == 2


def test_predict(server, engine):
    r = httpx.post(f"{server.url}/predict", json={"prompt": "Once upon", "max_new_tokens": 10, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200
    body = r.json()
    assert body["text"] == engine.generate("Once upon", max_new_tokens=10, temperature=0).texts[0]
    assert {"acceptance_rate", "mean_accepted_length", "new_tokens", "batch_size"} <= set(body["stats"])
    assert body["stats"]["new_tokens"] == 10 or body["stats"]["batch_size"] > 1
    default = httpx.post(f"{server.url}/predict", json={"prompt": "Once upon"}, timeout=60)
    assert default.status_code == 200 and isinstance(default.json()["text"], str)


# ---------------------------------------------------------------------------------------------- request rules
def test_token_id_prompts(server, engine, tokenizer):
    texts = ["def quicksort(arr):", "Once upon a time"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    expected = [engine.generate(t, max_new_tokens=6, temperature=0).texts[0] for t in texts]
    one = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids[0], "max_tokens": 6, "temperature": 0},
                     timeout=60)
    assert one.status_code == 200, one.text
    assert one.json()["choices"][0]["text"] == expected[0]
    assert one.json()["usage"]["prompt_tokens"] == len(ids[0])
    many = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0},
                      timeout=60)
    assert [c["text"] for c in many.json()["choices"]] == expected
    floats = httpx.post(f"{server.url}/v1/completions", timeout=60,  # 3.0 is an integer in JSON
                        json={"prompt": [float(t) for t in ids[0]], "max_tokens": 6, "temperature": 0})
    assert floats.json()["choices"][0]["text"] == expected[0]


def test_unsupported_parameters_are_named_in_one_400(server):
    body = {"prompt": "a", "best_of": 3, "suffix": "}", "min_tokens": 2, "echo": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    error = error_shape(r)
    assert r.status_code == 400 and error["code"] == "unsupported_parameter"
    assert error["param"] in ("best_of", "suffix", "min_tokens", "echo")
    for name in ("best_of", "suffix", "min_tokens", "echo"):
        assert name in error["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"messages": USER, "functions": [{"name": "f"}], "function_call": "auto"})
    assert chat.status_code == 400 and error_shape(chat)["code"] == "unsupported_parameter"
    assert "functions" in error_shape(chat)["message"] and "function_call" in error_shape(chat)["message"]


NEUTRAL = {  # every unsupported parameter at its neutral value, and the supported ones at their defaults: accepted,
    # the output unchanged
    C: {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": "", "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0,
        "ignore_eos": False, "stop_token_ids": [], "user": "u", "metadata": {"k": "v"}, "store": False,
        "response_format": {"type": "text"}},
    CHAT: {"n": 1, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "functions": [],
           "function_call": "none", "response_format": {"type": "text"}, "modalities": ["text"], "audio": None,
           "parallel_tool_calls": True, "presence_penalty": 0, "service_tier": "auto"},
}


@pytest.mark.parametrize("endpoint", [C, CHAT])
def test_neutral_values_are_accepted(server, endpoint):
    base = {"prompt": PROMPT} if endpoint == C else {"messages": MESSAGES}
    base.update(max_tokens=4, temperature=0)
    plain = httpx.post(f"{server.url}{endpoint}", json=base, timeout=60)
    neutral = httpx.post(f"{server.url}{endpoint}", json={**base, **NEUTRAL[endpoint]}, timeout=60)
    assert neutral.status_code == 200, neutral.text
    assert "x-ignored-fields" not in neutral.headers
    assert neutral.json()["choices"] == plain.json()["choices"]


def test_unknown_fields_are_ignored_and_named_in_a_header(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "frobnicate": 1, "my_option": {"a": 1},
            "unset_option": None, "é\nx": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    # null-valued fields are not named; other than plain names are quoted and escaped
    assert r.headers["x-ignored-fields"] == "frobnicate, my_option, '\\xe9\\nx'"
    chat = {"messages": [{"role": "user", "content": "hi", "refusal": None, "weight": 1}], "max_tokens": 2,
            "stream": True, "reasoning_effort": "low"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=60) as s:
        assert s.status_code == 200
        assert s.headers["x-ignored-fields"] == "reasoning_effort, messages[0].weight"
        assert list(s.iter_lines())[-2] == "data: [DONE]"
    clean = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=60)
    assert "x-ignored-fields" not in clean.headers


def test_chat_encoding_in_one_place(tokenizer):
    assert encode_chat(tokenizer, MESSAGES) == chat_ids(tokenizer, MESSAGES)
    assert encode_chat(tokenizer, "hi") == chat_ids(tokenizer, [{"role": "user", "content": "hi"}])
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        encode_chat(plain, MESSAGES)
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        encode_chat(strict, MESSAGES)


def test_chat_without_template_or_rejected_by_it(tiny_pair, tokenizer):
    for template, code, words in ((None, "no_chat_template", "no chat template"),
                                  ("{{ raise_exception('roles must alternate') }}", "invalid_value", "alternate")):
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = template
        app = create_app(make_generator(tiny_pair, tok), MODEL, tok, ServerSettings(max_tokens_limit=8))
        with TestClient(app) as http:
            r = http.post("/v1/chat/completions", json={"messages": USER})
            error = error_shape(r)
            assert r.status_code == 400 and error["code"] == code and error["param"] == "messages"
            assert words in error["message"]
            assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------------------------------------- bad input
def _long_prompt(tokenizer, tokens: int) -> str:
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids)


BAD = [
    # (id, endpoint, body (dict/list = JSON, bytes = raw), status, param)
    ("malformed-json", C, b'{"prompt": "a",', 400, None),
    ("not-json", C, b"prompt=a", 400, None),
    ("empty-body", C, b"", 400, None),
    ("array-body", C, [1, 2], 400, None),
    ("missing-prompt", C, {"max_tokens": 4}, 400, "prompt"),
    ("empty-prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", C, {"prompt": []}, 400, "prompt"),
    ("empty-prompt-in-list", C, {"prompt": ["ok", ""]}, 400, "prompt"),
    ("prompt-number", C, {"prompt": 42}, 400, "prompt"),
    ("prompt-null", C, {"prompt": None}, 400, "prompt"),
    ("too-many-prompts", C, {"prompt": ["a"] * 9}, 400, "prompt"),
    ("max-tokens-negative", C, {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-zero", C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-absurd", C, {"prompt": "a", "max_tokens": 10**12}, 400, "max_tokens"),
    ("max-tokens-over-limit", C, {"prompt": "a", "max_tokens": 513}, 400, "max_tokens"),
    ("max-tokens-string", C, {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-float", C, {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("max-tokens-bool", C, {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("temperature-negative", C, {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("temperature-huge", C, {"prompt": "a", "temperature": 1e308}, 400, "temperature"),
    ("temperature-string", C, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("temperature-nan", C, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("top-p-zero", C, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", C, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("top-p-negative", C, {"prompt": "a", "top_p": -1}, 400, "top_p"),
    ("top-k-negative", C, {"prompt": "a", "top_k": -2}, 400, "top_k"),
    ("seed-string", C, {"prompt": "a", "seed": "x"}, 400, "seed"),
    ("seed-too-big", C, {"prompt": "a", "seed": 2**70}, 400, "seed"),
    ("stream-string", C, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("stop-empty", C, {"prompt": "a", "stop": ""}, 400, "stop"),
    ("stop-number", C, {"prompt": "a", "stop": [1]}, 400, "stop"),
    ("stop-too-many", C, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("k-absurd", C, {"prompt": "a", "num_speculative_tokens": 10**6}, 400, "num_speculative_tokens"),
    ("n-zero", C, {"prompt": "a", "n": 0}, 400, "n"),
    ("n-over-batch", C, {"prompt": "a", "n": 9}, 400, "n"),
    ("n-times-prompts-over-batch", C, {"prompt": ["a", "b", "c"], "n": 3}, 400, "n"),
    ("n-float", C, {"prompt": "a", "n": 1.5}, 400, "n"),
    ("logprobs-over-20", C, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("logprobs-negative", C, {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("logprobs-bool", C, {"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ("response-format-unknown", C, {"prompt": "a", "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("ignore-eos-string", C, {"prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("best-of", C, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("echo", C, {"prompt": "a", "echo": True}, 400, "echo"),
    ("suffix", C, {"prompt": "a", "suffix": "}"}, 400, "suffix"),
    ("presence-penalty", C, {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency-penalty", C, {"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("logit-bias", C, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("repetition-penalty", C, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min-p", C, {"prompt": "a", "min_p": 1.1}, 400, "min_p"),
    ("min-tokens", C, {"prompt": "a", "min_tokens": 3}, 400, "min_tokens"),
    ("stop-token-ids", C, {"prompt": "a", "stop_token_ids": [1]}, 400, "stop_token_ids"),
    ("token-ids-out-of-vocab", C, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("token-ids-negative", C, {"prompt": [1, -1]}, 400, "prompt"),
    ("token-ids-float", C, {"prompt": [1, 2.5]}, 400, "prompt"),
    ("token-ids-bool", C, {"prompt": [True]}, 400, "prompt"),
    ("token-id-lists-out-of-vocab", C, {"prompt": [[1], [2, 10**6]]}, 400, "prompt[1]"),
    ("token-id-lists-empty", C, {"prompt": [[1], []]}, 400, "prompt"),
    ("prompt-mix", C, {"prompt": ["a", [1]]}, 400, "prompt"),
    ("token-ids-over-context", C, {"prompt": [1] * 600, "max_tokens": 1}, 400, "prompt"),
    ("unknown-model", C, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("prompt-over-context", C, "LONG:600", 400, "prompt"),
    ("prompt-plus-tokens-over-context", C, "LONG:300+300", 400, "max_tokens"),
    ("lone-surrogate", C, b'{"prompt": "\\ud800 x"}', None, None),
    ("chat-missing-messages", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("chat-messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("chat-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat-missing-role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("chat-max-tokens-negative", CHAT, {"messages": USER, "max_tokens": -1}, 400, "max_tokens"),
    ("chat-max-completion-tokens-absurd", CHAT, {"messages": USER, "max_completion_tokens": 10**9}, 400,
     "max_completion_tokens"),
    ("chat-temperature", CHAT, {"messages": USER, "temperature": 5}, 400, "temperature"),
    ("chat-top-p", CHAT, {"messages": USER, "top_p": 0}, 400, "top_p"),
    ("chat-unknown-model", CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
    ("chat-logprobs-number", CHAT, {"messages": USER, "logprobs": 3}, 400, "logprobs"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat-top-logprobs-over-20", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("chat-tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("chat-tool-choice", CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat-functions", CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions"),
    ("chat-function-call", CHAT, {"messages": USER, "function_call": "auto"}, 400, "function_call"),
    ("chat-json-schema-missing", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("chat-json-schema-not-object", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, 400,
     "response_format.json_schema.schema"),
    ("chat-response-format-string", CHAT, {"messages": USER, "response_format": "json"}, 400, "response_format"),
    ("chat-audio", CHAT, {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "x"}}, 400,
     "modalities"),
    ("chat-n", CHAT, {"messages": USER, "n": 9}, 400, "n"),
    ("chat-k-string", CHAT, {"messages": USER, "num_speculative_tokens": "many"}, 400, "num_speculative_tokens"),
    ("chat-over-context", CHAT, "CHATLONG:600", 400, "messages"),
    ("predict-missing-prompt", P, {}, 400, "prompt"),
    ("predict-empty-prompt", P, {"prompt": ""}, 400, "prompt"),
    ("predict-prompt-list", P, {"prompt": ["a"]}, 400, "prompt"),
    ("predict-max-new-tokens-zero", P, {"prompt": "a", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ("predict-max-new-tokens-absurd", P, {"prompt": "a", "max_new_tokens": 99999}, 400, "max_new_tokens"),
    ("predict-n", P, {"prompt": "a", "n": 2}, 400, "n"),
]


@pytest.mark.parametrize("endpoint,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_openai_error(server, tokenizer, endpoint, body, status, param):
    if isinstance(body, str) and body.startswith("LONG:"):
        spec = body.split(":")[1]
        tokens, _, new = spec.partition("+")
        body = {"prompt": _long_prompt(tokenizer, int(tokens)), "max_tokens": int(new or 1)}
    elif isinstance(body, str) and body.startswith("CHATLONG:"):
        body = {"messages": [{"role": "user", "content": _long_prompt(tokenizer, int(body.split(":")[1]))}]}
    if isinstance(body, bytes):
        r = httpx.post(f"{server.url}{endpoint}", content=body, headers={"content-type": "application/json"},
                       timeout=30)
    else:
        r = httpx.post(f"{server.url}{endpoint}", json=body, timeout=30)
    if status is None:  # input the tokenizer may or may not take: never a 5xx, never a crash
        assert r.status_code < 500, r.text
        return
    assert r.status_code == status, r.text
    error = error_shape(r)
    assert error["param"] == param, error
    if status == 400:
        assert error["type"] == "invalid_request_error"


def test_wrong_method_unknown_route_and_server_still_healthy(server):
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and error_shape(r)
    r = httpx.post(f"{server.url}/v2/nothing", json={})
    assert r.status_code == 404 and error_shape(r)
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and error_shape(r)
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", max_tokens=10**6)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics_count_requests_and_tokens(server):
    before = metric_values(server.url)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                    timeout=60)
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": ""})
    assert ok.status_code == 200 and bad.status_code == 400
    after = metric_values(server.url)
    C_ = "/v1/completions"
    assert metric(after, "specdecode_requests_total", endpoint=C_, status="200") == \
        metric(before, "specdecode_requests_total", endpoint=C_, status="200") + 1
    assert metric(after, "specdecode_requests_total", endpoint=C_, status="400") == \
        metric(before, "specdecode_requests_total", endpoint=C_, status="400") + 1
    assert metric(after, "specdecode_generated_tokens_total") >= metric(before, "specdecode_generated_tokens_total") + 6
    assert metric(after, "specdecode_prompt_tokens_total") > metric(before, "specdecode_prompt_tokens_total")
    assert metric(after, "specdecode_engine_steps_total") >= metric(before, "specdecode_engine_steps_total") + 1
    assert metric(after, "specdecode_draft_proposed_tokens_total") > 0
    assert 0.0 <= metric(after, "specdecode_acceptance_rate") <= 1.0
    assert metric(after, "specdecode_mean_accepted_length") >= 1.0
    assert metric(after, "specdecode_queue_depth") == 0
    assert metric(after, "specdecode_request_latency_seconds_count", endpoint=C_) == \
        metric(before, "specdecode_request_latency_seconds_count", endpoint=C_) + 2
    assert metric(after, "specdecode_time_to_first_token_seconds_count") >= 1
    assert metric(after, "specdecode_queue_wait_seconds_count") >= 1


# ---------------------------------------------------------------------------------------------- auth
def test_api_key(tiny_pair, tokenizer):
    with serve(tiny_pair, tokenizer, api_key="sekrit", max_tokens_limit=16) as srv:
        url = srv.url
        assert httpx.get(f"{url}/health").status_code == 200  # open, for load balancers
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 401 and error_shape(r)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        body = {"prompt": "a", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        assert httpx.post(f"{url}/predict", json={"prompt": "a"}, headers={"Authorization": "sekrit"}).status_code \
            == 401
        assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"},
                          timeout=60).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert good.completions.create(model=MODEL, prompt="a", max_tokens=3).usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------- timeouts
def test_request_timeout_cancels_and_answers_504(tiny_pair, tokenizer):
    with serve_slow(tiny_pair, tokenizer, delay=0.05, request_timeout=0.6, max_tokens_limit=200) as srv:
        start = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 150, "temperature": 0},
                       timeout=30)
        assert r.status_code == 504 and time.monotonic() - start < 5
        error = error_shape(r)
        assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
        assert wait_until(lambda: metric(metric_values(srv.url), "specdecode_running_requests") == 0, 5)

        # streaming: the headers are sent at the first token, so the timeout arrives as an error event
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIError) as info:
            for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=150, stream=True):
                pass
        assert "timeout" in str(info.value)
        values = metric_values(srv.url)
        assert metric(values, "specdecode_cancelled_requests_total", reason="timeout") == 2
        assert metric(values, "specdecode_requests_total", endpoint="/v1/completions", status="504") >= 1

        short = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert short.status_code == 200  # the engine is free again


# ---------------------------------------------------------------------------------------------- disconnects
def test_disconnect_mid_stream_frees_the_slot(tiny_pair, tokenizer, engine):
    # A long stream and a short request share a batch; the stream's client goes away after a few chunks.
    with serve_slow(tiny_pair, tokenizer, delay=0.02, max_tokens_limit=400) as srv:
        short_result = {}

        def short_request():
            short_result["r"] = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                                           json={"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0})

        worker = threading.Thread(target=short_request)
        worker.start()
        time.sleep(0.05)  # within the batch window of the short request
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{srv.url}/v1/completions",
                             json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
                assert got
        # The client is gone: its rows are cancelled long before their 400 tokens x 20 ms.
        assert wait_until(lambda: metric(metric_values(srv.url), "specdecode_cancelled_requests_total",
                                         reason="disconnect") == 1, 5)
        worker.join(30)
        assert short_result["r"].status_code == 200
        body = short_result["r"].json()
        assert body["speculative"]["batch_size"] == 2  # they did share the batch
        solo = engine.generate("Once upon a time", max_new_tokens=30, temperature=0, ignore_eos=True)
        assert body["choices"][0]["text"] == solo.texts[0]  # unaffected by the other row's cancellation
        assert wait_until(lambda: metric(metric_values(srv.url), "specdecode_running_requests") == 0, 5)
        start = time.monotonic()
        after = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30)
        assert after.status_code == 200 and time.monotonic() - start < 4


def test_disconnect_while_queued(tiny_pair, tokenizer):
    # One request occupies the engine; a second waits in the queue and its client gives up: it leaves the queue.
    with serve_slow(tiny_pair, tokenizer, delay=0.02, max_batch_size=1, max_tokens_limit=200) as srv:
        # 200 tokens (>= 40 steps of >= 20 ms): the engine stays busy well past the second client's 0.5 s (with 100,
        # a sampled run of 28 steps left only ~0.2 s to spare once the first was seen running)
        first = threading.Thread(target=lambda: httpx.post(f"{srv.url}/v1/completions", timeout=60,
                                                           json={"prompt": "a", "max_tokens": 200}))
        first.start()
        assert wait_until(lambda: metric(metric_values(srv.url), "specdecode_running_requests") == 1, 10)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/completions", json={"prompt": "b", "max_tokens": 5}, timeout=0.5)
        assert wait_until(lambda: metric(metric_values(srv.url), "specdecode_cancelled_requests_total",
                                         reason="disconnect") == 1, 5)
        assert metric(metric_values(srv.url), "specdecode_queue_depth") == 0
        first.join(60)


# ---------------------------------------------------------------------------------------------- shutdown
def test_graceful_shutdown_finishes_in_flight_work(tiny_pair, tokenizer):
    srv = serve_slow(tiny_pair, tokenizer, delay=0.02, max_tokens_limit=200)
    result = {}

    def request():
        result["r"] = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 40}, timeout=60)

    thread = threading.Thread(target=request)
    thread.start()
    assert wait_until(lambda: httpx.get(f"{srv.url}/health").json()["running"] == 1, 10)
    srv.stop()  # uvicorn stops accepting, waits for the in-flight request, then the app stops its worker
    thread.join(30)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 40
    assert not srv.app.state.batcher.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=2)


# ---------------------------------------------------------------------------------------------- the CLI
def test_cli_serve_and_its_log(tiny_model_dirs, tmp_path):
    port = free_port()
    args = tiny_serve_args(tiny_model_dirs, port) + ["--max-tokens-limit", "32", "--served-model-name", "tiny",
                                                      "--served-model-name", "tiny-alias"]
    with CLIServer(args, tmp_path / "serve.log", port) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
        res = client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=8, temperature=0)
        assert res.usage.completion_tokens >= 1 and res.choices[0].finish_reason in ("length", "stop")
        assert res.model == "tiny-alias"
        too_many = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 33})
        assert too_many.status_code == 400 and error_shape(too_many)["param"] == "max_tokens"
        assert srv.stop(signal.SIGTERM) == 0  # a graceful stop, not a kill
        log = srv.log()
    # One line per event, through logging: no progress bars, no line broken by a console's width.
    assert "\r" not in log, log
    lines = log.splitlines()
    assert any(re.search(rf"serving 'tiny', 'tiny-alias' \(speculative decoding, k=auto, draft 'draft'\) at "
                         rf"http://127\.0\.0\.1:{port}/v1$", line) for line in lines), log
    assert any(re.search(r"127\.0\.0\.1:\d+ POST /v1/completions 200 in [\d.]+ s$", line) for line in lines), log
    assert any(re.search(r"POST /v1/completions 400 in [\d.]+ s$", line) for line in lines), log
    assert lines[-1].endswith("INFO server stopped"), log


# ---------------------------------------------------------------------------------------------- plain decoding
def test_plain_decoding_server(tiny_pair, tokenizer):
    from specdecode import AutoregressiveGenerator
    from test_server_helpers import LiveServer

    plain = AutoregressiveGenerator(tiny_pair[0], tokenizer=tokenizer)
    with LiveServer(create_app(plain, MODEL, tokenizer, ServerSettings(max_tokens_limit=16))) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200
        body = r.json()
        expected = AutoregressiveGenerator(tiny_pair[0], tokenizer=tokenizer).generate(PROMPT, max_new_tokens=8,
                                                                                        temperature=0)
        assert body["choices"][0]["text"] == expected.texts[0]
        spec = body["speculative"]
        assert spec["draft_model"] is None and spec["num_speculative_tokens"] == 0
        assert spec["acceptance_rate"] == 0.0
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["draft"] is None
        k = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "num_speculative_tokens": 2})
        assert k.status_code == 400 and error_shape(k)["param"] == "num_speculative_tokens"
        k0 = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "num_speculative_tokens": 0},
                        timeout=60)
        assert k0.status_code == 200

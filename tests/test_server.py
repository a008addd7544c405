"""The HTTP server on a live uvicorn (loopback) over the tiny models: OpenAI client, raw HTTP, errors, auth, metrics,
timeouts, disconnects, shutdown, and the `specdecode serve` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import (MODEL, error_shape, free_port, make_generator, metric, metric_values, serve,
                                 serve_slow, wait_until)

PROMPT = "def quicksort(arr):"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


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
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def streamed_text(engine, prompt, **kwargs) -> str:
    return "".join(e.text or "" for e in engine.stream(prompt, **kwargs))


# ---------------------------------------------------------------------------------------------- discovery
def test_health_and_models(server, client):
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["model"] == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 512
    missing = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert missing.status_code == 404 and error_shape(missing)["code"] == "model_not_found"
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/predict"} <= \
        set(schema["paths"])
    assert "422" not in schema["paths"]["/v1/completions"]["post"]["responses"]


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


# ---------------------------------------------------------------------------------------------- bad input
def _long_prompt(tokenizer, tokens: int) -> str:
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids)


C, CHAT, P = "/v1/completions", "/v1/chat/completions", "/predict"
USER = [{"role": "user", "content": "hi"}]
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
    ("k-zero-with-draft", C, {"prompt": "a", "num_speculative_tokens": 0}, 400, "num_speculative_tokens"),
    ("k-absurd", C, {"prompt": "a", "num_speculative_tokens": 10**6}, 400, "num_speculative_tokens"),
    ("n-two", C, {"prompt": "a", "n": 2}, 400, "n"),
    ("logprobs", C, {"prompt": "a", "logprobs": 5}, 400, "logprobs"),
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
    ("chat-over-context", CHAT, "CHATLONG:600", 400, "messages"),
    ("predict-missing-prompt", P, {}, 400, "prompt"),
    ("predict-empty-prompt", P, {"prompt": ""}, 400, "prompt"),
    ("predict-prompt-list", P, {"prompt": ["a"]}, 400, "prompt"),
    ("predict-max-new-tokens-zero", P, {"prompt": "a", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ("predict-max-new-tokens-absurd", P, {"prompt": "a", "max_new_tokens": 99999}, 400, "max_new_tokens"),
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
    assert metric(after, "specdecode_batches_total") >= metric(before, "specdecode_batches_total") + 1
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
    with serve_slow(tiny_pair, tokenizer, delay=0.02, batch_window_s=0.5, max_tokens_limit=400) as srv:
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
        first = threading.Thread(target=lambda: httpx.post(f"{srv.url}/v1/completions", timeout=60,
                                                           json={"prompt": "a", "max_tokens": 100}))
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
def test_cli_serve(tiny_model_dirs):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1")
    cmd = [sys.executable, "-m", "specdecode", "serve", "--target", tiny_model_dirs["target"], "--draft",
           tiny_model_dirs["draft"], "--draft-quantize", "none", "--port", str(port), "--max-tokens-limit", "32",
           "--log-level", "warning", "--threads", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.returncode}: {proc.stderr.read()}")
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=120, interval=0.25), "the server did not come up"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["target"]
        res = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=0)
        assert res.usage.completion_tokens >= 1 and res.choices[0].finish_reason in ("length", "stop")
        too_many = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 33})
        assert too_many.status_code == 400 and error_shape(too_many)["param"] == "max_tokens"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------------- plain decoding
def test_plain_decoding_server(tiny_pair, tokenizer):
    from specdecode import AutoregressiveGenerator
    from specdecode.server import ServerSettings, create_app
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

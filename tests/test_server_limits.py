"""The server's time bounds, on a live uvicorn (loopback) over the tiny models with a slowed engine step: a long
answer that keeps producing tokens passes a stall limit far shorter than the answer; a stalled engine's requests
end with the error naming --stall-timeout (504, or an SSE error event); a request queued past --queue-timeout gets
a 503; a total deadline only where one is asked for; nothing of any of them is left behind. Then the defaults
that a long local conversation meets (max_tokens against the context), and Ray Serve's proxy timeout and
replica heartbeats (without Ray)."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdecode.server import ServerSettings
from specdecode.server.jobs import JobRunner
from specdecode.server.settings import ServedModel
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, error_shape, make_generator, metric, metric_values, serve_slow, wait_until

PROMPT = "def quicksort(arr):"
C = "/v1/completions"


def _stream(url: str, body: dict) -> tuple[int, dict | None]:
    """A streamed completion: (the new tokens its usage chunk counts, its error event's error or None)."""
    tokens, error = 0, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{C}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, error


def _nothing_left(srv) -> bool:
    """No job queued or in the engine, no row held by the session, no request task in the server."""
    batcher = srv.app.state.batcher
    session = batcher.session
    return (batcher.running == 0 and batcher.queue_depth == 0 and (session is None or not session.rows)
            and not srv.server.server_state.tasks)


def test_a_long_answer_that_keeps_producing_is_never_cut(tiny_pair, tokenizer):
    # one token a step (K = 0) at 0.05 s a step: 90 tokens take ~4.5 s, more than twice the 2 s stall limit
    with serve_slow(tiny_pair, tokenizer, delay=0.05, stall_timeout=2.0, max_tokens_limit=200) as srv:
        assert srv.app.state.settings.request_timeout == 0  # no total deadline by default
        body = {"prompt": PROMPT, "max_tokens": 90, "temperature": 0, "num_speculative_tokens": 0}
        start = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            whole = pool.submit(httpx.post, f"{srv.url}{C}", json=body, timeout=60)
            streamed = pool.submit(_stream, srv.url, body)
            r, (tokens, error) = whole.result(), streamed.result()
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 90 and r.json()["choices"][0]["finish_reason"] == "length"
        assert error is None and tokens == 90
        assert took > 2 * 2.0, took
        assert wait_until(lambda: _nothing_left(srv), 5)


def test_a_long_prefill_is_progress_too(tiny_pair, tokenizer):
    # 240 prompt tokens, 8 a step, 0.1 s a step: ~3 s before the first token, against a 1 s stall limit
    with serve_slow(tiny_pair, tokenizer, delay=0.1, stall_timeout=1.0, prefill_tokens_per_step=8,
                    max_tokens_limit=8) as srv:
        start = time.monotonic()
        r = httpx.post(f"{srv.url}{C}", json={"prompt": [i % 300 + 5 for i in range(240)], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert time.monotonic() - start > 2.5
        assert wait_until(lambda: _nothing_left(srv), 5)


def test_a_stalled_request_is_cancelled_naming_the_flag(tiny_pair, tokenizer):
    with serve_slow(tiny_pair, tokenizer, delay=0.02, stall_timeout=1.0, max_tokens_limit=400) as srv:
        batcher, slow = srv.app.state.batcher, srv.app.state.generator
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            whole = pool.submit(httpx.post, f"{srv.url}{C}", json=body, timeout=30)
            streamed = pool.submit(_stream, srv.url, body)
            assert wait_until(lambda: batcher.running == 2, 10)  # both decoding
            slow.stall_next(3.0)  # the next engine step hangs for 3 s
            start = time.monotonic()
            r, (tokens, error) = whole.result(), streamed.result()
            answered = time.monotonic() - start
        assert r.status_code == 504
        whole_error = error_shape(r)
        for err in (whole_error, error):  # the non-streamed 504 and the stream's last event
            assert err["type"] == "timeout_error" and err["code"] == "stall_timeout", err
            assert "no progress for 1 s (--stall-timeout" in err["message"], err
        assert answered < 2.9, answered  # at the limit, not when the stalled step ends
        assert metric(metric_values(srv.url), "specdecode_cancelled_requests_total", reason="stall") == 2
        assert wait_until(lambda: _nothing_left(srv), 10)  # their rows leave once the stalled step ends
        after = httpx.post(f"{srv.url}{C}", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert after.status_code == 200  # the engine serves again


def test_a_request_queued_past_its_wait_limit_gets_503(tiny_pair, tokenizer):
    with serve_slow(tiny_pair, tokenizer, delay=0.05, queue_timeout=1.0, max_batch_size=1,
                    max_tokens_limit=400) as srv:
        busy = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{srv.url}{C}", json=busy) as running:
            assert running.status_code == 200  # holds the batch's one row for ~20 s
            queued = {"prompt": "Once upon a time", "max_tokens": 4}
            start = time.monotonic()
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda b: httpx.post(f"{srv.url}{C}", json=b, timeout=30),
                                        [queued, {**queued, "stream": True}]))
            waited = time.monotonic() - start
        for r in answers:  # streamed or not: no stream has started, so a plain 503
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = error_shape(r)
            assert err["code"] == "queue_timeout" and "waited 1 s for room in the batch (--queue-timeout)" in \
                err["message"], err
        assert 1.0 <= waited < 3.0, waited
        assert metric(metric_values(srv.url), "specdecode_cancelled_requests_total", reason="queue_timeout") == 2
        assert wait_until(lambda: _nothing_left(srv), 10)  # the busy client went away: its row is freed too


def test_a_total_deadline_only_where_one_is_asked_for(tiny_pair, tokenizer):
    with serve_slow(tiny_pair, tokenizer, delay=0.05, max_tokens_limit=200) as srv:
        start = time.monotonic()
        r = httpx.post(f"{srv.url}{C}", json={"prompt": PROMPT, "max_tokens": 150, "timeout": 0.5}, timeout=30)
        assert r.status_code == 504 and time.monotonic() - start < 3
        err = error_shape(r)
        assert err["code"] == "request_timeout" and "deadline of 0.5 s (the request's timeout field)" in err["message"]
        bad = httpx.post(f"{srv.url}{C}", json={"prompt": PROMPT, "timeout": 0}, timeout=30)
        assert bad.status_code == 400 and error_shape(bad)["param"] == "timeout"
        assert wait_until(lambda: _nothing_left(srv), 5)
    # the earlier of the flag and the field applies; neither: none
    runner = JobRunner(None, None, ServerSettings(request_timeout=5))
    assert (runner.limits(0.0, 10).total, runner.limits(0.0, 10).total_by) == (5, "--request-timeout")
    assert (runner.limits(0.0, 2).total, runner.limits(0.0, 2).total_by) == (2, "the request's timeout field")
    assert JobRunner(None, None, ServerSettings()).limits(0.0).total == 0


def test_defaults_never_cut_a_request_that_makes_progress():
    from specdecode.server.ray_serve import HEARTBEAT_S, PROXY_GRACE_S, REPLICA_SILENCE_S, http_options

    settings = ServerSettings()
    assert (settings.queue_timeout, settings.stall_timeout, settings.request_timeout) == (600, 120, 0)
    assert settings.max_tokens_limit == 0 and settings.tokens_cap(4096) == 4095 and settings.tokens_cap(None) is None
    assert ServerSettings(max_tokens_limit=64).tokens_cap(4096) == 64
    # Ray's proxy timeout is end to end (streams too): none unless the server has a total deadline
    assert http_options("127.0.0.1", 8000, settings)["request_timeout_s"] is None
    assert http_options("127.0.0.1", 8000, ServerSettings(request_timeout=30))["request_timeout_s"] == \
        30 + PROXY_GRACE_S == 40
    assert (HEARTBEAT_S, REPLICA_SILENCE_S) == (5, 60)  # the README's numbers: a replica heard every 5 s


def test_a_chat_without_max_tokens_gets_the_rest_of_the_context(tiny_pair, tokenizer):
    from specdecode.server.schemas import ChatCompletionRequest, CompletionRequest
    from specdecode.server.translate import translate

    served = ServedModel.of(make_generator(tiny_pair, tokenizer), (MODEL,), tokenizer, None)
    context = served.context_length
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Rewrite the file."}]})
    job = translate(chat, "chat", served, ServerSettings()).job
    assert job.max_tokens == [context - len(job.prompts[0])]  # no cap of the server's own below the context
    assert translate(chat, "chat", served, ServerSettings(max_tokens_limit=64)).job.max_tokens == [64]
    plain = CompletionRequest.model_validate({"prompt": "a"})
    assert translate(plain, "completion", served, ServerSettings()).job.max_tokens == [16]  # OpenAI's default
    over = CompletionRequest.model_validate({"prompt": "a", "max_tokens": 3000})
    with pytest.raises(Exception, match=r"lower max_tokens to at most \d+") as info:
        translate(over, "completion", served, ServerSettings())
    assert info.value.status == 400 and info.value.param == "max_tokens"


def test_a_replica_says_it_is_alive_while_its_answer_takes_long(monkeypatch):
    """The ingress tells a long answer from a lost replica by heartbeats: a replica whose app has not answered yet
    yields None every HEARTBEAT_S, then the head and the body as before."""
    from specdecode.server import ray_serve

    monkeypatch.setattr(ray_serve, "HEARTBEAT_S", 0.05)

    async def slow_app(scope, receive, send):
        await asyncio.sleep(0.3)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"done", "more_body": False})

    replica = ray_serve.SpecdecodeReplica.__new__(ray_serve.SpecdecodeReplica)  # without loading models
    replica._app, replica._apps_running = slow_app, set()
    request = {"method": "POST", "path": C, "query": "", "headers": [], "body": b"{}"}

    async def items():
        return [item async for item in replica.forward(request)]

    got = asyncio.run(items())
    assert got[:2] == [None, None] and got[-2]["status"] == 200 and got[-1] == b"done"


class _Call:
    """A replica call as the ingress sees it: items (None: a heartbeat), then its end; "hang": silent forever."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item == "hang":
            await asyncio.sleep(3600)
        return item

    def cancel(self):
        self.cancelled = True


class _Engine:
    def __init__(self, *calls):
        self.calls = list(calls)

    def options(self, stream):
        return self

    @property
    def forward(self):
        return self

    def remote(self, forwarded, **keyed):
        return self.calls.pop(0)


def _ingress_answer(engine, body: bytes) -> tuple[int, bytes]:
    from starlette.requests import Request

    from specdecode.server.ray_serve import SpecdecodeIngress

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def run():
        scope = {"type": "http", "method": "POST", "path": C, "query_string": b"", "headers": [],
                 "server": ("ingress", 80)}
        response = await SpecdecodeIngress(engine)(Request(scope, receive))
        if hasattr(response, "body_iterator"):
            return response.status_code, b"".join([chunk async for chunk in response.body_iterator])
        return response.status_code, response.body

    return asyncio.run(run())


def test_the_ingress_takes_a_silent_replica_as_lost(monkeypatch):
    pytest.importorskip("ray")
    from specdecode.server import ray_serve

    monkeypatch.setattr(ray_serve, "REPLICA_SILENCE_S", 0.2)
    json_head = {"status": 200, "headers": [("content-type", "application/json")]}
    sse_head = {"status": 200, "headers": [("content-type", "text/event-stream")]}
    # a replica silent before its answer: the request goes to another, whose heartbeats are skipped
    dead, live = _Call(["hang"]), _Call([None, json_head, None, b'{"ok": 1}'])
    assert _ingress_answer(_Engine(dead, live), b'{"prompt": "a"}') == (200, b'{"ok": 1}')
    assert dead.cancelled
    # a stream whose replica goes silent mid-way ends with an error event
    stalled = _Call([sse_head, b"data: {}\n\n", None, "hang"])
    status, body = _ingress_answer(_Engine(stalled), b'{"prompt": "a", "stream": true}')
    assert status == 200 and body.startswith(b"data: {}\n\n") and b'"code": "replica_lost"' in body
    assert stalled.cancelled

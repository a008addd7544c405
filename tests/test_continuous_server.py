"""Continuous batching on a live server: 200 concurrent requests of every kind share the running batch and each
gets exactly its solo answer; a client that goes away mid-stream frees its row within one engine step."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from specdecode.server import ServerSettings, create_app
from test_server_helpers import SlowGenerator as SlowSessions
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer, make_generator, metric, metric_values, wait_until

WORDS = ("def", "quicksort", "arr", "pivot", "import", "numpy", "for", "print", "class", "Model", "The", "quick",
         "brown", "fox", "lazy", "dog", "Once", "upon", "a", "time", "small", "large", "model", "text")
N_REQUESTS = 200


def _specs(engine) -> list[dict]:
    """Request bodies with their solo answers (the engine alone), in every mix of settings."""
    rng = random.Random(12)
    specs = []
    for i in range(N_REQUESTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) + f" {i}"
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 20), "temperature": 0, "stream": i % 3 == 0}
        kind = i % 5
        if kind == 1:
            body["stop"] = ["e", "\n"]
        elif kind == 2:  # seeded sampling: the same sample whatever shares the batch
            body.update(temperature=0.8, top_k=40, seed=1000 + i)
        elif kind == 3:
            body.update(temperature=0.6, top_p=0.9, seed=7 * i)
        elif kind == 4:
            body["num_speculative_tokens"] = 1 + i % 3
        kwargs = {k: body[k] for k in ("temperature", "top_k", "top_p", "seed", "stop") if k in body}
        solo = engine.generate(prompt, max_new_tokens=body["max_tokens"], **kwargs)
        specs.append({"body": body, "text": solo.texts[0], "tokens": len(solo.token_ids[0])})
    return specs


async def _send(http, body: dict) -> tuple[int, str, dict | None]:
    if not body["stream"]:
        r = await http.post("/v1/completions", json=body)
        data = r.json()
        return r.status_code, data["choices"][0]["text"] if r.status_code == 200 else "", data
    text = ""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", None
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        text += "".join(c["text"] for c in chunk["choices"])
    return r.status_code, text, None


def test_200_concurrent_requests_of_any_mix_each_equal_their_solo_answer(tiny_pair, tokenizer):
    engine = make_generator(tiny_pair, tokenizer)
    specs = _specs(engine)
    settings = ServerSettings(max_batch_size=6, max_queue=N_REQUESTS + 10, max_tokens_limit=64,
                              request_timeout=180, prefill_tokens_per_step=16)
    app = create_app(make_generator(tiny_pair, tokenizer), MODEL, tokenizer, settings)
    with LiveServer(app) as srv:
        async def run():
            limits = httpx.Limits(max_connections=N_REQUESTS + 5, max_keepalive_connections=N_REQUESTS + 5)
            async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=180) as http:
                return await asyncio.gather(*(_send(http, s["body"]) for s in specs))

        start = time.monotonic()
        answers = asyncio.run(run())
        elapsed = time.monotonic() - start
        values = metric_values(srv.url)
        session = app.state.batcher.session

    batch_sizes = []
    for spec, (status, text, data) in zip(specs, answers):
        assert status == 200, spec["body"]
        assert text == spec["text"], (spec["body"], text, spec["text"])
        if data is not None:
            assert data["usage"]["completion_tokens"] == spec["tokens"]
            batch_sizes.append(data["speculative"]["batch_size"])
    assert max(batch_sizes) > 1 and max(batch_sizes) <= 6  # requests shared the batch, never more than 6 rows
    assert session.idle and session.running == 0
    assert metric(values, "specdecode_running_rows") == 0 and metric(values, "specdecode_queue_depth") == 0
    assert metric(values, "specdecode_time_to_first_token_seconds_count") == N_REQUESTS
    assert metric(values, "specdecode_inter_token_latency_seconds_count") > 0
    assert metric(values, "specdecode_generated_tokens_total") == sum(s["tokens"] for s in specs)
    assert metric(values, "specdecode_batch_size_bucket", le="1.0") < metric(values, "specdecode_batch_size_count")
    print(f"\n{N_REQUESTS} requests in {elapsed:.1f} s, {metric(values, 'specdecode_engine_steps_total'):.0f} "
          f"engine steps")


def test_a_client_gone_mid_stream_frees_its_row_within_one_step(tiny_pair, tokenizer):
    settings = ServerSettings(max_batch_size=4, max_tokens_limit=400, request_timeout=60)
    app = create_app(SlowSessions(make_generator(tiny_pair, tokenizer), 0.02), MODEL, tokenizer, settings)
    with LiveServer(app) as srv:
        batcher = app.state.batcher

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                other = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Once upon a time",
                                                                               "max_tokens": 60, "temperature": 0}))
                body = {"prompt": "def quicksort(arr):", "max_tokens": 400, "temperature": 0, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 4:
                            break
                    assert batcher.running_rows == 2
                # the client is gone: the row leaves at the next step, the other row goes on
                steps = await asyncio.to_thread(_steps_when_cancelled, srv.url, batcher)
                freed = await asyncio.to_thread(wait_until, lambda: batcher.running_rows <= 1, 5, 0.002)
                assert freed and batcher.session.steps <= steps + 2
                return await other

        response = asyncio.run(run())
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 60
        values = metric_values(srv.url)
        assert metric(values, "specdecode_cancelled_requests_total", reason="disconnect") == 1
        assert wait_until(lambda: metric(metric_values(srv.url), "specdecode_running_rows") == 0, 5)


def _steps_when_cancelled(url: str, batcher) -> int:
    assert wait_until(lambda: any(j.cancelled for j in list(batcher._running)) or
                      metric(metric_values(url), "specdecode_cancelled_requests_total", reason="disconnect") == 1,
                      5, 0.002)
    return batcher.session.steps


def test_bad_input_is_refused_before_queueing_with_openai_errors(tiny_pair, tokenizer):
    from test_server_helpers import error_shape

    settings = ServerSettings(max_batch_size=2, max_tokens_limit=256)
    app = create_app(make_generator(tiny_pair, tokenizer), MODEL, tokenizer, settings)
    with LiveServer(app) as srv:
        too_long = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a " * 400, "max_tokens": 200}, timeout=30)
        assert too_long.status_code == 400
        assert error_shape(too_long)["code"] == "context_length_exceeded"
        empty = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ""}, timeout=30)
        assert empty.status_code == 400 and error_shape(empty)["param"] == "prompt"
        bad_k = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "num_speculative_tokens": -1},
                           timeout=30)
        assert bad_k.status_code == 400 and error_shape(bad_k)["param"] == "num_speculative_tokens"
        values = metric_values(srv.url)
        assert metric(values, "specdecode_queue_wait_seconds_count") == 0  # none of them reached the queue

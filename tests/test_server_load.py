"""Load on a live server: 120 concurrent requests of mixed kinds and lengths are all answered, each with exactly
its own solo answer; /health answers throughout; a small queue overflows into 429 + Retry-After."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from specdecode.server import ServerSettings, create_app
from test_server_helpers import SlowGenerator as SlowSessions
from test_server_helpers import MODEL, LiveServer, error_shape, make_generator, metric, metric_values, serve

WORDS = ("def", "quicksort", "arr", "pivot", "import", "numpy", "for", "print", "class", "Model", "The", "quick",
         "brown", "fox", "lazy", "dog", "Once", "upon", "a", "time", "small", "large", "model", "text")
N_REQUESTS = 120
CONCURRENCY = 100


def _requests(tokenizer, engine) -> list[tuple[str, dict, str]]:
    """(endpoint, body, expected text) of every request, the expected text computed with the engine alone."""
    rng = random.Random(7)
    specs = []
    for i in range(N_REQUESTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + f" {i}"
        max_tokens = rng.randint(1, 16)
        kind = i % 6
        if kind == 4:  # chat
            messages = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            expected = engine.generate([ids], max_new_tokens=max_tokens, temperature=0).texts[0]
            specs.append(("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                   "temperature": 0}, expected))
            continue
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        kwargs = {}
        if kind == 3:  # stop strings, in the same batch as requests without them
            body["stop"] = kwargs["stop"] = ["e", "\n"]
        if kind == 5:  # seeded sampling: the engine's seeded solo answer, whatever shares the batch
            body.update(temperature=0.8, top_k=40, seed=1000 + i)
            kwargs.update(temperature=0.8, top_k=40, seed=1000 + i)
        expected = engine.generate(prompt, max_new_tokens=max_tokens, **{"temperature": 0, **kwargs}).texts[0]
        specs.append(("/v1/completions", body, expected))
    return specs


def test_concurrent_load_is_served_exactly(tiny_pair, tokenizer):
    engine = make_generator(tiny_pair, tokenizer)
    t0 = time.monotonic()
    specs = _requests(tokenizer, engine)
    solo_s = time.monotonic() - t0

    with serve(tiny_pair, tokenizer, max_batch_size=8, max_queue=CONCURRENCY + 10, max_tokens_limit=64,
               request_timeout=120) as srv:
        async def run():
            limits = httpx.Limits(max_connections=CONCURRENCY + 5, max_keepalive_connections=CONCURRENCY + 5)
            async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=120) as http:
                gate = asyncio.Semaphore(CONCURRENCY)
                done = asyncio.Event()

                async def one(endpoint, body):
                    async with gate:
                        return await http.post(endpoint, json=body)

                async def health_probe():
                    probes = []
                    while not done.is_set():
                        start = time.monotonic()
                        r = await http.get("/health")
                        probes.append((r.status_code, time.monotonic() - start, r.json()))
                        await asyncio.sleep(0.1)
                    return probes

                probe = asyncio.create_task(health_probe())
                start = time.monotonic()
                responses = await asyncio.gather(*(one(e, b) for e, b, _ in specs))
                elapsed = time.monotonic() - start
                done.set()
                return responses, await probe, elapsed

        responses, probes, elapsed = asyncio.run(run())
        values = metric_values(srv.url)

    assert len(responses) == N_REQUESTS
    batch_sizes = []
    for (endpoint, body, expected), r in zip(specs, responses):
        assert r.status_code == 200, (body, r.text)
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if endpoint.endswith("chat/completions") else choice["text"]
        assert text == expected, (body, text, expected)
        assert data["usage"]["completion_tokens"] <= body["max_tokens"]
        batch_sizes.append(data["speculative"]["batch_size"])
    assert max(batch_sizes) > 1, "concurrent requests never shared an engine batch"
    assert max(batch_sizes) <= 8

    # /health answered during the load, and saw the queue
    assert len(probes) >= 2 and all(status == 200 for status, _, _ in probes)
    assert max(latency for _, latency, _ in probes) < 5.0
    assert metric(values, "specdecode_requests_total", endpoint="/v1/completions", status="200") == \
        sum(1 for e, _, _ in specs if e == "/v1/completions")
    assert metric(values, "specdecode_requests_total", endpoint="/v1/chat/completions", status="200") == \
        sum(1 for e, _, _ in specs if e != "/v1/completions")
    assert metric(values, "specdecode_queue_depth") == 0
    assert metric(values, "specdecode_batch_size_bucket", le="1.0") < metric(values, "specdecode_batch_size_count")
    print(f"\n{N_REQUESTS} requests in {elapsed:.1f} s (solo answers: {solo_s:.1f} s); "
          f"mean batch {sum(batch_sizes) / len(batch_sizes):.1f}; health probes {len(probes)}")


def test_full_queue_answers_429_with_retry_after(tiny_pair, tokenizer):
    # one request at a time, each ~0.4 s: 16 arriving together overflow a queue of 2
    settings = ServerSettings(max_batch_size=1, max_queue=2, max_tokens_limit=16)
    app = create_app(SlowSessions(make_generator(tiny_pair, tokenizer), 0.05), MODEL, tokenizer, settings)
    with LiveServer(app) as srv:
        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 8})
                                              for i in range(16)))

        responses = asyncio.run(run())
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429}, codes
        assert codes.count(200) >= 2  # the queue's capacity at least
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                error = error_shape(r)
                assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        values = metric_values(srv.url)
        assert metric(values, "specdecode_rejected_requests_total", reason="queue_full") == codes.count(429)
        assert metric(values, "specdecode_requests_total", endpoint="/v1/completions", status="429") == \
            codes.count(429)
        # once the queue drains, requests are served again
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_many_streams_and_plain_requests_mixed(tiny_pair, tokenizer, stream):
    """Streaming and plain requests in the same batches get the same texts as alone (streams joined)."""
    engine = make_generator(tiny_pair, tokenizer)
    prompts = [f"{w} {i}" for i, w in enumerate(WORDS[:24])]
    expected = ["".join(e.text or "" for e in engine.stream(p, max_new_tokens=8, temperature=0)) if stream
                else engine.generate(p, max_new_tokens=8, temperature=0).texts[0] for p in prompts]
    with serve(tiny_pair, tokenizer, max_batch_size=8, max_tokens_limit=16) as srv:
        async def one(http, prompt):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
            if not stream:
                return (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            import json

            text = ""
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            for line in lines[:-1]:
                text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                return await asyncio.gather(*(one(http, p) for p in prompts))

        assert asyncio.run(run()) == expected

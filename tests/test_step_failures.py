"""Steps under concurrent load: rows whose draft never fed a token (plain steps under -k auto) leave and join while
the draft's cache holds no slot, and a later draft step must still see one cache row per batch row; a step that
fails anyway fails only the rows it names, and the engine keeps serving the others."""

from __future__ import annotations

import pytest

from conftest import perturbed_copy, tiny_qwen
from specdecode import SpeculativeGenerator
from specdecode.policy.choose import AdaptivePolicy

PROMPTS = [[11, 42, 7, 99, 5], [3, 17, 2], [8, 8, 9, 100, 4, 4, 2], [50, 51], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(128, seed=3, eos_token_id=127)
    return target, perturbed_copy(target, 0.3, seed=4)


def scripted(monkeypatch, plan: list[int]) -> None:
    """The adaptive policy's K, step by step, from plan (0 once it runs out): -k auto's plain runs, on demand."""
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: min(plan.pop(0) if plan else 0, max(caps)))


def solo(target, request) -> list[int]:
    plain = SpeculativeGenerator(target, None)
    return plain.generate([request.prompt], max_new_tokens=request.max_new_tokens, temperature=0.0,
                          ignore_eos=True).token_ids[0]


@pytest.mark.parametrize("then", ["a row leaves", "a row joins"])
def test_a_draft_step_after_the_draft_cache_emptied(models, monkeypatch, then):
    """Row 0 drafts; rows 1 and 2 join and decode plainly (their draft cache rows are all holes); row 0 leaves, which
    crops the draft's cache to no slot at all. Then a row leaves (or joins) while nothing is cached, and a draft step
    follows: transformers' cache ignores a row selection when it holds no slot, so the draft's forward used to fail
    ("Sizes of tensors must match except in dimension 2. Expected size 2 but got size 1")."""
    target, draft = models
    scripted(monkeypatch, [2, 0, 0, 0, 2, 2, 2])
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    requests = [gen.request(p, 30, 0.0, ignore_eos=True) for p in PROMPTS[:4]]
    session = gen.session()
    rows = [session.add(requests[0])]
    session.step()  # row 0 joins and drafts at K=2
    rows += [session.add(requests[1]), session.add(requests[2])]
    session.step()  # rows 1 and 2 join; K=0
    session.cancel(rows[0])
    session.step()  # K=0; row 0 leaves: the draft's cache keeps no slot
    assert session.drafter.backend.lengths == [0, 0]
    if then == "a row leaves":
        session.cancel(rows[1])
    else:
        rows.append(session.add(requests[3]))
    session.step()  # K=0
    while not session.idle:  # K=2: the draft feeds every row's backlog
        session.step()
    result = session.result(rows)
    for i, (row, request) in enumerate(zip(rows, requests)):
        if result.finish_reasons[i] == "length":
            assert result.token_ids[i] == solo(target, request)


# ---------------------------------------------------------------------------------------------- on a live server
WORDS = ("def", "quicksort", "arr", "pivot", "import", "numpy", "print", "The", "quick", "fox", "lazy", "dog")


def probing(monkeypatch, every: int = 4, k: int = 2) -> None:
    """-k auto as it runs when drafting does not pay: plain steps, and a probe at K=k every `every` steps."""
    calls = [0]

    def choose(self, rows, caps):
        calls[0] += 1
        return min(k if calls[0] % every == 0 else 0, max(caps))

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)


def test_six_clients_of_short_completions_under_auto_k(tiny_pair, tokenizer, monkeypatch):
    """The issue's load: six clients sending short completions (greedy and seeded) at once, -k auto, batches of 8:
    rows join and leave between the policy's probes. Every request is answered 200 with its solo answer."""
    import asyncio
    import random

    import httpx

    from specdecode.server import ServerSettings, create_app
    from test_server_helpers import MODEL, LiveServer, metric, metric_values

    probing(monkeypatch)
    target, draft = tiny_pair
    engine = SpeculativeGenerator(target, draft, num_speculative_tokens="auto", tokenizer=tokenizer)
    rng = random.Random(3)
    clients = []
    for c in range(6):
        bodies = []
        for i in range(6):
            body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))),
                    "max_tokens": rng.randint(1, 8), "temperature": 0}
            if i % 2:
                body.update(temperature=0.8, seed=100 * c + i)
            bodies.append(body)
        clients.append(bodies)
    expected = [[engine.generate(b["prompt"], max_new_tokens=b["max_tokens"], temperature=b["temperature"],
                                 seed=b.get("seed")).texts[0] for b in bodies] for bodies in clients]

    settings = ServerSettings(max_batch_size=8, prefix_cache_tokens=0, max_tokens_limit=64, request_timeout=120)
    app = create_app(SpeculativeGenerator(target, draft, num_speculative_tokens="auto", tokenizer=tokenizer),
                     MODEL, tokenizer, settings)
    with LiveServer(app) as srv:
        async def client(http, bodies):
            answers = []
            for body in bodies:
                r = await http.post("/v1/completions", json=body)
                answers.append(r.json()["choices"][0]["text"] if r.status_code == 200 else (r.status_code, r.text))
            return answers

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                return await asyncio.gather(*(client(http, bodies) for bodies in clients))

        answers = asyncio.run(run())
        failures = metric(metric_values(srv.url), "specdecode_engine_step_failures_total")
    assert answers == expected
    assert failures == 0


POISON = [301, 302, 303]  # a prompt with these three ids in a row makes the target's forward raise


def has_poison(ids: list[int]) -> bool:
    return any(ids[i:i + 3] == POISON for i in range(len(ids) - 2))


def poisoned(generator):
    """The generator's target raises on any forward whose input holds POISON in a row (its forks too: a subclass)."""
    backend = generator.target

    class Poisoned(type(backend)):
        def forward(self, input_ids, *args, **kwargs):
            if any(has_poison(row) for row in input_ids.tolist()):
                raise RuntimeError("injected failure: a poisoned prompt")
            return super().forward(input_ids, *args, **kwargs)

    backend.__class__ = Poisoned
    return generator


def test_a_failing_step_fails_only_the_request_that_breaks_it(tiny_pair, tokenizer):
    """A request whose prefill always raises joins while others decode. The step fails: the server starts a fresh
    session and runs each request of the failed step again, alone. The poisoned one fails again and is answered 500
    naming the error; a stream that had already sent tokens ends with an error event; every other request is
    answered with exactly its solo answer; later requests are served as before."""
    import asyncio
    import json

    import httpx

    from specdecode.server import ServerSettings, create_app
    from test_server_helpers import MODEL, LiveServer, SlowGenerator, error_shape, metric, metric_values

    engine = SpeculativeGenerator(*tiny_pair, num_speculative_tokens=3, tokenizer=tokenizer)
    bodies = [{"prompt": "def quicksort(arr):", "max_tokens": 24, "temperature": 0},
              {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0.8, "seed": 5},
              {"prompt": "import numpy", "max_tokens": 16, "temperature": 0}]
    expected = []
    for b in bodies:
        result = engine.generate(b["prompt"], max_new_tokens=b["max_tokens"], temperature=b["temperature"],
                                 seed=b.get("seed"), ignore_eos=True)
        assert not has_poison(result.prompt_token_ids[0] + result.token_ids[0])
        expected.append(result.texts[0])
    generator = SlowGenerator(poisoned(SpeculativeGenerator(*tiny_pair, num_speculative_tokens=3,
                                                            tokenizer=tokenizer)), delay=0.05)
    app = create_app(generator, MODEL, tokenizer, ServerSettings(max_batch_size=8, max_tokens_limit=200))
    with LiveServer(app) as srv:
        async def stream(http, started: asyncio.Event):
            body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                chunks = []
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                        if any(c.get("text") for c in chunks[-1].get("choices", [])):
                            started.set()
                return r.status_code, chunks

        async def poison(http, started: asyncio.Event):
            await asyncio.wait_for(started.wait(), 30)  # the stream has sent tokens, the others are decoding
            return await http.post("/v1/completions", json={"prompt": [5, 6] + POISON, "max_tokens": 4})

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                started = asyncio.Event()
                return await asyncio.gather(stream(http, started), poison(http, started),
                                            *(http.post("/v1/completions", json=b) for b in bodies))

        (stream_status, chunks), bad, *good = asyncio.run(run())
        after = httpx.post(f"{srv.url}/v1/completions", json=bodies[0], timeout=60)
        health = httpx.get(f"{srv.url}/health", timeout=10)
        values = metric_values(srv.url)

    assert bad.status_code == 500
    error = error_shape(bad)
    assert "injected failure: a poisoned prompt" in error["message"] and "again" in error["message"], error
    assert [r.status_code for r in good] == [200] * len(bodies)
    assert [r.json()["choices"][0]["text"] for r in good] == expected
    assert stream_status == 200 and "error" in chunks[-1], chunks[-1]  # the stream's end: an error event
    assert "already streamed" in chunks[-1]["error"]["message"]
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected[0]
    assert health.status_code == 200
    assert metric(values, "specdecode_engine_step_failures_total") == 2  # the mixed step, then the poison alone
    assert metric(values, "specdecode_engine_step_retries_total") >= 2  # the poisoned one and an innocent

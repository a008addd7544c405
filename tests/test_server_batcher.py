"""The batcher and worker without HTTP: batching rules, cancellation, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from specdecode.server.batcher import Batcher, Cancelled, Done, Failed, Job, QueueFull, ShuttingDown, Started, Token
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import SlowGenerator, make_generator


def _ids(tokenizer, text):
    return tokenizer(text)["input_ids"]


async def _drain(job: Job, timeout: float = 30.0) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(job.queue.get(), timeout)
        items.append(item)
        if isinstance(item, (Done, Failed)):
            return items


def test_compatible_jobs_share_a_batch_and_get_their_own_rows(tiny_pair, tokenizer):
    engine = make_generator(tiny_pair, tokenizer)
    batcher = Batcher(make_generator(tiny_pair, tokenizer), max_batch_size=4, batch_window_s=0.05)
    prompts = ["def quicksort", "The quick brown fox", "import numpy", "Once upon a time", "class Model"]

    async def run():
        jobs = [Job(prompts=[_ids(tokenizer, p)], max_tokens=[3 + i], temperature=0.0) for i, p in enumerate(prompts)]
        seeded = Job(prompts=[_ids(tokenizer, "a b c")], max_tokens=[4], temperature=0.7, seed=5)
        other_key = Job(prompts=[_ids(tokenizer, "x y")], max_tokens=[4], temperature=0.0, stop=("\n",))
        for job in jobs + [seeded, other_key]:
            batcher.submit(job)
        batcher.start()
        return [await _drain(j) for j in jobs + [seeded, other_key]]

    try:
        results = asyncio.run(run())
    finally:
        batcher.stop(5)
    dones = [items[-1] for items in results]
    assert all(isinstance(d, Done) for d in dones)
    assert [d.batch_size for d in dones[:5]] == [4, 4, 4, 4, 1]  # FIFO, at most max_batch_size prompts
    assert dones[5].batch_size == 1 and dones[6].batch_size == 1  # a seed, different stop strings: alone
    for i, (prompt, done) in enumerate(zip(prompts, dones)):
        assert done.texts[0] == engine.generate(prompt, max_new_tokens=3 + i, temperature=0).texts[0]
        tokens = [it.event.token_id for it in results[i] if isinstance(it, Token)]
        assert tokens == done.token_ids[0]
        assert isinstance(results[i][0], Started)
    assert dones[5].texts[0] == engine.generate("a b c", max_new_tokens=4, temperature=0.7, seed=5).texts[0]


def test_greedy_ignores_top_k_and_top_p_when_grouping():
    a = Job(prompts=[[1]], max_tokens=[1], temperature=0.0, top_k=5, top_p=0.5)
    b = Job(prompts=[[1]], max_tokens=[1], temperature=1e-9)
    assert a.key == b.key and a.temperature == 0.0


def test_queue_limit_and_prompt_limit(tiny_pair, tokenizer):
    batcher = Batcher(make_generator(tiny_pair, tokenizer), max_batch_size=2, max_queue=2)

    async def run():
        batcher.submit(Job(prompts=[[1]], max_tokens=[1]))
        batcher.submit(Job(prompts=[[1]], max_tokens=[1]))
        with pytest.raises(QueueFull):
            batcher.submit(Job(prompts=[[1]], max_tokens=[1]))
        with pytest.raises(ValueError):
            batcher.submit(Job(prompts=[[1]] * 3, max_tokens=[1] * 3))

    asyncio.run(run())
    batcher.stop(1)


def test_cancel_queued_and_running_jobs(tiny_pair, tokenizer):
    batcher = Batcher(SlowGenerator(make_generator(tiny_pair, tokenizer), 0.02), max_batch_size=1)

    async def run():
        running = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[200])
        queued = Job(prompts=[_ids(tokenizer, "b")], max_tokens=[5])
        batcher.submit(running)
        batcher.submit(queued)
        batcher.start()
        assert isinstance(await asyncio.wait_for(running.queue.get(), 10), Started)
        batcher.cancel(queued, "disconnect")
        assert batcher.queue_depth == 0
        batcher.cancel(running, "disconnect")
        items = await _drain(running, 10)
        assert isinstance(items[-1], Failed) and isinstance(items[-1].error, Cancelled)
        assert sum(isinstance(i, Token) for i in items) < 50  # stopped long before its 200 tokens

    asyncio.run(run())
    batcher.stop(5)
    assert not batcher.alive


def test_stop_fails_queued_work_and_cancels_the_running_batch_after_the_grace(tiny_pair, tokenizer):
    batcher = Batcher(SlowGenerator(make_generator(tiny_pair, tokenizer), 0.02), max_batch_size=1)

    async def run():
        running = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[300])
        queued = Job(prompts=[_ids(tokenizer, "b")], max_tokens=[5])
        batcher.submit(running)
        batcher.submit(queued)
        batcher.start()
        assert isinstance(await asyncio.wait_for(running.queue.get(), 10), Started)
        await asyncio.to_thread(batcher.stop, 0.2)
        assert not batcher.alive
        with pytest.raises(ShuttingDown):
            batcher.submit(Job(prompts=[[1]], max_tokens=[1]))
        queued_items = await _drain(queued, 5)
        assert isinstance(queued_items[-1].error, ShuttingDown)
        running_items = await _drain(running, 5)
        assert isinstance(running_items[-1], Failed) and isinstance(running_items[-1].error, Cancelled)

    asyncio.run(run())

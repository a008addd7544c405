"""The engine loop without HTTP: continuous batching over one session, cancellation, shutdown, engine failures."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdecode.server.batcher import (Batcher, Cancelled, Done, Failed, Job, QueueFull, ShuttingDown, Started,
                                      StepFailed, Token)
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import SlowGenerator as SlowSessions  # each engine step slowed, EOS ignored
from test_server_helpers import make_generator


def _ids(tokenizer, text):
    return tokenizer(text)["input_ids"]


async def _drain(job: Job, timeout: float = 30.0) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(job.queue.get(), timeout)
        items.append(item)
        if isinstance(item, (Done, Failed)):
            return items


def test_any_mix_of_settings_shares_the_batch_and_equals_solo(tiny_pair, tokenizer):
    engine = make_generator(tiny_pair, tokenizer)
    batcher = Batcher(make_generator(tiny_pair, tokenizer), max_batch_size=4, prefill_tokens_per_step=8)
    specs = [("def quicksort", dict(temperature=0.0)), ("The quick brown fox", dict(temperature=0.7, seed=5)),
             ("import numpy", dict(temperature=0.0, stop=("\n",))), ("Once upon a time", dict(temperature=0.9,
             top_k=20, seed=11)), ("class Model", dict(temperature=0.0, num_speculative_tokens=2)),
             ("a b c", dict(temperature=0.6, top_p=0.8, seed=3))]

    async def run():
        jobs = [Job(prompts=[_ids(tokenizer, p)], max_tokens=[4 + 2 * i], **kw) for i, (p, kw) in enumerate(specs)]
        two = Job(prompts=[_ids(tokenizer, "x y"), _ids(tokenizer, "for i in")], max_tokens=[6, 6], temperature=0.8,
                  seed=40)
        for job in jobs + [two]:
            batcher.submit(job)
        batcher.start()
        return [await _drain(j) for j in jobs + [two]]

    try:
        results = asyncio.run(run())
    finally:
        batcher.stop(5)
    dones = [items[-1] for items in results]
    assert all(isinstance(d, Done) for d in dones), dones
    assert max(d.batch_size for d in dones) > 1  # different settings shared the batch
    assert max(d.batch_size for d in dones) <= 4
    for i, ((prompt, kw), done) in enumerate(zip(specs, dones)):
        kw = {("stop" if k == "stop" else k): (list(v) if k == "stop" else v) for k, v in kw.items()}
        solo = engine.generate(prompt, max_new_tokens=4 + 2 * i, **kw)
        assert done.texts[0] == solo.texts[0], (prompt, kw)
        assert isinstance(results[i][0], Started)
        assert [it.event.token_id for it in results[i] if isinstance(it, Token)] == done.token_ids[0]
        assert done.stats.new_tokens == len(done.token_ids[0])
    solo_two = engine.generate(["x y", "for i in"], max_new_tokens=6, temperature=0.8, seed=40)
    assert dones[-1].texts == solo_two.texts  # row i of a request seeded S draws the stream (S, i), as in generate


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


def test_a_job_joins_the_running_batch_and_cancelled_rows_leave_within_a_step(tiny_pair, tokenizer):
    batcher = Batcher(SlowSessions(make_generator(tiny_pair, tokenizer), 0.01), max_batch_size=2)

    async def run():
        long = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[300])
        queued = Job(prompts=[_ids(tokenizer, "b")], max_tokens=[5])
        third = Job(prompts=[_ids(tokenizer, "c")], max_tokens=[5])
        batcher.submit(long)
        batcher.start()
        assert isinstance(await asyncio.wait_for(long.queue.get(), 10), Started)
        await asyncio.wait_for(long.queue.get(), 10)  # a token: the long job is decoding
        batcher.submit(queued)  # joins at the next step, while the long job runs
        items = await _drain(queued, 10)
        assert isinstance(items[-1], Done) and items[-1].batch_size == 2
        assert long.state == "running"
        batcher.cancel(long, "disconnect")
        batcher.submit(third)
        items = await _drain(long, 10)
        assert isinstance(items[-1], Failed) and isinstance(items[-1].error, Cancelled)
        session = batcher.session
        # freed at the next step (the session may go idle right after: wait for the state, not for steps); the
        # session forgets a released row only once it has left the batch
        assert await asyncio.to_thread(
            lambda: _until(lambda: not any(r in session.rows for r in long.rows)))
        assert long.rows and not any(r.index in long.rows for r in session.active)
        assert isinstance((await _drain(third, 10))[-1], Done)
        assert sum(isinstance(i, Token) for i in items) < 100  # stopped long before its 300 tokens

    asyncio.run(run())
    batcher.stop(5)
    assert not batcher.alive


def test_cancel_queued_job_leaves_the_queue_at_once(tiny_pair, tokenizer):
    batcher = Batcher(SlowSessions(make_generator(tiny_pair, tokenizer), 0.01), max_batch_size=1)

    async def run():
        running = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[100])
        queued = Job(prompts=[_ids(tokenizer, "b")], max_tokens=[5])
        batcher.submit(running)
        batcher.submit(queued)
        batcher.start()
        assert isinstance(await asyncio.wait_for(running.queue.get(), 10), Started)
        assert batcher.queue_depth == 1
        batcher.cancel(queued, "disconnect")
        assert batcher.queue_depth == 0 and queued.state == "finished"
        batcher.cancel(running, "timeout")
        assert isinstance((await _drain(running, 10))[-1], Failed)

    asyncio.run(run())
    batcher.stop(5)


def test_stop_fails_queued_work_and_cancels_the_running_rows_after_the_grace(tiny_pair, tokenizer):
    batcher = Batcher(SlowSessions(make_generator(tiny_pair, tokenizer), 0.02), max_batch_size=1)

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


@pytest.mark.parametrize("failures", [1, 2])
def test_an_engine_failure_reruns_the_job_alone_or_fails_it_and_the_loop_goes_on(tiny_pair, tokenizer, failures):
    """A job whose step raised runs again from its start, alone, in a fresh session: after one failure it gets its
    exact answer; when it fails again it fails with the error. Either way the next job is served."""
    generator = make_generator(tiny_pair, tokenizer)
    broken = {"left": failures}

    class FailingOnce:
        def __getattr__(self, name):
            return getattr(generator, name)

        def session(self, **kwargs):
            session = generator.session(**kwargs)
            decode = session.decode  # the batcher runs a step as admit() then decode()

            def failing_decode():
                if broken["left"]:
                    broken["left"] -= 1
                    raise RuntimeError("boom")
                return decode()

            session.decode = failing_decode
            return session

    batcher = Batcher(FailingOnce(), max_batch_size=2)

    async def run():
        first = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[3], temperature=0)
        batcher.submit(first)
        batcher.start()
        items = await _drain(first)
        if failures == 1:
            assert isinstance(items[-1], Done)
            assert items[-1].texts[0] == generator.generate("a", max_new_tokens=3, temperature=0).texts[0]
        else:
            assert isinstance(items[-1], Failed) and isinstance(items[-1].error, StepFailed)
            assert "boom" in str(items[-1].error) and "failed again" in str(items[-1].error)
        second = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[3], temperature=0)
        batcher.submit(second)
        return (await _drain(second))[-1]

    done = asyncio.run(run())
    batcher.stop(5)
    assert isinstance(done, Done)
    assert done.texts[0] == generator.generate("a", max_new_tokens=3, temperature=0).texts[0]


def test_a_request_that_fails_to_join_fails_alone_and_the_worker_lives_on(tiny_pair, tokenizer):
    """An error while a request joins the session (not a ValueError from its checks: say its grammar's matcher
    raised) is handled as a failed step: that job fails with the error, the worker thread lives on, and the job
    beside it and the next job are served exactly."""
    generator = make_generator(tiny_pair, tokenizer)
    bad_prompt = _ids(tokenizer, "poison")

    class FailingJoin:
        def __getattr__(self, name):
            return getattr(generator, name)

        def session(self, **kwargs):
            session = generator.session(**kwargs)
            add = session.add

            def failing_add(request):
                if list(request.prompt) == bad_prompt:
                    raise RuntimeError("matcher exploded")
                return add(request)

            session.add = failing_add
            return session

    batcher = Batcher(FailingJoin(), max_batch_size=4)
    solo = generator.generate("a", max_new_tokens=3, temperature=0).texts[0]

    async def run():
        good, bad = (Job(prompts=[p], max_tokens=[3], temperature=0) for p in (_ids(tokenizer, "a"), bad_prompt))
        batcher.submit(good)
        batcher.submit(bad)
        batcher.start()
        good_items, bad_items = await asyncio.gather(_drain(good), _drain(bad))
        after = Job(prompts=[_ids(tokenizer, "a")], max_tokens=[3], temperature=0)
        batcher.submit(after)
        return good_items[-1], bad_items[-1], (await _drain(after))[-1]

    good, bad, after = asyncio.run(run())
    assert batcher.alive
    batcher.stop(5)
    assert isinstance(bad, Failed) and isinstance(bad.error, StepFailed) and "matcher exploded" in str(bad.error)
    assert isinstance(good, Done) and good.texts[0] == solo
    assert isinstance(after, Done) and after.texts[0] == solo


def _until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()

"""The request queue and the engine worker.

One worker thread owns the generator (torch releases the GIL, so the event loop keeps answering while it runs).
The event loop submits jobs (a request's prompts and sampling settings) to a bounded FIFO queue; the worker takes
the oldest job and every other queued job it can share an engine batch with (same sampling parameters, stop
strings and k; per-prompt max_tokens may differ), up to max_batch_size prompts, runs `generator.stream(...)` on
the batch, and forwards each TokenEvent to its job's asyncio.Queue with `loop.call_soon_threadsafe`. A job with
a seed runs in a batch of its own, so the same seed gives the same output.

A job cancelled while queued leaves the queue at once; a job cancelled while running has its rows cancelled
(`TokenStream.cancel`) before the engine's next step, which the other rows of the batch do not notice.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("specdecode.server")

GREEDY_EPS = 1e-5  # temperatures below this are greedy decoding (as in vLLM): 1/T would overflow the logits


class QueueFull(Exception):
    """The queue holds max_queue jobs already."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work."""


class Cancelled(Exception):
    """The job was cancelled (client gone, timeout, shutdown)."""


# Items a job's queue receives, in order: Started, Token*, then Done or Failed.
@dataclass(frozen=True)
class Started:
    batch_size: int
    queue_wait_s: float


@dataclass(frozen=True)
class Token:
    index: int  # the prompt's index within its job
    event: Any  # the engine's TokenEvent


@dataclass(frozen=True)
class Done:
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: list[int]
    stats: Any  # the engine's Stats for the whole batch
    batch_size: int
    row_stats: list = field(default_factory=list)  # the engine's RowStats of this request's own prompts


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass
class Job:
    """One request's generation work: its prompts (token ids) and settings, and where its events go."""

    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    cancel_reason: str | None = None
    state: str = "new"  # new -> queued -> running -> finished

    def __post_init__(self):
        if self.temperature < GREEDY_EPS:
            self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0  # greedy: top-k/top-p change nothing

    @property
    def key(self) -> tuple:
        """Jobs with equal keys (and no seed) can share an engine batch."""
        return self.temperature, self.top_k, self.top_p, self.stop, self.num_speculative_tokens

    def post(self, item) -> None:
        """Hand an item to the job's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Batcher:
    def __init__(self, generator, *, max_batch_size: int = 8, max_queue: int = 64, batch_window_s: float = 0.005,
                 metrics=None):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be >= 1")
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch_window_s = batch_window_s
        self.metrics = metrics
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._accepting = True
        self._stopping = False
        self._abort = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ event-loop side
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def accepting(self) -> bool:
        return self._accepting

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="specdecode-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        if len(job.prompts) > self.max_batch_size:
            raise ValueError(f"{len(job.prompts)} prompts in one request; at most {self.max_batch_size} "
                             f"(--max-batch-size)")
        if job.loop is None:
            job.loop = asyncio.get_running_loop()
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            job.state = "queued"
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Cancel a job: out of the queue now if it waits there, its rows stopped at the next step if it runs."""
        if job.cancelled or job.state == "finished":
            return
        job.cancelled, job.cancel_reason = True, reason
        with self._cond:
            if job.state == "queued":
                try:
                    self._pending.remove(job)
                except ValueError:
                    pass
                job.state = "finished"
        if self.metrics is not None:
            self.metrics.cancelled.labels(reason=reason).inc()

    def stop(self, grace_s: float = 30.0) -> None:
        """Refuse new work, fail what is queued, let the running batch finish for grace_s, then cancel it."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            drained = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in drained:
            job.state = "finished"
            job.post(Failed(ShuttingDown("the server is shutting down")))
        if self._thread is None:
            return
        self._thread.join(grace_s)
        if self._thread.is_alive():
            self._abort = True
            self._thread.join(10.0)

    # ------------------------------------------------------------------ worker side
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._pending:
                    return
                short = sum(len(j.prompts) for j in self._pending) < self.max_batch_size
            if short and self.batch_window_s > 0:
                time.sleep(self.batch_window_s)  # let requests that arrive together share the batch
            with self._cond:
                batch = self._take_batch()
                self._running = batch
            if batch:
                try:
                    self._run(batch)
                except Exception as exc:  # never let the worker die
                    log.exception("engine batch failed")
                    for job in batch:
                        job.post(Failed(exc))
                finally:
                    for job in batch:
                        job.state = "finished"
                    with self._cond:
                        self._running = []

    def _take_batch(self) -> list[Job]:
        """Under the lock: the oldest job and the queued jobs compatible with it, up to max_batch_size prompts."""
        if not self._pending:
            return []
        head = self._pending.popleft()
        batch = [head]
        if head.seed is None:
            rows = len(head.prompts)
            for job in list(self._pending):
                if rows >= self.max_batch_size:
                    break
                if job.seed is None and job.key == head.key and rows + len(job.prompts) <= self.max_batch_size:
                    self._pending.remove(job)
                    batch.append(job)
                    rows += len(job.prompts)
        for job in batch:
            job.state = "running"
        return batch

    def _run(self, batch: list[Job]) -> None:
        head = batch[0]
        prompts, limits, owner = [], [], []
        for job in batch:
            for i, (ids, limit) in enumerate(zip(job.prompts, job.max_tokens)):
                prompts.append(ids)
                limits.append(limit)
                owner.append((job, i))
        try:
            stream = self.generator.stream(prompts, max_new_tokens=limits, temperature=head.temperature,
                                           top_k=head.top_k, top_p=head.top_p, seed=head.seed,
                                           stop=list(head.stop) or None,
                                           num_speculative_tokens=head.num_speculative_tokens)
        except Exception as exc:  # argument checks: the app validates first, so this is unexpected
            for job in batch:
                job.post(Failed(exc))
            return
        now = time.monotonic()
        for job in batch:
            wait = now - job.created
            if self.metrics is not None:
                self.metrics.queue_wait.observe(wait)
            job.post(Started(len(prompts), wait))
        rows_of = {id(job): [r for r, (j, _) in enumerate(owner) if j is job] for job in batch}
        stopped: set[int] = set()
        try:
            for event in stream:
                job, index = owner[event.row]
                if not job.cancelled:
                    job.post(Token(index, event))
                for other in batch:
                    if (other.cancelled or self._abort) and id(other) not in stopped:
                        stopped.add(id(other))
                        for r in rows_of[id(other)]:
                            stream.cancel(r)
        finally:
            stream.close()
        result = stream.result
        if self.metrics is not None and result is not None:
            self.metrics.observe_batch(result.stats, len(prompts))
        offset = 0
        for job in batch:
            n = len(job.prompts)
            rows = slice(offset, offset + n)
            offset += n
            if job.cancelled or self._abort:
                job.post(Failed(Cancelled(job.cancel_reason or "shutdown")))
                continue
            texts = result.texts[rows] if result.texts is not None else [""] * n
            job.post(Done(texts, result.token_ids[rows], result.finish_reasons[rows],
                          [len(p) for p in result.prompt_token_ids[rows]], result.stats, len(prompts),
                          result.row_stats[rows]))


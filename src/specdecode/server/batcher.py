"""The request queue and the engine loop: continuous batching over one long-lived DecodingSession.

One worker thread owns the generator and one `DecodingSession` (torch releases the GIL, so the event loop keeps
answering while it runs). The event loop submits jobs (a request's prompts and sampling settings) to a bounded
FIFO queue. A job's rows are its prompts times its n choices. Between two engine steps the worker moves queued
jobs into the session while it has room for all their rows (max_batch_size rows at most), one engine Request per
row with the job's own settings and seed, so any mix of settings (grammars and logprobs included) shares a batch;
the session prefills new prompts in chunks (prefill_tokens_per_step) beside the running rows, which keep
decoding. Each TokenEvent goes to its job's asyncio.Queue with `loop.call_soon_threadsafe`; a row leaves the batch
as soon as it finishes.

A job cancelled while queued leaves the queue at once; a job cancelled while running (client gone, timeout) has
its rows cancelled before the next step, which frees them within that step; the other rows do not notice.

A step that raises loses every row's state (a failed forward may leave a cache half written). A fresh session takes
over; each job that was in it runs again from its start, alone (so a request that breaks steps fails by itself),
unless its client was already sent some tokens (a stream) or it failed once already: those fail with a StepFailed
naming the error. Greedy and seeded non-streaming requests get the answer they would have got without the failure.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..backends import huge_pages
from ..backends.base import Interrupted
from ..engine.params import GenerationParams, takes_params_keywords
from ..engine.results import GenerationResult, Stats

log = logging.getLogger("specdecode.server")


class QueueFull(Exception):
    """The queue holds max_queue jobs already."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work."""


class Cancelled(Exception):
    """The job was cancelled (client gone, timeout, shutdown)."""


class StepFailed(Exception):
    """An engine step that decoded the job's rows raised, and the job could not run again (see the module's doc)."""


# Items a job's queue receives, in order: Started, Token*, then Done or Failed.
@dataclass(frozen=True)
class Started:
    batch_size: int  # rows in the session when the job joined (its own included)
    queue_wait_s: float


@dataclass(frozen=True)
class Token:
    index: int  # the row's index within its job: OpenAI's choice index
    event: Any  # the engine's TokenEvent


@dataclass(frozen=True)
class Done:
    """A job's end: the engine's result of its rows, and its own statistics."""

    result: GenerationResult  # of this job's rows, in choice order (its .stats is the session's: see `stats`)
    prompt_tokens: list[int]  # each prompt's length, once however many choices it has
    stats: Stats  # this job's own rows' counters, and its time in the engine
    batch_size: int  # the most rows the session ran in one step while this job was in it

    @property
    def texts(self) -> list[str]:
        result = self.result
        return result.texts if result.texts is not None else [""] * len(result.token_ids)

    @property
    def token_ids(self) -> list[list[int]]:
        return self.result.token_ids

    @property
    def finish_reasons(self) -> list[str]:
        return self.result.finish_reasons

    @property
    def row_stats(self) -> list:
        return self.result.row_stats


@dataclass(frozen=True)
class Failed:
    error: BaseException


@takes_params_keywords  # Job(prompts, max_tokens, temperature=0.8): a field of GenerationParams, as generate() takes it
@dataclass(eq=False)  # a job is itself, whatever its fields say
class Job:
    """One request's generation work: its prompts (token ids), n choices of each, its settings, and where its
    events go.

    Row r = i * n + j is prompt i's choice j (OpenAI's choice index). With a seed S, row r draws the stream (S, r)
    (the engine's seed_index), as row r of the engine's generate(prompts, seed=S) does. The settings are checked
    when made (GenerationParams), what needs the model by the engine's `request()`, in `prepare`."""

    prompts: list[list[int]]
    max_tokens: list[int]  # each prompt's max_new_tokens
    n: int = 1
    # the request's options; num_speculative_tokens: None, the session's policy, or this job's K (0 = plain)
    params: GenerationParams = field(default_factory=GenerationParams)
    copy_texts: list[str] = field(default_factory=list)  # escaped texts the suffix history takes before it joins
    streaming: bool = False  # its tokens go to the client as they come (so a job that has sent some cannot rerun)
    resend: Any = None  # chat: an answer's text -> the ids of the conversation a next turn re-sends (server/resend.py)
    engine_requests: list | None = None  # one engine Request per row, built once by prepare()
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    queued_at: float = 0.0  # time.monotonic() when it last entered the queue
    started_at: float = 0.0  # time.monotonic() when it last left the queue for the engine (0: it waits there)
    cancelled: bool = False
    cancel_reason: str | None = None
    state: str = "new"  # new -> queued -> running -> finished
    # the worker's bookkeeping while the job runs
    rows: list[int] = field(default_factory=list)
    open_rows: int = 0
    peak_rows: int = 0
    joined: float = 0.0
    first_call: int = 0  # the session's target forward calls when the job joined
    last_token: dict = field(default_factory=dict)  # row -> time its last token was routed
    tokens_sent: int = 0  # Token items posted (in this attempt)
    attempts: int = 0  # attempts that a failed step ended
    solo: bool = False  # runs again after a failed step: alone in the session

    def post(self, item) -> None:
        """Hand an item to the job's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def constrained(self) -> bool:
        return self.params.constraint is not None

    def prepare(self, generator) -> list:
        """The engine Requests of the job's rows, built (and so checked: a ValueError names the problem, a
        constraints.ConstraintError a bad schema) once; the app calls it before queueing the job."""
        if self.engine_requests is None:
            self.engine_requests = [
                generator.request(self.prompts[r // self.n], params=self.params, seed_index=r,
                                  max_new_tokens=self.max_tokens[r // self.n])
                for r in range(self.num_rows)]
        return self.engine_requests


class Batcher:
    """The queue and the engine loop of one server (see the module's docstring).

    join_running=False admits new jobs only when the session is idle ("wait for the batch"): the static batching
    that continuous batching replaces, kept to measure one against the other."""

    def __init__(self, generator, *, max_batch_size: int = 8, max_queue: int = 64,
                 prefill_tokens_per_step: int | None = 256, metrics=None, join_running: bool = True,
                 copies=None):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be >= 1")
        if prefill_tokens_per_step is not None and prefill_tokens_per_step < 1:
            raise ValueError("prefill_tokens_per_step must be >= 1 (or None: whole prompts at once)")
        self.generator = generator
        self._collapses = huge_pages.collapses_of(getattr(generator, "target", None),
                                                  getattr(getattr(generator, "drafter", None), "backend", None))
        self._collapsing = True
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.metrics = metrics
        self.join_running = join_running
        self.copies = copies  # an EscapedCopies: jobs' copy_texts go to the suffix history before they join
        self.session = None
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._owner: dict[int, tuple[Job, int]] = {}  # session row -> (job, prompt index)
        self._accepting = True
        self._stopping = False
        self._abort = False
        self._thread: threading.Thread | None = None
        self._idle_work = False  # the session may have idle work (Batcher._idle_step)
        # time.monotonic() when the last engine step ended: progress for every job in the session (a token for each
        # running row, or a chunk of the prefill joining rows wait on); the time bounds are jobs.py's
        self.stepped_at = 0.0

    # ------------------------------------------------------------------ event-loop side
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        """Requests in the engine (their rows running or being prefilled)."""
        return len(self._running)

    @property
    def running_rows(self) -> int:
        """Rows decoding in the session now."""
        session = self.session
        return session.running if session is not None else 0

    alive = property(lambda self: self._thread is not None and self._thread.is_alive())
    started = property(lambda self: self._thread is not None)
    accepting = property(lambda self: self._accepting)

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="specdecode-engine", daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> None:
        if job.num_rows > self.max_batch_size:
            raise ValueError(f"{job.num_rows} rows (prompts × n) in one request; at most {self.max_batch_size} "
                             f"(--max-batch-size)")
        if job.loop is None:
            job.loop = asyncio.get_running_loop()
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            job.state = "queued"
            job.queued_at = time.monotonic()
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Cancel a job: out of the queue now if it waits there, its rows freed at the next step if it runs."""
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
            self._cond.notify()
        if self.metrics is not None:
            self.metrics.cancelled.labels(reason=reason).inc()

    def stop(self, grace_s: float = 30.0) -> None:
        """Refuse new work, fail what is queued, let the running rows finish for grace_s, then cancel them."""
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
            with self._cond:
                self._cond.notify_all()
            self._thread.join(10.0)

    # ------------------------------------------------------------------ worker side
    def _work(self) -> None:
        self.session = self._new_session()
        while True:
            with self._cond:
                if not self._pending and not self._running:
                    self._let_collapse(True)
                while not self._pending and not self._running and not self._stopping and not self._idle_work:
                    self._cond.wait()
                if self._pending or self._running:
                    self._let_collapse(False)
                if self._stopping and not self._running:
                    return
                joining = self._take_jobs()
                idle = not joining and not self._running
            if idle:  # nothing to serve: a chunk of idle work, then the queue is looked at again
                self._idle_step()
                continue
            self._idle_work = True  # rows that finish park their KV: an answer may be worth prefilling once idle
            try:  # joining and cancelling too: nothing a request brings may end the worker thread
                for job in joining:
                    self._join(job)
                self._cancel_rows()
                if self.session.idle:
                    continue
                # First tokens of joining rows go out before the running rows' step: one step less of TTFT.
                admitted = self.session.admit()
                self._route(admitted, step=False)
                self._route(self.session.decode(), first_tokens=len(admitted))
                self.stepped_at = time.monotonic()
            except Exception as exc:  # never let the worker die: rerun or fail the step's jobs in a fresh session
                log.exception("engine step failed (rows of %d requests)", len(self._running))
                self._recover(exc)
                continue

    def _let_collapse(self, on: bool) -> None:
        """The models' huge-page collapse (backends.huge_pages) runs only while no request is served: it slowed a
        first request's prefill (43 % of a 2-core Xeon's samples were in it)."""
        if on != self._collapsing:
            self._collapsing = on
            for collapse in self._collapses:
                collapse.resume() if on else collapse.pause()

    def _idle_step(self) -> None:
        """One chunk of the session's idle work (a parked answer's prefill, session.idle_prefill); none left: the
        worker waits for requests. A failure there drops only that cached answer (the prefix cache does) and is
        logged: no request is in the session; the rest waits for the next request's end."""
        try:
            # a request that arrives stops the chunk within milliseconds (llama.cpp) instead of waiting for it
            self._idle_work = self.session.idle_prefill(lambda: bool(self._pending) or self._stopping) > 0
        except Interrupted:
            self._idle_work = True  # the chunk is done again once the server is idle
        except Exception:
            self._idle_work = False
            log.exception("idle prefill of a cached answer failed")

    def _new_session(self):
        return self.generator.session(prefill_tokens_per_step=self.prefill_tokens_per_step,
                                      max_batch=self.max_batch_size)

    def _take_jobs(self) -> list[Job]:
        """Under the lock: queued jobs, oldest first, while the session has room for all their rows."""
        if self._stopping or (not self.join_running and self._running):
            return []
        if any(j.solo for j in self._running):
            return []  # a job rerunning after a failed step runs alone
        if self._pending and self._pending[0].solo:
            if self._running:
                return []
            taken = [self._pending.popleft()]
        else:
            room = self.max_batch_size - sum(j.open_rows for j in self._running)
            taken = []
            while self._pending and self._pending[0].num_rows <= room and not self._pending[0].solo:
                taken.append(self._pending.popleft())
                room -= taken[-1].num_rows
        for job in taken:
            job.state, job.started_at = "running", time.monotonic()
        self._running += taken
        return taken

    def _join(self, job: Job) -> None:
        session = self.session
        try:
            requests = job.prepare(self.generator)
        except ValueError as exc:  # the app prepares jobs before queueing them: only direct users end here
            self._finish(job, Failed(exc))
            return
        if self.copies is not None and job.copy_texts:  # before the rows join: their marks include them
            self.copies.add(job.copy_texts)
        job.rows = [session.add(r) for r in requests]
        job.open_rows = len(job.rows)
        for i, row in enumerate(job.rows):
            self._owner[row] = (job, i)
        job.joined = time.monotonic()
        job.first_call = session.stats.target_forward_calls
        wait = job.joined - job.created
        if self.metrics is not None:
            self.metrics.queue_wait.observe(wait)
        job.post(Started(session.running + session.queued, wait))

    def _cancel_rows(self) -> None:
        """Rows of cancelled jobs (and all of them on abort) leave at the next step; their jobs end now."""
        for job in [j for j in self._running if j.cancelled or self._abort]:
            for row in job.rows:
                self.session.cancel(row)
                self._owner.pop(row, None)
            self._finish(job, Failed(Cancelled(job.cancel_reason or "shutdown")))

    def _route(self, events, step: bool = True, first_tokens: int = 0) -> None:
        """Hand events to their jobs; step=False for the first tokens of joining rows (counted with the decode step
        that follows: first_tokens)."""
        now = time.monotonic()
        counts = collections.Counter(e.row for e in events)
        rows_now = len(counts)  # every row that ran this step got a token (rows that finished in it included)
        for job in self._running if step else ():
            job.peak_rows = max(job.peak_rows, rows_now)
        for event in events:
            owner = self._owner.get(event.row)
            if owner is None:
                continue
            job, index = owner
            job.post(Token(index, event))
            job.tokens_sent += 1
            self._observe_token(job, event.row, now, counts[event.row])
            if event.finished:
                self._owner.pop(event.row, None)
                job.open_rows -= 1
                if job.open_rows == 0:
                    self._finish(job, self._done(job, now))
        if self.metrics is not None and step:
            self.metrics.observe_step(rows_now, len(events) + first_tokens, now)

    def _observe_token(self, job: Job, row: int, now: float, tokens_this_step: int) -> None:
        if self.metrics is None:
            return
        last = job.last_token.get(row)
        if last is None:
            self.metrics.time_to_first_token.observe(now - job.created)
        else:  # a step that delivers n tokens of a row spreads its interval over them
            self.metrics.inter_token_latency.observe((now - last) / tokens_this_step)
        job.last_token[row] = now

    def _done(self, job: Job, now: float) -> Done:
        result = self.session.result(job.rows)
        self._resend(job, result)
        stats = _job_stats(job, result, self.session.stats, now)
        if self.metrics is not None:
            self.metrics.observe_rows(result.row_stats, stats.prompt_tokens)
        return Done(result, [len(p) for p in job.prompts], stats, max(job.peak_rows, 1))

    def _resend(self, job: Job, result: GenerationResult) -> None:
        """A chat's answers come back as the client re-sends them (job.resend): the prefix cache prefills that form
        of each row it parked, while idle."""
        cache = getattr(self.session, "prefix_cache", None)
        if job.resend is None or cache is None or result.texts is None:
            return
        for r, (ids, text) in enumerate(zip(result.token_ids, result.texts)):
            prompt = job.prompts[r // job.n]
            cache.resend(prompt + ids, len(prompt), functools.partial(job.resend, text))

    def _finish(self, job: Job, item) -> None:
        job.state = "finished"
        job.post(item)
        self.session.release(job.rows)  # the long-lived session forgets the rows once they leave its batch
        with self._cond:
            if job in self._running:
                self._running.remove(job)

    def _recover(self, exc: BaseException) -> None:
        """After a step raised: a fresh session; the jobs that were in the old one run again alone, in order, at the
        head of the queue, or fail (see the module's doc)."""
        try:
            self.session.abandon()
        except Exception:  # the models are reset by the new session in any case
            log.exception("abandoning the failed session")
        self.session = self._new_session()
        self._owner.clear()
        if self.metrics is not None:
            self.metrics.step_failures.inc()
        error = f"{type(exc).__name__}: {exc}"
        again = []
        for job in list(self._running):
            job.attempts += 1
            if job.attempts > 1 or (job.streaming and job.tokens_sent):
                job.rows = []  # rows of the abandoned session: nothing for the new one to release
                why = "its tokens were already streamed" if job.attempts == 1 else "it failed again when run alone"
                self._finish(job, Failed(StepFailed(f"an engine step that decoded this request failed ({error}); "
                                                    f"it was not run again: {why}")))
                continue
            job.rows, job.open_rows, job.peak_rows, job.tokens_sent, job.solo = [], 0, 0, 0, True
            job.last_token.clear()
            again.append(job)
        with self._cond:
            for job in again:
                self._running.remove(job)
                job.state, job.queued_at, job.started_at = "queued", time.monotonic(), 0.0
            self._pending.extendleft(reversed(again))
        if self.metrics is not None and again:
            self.metrics.step_retries.inc(len(again))


def _job_stats(job: Job, result: GenerationResult, session: Stats, now: float) -> Stats:
    """A job's own Stats: its rows' counters (the engine's RowStats) summed, with the session's calls and time since
    the job joined; its prompts count once however many choices they have (as in usage)."""
    rows = result.row_stats
    k = job.params.num_speculative_tokens
    return Stats(num_rows=len(rows), prompt_tokens=sum(len(p) for p in job.prompts),
                 new_tokens=sum(len(t) for t in result.token_ids),
                 num_speculative_tokens=k if k is not None else session.num_speculative_tokens,
                 copy_limit=session.copy_limit, policy=session.policy,
                 proposed_tokens=sum(r.proposed_tokens for r in rows),
                 accepted_tokens=sum(r.accepted_tokens for r in rows), forced_tokens=sum(r.forced_tokens for r in rows),
                 verification_steps=sum(r.verification_steps for r in rows),
                 cached_prompt_tokens=sum(rows[i * job.n].cached_tokens for i in range(len(job.prompts))
                                          if i * job.n < len(rows)),
                 target_forward_calls=session.target_forward_calls - job.first_call, wall_time_s=now - job.joined,
                 num_rows_with_first_token=sum(1 for tokens in result.token_ids if tokens))

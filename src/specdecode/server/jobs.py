"""Running a job for a request: build its engine requests (a bad setting or schema is a 400 before any work),
submit it to the batcher, wait for its result or stream its tokens as SSE, and cancel it when its client goes away
or a time bound is past.

The time bounds (`Limits`), each with its own flag and error: the wait in the queue for room in the batch
(--queue-timeout: 503 with Retry-After), the time in the engine without progress (--stall-timeout: 504), and a
total deadline only where one is asked for (--request-timeout, or the request's own `timeout` field: 504). A
request that keeps producing tokens is never cut by the defaults. Once a stream has started, an error is its last
event."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from .batcher import Batcher, Cancelled, Done, Failed, Job, QueueFull, ShuttingDown, Started, Token
from .errors import APIError, ClientGone, bad_request
from .metrics import ServerMetrics
from .responses import Responder, sse
from .settings import ServerSettings

DISCONNECT_POLL_S = 0.2  # how often a waiting request checks whether its client is still there


@dataclass(frozen=True)
class Limits:
    """A request's time bounds in seconds (0: none), fixed when it arrives."""

    arrival: float  # time.monotonic()
    queue: float  # --queue-timeout: from entering the queue to leaving it for the engine
    stall: float  # --stall-timeout: in the engine, between two steps of progress
    total: float  # from arrival to the end of the response: the earlier of --request-timeout and `timeout`
    total_by: str = "--request-timeout"  # what set `total`, for its error message


class JobRunner:
    def __init__(self, batcher: Batcher, metrics: ServerMetrics, settings: ServerSettings):
        self.batcher, self.metrics, self.settings = batcher, metrics, settings

    def limits(self, arrival: float, timeout: float | None = None) -> Limits:
        """The bounds of a request that arrived at `arrival` (time.monotonic()) asking for a total deadline of
        `timeout` seconds (its body's field; None: none of its own)."""
        settings = self.settings
        total, by = settings.request_timeout, "--request-timeout"
        if timeout is not None and (not total or timeout < total):
            total, by = timeout, "the request's timeout field"
        return Limits(arrival, settings.queue_timeout, settings.stall_timeout, total, by)

    async def result(self, job: Job, request: Request, limits: Limits) -> Done:
        """Submit and wait for the whole result (non-streaming requests)."""
        await self._prepare(job)
        self._submit(job)
        try:
            while True:
                item = await self._next(job, limits, request)
                if isinstance(item, Done):
                    return item
                elif isinstance(item, Failed):
                    raise self._failure(item)
        except asyncio.CancelledError:
            self.batcher.cancel(job, "disconnect")
            raise

    async def stream(self, job: Job, request: Request, limits: Limits, responder: Responder,
                     include_usage: bool) -> AsyncIterator[bytes]:
        """Submit and wait until the job joins the engine's batch (errors until then are raised, to be answered with their
        status code); then the SSE events of its tokens, as an async iterator."""
        await self._prepare(job)
        job.streaming = True
        self._submit(job)
        try:
            while True:
                item = await self._next(job, limits, request)
                if isinstance(item, Started):
                    return self._events(job, limits, responder, include_usage)
                if isinstance(item, Failed):
                    raise self._failure(item)
        except asyncio.CancelledError:
            self.batcher.cancel(job, "disconnect")
            raise

    async def _events(self, job: Job, limits: Limits, responder: Responder,
                      include_usage: bool) -> AsyncIterator[bytes]:
        open_rows = set(range(job.num_rows))
        ended = False  # True once the job is over: nothing left to cancel
        try:
            for i in sorted(open_rows):
                opening = responder.opening(i)
                if opening:
                    yield sse(opening)
            while open_rows or include_usage:
                try:
                    item = await self._next(job, limits, None)
                except APIError as exc:  # a time bound: _next has cancelled the job
                    ended = True
                    yield sse(exc.body())
                    return
                if isinstance(item, Token):
                    event = item.event
                    if item.index not in open_rows:
                        continue
                    chunk = responder.token(item.index, event)
                    if chunk is not None:
                        yield sse(chunk)
                    if event.finished:
                        open_rows.discard(item.index)
                        yield sse(responder.delta(item.index, "", event.finish_reason))
                elif isinstance(item, Done):
                    for i in sorted(open_rows):  # rows that ended without a last event
                        yield sse(responder.delta(i, "", item.finish_reasons[i]))
                    open_rows.clear()
                    if include_usage:
                        yield sse(responder.usage_chunk(item))
                    break
                elif isinstance(item, Failed):
                    ended = True
                    yield sse(self._failure(item).body())
                    return
            ended = True
            yield sse("[DONE]")
        finally:
            if not ended:  # the client went away mid-stream: free its rows
                self.batcher.cancel(job, "disconnect")

    async def _prepare(self, job: Job) -> None:
        """The job's engine requests, checked by the engine; a grammar is compiled off the event loop."""
        generator = self.batcher.generator
        if not job.constrained:
            try:
                job.prepare(generator)
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            return
        from ..structured.constraints import ConstraintError  # the grammar engine is imported only when a request needs it

        try:
            await asyncio.to_thread(job.prepare, generator)
        except ConstraintError as exc:
            param = "tools" if job.params.grammar is not None else "response_format"
            raise bad_request(f"{param}: {exc}", param) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def _submit(self, job: Job) -> None:
        self.batcher.start()  # no-op once started; covers apps run without their lifespan
        try:
            self.batcher.submit(job)
        except QueueFull as exc:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(429, f"{exc}: retry later", "rate_limit_error", None, "queue_full",
                           {"Retry-After": str(self.settings.retry_after_s)}) from None
        except ShuttingDown as exc:
            self.metrics.rejected.labels(reason="shutting_down").inc()
            raise APIError(503, str(exc), "server_error", None, "shutting_down") from None
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None

    async def _next(self, job: Job, limits: Limits, request: Request | None):
        """The job's next item; with a request, notices a client that went away while waiting. An item already
        there is taken whatever the time: an answer that is ready is never cancelled."""
        while True:
            if not job.queue.empty():
                return job.queue.get_nowait()
            wait = self._time_left(job, limits)
            if request is not None:
                wait = DISCONNECT_POLL_S if wait is None else min(wait, DISCONNECT_POLL_S)
            try:
                return await asyncio.wait_for(job.queue.get(), wait)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.batcher.cancel(job, "disconnect")
                    raise ClientGone() from None

    def _time_left(self, job: Job, limits: Limits) -> float | None:
        """Seconds until the job's next bound (None: it has none); past one, the job is cancelled and the error that
        names its flag raised."""
        now, left = time.monotonic(), []
        if limits.total:
            left.append(limits.arrival + limits.total - now)
            if left[-1] <= 0:
                self.batcher.cancel(job, "timeout")
                raise APIError(504, f"the request ran past its deadline of {limits.total:g} s ({limits.total_by}) "
                                    f"and was cancelled", "timeout_error", None, "request_timeout")
        started = job.started_at  # written by the engine's thread: read once
        if not started and limits.queue:
            left.append(job.queued_at + limits.queue - now)
            if left[-1] <= 0:
                self.batcher.cancel(job, "queue_timeout")
                raise APIError(503, f"the request waited {limits.queue:g} s for room in the batch (--queue-timeout) "
                                    f"and was not started: the server is busy, retry later", "server_error", None,
                               "queue_timeout", {"Retry-After": str(self.settings.retry_after_s)})
        if started and limits.stall:
            left.append(max(started, self.batcher.stepped_at) + limits.stall - now)
            if left[-1] <= 0:
                self.batcher.cancel(job, "stall")
                raise APIError(504, f"the request made no progress for {limits.stall:g} s (--stall-timeout: no "
                                    f"new token, no engine step) and was cancelled", "timeout_error", None,
                               "stall_timeout")
        return min(left) if left else None

    @staticmethod
    def _failure(item: Failed) -> APIError:
        err = item.error
        if isinstance(err, (ShuttingDown, Cancelled)):
            return APIError(503, f"the request was cancelled: {err}", "server_error", None, "shutting_down")
        if isinstance(err, ValueError):
            return bad_request(str(err))
        return APIError(500, f"the engine failed: {type(err).__name__}: {err}", "server_error", None,
                        "engine_error")

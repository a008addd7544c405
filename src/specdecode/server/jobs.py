"""Running a job for a request: build its engine requests (a bad setting or schema is a 400 before any work),
submit it to the batcher, wait for its result or stream its tokens as SSE, and cancel it when its client goes away
or its time is up."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from .batcher import Batcher, Cancelled, Done, Failed, Job, QueueFull, ShuttingDown, Started, Token
from .errors import APIError, ClientGone, bad_request
from .metrics import ServerMetrics
from .responses import Responder, sse
from .settings import ServerSettings

DISCONNECT_POLL_S = 0.2  # how often a waiting request checks whether its client is still there


class JobRunner:
    def __init__(self, batcher: Batcher, metrics: ServerMetrics, settings: ServerSettings):
        self.batcher, self.metrics, self.settings = batcher, metrics, settings

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.settings.request_timeout

    async def result(self, job: Job, request: Request, deadline: float) -> Done:
        """Submit and wait for the whole result (non-streaming requests)."""
        await self._prepare(job)
        self._submit(job)
        try:
            while True:
                item = await self._next(job, deadline, request)
                if isinstance(item, Done):
                    return item
                elif isinstance(item, Failed):
                    raise self._failure(item)
        except asyncio.CancelledError:
            self.batcher.cancel(job, "disconnect")
            raise

    async def stream(self, job: Job, request: Request, deadline: float, responder: Responder,
                     include_usage: bool) -> AsyncIterator[bytes]:
        """Submit and wait until the job joins the engine's batch (errors until then are raised, to be answered with their
        status code); then the SSE events of its tokens, as an async iterator."""
        await self._prepare(job)
        job.streaming = True
        self._submit(job)
        try:
            while True:
                item = await self._next(job, deadline, request)
                if isinstance(item, Started):
                    return self._events(job, deadline, responder, include_usage)
                if isinstance(item, Failed):
                    raise self._failure(item)
        except asyncio.CancelledError:
            self.batcher.cancel(job, "disconnect")
            raise

    async def _events(self, job: Job, deadline: float, responder: Responder,
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
                    item = await self._next(job, deadline, None)
                except APIError as exc:  # the timeout: _next has cancelled the job
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
            param = "tools" if job.grammar is not None else "response_format"
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

    async def _next(self, job: Job, deadline: float, request: Request | None):
        """The job's next item; with a request, notices a client that went away while waiting."""
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.batcher.cancel(job, "timeout")
                raise APIError(504, f"the request took longer than the server's timeout of "
                                    f"{self.settings.request_timeout:g} s (--request-timeout) and was cancelled",
                               "timeout_error", None, "request_timeout")
            wait = min(remaining, DISCONNECT_POLL_S) if request is not None else remaining
            try:
                return await asyncio.wait_for(job.queue.get(), wait)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.batcher.cancel(job, "disconnect")
                    raise ClientGone() from None

    @staticmethod
    def _failure(item: Failed) -> APIError:
        err = item.error
        if isinstance(err, (ShuttingDown, Cancelled)):
            return APIError(503, f"the request was cancelled: {err}", "server_error", None, "shutting_down")
        if isinstance(err, ValueError):
            return bad_request(str(err))
        return APIError(500, f"the engine failed: {type(err).__name__}: {err}", "server_error", None,
                        "engine_error")

"""The OpenAI-compatible HTTP app: `create_app(generator, model_name, tokenizer, settings) -> FastAPI`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with server-sent-event streaming), GET /v1/models,
GET /v1/models/{model}, GET /health, GET /metrics (Prometheus), POST /predict (the old seed server's API).

Every error, ours or the framework's, is answered with OpenAI's body `{"error": {"message", "type", "param",
"code"}}`: 400 for any bad input (malformed JSON, wrong types, missing or out-of-range fields), 401 for a missing
or wrong API key, 404 for an unknown model or route, 405 for a wrong method, 429 (with Retry-After) when the
queue is full, 503 while shutting down, 504 when a request ran past --request-timeout (it is cancelled).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batcher import Batcher, Cancelled, Done, Failed, Job, QueueFull, ShuttingDown, Started, Token
from .metrics import ServerMetrics
from .schemas import (MAX_STOP_STRINGS, UNSUPPORTED, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                      ChatResponseMessage, CompletionChoice, CompletionRequest, CompletionResponse, ErrorResponse,
                      Health, ModelCard, ModelList, PredictRequest, PredictResponse, SpeculativeStats, Usage)

log = logging.getLogger("specdecode.server")

DISCONNECT_POLL_S = 0.2  # how often a waiting request checks whether its client is still there
LONG_TEXT_CHARS = 20_000
PUBLIC_PATHS = {"/health"}
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/predict",
             "/openapi.json", "/docs", "/redoc"}


@dataclass
class ServerSettings:
    """Limits and options of one server (the CLI's flags)."""

    max_batch_size: int = 8
    max_queue: int = 64
    max_tokens_limit: int = 2048
    request_timeout: float = 120.0  # seconds from arrival to the end of the response
    api_key: str | None = None
    draft_name: str | None = None
    model_aliases: Sequence[str] = ()  # other names accepted in a request's "model"
    batch_window_s: float = 0.005  # how long the worker waits for more requests to share a batch
    max_speculative_tokens: int = 32
    max_prompt_chars: int = 1_000_000
    default_predict_tokens: int = 64
    shutdown_grace_s: float = 30.0  # in-flight batch: finish for this long, then cancel
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_batch_size", "max_queue", "max_tokens_limit", "max_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout!r}")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ensure_ascii: a message may quote user input, which may hold lone surrogates that UTF-8 cannot encode
        return Response(json.dumps(self.body(), ensure_ascii=True), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class ClientGone(Exception):
    """The client disconnected while its request was waiting."""


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the error names the field in `param`)."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key."},
    404: {"model": ErrorResponse, "description": "Unknown model."},
    429: {"model": ErrorResponse, "description": "Queue full; retry after the Retry-After header's seconds."},
    503: {"model": ErrorResponse, "description": "Shutting down."},
    504: {"model": ErrorResponse, "description": "The request ran past the server's timeout and was cancelled."},
}


# ---------------------------------------------------------------------------------------------- middleware
class AuthMiddleware:
    """With an API key, every path but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not given else
                       "invalid API key")
            response = APIError(401, message, "authentication_error", None, "invalid_api_key",
                                {"WWW-Authenticate": "Bearer"}).response()
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and status code, and times it to the end of its response."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models/{model}" if path.startswith("/v1/models/") \
            else "other"
        status = {"code": 500}
        start = time.perf_counter()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            status["code"] = 499  # the client went away (nginx's code)
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
            self.metrics.request_latency.labels(endpoint=endpoint).observe(time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- helpers
def _error_param(loc: Sequence) -> str | None:
    """A validation error's location as a field path: ("body", "messages", 0, "content") -> messages[0].content.

    pydantic adds the member of a union it tried (str, list[str], ...) to the location: those are left out.
    """
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        item = str(item)
        if not item.isidentifier() or item in ("str", "int", "float", "bool", "list", "dict", "none"):
            continue
        parts.append(item)
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return bad_request(f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _error_param(loc)
    if param is None:
        if first.get("type") == "missing":
            return bad_request("a JSON object body is required", code="missing_body")
        return bad_request("the request body must be a JSON object", code="invalid_body")
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if first.get("type") == "missing":
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    if param in UNSUPPORTED:
        message = "is not supported by this server (only its neutral value is accepted)"
    others = {_error_param(e.get("loc", ())) for e in errors[1:]} - {param}
    more = f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''})" if others else ""
    return bad_request(f"{param}: {message}{more}", param)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


# ---------------------------------------------------------------------------------------------- the app
def create_app(generator, model_name: str, tokenizer=None, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `generator` (a SpeculativeGenerator or AutoregressiveGenerator) as `model_name`.

    The generator is used only by the app's engine worker thread from now on. The worker starts with the app's
    lifespan (or with the first request) and stops at shutdown: queued requests are answered 503, the running
    batch gets settings.shutdown_grace_s to finish before it is cancelled.
    """
    settings = settings or ServerSettings()
    tokenizer = tokenizer if tokenizer is not None else getattr(generator, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer (text in, text out): load the model with its tokenizer")
    metrics = ServerMetrics()
    batcher = Batcher(generator, max_batch_size=settings.max_batch_size, max_queue=settings.max_queue,
                      batch_window_s=settings.batch_window_s, metrics=metrics)
    metrics.queue_depth.set_function(lambda: batcher.queue_depth)
    metrics.running.set_function(lambda: batcher.running)
    context = getattr(getattr(generator, "target", None), "max_positions", None)
    has_draft = getattr(generator, "drafter", None) is not None
    draft_name = (settings.draft_name or "draft") if has_draft else None
    default_k = getattr(generator, "num_speculative_tokens", 0)
    names = {model_name, *settings.model_aliases}
    created = int(time.time())

    async def lifespan(_app):
        batcher.start()
        yield
        await asyncio.to_thread(batcher.stop, settings.shutdown_grace_s)

    app = FastAPI(title="specdecode", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions served with lossless speculative decoding.")
    app.state.batcher, app.state.metrics, app.state.settings = batcher, metrics, settings
    app.state.generator, app.state.tokenizer, app.state.model_name = generator, tokenizer, model_name

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(exc.status_code, message, kind, None, None, dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal server error ({type(exc).__name__})", "server_error", None,
                        "internal_error").response()

    # ------------------------------------------------------------------ validation of what the schema cannot know
    def check_model(requested: str | None) -> None:
        if requested not in (None, "") and requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist: this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def tokenize(text: str, special: bool) -> list[int]:
        # Plain prompts are encoded exactly as the engine encodes them; a chat template holds its own specials.
        return tokenizer(text)["input_ids"] if special else tokenizer(text, add_special_tokens=False)["input_ids"]

    async def encode(text: str, param: str, special: bool = True) -> list[int]:
        if len(text) > settings.max_prompt_chars:
            raise bad_request(f"{param} is longer than {settings.max_prompt_chars} characters", param,
                              "context_length_exceeded")
        try:
            if len(text) > LONG_TEXT_CHARS:  # long texts are tokenized off the event loop
                ids = await asyncio.to_thread(tokenize, text, special)
            else:
                ids = tokenize(text, special)
        except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
            raise bad_request(f"{param} could not be tokenized: {type(exc).__name__}", param) from None
        if not ids:
            raise bad_request(f"{param} is empty after tokenization: give at least one token of text", param)
        vocab = getattr(getattr(generator, "target", None), "vocab_size", None)
        if vocab is not None and any(t >= vocab for t in ids):
            raise bad_request(f"{param} holds tokens outside the model's vocabulary", param)
        return list(ids)

    def check_length(ids: list[int], max_tokens: int, prompt_param: str, tokens_param: str) -> None:
        if context is None:
            return
        if len(ids) >= context:
            raise bad_request(f"{prompt_param} has {len(ids)} tokens, and the model's context is {context} tokens:"
                              f" shorten it", prompt_param, "context_length_exceeded")
        if len(ids) + max_tokens > context:
            raise bad_request(f"{prompt_param} has {len(ids)} tokens; with {tokens_param}={max_tokens} that "
                              f"exceeds the model's context of {context} tokens: lower {tokens_param} to at most "
                              f"{context - len(ids)}", tokens_param, "context_length_exceeded")

    def check_max_tokens(value: int, param: str) -> int:
        if value > settings.max_tokens_limit:
            raise bad_request(f"{param} is {value}; this server allows at most {settings.max_tokens_limit} "
                              f"(--max-tokens-limit)", param)
        return value

    def make_job(body, prompts: list[list[int]], max_tokens: list[int]) -> Job:
        k = body.num_speculative_tokens
        if k is not None:
            if not has_draft:
                if k != 0:
                    raise bad_request("num_speculative_tokens needs a draft model, and this server runs without "
                                      "one (only 0 is accepted)", "num_speculative_tokens")
                k = None
            elif not 1 <= k <= settings.max_speculative_tokens:
                raise bad_request(f"num_speculative_tokens must be between 1 and {settings.max_speculative_tokens},"
                                  f" got {k}", "num_speculative_tokens")
        if len(prompts) > settings.max_batch_size:
            raise bad_request(f"{len(prompts)} prompts in one request; at most {settings.max_batch_size} "
                              f"(--max-batch-size)", "prompt")
        stop = body.stop
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        temperature = 1.0 if body.temperature is None else body.temperature
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        top_p = 1.0 if body.top_p is None else body.top_p
        return Job(prompts=prompts, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=body.seed, stop=stop, num_speculative_tokens=k)

    # ------------------------------------------------------------------ running a job
    def submit(job: Job) -> None:
        batcher.start()  # no-op once started; covers apps run without their lifespan
        try:
            batcher.submit(job)
        except QueueFull as exc:
            metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(429, f"{exc}: retry later", "rate_limit_error", None, "queue_full",
                           {"Retry-After": str(settings.retry_after_s)}) from None
        except ShuttingDown as exc:
            metrics.rejected.labels(reason="shutting_down").inc()
            raise APIError(503, str(exc), "server_error", None, "shutting_down") from None
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None

    def timeout_error() -> APIError:
        return APIError(504, f"the request took longer than the server's timeout of {settings.request_timeout:g} s"
                             f" (--request-timeout) and was cancelled", "timeout_error", None, "request_timeout")

    def failure(item: Failed) -> APIError:
        err = item.error
        if isinstance(err, (ShuttingDown, Cancelled)):
            return APIError(503, f"the request was cancelled: {err}", "server_error", None, "shutting_down")
        if isinstance(err, ValueError):
            return bad_request(str(err))
        return APIError(500, f"the engine failed: {type(err).__name__}: {err}", "server_error", None,
                        "engine_error")

    async def next_item(job: Job, deadline: float, request: Request | None):
        """The job's next item; with a request, notices a client that went away while waiting."""
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                batcher.cancel(job, "timeout")
                raise timeout_error()
            wait = min(remaining, DISCONNECT_POLL_S) if request is not None else remaining
            try:
                return await asyncio.wait_for(job.queue.get(), wait)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    batcher.cancel(job, "disconnect")
                    raise ClientGone() from None

    async def run_job(job: Job, request: Request, deadline: float) -> Done:
        """Submit and wait for the whole result (non-streaming requests)."""
        submit(job)
        first_token_seen = False
        try:
            while True:
                item = await next_item(job, deadline, request)
                if isinstance(item, Token) and not first_token_seen:
                    first_token_seen = True
                    metrics.time_to_first_token.observe(time.monotonic() - job.created)
                elif isinstance(item, Done):
                    return item
                elif isinstance(item, Failed):
                    raise failure(item)
        except asyncio.CancelledError:
            batcher.cancel(job, "disconnect")
            raise

    def speculative(done: Done) -> SpeculativeStats:
        """This request's own counters (its rows of the engine batch), plus the batch's call count and time."""
        s, rows = done.stats, done.row_stats
        proposed = sum(r.proposed_tokens for r in rows)
        accepted = sum(r.accepted_tokens for r in rows)
        steps = sum(r.verification_steps for r in rows)
        emitted = sum(r.new_tokens - 1 for r in rows if r.new_tokens)
        return SpeculativeStats(draft_model=draft_name, num_speculative_tokens=s.num_speculative_tokens,
                                acceptance_rate=accepted / proposed if proposed else 0.0,
                                mean_accepted_length=emitted / steps if steps else 0.0, proposed_tokens=proposed,
                                accepted_tokens=accepted, verification_steps=steps,
                                target_forward_calls=s.target_forward_calls, batch_size=done.batch_size,
                                wall_time_s=s.wall_time_s)

    def usage(done: Done) -> Usage:
        prompt = sum(done.prompt_tokens)
        completion = sum(len(t) for t in done.token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def stream_job(job: Job, request: Request, deadline: float, include_usage: bool,
                         chunk: Callable[[int, str | None, str | None], dict],
                         final: Callable[[Done], dict]) -> StreamingResponse:
        """Submit, wait until the batch starts (errors until then get their status code), then stream SSE."""
        submit(job)
        try:
            while True:
                item = await next_item(job, deadline, request)
                if isinstance(item, Started):
                    break
                if isinstance(item, Failed):
                    raise failure(item)
        except asyncio.CancelledError:
            batcher.cancel(job, "disconnect")
            raise

        async def events() -> AsyncIterator[bytes]:
            open_rows = set(range(len(job.prompts)))
            ended = False  # True once the job is over: nothing left to cancel
            first = True
            try:
                for i in sorted(open_rows):
                    opening = chunk(i, None, None)
                    if opening:
                        yield _sse(opening)
                while open_rows or include_usage:
                    try:
                        item = await next_item(job, deadline, None)
                    except APIError as exc:  # the timeout: next_item has cancelled the job
                        ended = True
                        yield _sse(exc.body())
                        return
                    if isinstance(item, Token):
                        if first:
                            first = False
                            metrics.time_to_first_token.observe(time.monotonic() - job.created)
                        ev = item.event
                        if item.index not in open_rows:
                            continue
                        if ev.text:
                            yield _sse(chunk(item.index, ev.text, None))
                        if ev.finished:
                            open_rows.discard(item.index)
                            yield _sse(chunk(item.index, "", done_reason(ev.finish_reason)))
                    elif isinstance(item, Done):
                        for i in sorted(open_rows):  # rows that ended without a last event
                            yield _sse(chunk(i, "", done_reason(item.finish_reasons[i])))
                        open_rows.clear()
                        if include_usage:
                            yield _sse(final(item))
                        break
                    elif isinstance(item, Failed):
                        ended = True
                        yield _sse(failure(item).body())
                        return
                ended = True
                yield _sse("[DONE]")
            finally:
                if not ended:  # the client went away mid-stream: free its rows
                    batcher.cancel(job, "disconnect")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def done_reason(reason: str | None) -> str:
        return reason if reason in ("stop", "length") else "stop"

    def deadline_now() -> float:
        return asyncio.get_running_loop().time() + settings.request_timeout

    # ------------------------------------------------------------------ endpoints
    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES,
              summary="Text completion (OpenAI-compatible; stream=true for server-sent events)")
    async def completions(body: CompletionRequest, request: Request):
        deadline = deadline_now()
        check_model(body.model)
        texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if len(texts) > settings.max_batch_size:
            raise bad_request(f"{len(texts)} prompts in one request; at most {settings.max_batch_size} "
                              f"(--max-batch-size)", "prompt")
        default = min(16, settings.max_tokens_limit)  # OpenAI's default, within this server's limit
        max_tokens = check_max_tokens(default if body.max_tokens is None else body.max_tokens, "max_tokens")
        prompts = []
        for i, text in enumerate(texts):
            param = "prompt" if len(texts) == 1 else f"prompt[{i}]"
            ids = await encode(text, param)
            check_length(ids, max_tokens, param, "max_tokens")
            prompts.append(ids)
        job = make_job(body, prompts, [max_tokens] * len(prompts))
        rid, model = _new_id("cmpl"), model_name
        now = int(time.time())

        if body.stream:
            def chunk(index, text, finish):
                if text is None:
                    return {}
                return {"id": rid, "object": "text_completion", "created": now, "model": model,
                        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

            def final(done: Done):
                return {"id": rid, "object": "text_completion", "created": now, "model": model, "choices": [],
                        "usage": usage(done).model_dump(), "speculative": speculative(done).model_dump()}

            include = bool(body.stream_options and body.stream_options.include_usage)
            return await gone_safe(stream_job(job, request, deadline, include, chunk, final))

        done = await gone_safe(run_job(job, request, deadline))
        if isinstance(done, Response):
            return done
        choices = [CompletionChoice(index=i, text=done.texts[i], finish_reason=done_reason(done.finish_reasons[i]))
                   for i in range(len(prompts))]
        return CompletionResponse(id=rid, created=now, model=model, choices=choices, usage=usage(done),
                                  speculative=speculative(done))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES,
              summary="Chat completion with the model's chat template (stream=true for server-sent events)")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        deadline = deadline_now()
        check_model(body.model)
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad_request(f"the model {model_name!r} has no chat template: use /v1/completions", "messages",
                              "no_chat_template")
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template rejected the conversation (roles out of order, ...)
            raise bad_request(f"messages could not be formatted with the model's chat template: {exc}",
                              "messages") from None
        ids = await encode(text, "messages", special=False)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if requested is None:
            if context is not None and len(ids) >= context:
                check_length(ids, 1, "messages", param)
            room = context - len(ids) if context is not None else settings.max_tokens_limit
            max_tokens = min(settings.max_tokens_limit, room)
        else:
            max_tokens = check_max_tokens(requested, param)
            check_length(ids, max_tokens, "messages", param)
        job = make_job(body, [ids], [max_tokens])
        rid, model = _new_id("chatcmpl"), model_name
        now = int(time.time())

        if body.stream:
            def chunk(index, text, finish):
                delta = {"role": "assistant", "content": ""} if text is None else \
                    ({"content": text} if text else {})
                return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}

            def final(done: Done):
                return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                        "choices": [], "usage": usage(done).model_dump(), "speculative": speculative(done).model_dump()}

            include = bool(body.stream_options and body.stream_options.include_usage)
            return await gone_safe(stream_job(job, request, deadline, include, chunk, final))

        done = await gone_safe(run_job(job, request, deadline))
        if isinstance(done, Response):
            return done
        choice = ChatChoice(index=0, message=ChatResponseMessage(content=done.texts[0]),
                            finish_reason=done_reason(done.finish_reasons[0]))
        return ChatCompletionResponse(id=rid, created=now, model=model, choices=[choice], usage=usage(done),
                                      speculative=speculative(done))

    @app.post("/predict", response_model=PredictResponse, responses=ERROR_RESPONSES,
              summary="The old seed server's API: {'prompt': ...} -> {'text': ..., 'stats': ...}")
    async def predict(body: PredictRequest, request: Request):
        deadline = deadline_now()
        check_model(body.model)
        param = "max_new_tokens" if body.max_new_tokens is not None else "max_tokens"
        requested = body.max_new_tokens if body.max_new_tokens is not None else body.max_tokens
        if requested is None:
            param, requested = "max_new_tokens", min(settings.default_predict_tokens, settings.max_tokens_limit)
        max_tokens = check_max_tokens(requested, param)
        ids = await encode(body.prompt, "prompt")
        check_length(ids, max_tokens, "prompt", param)
        job = make_job(body, [ids], [max_tokens])
        done = await gone_safe(run_job(job, request, deadline))
        if isinstance(done, Response):
            return done
        stats = done.stats.to_dict()
        stats["batch_size"] = done.batch_size
        return PredictResponse(text=done.texts[0], finish_reason=done_reason(done.finish_reasons[0]), stats=stats)

    async def gone_safe(awaitable):
        """Nobody reads the answer to a client that went away: 499 (nginx's code) for the logs and metrics."""
        try:
            return await awaitable
        except ClientGone:
            return Response(status_code=499)

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=created, draft=draft_name,
                         num_speculative_tokens=default_k if has_draft else 0, max_model_len=context)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
    async def list_models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={401: ERROR_RESPONSES[401],
                                                                              404: ERROR_RESPONSES[404]})
    async def get_model(model: str):
        if model not in names:
            check_model(model)
        return card()

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        ok = batcher.accepting and (batcher.alive or not batcher.started)
        status = "ok" if ok else ("shutting_down" if not batcher.accepting else "engine_stopped")
        body = Health(status=status, model=model_name, queue_depth=batcher.queue_depth, running=batcher.running)
        if ok:
            return body
        return Response(body.model_dump_json(), status_code=503, media_type="application/json")

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}},
             summary="Prometheus metrics (text format)")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            # Invalid input is answered 400 with OpenAI's error body, never FastAPI's 422.
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            _document_limits(schemas, settings, has_draft, sorted(names))
            if settings.api_key:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def _document_limits(schemas: dict, settings: ServerSettings, has_draft: bool, names: list[str]) -> None:
    """Write this server's limits, and the non-empty rules the validators enforce, into the OpenAPI schemas."""
    def branches(prop: dict) -> list[dict]:
        return prop.get("anyOf", [prop])

    for model in schemas.values():
        props = model.get("properties", {})
        for name, prop in props.items():
            for branch in branches(prop):
                kind = branch.get("type")
                if name in ("max_tokens", "max_completion_tokens", "max_new_tokens") and kind == "integer":
                    branch["maximum"] = settings.max_tokens_limit
                elif name == "num_speculative_tokens" and kind == "integer":
                    branch["minimum"], branch["maximum"] = (1, settings.max_speculative_tokens) if has_draft \
                        else (0, 0)
                elif name == "model" and kind == "string":
                    branch["enum"] = names
                elif name in ("prompt", "stop") and kind == "string":
                    branch["minLength"] = 1
                elif name in ("prompt", "stop") and kind == "array":
                    branch["minItems"] = 1 if name == "prompt" else 0
                    branch["maxItems"] = settings.max_batch_size if name == "prompt" else MAX_STOP_STRINGS
                    branch.setdefault("items", {})["minLength"] = 1


def _version() -> str:
    try:
        from .. import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "0"

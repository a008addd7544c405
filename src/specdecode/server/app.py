"""The OpenAI-compatible HTTP app: `create_app(generator, model_name, tokenizer, settings) -> FastAPI`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with server-sent-event streaming), GET /v1/models,
GET /v1/models/{model}, GET /health, GET /metrics (Prometheus), POST /predict (the old seed server's API).

The routes are thin: every generation request takes the same path, `translate` (translate.py: the body -> an
engine job), the JobRunner (jobs.py: queue, wait or stream, cancel), and a Responder (responses.py: OpenAI's
bodies and chunks). Errors are answered with OpenAI's error body (errors.py).

Model ids: the server answers to its served names (settings.served_model_names, the CLI's repeatable
--served-model-name); without any, to the target's name and "specdecode". GET /v1/models lists them all, and a
response names the model id its request asked for (the first served name when the request named none).

Beyond sampling: n choices per prompt, logprobs (OpenAI's legacy shape in completions, the chat shape in chat),
response_format json_object / json_schema (on both endpoints: the engine's grammar constraint), tools (chat: the
model's template shows them, a grammar allows only valid calls, tool_calls.py parses them back), ignore_eos.
Unknown fields are ignored, and named in the response's X-Ignored-Fields header; parameters this server does not
implement that would change the output are refused with a 400 naming them (schemas.UNSUPPORTED).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse

from ..backends.openmp import single_threaded_torch_beside_llamacpp
from ..drafters.escaped_copies import EscapedCopies
from ..structured.tool_calls import template_supports_tools
from . import allocator
from .batcher import Batcher
from .errors import ERROR_RESPONSES, APIError, install_error_handlers
from .jobs import JobRunner
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .middleware import AuthMiddleware, MetricsMiddleware
from .playground import router as playground_router
from .responses import Responder
from .schemas import (MAX_STOP_STRINGS, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                      CompletionResponse, Health, ModelCard, ModelList, PredictRequest, PredictResponse)
from .settings import ServedModel, ServerSettings, served_names
from .translate import resolve_model, text_size, translate

log = logging.getLogger("specdecode.server")

LONG_TEXT_CHARS = 20_000  # requests with more text than this are tokenized off the event loop
MAX_IGNORED_HEADER_CHARS = 1000
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\[\]-]+")

__all__ = ["create_app", "ServerSettings", "APIError"]


def _prepare_grammars(generator) -> None:
    """The grammar compiler built before the first request (its time to the first token would pay it); without a
    tokenizer or llguidance, structured requests get their error when they come, as before."""
    if getattr(generator, "tokenizer", None) is None or not hasattr(generator, "prepare_grammars"):
        return
    try:
        generator.prepare_grammars()
    except (ImportError, ValueError) as exc:  # no grammar engine, or a tokenizer it cannot read
        log.info("structured outputs not prepared at start-up: %s", exc)


def create_app(generator, model_name: str, tokenizer=None, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `generator` (a SpeculativeGenerator or AutoregressiveGenerator); `model_name` is the target's.

    The generator is used only by the app's engine worker thread from now on: one long-lived decoding session
    that requests join at a step boundary and leave when done (continuous batching). The worker starts with the
    app's lifespan (or with the first request) and stops at shutdown: queued requests are answered 503, the
    running rows get settings.shutdown_grace_s to finish before they are cancelled.
    """
    settings = settings or ServerSettings()
    # before the worker, the event loop and the thread pool allocate (serve and Ray replicas: before loading too)
    allocator.fix_mmap_threshold(settings.malloc_mmap_threshold_kib)
    if hasattr(generator, "target"):  # before any request's torch op in a worker thread (backends/openmp.py)
        single_threaded_torch_beside_llamacpp(generator.target, getattr(generator, "drafter", None))
    tokenizer = tokenizer if tokenizer is not None else generator.tokenizer
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer (text in, text out): load the model with its tokenizer")
    served = ServedModel.of(generator, served_names(model_name, settings.served_model_names), tokenizer,
                            settings.draft_name)
    generator.set_prefix_cache(settings.prefix_cache_tokens)
    generator.set_grammar_cache(settings.grammar_cache_entries)
    if getattr(generator, "prefix_cache", None) is not None:  # the target's: what an answer's KV is worth
        generator.prefix_cache.answers = settings.answer_kv
    metrics = ServerMetrics()
    batcher = Batcher(generator, max_batch_size=settings.max_batch_size, max_queue=settings.max_queue,
                      prefill_tokens_per_step=settings.prefill_tokens_per_step, metrics=metrics,
                      join_running=not settings.static_batching,
                      copies=EscapedCopies(getattr(generator, "drafter", None), tokenizer)
                      if settings.escaped_copies else None)
    metrics.queue_depth.set_function(lambda: batcher.queue_depth)
    metrics.running.set_function(lambda: batcher.running)
    metrics.running_rows.set_function(lambda: batcher.running_rows)
    metrics.watch_policy(lambda: getattr(generator, "policy", None))  # every session uses the generator's policy
    metrics.watch_prefix_cache(lambda: generator.prefix_cache)
    metrics.watch_memory(lambda: getattr(generator, "drafter", None))
    runner = JobRunner(batcher, metrics, settings)
    token_texts = TokenTexts(tokenizer)
    metrics.watch_caches(generator.grammar_cache, token_texts, served.vocab_size)

    async def lifespan(_app):
        await asyncio.to_thread(_prepare_grammars, generator)
        batcher.start()
        yield
        await asyncio.to_thread(batcher.stop, settings.shutdown_grace_s)

    app = FastAPI(title="specdecode", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions served with lossless speculative decoding.")
    app.state.batcher, app.state.metrics, app.state.settings, app.state.served = batcher, metrics, settings, served
    app.state.generator, app.state.tokenizer, app.state.model_name = generator, tokenizer, served.name
    install_error_handlers(app)

    async def generate(body, kind: str, request: Request) -> Response:
        """The one path of every generation request: translate, run (whole or streamed), answer."""
        arrival = time.monotonic()
        if text_size(body) > LONG_TEXT_CHARS:
            generation = await asyncio.to_thread(translate, body, kind, served, settings)
        else:
            generation = translate(body, kind, served, settings)
        job = generation.job
        headers = _ignored_header(generation.ignored)
        options = job.params
        log.debug("%s: %d prompt(s) of %s tokens, n %d, max_tokens %d, temperature %g, k %s%s%s%s", kind,
                  len(job.prompts), "/".join(str(len(p)) for p in job.prompts), job.n, job.max_tokens[0],
                  options.temperature, "auto" if options.num_speculative_tokens is None
                  else options.num_speculative_tokens, ", constrained" if job.constrained else "",
                  "" if options.logprobs is None else f", logprobs {options.logprobs}",
                  f"; ignored: {headers['X-Ignored-Fields']}" if headers else "")
        responder = Responder(kind, generation.model, served.draft_name, generation.provenance, generation.logprobs,
                              token_texts, generation.tool_calls)
        limits = runner.limits(arrival, generation.timeout)
        if generation.stream:
            events = await runner.stream(job, request, limits, responder, generation.include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        done = await runner.result(job, request, limits)
        return Response(responder.body(done).model_dump_json(), media_type="application/json", headers=headers)

    # ------------------------------------------------------------------ endpoints
    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES,
              summary="Text completion (OpenAI-compatible; stream=true for server-sent events)")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, "completion", request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES,
              summary="Chat completion with the model's chat template (stream=true for server-sent events)")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, "chat", request)

    @app.post("/predict", response_model=PredictResponse, responses=ERROR_RESPONSES,
              summary="The old seed server's API: {'prompt': ...} -> {'text': ..., 'stats': ...}")
    async def predict(body: PredictRequest, request: Request):
        return await generate(body, "predict", request)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=served.created, draft=served.draft_name,
                         num_speculative_tokens=served.num_speculative_tokens, max_model_len=served.context_length)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
    async def list_models():
        return ModelList(data=[card(name) for name in served.names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={401: ERROR_RESPONSES[401],
                                                                              404: ERROR_RESPONSES[404]})
    async def get_model(model: str):
        return card(resolve_model(model, served))

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        ok = batcher.accepting and (batcher.alive or not batcher.started)
        status = "ok" if ok else ("shutting_down" if not batcher.accepting else "engine_stopped")
        body = Health(status=status, model=served.name, queue_depth=batcher.queue_depth, running=batcher.running)
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
            _document_limits(schemas, settings, served)
            if settings.api_key:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.include_router(playground_router)
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def _ignored_header(names: list[str]) -> dict[str, str]:
    """X-Ignored-Fields: the ignored fields' names; a name other than plain ASCII as a quoted Python literal
    (a header value cannot hold control characters, non-Latin-1 text, or whitespace at its ends)."""
    if not names:
        return {}
    shown = [name if _PLAIN_NAME.fullmatch(name) else ascii(name) for name in names]
    value = shown[0]
    if len(value) > MAX_IGNORED_HEADER_CHARS:
        value = value[:MAX_IGNORED_HEADER_CHARS].rstrip() + "..."
    for name in shown[1:]:
        if len(value) + len(name) > MAX_IGNORED_HEADER_CHARS:
            value += ", ..."
            break
        value += f", {name}"
    return {"X-Ignored-Fields": value}


def _document_limits(schemas: dict, settings: ServerSettings, served: ServedModel) -> None:
    """Write this server's limits, and the non-empty rules the validators enforce, into the OpenAPI schemas."""
    last_id = served.vocab_size - 1 if served.vocab_size else None
    tools = template_supports_tools(served.tokenizer)  # without a tool format: no tools, no tool messages
    longest = served.context_length - 1 if served.context_length else None  # a prompt leaves room for one token
    tokens_cap = settings.tokens_cap(served.context_length)

    def token_ids(branch: dict) -> None:
        branch["minItems"] = 1
        if longest is not None:
            branch["maxItems"] = longest
        branch.setdefault("items", {})["minimum"] = 0
        if last_id is not None:
            branch["items"]["maximum"] = last_id

    for model in schemas.values():
        for name, prop in model.get("properties", {}).items():
            if name == "tool_choice" and not tools:  # only "none": the named-function branch goes
                prop["anyOf"] = [b for b in prop.get("anyOf", [prop]) if "$ref" not in b]
            for branch in prop.get("anyOf", [prop]):
                kind, items = branch.get("type"), branch.get("items", {})
                if name in ("max_tokens", "max_completion_tokens", "max_new_tokens") and kind == "integer":
                    if tokens_cap is not None:
                        branch["maximum"] = tokens_cap
                elif name == "num_speculative_tokens" and kind == "integer":
                    branch["minimum"], branch["maximum"] = (0, settings.max_speculative_tokens) \
                        if served.has_draft else (0, 0)
                elif name == "n" and kind == "integer" and "maximum" not in branch:  # /predict's n is 1
                    branch["maximum"] = settings.max_batch_size
                elif name in ("tools", "tool_calls") and kind == "array" and not tools:
                    branch["maxItems"] = 0
                elif name == "tool_choice" and kind == "string" and not tools:
                    branch["enum"] = ["none"]
                elif name == "role" and "tool" in branch.get("enum", ()) and not tools:
                    branch["enum"] = [r for r in branch["enum"] if r != "tool"]
                elif name == "model" and kind == "string":
                    branch["enum"] = list(served.names) + [""]  # "": the main model, as when left out
                elif name in ("prompt", "stop") and kind == "string":
                    branch["minLength"] = 1
                elif name == "stop" and kind == "array":
                    branch["maxItems"] = MAX_STOP_STRINGS
                    items["minLength"] = 1
                elif name == "prompt" and kind == "array" and items.get("type") == "string":
                    branch["minItems"], branch["maxItems"] = 1, settings.max_batch_size
                    items["minLength"] = 1
                elif name == "prompt" and kind == "array" and items.get("type") == "integer":
                    token_ids(branch)
                elif name == "prompt" and kind == "array" and items.get("type") == "array":
                    branch["minItems"], branch["maxItems"] = 1, settings.max_batch_size
                    token_ids(items)


def _version() -> str:
    try:
        from .. import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "0"

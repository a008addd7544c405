"""`specdecode serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on a target/draft pair."""

from __future__ import annotations

from typing import List, Optional

import typer

from .app import app
from .applies import refuse_ignored
from .common import CLIError, generator_of, load_pair, user_errors
from .options import AUTO, AUTO_DRAFT, ModelOptions, model_options
from ..pairing.pair import display_name


@app.command("serve")
@model_options(k_default=AUTO, draft_default=AUTO_DRAFT)
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind. The default answers only this "
                             "machine; binding another address without --api-key exposes the model to the network."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDECODE_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    max_batch_size: int = typer.Option(8, "--max-batch-size", help="Rows (prompts) decoding at once at most: "
                                       "requests join the running batch between steps and leave when done."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting for room in the batch at most; more "
                                  "are answered 429 with Retry-After."),
    prefill_tokens_per_step: int = typer.Option(256, "--prefill-tokens-per-step", help="Prompt tokens prefilled "
                                                "per engine step: long prompts join in chunks, so the running rows "
                                                "keep decoding meanwhile (0: whole prompts at once)."),
    static_batching: bool = typer.Option(False, "--static-batching", help="Admit new requests only when the "
                                         "running batch has finished (static batching, what continuous batching "
                                         "replaced): for before/after comparisons with `bench serve`."),
    prefix_cache_tokens: int = typer.Option(65536, "--prefix-cache-tokens", help="Keep the KV of finished "
                                            "requests, up to this many tokens, and prefill only what is new of a "
                                            "prompt that starts the same (a chat's history, a shared system "
                                            "prompt); exact: the same output as a cold prefill (0: off)."),
    prefix_cache_rows: int = typer.Option(4, "--prefix-cache-rows", help="llama.cpp: sequences beside "
                                          "--max-batch-size that hold cached prefixes (each a KV stream of n_ctx)."),
    grammar_cache: int = typer.Option(64, "--grammar-cache", help="Compiled grammars kept for later requests "
                                      "(least recently used out first): each distinct json_schema, regex or set of "
                                      "tools is one."),
    answer_kv: str = typer.Option("prefill", "--answer-kv", help="What a finished answer's KV is worth to the "
                                  "next turn, which re-sends it: prefill (prefilled again while the server is "
                                  "idle, as a cold prefill would: exact), lend (the decode-computed KV, as "
                                  "llama-server does: equal up to float rounding) or off (prompts only)."),
    escaped_copies: bool = typer.Option(True, "--escaped-copies/--no-escaped-copies", help="Requests whose answer "
                                        "is JSON (tools, a json response_format): the suffix draft's history takes "
                                        "the tool and user messages' texts as JSON escapes them, so a call that "
                                        "writes a file it read copies it (exact: drafts only)."),
    json_layout: str = typer.Option("compact", "--json-layout", help="A response_format's JSON: compact (no "
                                    "whitespace between tokens: fewest tokens, most of them forced) or model (laid "
                                    "out as the model writes it, e.g. indented, at most one newline and 24 spaces "
                                    "between two tokens), which keeps a model trained on indented JSON on the "
                                    "answer it would give. A schema's own \"x-guidance\" layout wins."),
    strict_tool_calls: bool = typer.Option(False, "--strict-tool-calls", help="Tool calls only in the chat "
                                           "template's own form (e.g. <tool_call> blocks): not the fenced or bare "
                                           "JSON that small models write at the start of an answer instead."),
    max_tool_calls: int = typer.Option(0, "--max-tool-calls", help="Tool calls in one answer at most (parallel "
                                       "calls; 0: the number of tools the request declares)."),
    malloc_mmap_threshold: int = typer.Option(128, "--malloc-mmap-threshold", help="KiB: blocks this large get "
                                              "their own mapping, returned to the system when freed (0: glibc's own "
                                              "threshold, which rises with the blocks freed: under a long mixed "
                                              "load the free space kept in its heaps grew without a bound)."),
    max_tokens_limit: int = typer.Option(0, "--max-tokens-limit", help="Largest max_tokens a request may ask (0: "
                                         "as many as the model's context leaves after the prompt; a chat without "
                                         "max_tokens gets that much room)."),
    queue_timeout: float = typer.Option(600.0, "--queue-timeout", help="Seconds a request may wait for room in "
                                        "the batch before it is dropped and answered 503 with Retry-After (0: no "
                                        "limit). Once it runs, --stall-timeout applies instead."),
    stall_timeout: float = typer.Option(120.0, "--stall-timeout", help="Seconds a running request may go without "
                                        "progress (no new token; before its first, no engine step) before it is "
                                        "cancelled and answered 504, or sent an error event if streaming (0: no "
                                        "limit). A long answer that keeps producing tokens is never cut."),
    request_timeout: float = typer.Option(0.0, "--request-timeout", help="A total deadline: seconds from a "
                                          "request's arrival to the end of its response, after which it is "
                                          "cancelled (504, or an error event if streaming) even while producing "
                                          "tokens. 0 (the default): none; a request may set its own with the "
                                          "body's `timeout` field (the earlier of the two applies)."),
    served_model_name: Optional[List[str]] = typer.Option(
        None, "--served-model-name", help="A model id clients may send and /v1/models lists; repeat it for more "
        "(the first names the model in responses that ask for none). Default: the target's name (its directory's "
        "name for a path) and 'specdecode'."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: critical, error, warning, "
                                  "info, debug."),
    ray: bool = typer.Option(False, "--ray", help="Serve with Ray Serve: replicas that each load the models once "
                             "and run their own engine loop (needs the [ray] extra)."),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="With --ray: this many replicas (default 1)."),
    autoscale: Optional[str] = typer.Option(None, "--autoscale", help="With --ray: MIN,MAX replicas, scaled on "
                                            "the requests each one holds."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --ray: join this Ray cluster "
                                              "(e.g. ray://head:10001 or auto); default: start a local one."),
    ray_num_cpus: Optional[int] = typer.Option(None, "--ray-num-cpus", help="With --ray and no address: CPUs of "
                                               "the local Ray instance (default: all)."),
    routing: Optional[str] = typer.Option(None, "--routing", help="With --ray: affinity (default: a conversation's "
                                          "turns go to the replica holding its prefix cache and suffix history, "
                                          "under a load bound) or load (the least loaded replica)."),
    opts: ModelOptions = None,
) -> None:
    """Serve the target (sped up by the draft) over an OpenAI-compatible HTTP API.

    Endpoints: /v1/completions and /v1/chat/completions (streaming too), /v1/models, /health, /metrics (Prometheus),
    /predict (the old seed server's API) and /openapi.json.
    """
    with user_errors():
        from ..server import ServerSettings, create_app, run
        from ..server.allocator import fix_mmap_threshold
        from ..server.run import log_config

        log_config(log_level)  # checks the level before anything loads
        if not 0 <= port <= 65535:
            raise CLIError(f"--port must be between 0 and 65535, got {port}")
        if not ray and (replicas is not None or autoscale is not None or ray_address or ray_num_cpus is not None
                        or routing is not None):
            raise CLIError("--replicas, --autoscale, --ray-address, --ray-num-cpus and --routing need --ray")
        settings = ServerSettings(max_batch_size=max_batch_size, max_queue=max_queue,
                                  max_tokens_limit=max_tokens_limit, queue_timeout=queue_timeout,
                                  stall_timeout=stall_timeout, request_timeout=request_timeout,
                                  api_key=api_key, served_model_names=tuple(served_model_name or ()),
                                  draft_name=display_name(opts.draft) if opts.has_draft else None,
                                  prefill_tokens_per_step=prefill_tokens_per_step, static_batching=static_batching,
                                  prefix_cache_tokens=prefix_cache_tokens, prefix_cache_rows=prefix_cache_rows,
                                  grammar_cache_entries=grammar_cache,
                                  answer_kv=answer_kv,
                                  escaped_copies=escaped_copies, json_layout=json_layout,
                                  strict_tool_calls=strict_tool_calls,
                                  max_tool_calls=max_tool_calls,
                                  malloc_mmap_threshold_kib=malloc_mmap_threshold)
        fix_mmap_threshold(settings.malloc_mmap_threshold_kib)  # before loading allocates
        if ray:
            _serve_with_ray(opts, settings, host, port, ray_address, ray_num_cpus, replicas, autoscale,
                            routing or "affinity")
            return
        _refuse_ignored(opts, settings)
        target_model, draft_model = load_pair(opts, announce=True, rows=settings.model_rows)
        if opts.draft_choice is not None:  # --draft auto: the draft it chose is the one the server names
            settings.draft_name = display_name(opts.draft)
        if target_model.tokenizer is None:
            raise CLIError(f"{opts.target} has no tokenizer: the server takes text and returns text")
        generator = generator_of(opts, target_model, draft_model)
        server_app = create_app(generator, display_name(opts.target), target_model.tokenizer, settings)
    # Logs go through `logging`, one line per event; on SIGINT/SIGTERM uvicorn stops accepting, lets in-flight
    # requests finish for the settings' shutdown grace, the app's shutdown stops the engine worker, and run() logs
    # "server stopped".
    run(server_app, host=host, port=port, log_level=log_level)


def _serve_with_ray(opts: ModelOptions, settings, host: str, port: int, address: Optional[str],
                    num_cpus: Optional[int], replicas: Optional[int], autoscale: Optional[str],
                    routing: str = "affinity") -> None:
    """The same app as a Ray Serve deployment: each replica loads the models itself (one thread unless
    --threads says otherwise), so nothing is loaded here; the deployment options are checked before Ray starts."""
    import logging.config

    from ..server.ray_serve import ROUTING_POLICIES, deployment_options, parse_autoscale, replica_config, serve_with_ray
    from ..server.run import log_config

    if routing not in ROUTING_POLICIES:
        raise CLIError(f"--routing takes {' or '.join(ROUTING_POLICIES)}, got {routing!r}")
    opts.threads = opts.threads or 1
    scale = parse_autoscale(autoscale) if autoscale is not None else None
    options = deployment_options(replicas, scale, settings, cpus_per_replica=opts.threads)
    _refuse_ignored(opts, settings)  # each replica loads as `serve` would
    try:
        import ray  # noqa: F401
    except ImportError:
        raise CLIError("--ray needs Ray Serve: pip install 'specdecode[ray]'") from None
    logging.config.dictConfig(log_config("info"))
    config = replica_config(opts, settings, display_name(opts.target))
    serve_with_ray(config, options, host=host, port=port, address=address, num_cpus=num_cpus, settings=settings,
                   routing=routing)




def _refuse_ignored(opts: ModelOptions, settings) -> None:
    """The model options and the server's own where they would do nothing here (cli/applies.py)."""
    refuse_ignored(opts, values={name: getattr(settings, name) for name in
                                 ("prefix_cache_tokens", "prefix_cache_rows", "answer_kv", "escaped_copies")})

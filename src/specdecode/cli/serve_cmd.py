"""`specdecode serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on a target/draft pair."""

from __future__ import annotations

import os
from typing import Optional

import typer

from .app import app
from .common import (DeviceMapOpt, DeviceOpt, DraftOpt, DraftQuantizeOpt, DtypeOpt, KOpt, MethodOpt, ModelOptions,
                     PrepackOpt, QuantizeOpt, TargetOpt, ThreadsOpt, TrustOpt, err, fail, load_pair, make_generator,
                     user_errors)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command("serve")
def serve(
    target: str = TargetOpt,
    draft: str = DraftOpt,
    k: int = KOpt,
    method: str = MethodOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    device_map: Optional[str] = DeviceMapOpt,
    quantize: Optional[str] = QuantizeOpt,
    draft_quantize: Optional[str] = DraftQuantizeOpt,
    trust_remote_code: bool = TrustOpt,
    threads: Optional[int] = ThreadsOpt,
    prepack: bool = PrepackOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind. The default answers only this "
                             "machine; binding another address without --api-key exposes the model to the network."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDECODE_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    max_batch_size: int = typer.Option(8, "--max-batch-size", help="Prompts per engine batch at most: requests "
                                       "that arrive together share one speculative batch."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting at most; more are answered 429."),
    max_tokens_limit: int = typer.Option(2048, "--max-tokens-limit", help="Largest max_tokens a request may ask."),
    request_timeout: float = typer.Option(120.0, "--request-timeout", help="Seconds a request may take, queue "
                                          "included, before it is cancelled and answered 504."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id clients "
                                                    "use (default: the target's name, or its directory's name)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: critical, error, warning, "
                                  "info, debug."),
) -> None:
    """Serve the target (sped up by the draft) over an OpenAI-compatible HTTP API.

    Endpoints: /v1/completions and /v1/chat/completions (streaming too), /v1/models, /health, /metrics (Prometheus),
    /predict (the old seed server's API) and /openapi.json.
    """
    with user_errors():
        import uvicorn

        from ..server import ServerSettings, create_app

        for name, value in (("--max-batch-size", max_batch_size), ("--max-queue", max_queue),
                            ("--max-tokens-limit", max_tokens_limit)):
            if value < 1:
                fail(f"{name} must be >= 1, got {value}")
        if not request_timeout > 0:
            fail(f"--request-timeout must be > 0 seconds, got {request_timeout}")
        if log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            fail(f"--log-level must be one of critical, error, warning, info, debug, trace, got {log_level!r}")
        if not 0 <= port <= 65535:
            fail(f"--port must be between 0 and 65535, got {port}")
        opts = ModelOptions(target=target, draft=draft, device=device, dtype=dtype, device_map=device_map,
                            quantize=quantize, draft_quantize=draft_quantize, trust_remote_code=trust_remote_code,
                            threads=threads, prepack=prepack)
        target_model, draft_model = load_pair(opts)
        if target_model.tokenizer is None:
            fail(f"{target} has no tokenizer: the server takes text and returns text")
        generator = make_generator(target_model, draft_model, k, method)
        name = served_model_name or _display_name(target)
        settings = ServerSettings(max_batch_size=max_batch_size, max_queue=max_queue,
                                  max_tokens_limit=max_tokens_limit, request_timeout=request_timeout,
                                  api_key=api_key or None, model_aliases=tuple({target, _display_name(target)}),
                                  draft_name=_display_name(draft) if draft_model is not None else None)
        server_app = create_app(generator, name, target_model.tokenizer, settings)
    if host not in LOOPBACK and not api_key:
        err.print(f"[yellow]warning:[/] binding {host} without --api-key: anyone who can reach this port can use "
                  f"the model", markup=True)
    shown = f"[{host}]" if ":" in host else host
    err.print(f"serving {name!r} ({'speculative, k=' + str(k) if draft_model is not None else 'plain decoding'}) at "
              f"http://{shown}:{port}/v1", markup=False)
    # On SIGINT/SIGTERM uvicorn stops accepting, lets in-flight requests finish for up to 30 s, then cancels them;
    # the app's shutdown then stops the engine worker.
    try:
        uvicorn.run(server_app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
                    access_log=log_level in ("debug", "info"))
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it has already handled by shutting down gracefully
        pass
    err.print("server stopped", markup=False)


def _display_name(name: str) -> str:
    """A path's last component ('/models/qwen-1.5b/' -> 'qwen-1.5b'); a built-in name or hub id as it is."""
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        return os.path.basename(os.path.normpath(expanded)) or name
    return name

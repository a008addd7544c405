"""The same OpenAI-compatible app as a Ray Serve deployment: N replicas (or autoscaling), each loading the models
once and running its own engine loop (continuous batching within a replica; Ray's proxy spreads requests across
replicas).

Three ways in:
- `specdecode serve --ray [--replicas N | --autoscale MIN,MAX] [--ray-address ADDR]` (`serve_with_ray`);
- `serve run deploy/ray-serve.yaml` / `serve deploy deploy/ray-serve.yaml`: the application builder `app_builder`,
  whose args are the `specdecode serve` options (target, draft, k, max_batch_size, ...);
- KubeRay: deploy/kuberay-rayservice.yaml embeds that same config.

A replica that dies is restarted by Ray's controller; requests it held are answered 5xx by the proxy (or see their
stream cut), and a retry goes to a live replica. As a backstop against a request the proxy keeps waiting on after its
replica died (seen once under load on a 2-core VM), the proxy's own timeout is the server's --request-timeout plus
PROXY_GRACE_S: such a request is answered 408 (which OpenAI clients retry), never left hanging.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from ..errors import OptionError

log = logging.getLogger("specdecode.server")

DEFAULT_PORT = 8000
PROXY_GRACE_S = 10.0  # the replica answers 504 at --request-timeout; the proxy gives up only after this much more


class SpecdecodeReplica:
    """One replica: the models, loaded once, and an app of its own (its engine loop starts with the app)."""

    def __init__(self, config: dict):
        import torch

        from ..pair import ModelOptions, load_pair, make_generator
        from .app import create_app
        from .settings import ServerSettings

        opts = ModelOptions(**config["model"])
        if opts.threads:
            torch.set_num_threads(opts.threads)
        settings = ServerSettings(**config["settings"])
        target, draft = load_pair(opts, rows=settings.model_rows)
        if target.tokenizer is None:
            raise ValueError(f"{opts.target} has no tokenizer: the server takes text and returns text")
        generator = make_generator(target, draft, opts.num_speculative_tokens, opts.method)
        self._app = create_app(generator, config["model_name"], target.tokenizer, settings)

    def __serve_build_asgi_app__(self):
        return self._app


def replica_config(opts, settings, model_name: str) -> dict:
    """What each replica is built from (plain data: it travels to the replicas' processes)."""
    return {"model": dataclasses.asdict(opts), "settings": dataclasses.asdict(settings), "model_name": model_name}


def parse_autoscale(text: str) -> tuple[int, int]:
    """"MIN,MAX" as deployment_options takes it (which checks the range)."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise OptionError("autoscale", f"autoscale takes MIN,MAX (two integers), got {text!r}") from None
    return low, high


def deployment_options(replicas: int | None = None, autoscale: tuple[int, int] | None = None,
                       settings=None, cpus_per_replica: float = 1.0) -> dict:
    """Ray Serve deployment options: a fixed replica count or an autoscaling range; requests per replica bounded by
    the server's own queue and batch (it answers 429 beyond), not by Ray's default of 5. Checked here, once."""
    if replicas is not None and autoscale is not None:
        raise ValueError("give replicas or autoscale, not both")
    ongoing = (settings.max_queue + settings.max_batch_size) if settings is not None else 128
    options: dict[str, Any] = {"max_ongoing_requests": ongoing, "ray_actor_options": {"num_cpus": cpus_per_replica},
                               "health_check_period_s": 2, "health_check_timeout_s": 30}
    if autoscale is not None:
        low, high = autoscale
        if not 0 <= low <= high or high < 1:
            raise OptionError("autoscale", f"autoscale MIN,MAX needs 0 <= MIN <= MAX and MAX >= 1, got {low},{high}")
        target = settings.max_batch_size if settings is not None else 8
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
                                         "target_ongoing_requests": target}
    else:
        count = 1 if replicas is None else replicas
        if count < 1:
            raise OptionError("replicas", f"replicas must be >= 1, got {count}")
        options["num_replicas"] = count
    return options


def http_options(host: str, port: int, settings=None) -> dict:
    """Ray Serve's proxy options: where it listens, and a request timeout just past the replicas' own."""
    from .settings import ServerSettings

    timeout = (settings or ServerSettings()).request_timeout + PROXY_GRACE_S
    return {"host": host, "port": port, "request_timeout_s": timeout}


def build_application(config: dict, **options):
    """A bound Ray Serve application of SpecdecodeReplica with these deployment options."""
    from ray import serve

    deployment = serve.deployment(serve.ingress()(SpecdecodeReplica), name="specdecode")
    return deployment.options(**options).bind(config)


def app_builder(args: dict):
    """`serve run`/`serve deploy` entry point: args are `specdecode serve` option names (underscores), e.g.
    {"target": "...", "draft": "...", "k": "auto", "max_batch_size": 8, "threads": 1}. Replica counts and
    autoscaling come from the config file's `deployments` section."""
    from ..pair import ModelOptions
    from .settings import ServerSettings

    args = dict(args)
    model_fields = {f.name for f in dataclasses.fields(ModelOptions)}
    setting_fields = {f.name for f in dataclasses.fields(ServerSettings)}
    unknown = set(args) - model_fields - setting_fields - {"model_name"}
    if unknown:
        raise ValueError(f"unknown specdecode args: {', '.join(sorted(unknown))}; use `specdecode serve` option "
                         f"names with underscores")
    opts = ModelOptions(**{k: v for k, v in args.items() if k in model_fields})
    opts.num_speculative_tokens  # noqa: B018  (K parsed here, not first in each replica)
    settings = ServerSettings(**{k: v for k, v in args.items() if k in setting_fields})
    name = args.get("model_name") or opts.target
    return build_application(replica_config(opts, settings, name), **deployment_options(settings=settings))


def serve_with_ray(config: dict, options: dict, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                   address: str | None = None, num_cpus: int | None = None, settings=None) -> None:
    """Start (or join, with an address) Ray, run the deployment (options: from deployment_options) on host:port,
    and block until Ctrl-C/SIGTERM."""
    import signal

    import ray
    from ray import serve

    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    serve.start(http_options=http_options(host, port, settings))
    serve.run(build_application(config, **options), name="specdecode", route_prefix="/")
    scale = options.get("autoscaling_config", {})
    count = options.get("num_replicas") or f"{scale.get('min_replicas')}..{scale.get('max_replicas')}"
    log.info("serving with Ray Serve (%s replica(s)) at http://%s:%d/v1", count, host, port)
    stopping = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        while not stopping:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        serve.shutdown()
        ray.shutdown()
        log.info("server stopped")

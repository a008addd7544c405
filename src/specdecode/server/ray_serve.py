"""The same OpenAI-compatible app as a Ray Serve deployment: N replicas (or autoscaling), each loading the models
once and running its own engine loop (continuous batching within a replica; Ray's proxy spreads requests across
replicas).

Three ways in:
- `specdecode serve --ray [--replicas N | --autoscale MIN,MAX] [--ray-address ADDR]` (`serve_with_ray`);
- `serve run deploy/ray-serve.yaml` / `serve deploy deploy/ray-serve.yaml`: the application builder `app_builder`,
  whose args are the `specdecode serve` options (target, draft, k, max_batch_size, ...);
- KubeRay: deploy/kuberay-rayservice.yaml embeds that same config.

A replica that dies is restarted by Ray's controller; requests it held are answered 5xx by the proxy (or see their
stream cut), and a retry goes to a live replica. A request that keeps producing tokens is never cut: Ray's proxy
timeout is end to end (streams included), so the proxy gets one only where the server has a total deadline
(--request-timeout, plus PROXY_GRACE_S: a backstop behind the replica's own 504). Against a request left waiting on a
replica that died without Ray noticing (seen once under load on a 2-core VM), a replica says something at least
every HEARTBEAT_S (a heartbeat while its answer is not ready), and the ingress takes a replica silent for
REPLICA_SILENCE_S as lost: the request goes to another replica, or a stream under way ends with an error event.

Cache-aware routing (routing.py): requests enter through a light ingress deployment that reads each body's prefix
key and calls the replicas through a handle whose request router (PrefixAffinityRouter, Ray Serve's RequestRouter
API) places it by bounded-load consistent hashing: a conversation's turns land on the replica that holds its prefix
cache and suffix history, unless that replica is at the load bound (then the next on the ring) or full (then the
least loaded). A replica lost before it answered costs nothing: the ingress sends the request again, the ring
without that replica re-homes it (a prefill from scratch), and only a stream already under way is cut (with an
error event). `routing="load"` places by load alone (for comparison). The ingress's /metrics holds each replica's
metrics (label replica) and the router's counts (specdecode_routed_requests{replica, by}).
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
HEARTBEAT_S = 5.0  # a replica whose answer is not ready says so this often: alive, however long the answer takes
REPLICA_SILENCE_S = 60.0  # the ingress takes a replica that said nothing for this long (12 heartbeats) as lost


class SpecdecodeReplica:
    """One replica: the models, loaded once, and an app of its own (its engine loop starts with its first request).
    The ingress calls `forward` with an HTTP request as plain data; the replica runs it through its app in-process
    and yields the response: its head ({"status", "headers"}), then the body's chunks as they come."""

    def __init__(self, config: dict):
        import torch

        from ..pairing.pair import ModelOptions, display_name, generator_of, load_pair
        from .allocator import fix_mmap_threshold
        from .app import create_app
        from .settings import ServerSettings

        opts = ModelOptions(**config["model"])
        if opts.threads:
            torch.set_num_threads(opts.threads)
        settings = ServerSettings(**config["settings"])
        fix_mmap_threshold(settings.malloc_mmap_threshold_kib)  # before loading allocates
        target, draft = load_pair(opts, rows=settings.model_rows)
        if opts.draft_choice is not None:  # --draft auto: each replica names the draft it resolved to, not "auto"
            settings = dataclasses.replace(settings, draft_name=display_name(opts.draft) if opts.has_draft else None)
        if target.tokenizer is None:
            raise ValueError(f"{opts.target} has no tokenizer: the server takes text and returns text")
        generator = generator_of(opts, target, draft)
        self._app = create_app(generator, config["model_name"], target.tokenizer, settings)
        self._apps_running: set = set()  # app calls whose client went away, left to finish their cleanup

    async def forward(self, request: dict, routing_key: str | None = None):
        """The app's response to `request` (method, path, query, headers, body): its head, then body chunks. A
        caller that goes away (Ray cancels this generator) is a client disconnect to the app: its job is cancelled.
        routing_key is read by the router only."""
        import asyncio

        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            messages.put_nowait(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request["method"],
                 "scheme": "http", "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query"].encode(), "root_path": "",
                 "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
                 "client": ("ray-ingress", 0), "server": ("replica", 0)}
        task = asyncio.ensure_future(self._app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                try:
                    message = await asyncio.wait_for(messages.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield None  # a heartbeat (the ingress skips it): this replica is alive, its answer not ready
                    continue
                if message is None:
                    break
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())]
                    yield {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()
            if not task.done():
                self._apps_running.add(task)
                task.add_done_callback(self._apps_running.discard)

    def replica_metrics(self, replica: str | None = None) -> tuple[str, str]:
        """(this replica's id, its Prometheus text); replica: read by the router, which sends the call there."""
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id, self._app.state.metrics.render().decode()


class SpecdecodeIngress:
    """The HTTP entry: reads each request's body, and calls a replica through the engine handle with the body's
    prefix key (the router places it). A replica lost before its answer began is asked again (the ring re-homes
    the request); a stream cut mid-way ends with an error event. Holds no model: it needs no CPU of its own."""

    def __init__(self, engine):
        self._engine = engine

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        from .routing import routing_key, routing_stats

        body = await request.body()
        if request.method == "GET" and request.url.path == "/metrics":
            return Response(await self._metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")
        forwarded = {"method": request.method, "path": request.url.path, "query": request.url.query,
                     "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
                     "body": body}
        # only generation requests (POST) are placed by key and counted; a GET goes anywhere
        keyed = {"routing_key": routing_key(request.url.path, body)} if request.method == "POST" else {}
        for attempt in range(REPLICA_ATTEMPTS):
            call = self._engine.options(stream=True).forward.remote(forwarded, **keyed)
            try:
                head = await _heard(call)
                # a whole answer is read whole: a replica lost before its end costs only a retry
                chunks = None if _streamed(head) else [chunk async for chunk in _chunks(call)]
            except (*_replica_lost_errors(), ReplicaSilent) as exc:
                log.warning("a replica was lost before it answered (%s): sending the request again", exc)
                routing_stats().reroute()
                continue
            except StopAsyncIteration:  # the app ended without an answer (not seen: its error handlers answer)
                return Response(_error_body("the replica ended the request without an answer", "no_answer"),
                                status_code=502, media_type="application/json")
            headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
            if chunks is not None:
                return Response(b"".join(chunks), status_code=head["status"], headers=headers)
            return StreamingResponse(_rest_of_stream(call), status_code=head["status"], headers=headers)
        return Response(_error_body(f"no replica answered after {REPLICA_ATTEMPTS} tries (replicas lost): "
                                    f"retry later", "replica_lost"), status_code=503,
                        media_type="application/json", headers={"Retry-After": "1"})

    async def _metrics(self) -> str:
        """Each live replica's metrics with its id as label `replica`, and the router's counts."""
        from .routing import render_metrics, routing_stats

        stats = routing_stats().snapshot()
        live = stats["live"] or sorted({replica for replica, _ in stats["routed"]})
        texts = {}
        for replica in live:
            try:
                rid, text = await self._engine.replica_metrics.remote(replica=replica)
            except _replica_lost_errors():
                continue
            texts[rid] = text
        if not texts:  # nothing routed yet: any one replica's figures
            try:
                rid, text = await self._engine.replica_metrics.remote()
                texts[rid] = text
            except _replica_lost_errors():
                pass
        return render_metrics(texts, routing_stats().snapshot())


REPLICA_ATTEMPTS = 3  # sends of one request, while replicas are lost under it


def _streamed(head: dict) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])


class ReplicaSilent(Exception):
    """A replica said nothing, not even a heartbeat, for REPLICA_SILENCE_S: taken as lost."""


async def _heard(call):
    """The call's next item, heartbeats skipped (StopAsyncIteration at its end); ReplicaSilent, the call cancelled,
    when the replica says nothing for REPLICA_SILENCE_S."""
    import asyncio

    while True:
        try:
            item = await asyncio.wait_for(call.__anext__(), REPLICA_SILENCE_S)
        except asyncio.TimeoutError:
            call.cancel()
            raise ReplicaSilent(f"the replica said nothing for {REPLICA_SILENCE_S:g} s") from None
        if item is not None:
            return item


async def _chunks(call):
    """The call's body chunks (after its head), as _heard reads them."""
    while True:
        try:
            chunk = await _heard(call)
        except StopAsyncIteration:
            return
        yield chunk


async def _rest_of_stream(call):
    try:
        async for chunk in _chunks(call):
            yield chunk
    except (*_replica_lost_errors(), ReplicaSilent) as exc:
        log.warning("a replica was lost mid-stream: %s", exc)
        yield b"data: " + _error_body("the replica serving this stream was lost: send the request again",
                                      "replica_lost") + b"\n\n"


def _error_body(message: str, code: str) -> bytes:
    import json

    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()


def _replica_lost_errors() -> tuple:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (RayActorError, ActorDiedError, ActorUnavailableError)


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
    """Ray Serve's proxy options: where it listens, and its request timeout: none (None) unless the server has a
    total deadline (--request-timeout), then just past the replicas' own. Ray's is end to end, streams included: any
    other value would cut a long answer that is still producing tokens."""
    from .settings import ServerSettings

    deadline = (settings or ServerSettings()).request_timeout
    return {"host": host, "port": port, "request_timeout_s": deadline + PROXY_GRACE_S if deadline else None}


ROUTING_POLICIES = ("affinity", "load")


def build_application(config: dict, routing: str = "affinity", **options):
    """A bound Ray Serve application: SpecdecodeReplica with these deployment options (the deployment "specdecode"),
    behind the ingress (deployment "ingress", one replica, no CPU) that routes by `routing`: "affinity" (prefix
    affinity under a load bound) or "load"."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if routing not in ROUTING_POLICIES:
        raise OptionError("routing", f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
    batch = config["settings"].get("max_batch_size", 1)  # a replica under a batch of requests is not hot
    router = RequestRouterConfig(request_router_class="specdecode.server.ray_routing:PrefixAffinityRouter",
                                 request_router_kwargs={"policy": routing, "load_floor": batch})
    engine = serve.deployment(SpecdecodeReplica, name="specdecode").options(request_router_config=router, **options)
    ongoing = options.get("max_ongoing_requests", 128) * 8
    ingress = serve.deployment(SpecdecodeIngress, name="ingress", num_replicas=1, max_ongoing_requests=ongoing,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(config))


def app_builder(args: dict):
    """`serve run`/`serve deploy` entry point: args are `specdecode serve` option names (underscores), e.g.
    {"target": "...", "draft": "...", "k": "auto", "max_batch_size": 8, "threads": 1}, and "routing" ("affinity",
    the default, or "load"). Replica counts and autoscaling come from the config file's `deployments` section
    (deployment "specdecode"; "ingress" is the router's)."""
    from ..pairing.pair import ModelOptions
    from .settings import ServerSettings

    args = dict(args)
    model_fields = {f.name for f in dataclasses.fields(ModelOptions)}
    setting_fields = {f.name for f in dataclasses.fields(ServerSettings)}
    unknown = set(args) - model_fields - setting_fields - {"model_name", "routing"}
    if unknown:
        raise ValueError(f"unknown specdecode args: {', '.join(sorted(unknown))}; use `specdecode serve` option "
                         f"names with underscores")
    opts = ModelOptions(**{k: v for k, v in args.items() if k in model_fields})
    opts.num_speculative_tokens  # noqa: B018  (K parsed here, not first in each replica)
    settings = ServerSettings(**{k: v for k, v in args.items() if k in setting_fields})
    name = args.get("model_name") or opts.target
    return build_application(replica_config(opts, settings, name), routing=args.get("routing", "affinity"),
                             **deployment_options(settings=settings))


def serve_with_ray(config: dict, options: dict, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                   address: str | None = None, num_cpus: int | None = None, settings=None,
                   routing: str = "affinity") -> None:
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
    serve.run(build_application(config, routing=routing, **options), name="specdecode", route_prefix="/")
    scale = options.get("autoscaling_config", {})
    count = options.get("num_replicas") or f"{scale.get('min_replicas')}..{scale.get('max_replicas')}"
    log.info("serving with Ray Serve (%s replica(s), routed by %s) at http://%s:%d/v1", count, routing, host, port)
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

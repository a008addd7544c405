"""The app as a Ray Serve deployment on a local Ray instance (2 CPUs): two replicas of the tiny models answer 100
concurrent requests exactly; a replica killed mid-load costs only clean, retryable failures; bad input keeps its
OpenAI-shaped 4xx; the throughput of 2 replicas against 1 is measured (printed)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from specdecode.errors import OptionError  # noqa: E402
from specdecode.pairing.pair import ModelOptions  # noqa: E402
from specdecode.server import ServerSettings  # noqa: E402
from specdecode.server.ray_serve import build_application, deployment_options, http_options, replica_config  # noqa: E402
from test_server_helpers import one_torch_thread  # noqa: E402,F401  (an autouse fixture)
from test_server_helpers import error_shape, free_port, make_generator, wait_until  # noqa: E402

# The replicas' own timeout (504) and the proxy's (408) end well before the client's 60 s: no request can hang.
SETTINGS = ServerSettings(max_batch_size=8, max_queue=200, max_tokens_limit=64, request_timeout=30)
WORDS = ("def", "quicksort", "arr", "pivot", "import", "numpy", "for", "print", "class", "Model", "The", "quick")


@pytest.fixture(scope="module")
def ray_url(tiny_model_dirs):
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    options = http_options("127.0.0.1", port, SETTINGS)
    serve.start(http_options=options)
    from ray.serve.context import _get_global_client

    # the proxy runs with the backstop timeout (a request left on a dead replica gets a 408, never hangs)
    assert _get_global_client().get_serve_details()["http_options"]["request_timeout_s"] == 40
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(tiny_model_dirs, url: str, replicas: int) -> None:
    from ray import serve

    opts = ModelOptions(target=tiny_model_dirs["target"], draft=tiny_model_dirs["draft"], k=4,
                        draft_quantize="none", threads=1)
    options = deployment_options(replicas=replicas, settings=SETTINGS, cpus_per_replica=1)
    serve.run(build_application(replica_config(opts, SETTINGS, "tiny-target"), **options), name="specdecode",
              route_prefix="/")
    assert wait_until(lambda: _healthy(url), 60, 0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _specs(engine, n: int, max_tokens: int) -> list[tuple[dict, str]]:
    specs = []
    for i in range(n):
        prompt = " ".join(WORDS[(i * j) % len(WORDS)] for j in range(1, 2 + i % 9)) + f" {i}"
        body = {"prompt": prompt, "max_tokens": 1 + (i * 7) % max_tokens, "temperature": 0}
        specs.append((body, engine.generate(prompt, max_new_tokens=body["max_tokens"], temperature=0).texts[0]))
    return specs


async def _post_all(url: str, bodies: list[dict], retries: int = 0) -> list[tuple[list, httpx.Response | None]]:
    """Each body posted once, concurrently; a failure (5xx or a cut connection) retried up to `retries` times.
    Returns (the failures seen, the last response) per body."""
    limits = httpx.Limits(max_connections=len(bodies) + 5, max_keepalive_connections=len(bodies) + 5)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        async def one(body):
            failures = []
            for attempt in range(retries + 1):
                try:
                    r = await http.post("/v1/completions", json=body)
                except httpx.TransportError as exc:  # the replica died with the connection open
                    failures.append(type(exc).__name__)
                else:
                    if r.status_code < 500 and r.status_code != 408:  # 408: the proxy's timeout, retryable
                        return failures, r
                    failures.append(r.status_code)
                await asyncio.sleep(0.5 * (attempt + 1))
            return failures, None

        return await asyncio.gather(*(one(b) for b in bodies))


async def _busy_replica(replicas, at_least: int = 3, within: float = 20.0):
    """The first replica seen with requests in flight (Ray Serve's replica actor counts them): a kill after a fixed
    sleep once hit a replica that had none yet, and then no request needed a retry."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for replica in replicas:
            if await replica.get_num_ongoing_requests.remote() >= at_least:
                return replica
        await asyncio.sleep(0.02)
    raise AssertionError(f"no replica had {at_least} requests in flight within {within} s")


def test_two_replicas_serve_exactly_and_survive_a_killed_replica(ray_url, tiny_model_dirs, tiny_pair, tokenizer):
    import ray

    _deploy(tiny_model_dirs, ray_url, replicas=2)
    engine = make_generator(tiny_pair, tokenizer)

    # bad input: the same 4xx in OpenAI's shape as the plain server
    empty = httpx.post(f"{ray_url}/v1/completions", json={"prompt": ""}, timeout=30)
    assert empty.status_code == 400 and error_shape(empty)["param"] == "prompt"
    too_long = httpx.post(f"{ray_url}/v1/completions", json={"prompt": "a", "max_tokens": 10_000}, timeout=30)
    assert too_long.status_code == 400 and error_shape(too_long)["param"] == "max_tokens"
    missing = httpx.post(f"{ray_url}/v1/completions", json={"prompt": "a", "model": "gpt-4"}, timeout=30)
    assert missing.status_code == 404 and error_shape(missing)["code"] == "model_not_found"

    specs = _specs(engine, 100, 24)
    start = time.monotonic()
    results = asyncio.run(_post_all(ray_url, [b for b, _ in specs]))
    two_s = time.monotonic() - start
    for (body, expected), (failures, r) in zip(specs, results):
        assert not failures and r.status_code == 200, (body, failures)
        assert r.json()["choices"][0]["text"] == expected

    # kill one replica's actor mid-load: requests are answered, or fail cleanly and succeed on retry
    long_specs = _specs(engine, 60, 32)  # seconds of work per replica, not minutes on a slow 2-core CPU

    async def load_and_kill():
        task = asyncio.create_task(_post_all(ray_url, [b for b, _ in long_specs], retries=8))
        replicas = [ray.get_actor(a["name"], namespace=a["namespace"])
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::specdecode#specdecode#")]  # not the ingress
        assert len(replicas) == 2
        pids = [await replica.__ray_call__.remote(lambda self: os.getpid()) for replica in replicas]
        victim = await _busy_replica(replicas)
        # frozen first: the requests it holds cannot finish while the kill is on its way (under load one run's kill
        # landed after they had all been answered, and nothing was left to send again)
        os.kill(pids[replicas.index(victim)], signal.SIGSTOP)
        ray.kill(victim, no_restart=True)
        return await asyncio.wait_for(task, 110)

    results = asyncio.run(load_and_kill())
    failed_once = 0
    for (body, expected), (failures, r) in zip(long_specs, results):
        assert r is not None and r.status_code == 200, (body, failures)
        assert r.json()["choices"][0]["text"] == expected
        # A clean failure: a 5xx, a dropped connection, or (seen once on a slow Intel VM: Ray's proxy kept a
        # request of the killed replica open) the proxy's 408 at its timeout; never the client's own timeout (a
        # hang). Each is retried and then answered exactly.
        assert all(f in ("RemoteProtocolError", "ReadError", 408) or (isinstance(f, int) and f >= 500)
                   for f in failures), failures
        failed_once += bool(failures)
    # the kill did hit requests in flight: the ingress sent them again to the live replica, or (a loaded machine:
    # Ray's proxy kept a killed replica's request open until its own 40 s timeout, before the ingress heard of the
    # loss) the client got the proxy's 408 and sent it again itself
    rerouted = _metric_value(httpx.get(f"{ray_url}/metrics", timeout=30).text, "specdecode_rerouted_requests_total")
    assert rerouted > 0 or any(408 in failures for failures, _ in results), (rerouted, failed_once)
    assert _healthy(ray_url)
    print(f"\n2 replicas: 100 requests in {two_s:.1f} s; after the kill {failed_once}/{len(long_specs)} requests needed a retry, "
          f"{rerouted:g} were sent again by the ingress, failures seen: {sorted({str(f) for fs, _ in results for f in fs})}")


def _metric_value(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_throughput_one_replica_vs_two(ray_url, tiny_model_dirs, tiny_pair, tokenizer):
    engine = make_generator(tiny_pair, tokenizer)
    specs = _specs(engine, 100, 24)
    timings = {}
    for replicas in (1, 2):
        _deploy(tiny_model_dirs, ray_url, replicas=replicas)
        start = time.monotonic()
        results = asyncio.run(_post_all(ray_url, [b for b, _ in specs]))
        timings[replicas] = time.monotonic() - start
        tokens = 0
        for (body, expected), (failures, r) in zip(specs, results):
            assert not failures and r.json()["choices"][0]["text"] == expected
            tokens += r.json()["usage"]["completion_tokens"]
        print(f"\n{replicas} replica(s) x 1 thread: 100 requests in {timings[replicas]:.2f} s, "
              f"{tokens / timings[replicas]:.0f} output tok/s")


def test_cli_ray_options_are_checked_before_anything_loads():
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    runner = CliRunner()
    for args, message in ((["--replicas", "2"], "need --ray"), (["--ray", "--replicas", "2", "--autoscale", "1,2"],
                          "not both"), (["--ray", "--autoscale", "3,1"], "MIN <= MAX"),
                          (["--ray", "--autoscale", "x"], "two integers"), (["--routing", "load"], "need --ray"),
                          (["--ray", "--routing", "nearest"], "--routing takes affinity or load")):
        result = runner.invoke(app, ["serve", *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)


def test_deploy_configs_are_valid_serve_configs_for_the_app_builder():
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from specdecode.server.ray_serve import app_builder

    deploy = Path(__file__).resolve().parent.parent / "deploy"
    plain = yaml.safe_load((deploy / "ray-serve.yaml").read_text())
    kuberay = yaml.safe_load((deploy / "kuberay-rayservice.yaml").read_text())
    assert kuberay["kind"] == "RayService"
    for config in (plain, yaml.safe_load(kuberay["spec"]["serveConfigV2"])):
        schema = ServeDeploySchema.model_validate(config)
        app = schema.applications[0]
        assert app.import_path == "specdecode.server.ray_serve:app_builder"
        assert app_builder(app.args) is not None  # the args are specdecode serve options (nothing loads here)
    with pytest.raises(ValueError, match="unknown specdecode args: bogus"):
        app_builder({"target": "x", "bogus": 1})
    # the library's checks, before any replica starts: K by Speculation.parse, limits by ServerSettings
    with pytest.raises(OptionError, match="'auto' or an integer 0..32") as excinfo:
        app_builder({"target": "x", "k": 99})
    assert excinfo.value.option == "k"
    with pytest.raises(OptionError, match="max_batch_size must be an integer >= 1"):
        app_builder({"target": "x", "max_batch_size": 0})
    with pytest.raises(OptionError, match="autoscale MIN,MAX needs 0 <= MIN <= MAX"):
        deployment_options(autoscale=(3, 1))


def test_a_replica_names_the_draft_auto_resolved_to(tiny_model_dirs):
    """--draft auto resolves in each replica (after its target loads): /v1/models and every response's speculative
    block name the draft it chose, never "auto" (a tiny target: no draft model is known for it, so the suffix
    drafter). Built in this process, without Ray: the replica is the class Ray Serve instantiates."""
    from fastapi.testclient import TestClient

    from specdecode.server.ray_serve import SpecdecodeReplica

    opts = ModelOptions(target=tiny_model_dirs["target"], draft="auto", k="auto", draft_quantize="none", threads=1)
    settings = ServerSettings(max_batch_size=2, max_tokens_limit=16, draft_name="auto")
    replica = SpecdecodeReplica(replica_config(opts, settings, "tiny-target"))
    with TestClient(replica._app) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["draft"] == "suffix"
        body = http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}).json()
        assert body["speculative"]["draft_model"] == "suffix"

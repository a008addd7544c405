"""`specdecode bench serve` against a live server on 127.0.0.1: the report's numbers, the CLI's JSON and figure, and
continuous batching against the "wait for the batch" baseline under staggered Poisson arrivals."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from specdecode.bench.serve import ServeBenchSettings, bench_serve, percentiles, request_max_tokens
from specdecode.cli.bench_serve_cmd import bench_serve as bench_serve_command
from specdecode.server import ServerSettings, create_app
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer, make_generator

PROMPTS = ["def quicksort(arr):", "The quick brown fox", "import numpy as np\nfor i in range(10):",
           "Once upon a time there was a small model", "class Model:\n    pass\n"]


def _server(tiny_pair, tokenizer, **settings) -> LiveServer:
    """static_batching=True: new requests wait until the running batch is done (what continuous batching replaced)."""
    defaults = dict(max_batch_size=8, max_queue=200, max_tokens_limit=128, request_timeout=120)
    app = create_app(make_generator(tiny_pair, tokenizer), MODEL, tokenizer, ServerSettings(**{**defaults,
                                                                                                **settings}))
    return LiveServer(app).start()


def test_percentiles_and_settings():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (50.0, 90.0, 99.0, 50.5)
    with pytest.raises(ValueError, match="concurrency or a rate"):
        ServeBenchSettings(url="http://127.0.0.1:1", prompts=["a"], concurrency=2, rate=1.0)
    with pytest.raises(ValueError, match="no prompts"):
        ServeBenchSettings(url="http://127.0.0.1:1", prompts=[])


def test_report_of_a_fixed_concurrency_run(tiny_pair, tokenizer):
    with _server(tiny_pair, tokenizer) as srv:
        report = bench_serve(ServeBenchSettings(url=f"{srv.url}/v1", prompts=PROMPTS, num_requests=12,
                                                concurrency=4, max_tokens=12))
    assert report["requests"] == 12 and report["succeeded"] == 12 and report["errors"] == {}
    assert 0 < report["output_tokens"] <= 12 * 12
    assert report["request_throughput"] > 0 and report["output_tokens_per_s"] > 0
    for key in ("ttft_s", "latency_s"):
        assert 0 < report[key]["p50"] <= report[key]["p90"] <= report[key]["p99"]
    assert all(r["ttft_s"] <= r["latency_s"] for r in report["per_request"])


def test_mixed_lengths_are_seeded_per_request_and_sent(tiny_pair, tokenizer):
    mixed = dict(url="http://127.0.0.1:1", prompts=PROMPTS, max_tokens=24, min_max_tokens=4, seed=5)
    draws = [request_max_tokens(ServeBenchSettings(**mixed), i) for i in range(40)]
    assert draws == [request_max_tokens(ServeBenchSettings(**mixed), i) for i in range(40)]  # two servers, same load
    assert all(4 <= d <= 24 for d in draws) and len(set(draws)) > 5
    assert draws != [request_max_tokens(ServeBenchSettings(**{**mixed, "seed": 6}), i) for i in range(40)]
    assert {request_max_tokens(ServeBenchSettings(url="u", prompts=PROMPTS, max_tokens=9), i) for i in range(5)} == {9}
    with pytest.raises(ValueError, match="shortest max_tokens"):
        ServeBenchSettings(url="u", prompts=PROMPTS, max_tokens=8, min_max_tokens=9)
    with _server(tiny_pair, tokenizer) as srv:  # ignore_eos: every request runs to its own max_tokens
        report = bench_serve(ServeBenchSettings(**{**mixed, "url": srv.url, "num_requests": 8, "concurrency": 4,
                                                   "ignore_eos": True}))
    assert report["succeeded"] == 8 and report["config"]["min_max_tokens"] == 4
    assert sorted(r["output_tokens"] for r in report["per_request"]) == sorted(draws[:8])  # in the order they end


def test_errors_are_counted_not_raised(tiny_pair, tokenizer):
    with _server(tiny_pair, tokenizer, max_tokens_limit=8) as srv:  # max_tokens 12 > 8: every request is a 400
        report = bench_serve(ServeBenchSettings(url=srv.url, prompts=PROMPTS, num_requests=3, concurrency=3,
                                                max_tokens=12))
    assert report["succeeded"] == 0 and report["errors"] == {"400": 3}


def test_cli_writes_json_and_a_figure(tiny_pair, tokenizer, tmp_path):
    cli = typer.Typer()
    cli.command()(bench_serve_command)
    with _server(tiny_pair, tokenizer) as srv:
        result = CliRunner().invoke(cli, ["--url", srv.url, "--prompts", "code", "-n", "4", "--rate", "20",
                                          "--max-tokens", "6", "--json", str(tmp_path / "r.json"),
                                          "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    assert "4/4 requests succeeded" in result.output and "time to first token" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["rate"] == 20 and report["config"]["prompts"] == "code"
    assert (tmp_path / "r.png").stat().st_size > 1000
    both = CliRunner().invoke(cli, ["--url", "http://127.0.0.1:9", "-c", "2", "--rate", "1"])
    assert both.exit_code != 0 and "not both" in both.output


def test_continuous_batching_cuts_tail_ttft_without_losing_throughput(tiny_pair, tokenizer):
    """Poisson arrivals: requests that join the running batch get their first token after one prefill; waiting for
    the batch to drain (the static batching it replaces, --static-batching) makes them queue behind whole
    generations (the issue's case: long requests that hold the engine; 128 tokens here, so that a generation lasts
    long beside a prefill even on a fast CPU)."""
    load = dict(prompts=PROMPTS, num_requests=24, max_tokens=128, seed=3)
    reports = {}
    for name, join in (("continuous", True), ("wait-for-batch", False)):
        with _server(tiny_pair, tokenizer, static_batching=not join, max_tokens_limit=128) as srv:
            assert srv.app.state.batcher.join_running is join
            if "rate" not in load:
                # Arrivals paced to this machine: one every 1.25 lone generations (a load of ~0.8), so that with
                # static batching most requests arrive while a batch is running, however fast the CPU is.
                alone = bench_serve(ServeBenchSettings(url=srv.url, **{**load, "num_requests": 3}, concurrency=1))
                load["rate"] = 0.8 / alone["latency_s"]["p50"]
            reports[name] = bench_serve(ServeBenchSettings(url=srv.url, **load))
    cont, base = reports["continuous"], reports["wait-for-batch"]
    assert cont["succeeded"] == base["succeeded"] == load["num_requests"]
    print(f"\ncontinuous: p99 TTFT {cont['ttft_s']['p99']:.3f} s, p50 {cont['ttft_s']['p50']:.3f} s, "
          f"{cont['output_tokens_per_s']:.0f} tok/s, p99 latency {cont['latency_s']['p99']:.2f} s\n"
          f"wait-for-batch: p99 TTFT {base['ttft_s']['p99']:.3f} s, p50 {base['ttft_s']['p50']:.3f} s, "
          f"{base['output_tokens_per_s']:.0f} tok/s, p99 latency {base['latency_s']['p99']:.2f} s")
    # The bar: p99 TTFT at least 5x lower (measured: 0.078 s vs 1.22 s, 16x, with another test suite on the
    # same 2 cores), tokens/s no lower. The load stays below capacity, where throughput is the arrivals'.
    assert 5 * cont["ttft_s"]["p99"] <= base["ttft_s"]["p99"]
    # same arrivals, same work: the arrivals pace the run either way (the bound leaves room for timing noise)
    assert cont["output_tokens_per_s"] > 0.85 * base["output_tokens_per_s"]

"""`specdecode bench serve`: load a running OpenAI-compatible server and report its latencies and throughput.

The command function is registered by the bench command group (`bench_app.command("serve")(bench_serve)`).
Measurements are in specdecode.bench.serve; this module only reads options and prints.
"""

from __future__ import annotations

from typing import Optional

import typer

from .common import CLIError, out, user_errors


def bench_serve(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server's base URL (ours or any "
                            "OpenAI-compatible one); requests go to URL/v1/completions and nowhere else."),
    prompts: str = typer.Option("code", "--prompts", help="Prompt set: code, prose, edit (built in), or a file."),
    num_requests: int = typer.Option(100, "--num-requests", "-n", help="Requests to send in all."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", "-c", help="Fixed concurrency: this many "
                                              "clients, each sending its next request when the last one ends. "
                                              "Default 8 unless --rate is given."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Poisson arrivals at this many requests per second "
                                         "(instead of --concurrency)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="max_tokens of each request."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature of each request."),
    model: Optional[str] = typer.Option(None, "--model", help="The model id to send (default: none, the server's "
                                        "own)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDECODE_API_KEY",
                                          help="Sent as 'Authorization: Bearer KEY'."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds a request may take before it counts as failed."),
    duration: Optional[float] = typer.Option(None, "--duration", help="Send no new request after this many seconds."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Poisson arrival times."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report (JSON) to this file."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a figure (PNG) of the latencies to this file."),
) -> None:
    """Load a running server with streamed completions: request throughput, output tokens/s, TTFT, inter-token
    latency and end-to-end latency (p50/p90/p99), errors."""
    with user_errors():
        from ..bench.prompts import load_prompts
        from ..bench.serve import ServeBenchSettings, bench_serve as run, plot_serve, write_report

        if concurrency is not None and rate is not None:
            raise CLIError("give --concurrency or --rate, not both")
        if concurrency is None and rate is None:
            concurrency = 8
        texts = [p.text for p in load_prompts(prompts)]
        settings = ServeBenchSettings(url=url, prompts=texts, num_requests=num_requests, concurrency=concurrency,
                                      rate=rate, max_tokens=max_tokens, temperature=temperature, model=model,
                                      api_key=api_key, timeout_s=timeout, duration_s=duration, seed=seed)
        report = run(settings)
        report["config"]["prompts"] = prompts
        _print(report)
        if json_path:
            write_report(report, json_path)
            out.print(f"report: {json_path}")
        if plot:
            plot_serve(report, plot)
            out.print(f"figure: {plot}")
        if report["succeeded"] == 0:
            raise CLIError(f"no request succeeded against {url}: {report['errors']}")


def _print(report: dict) -> None:
    from rich.table import Table

    out.print(f"{report['succeeded']}/{report['requests']} requests succeeded in {report['duration_s']:.1f} s: "
              f"{report['request_throughput']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tokens/s")
    if report["errors"]:
        out.print("errors: " + ", ".join(f"{k} x{v}" for k, v in report["errors"].items()))
    table = Table("latency (ms)", "p50", "p90", "p99", "mean")
    for name, key in (("time to first token", "ttft_s"), ("inter-token", "itl_s"), ("end-to-end", "latency_s")):
        row = report[key]
        table.add_row(name, *("–" if row[c] is None else f"{1000 * row[c]:.1f}" for c in ("p50", "p90", "p99", "mean")))
    out.print(table)

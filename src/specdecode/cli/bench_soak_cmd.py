"""`specdecode bench soak`: a bounded, mixed, faulty load against a running server; the report says what broke.

The command function is registered by the bench command group (`bench_app.command("soak")(bench_soak)`); the load
and its verdict are in specdecode.bench.soak, this module only reads options and prints.
"""

from __future__ import annotations

from typing import Optional

import typer

from .common import CLIError, out, user_errors


def bench_soak(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server's base URL; requests go to "
                            "URL/v1/... and URL/metrics, nowhere else."),
    duration: float = typer.Option(60.0, "--duration", help="Seconds of load (then the replays: greedy and seeded "
                                   "requests sent again alone)."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", help="Clients sending at once."),
    max_tokens: int = typer.Option(16, "--max-tokens", help="The longest max_tokens of a request."),
    classes: Optional[str] = typer.Option(None, "--classes", help="Comma-separated request classes (default "
                                          "all): completion, chat_stream, json_schema, tools, logprobs, n_choices, "
                                          "seeded, drop_stream, cancel, malformed, too_long, unknown_model, "
                                          "client_timeout."),
    replays: int = typer.Option(8, "--replays", help="Greedy and seeded requests sent again alone afterwards."),
    scrape_every: float = typer.Option(2.0, "--scrape-every", help="Seconds between reads of /metrics."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds a request may take."),
    seed: int = typer.Option(0, "--seed", help="Seed of the requests' mix and prompts."),
    model: Optional[str] = typer.Option(None, "--model", help="The model id to ask for (default: the server's "
                                        "first)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDECODE_API_KEY", help="Bearer key."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write the memory-over-time plot here (PNG)."),
    check: bool = typer.Option(False, "--check", help="Exit non-zero unless the soak passed (no 5xx, every bad "
                               "request a 4xx with a message, replays equal, memory flat, caches in bounds)."),
) -> None:
    """Soak a running server with a mixed, faulty load for a bounded time, and report what it survived."""
    with user_errors():
        from ..bench.serve import write_report
        from ..bench.soak import CLASSES, SoakSettings, bench_soak as run, plot_memory

        chosen = tuple(c.strip() for c in classes.split(",") if c.strip()) if classes else CLASSES
        settings = SoakSettings(url=url, duration_s=duration, concurrency=concurrency, max_tokens=max_tokens,
                                classes=chosen, replays=replays, scrape_every_s=scrape_every, timeout_s=timeout,
                                seed=seed, model=model, api_key=api_key)
        report = run(settings)
        _print(report)
        if json_path:
            write_report(report, json_path)
            out.print(f"report: {json_path}")
        if plot:
            plot_memory(report, plot)
            out.print(f"plot: {plot}")
        if check and not report["ok"]:
            raise CLIError("the soak failed: see the violations above")


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _print(report: dict) -> None:
    out.print(f"{report['requests']} requests in {report['wall_s']:.0f} s against {report['model']}: "
              f"{report['server_errors']} 5xx, {report['violations']} violations")
    out.print(f"{'class':<15}{'sent':>6}  {'p50 ms':>8}{'p99 ms':>8}  status codes")
    for name, row in report["classes"].items():
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(row["status"].items()))
        notes = "".join(f"  ({k}: {v})" for k, v in row["notes"].items())
        out.print(f"{name:<15}{row['sent']:>6}  {_ms(row['p50_s']):>8}{_ms(row['p99_s']):>8}  {codes}{notes}")
        for example in row["examples"]:
            out.print(f"    violation {example}")
    memory, replays = report["memory"], report["replays"]
    if "rss_warm_mib" in memory:
        out.print(f"RSS: {memory['rss_warm_mib']:.0f} MiB after warm-up, peak {memory['rss_peak_after_warmup_mib']:.0f}"
                  f" MiB after ({memory['rss_growth']:+.1%}); prefix cache at most {memory['cache_tokens_max']:.0f} "
                  f"of {memory['cache_max_tokens']:.0f} tokens; suffix history at most "
                  f"{memory['history_tokens_max']:.0f} of {memory['history_max_tokens']:.0f}")
    if "malloc_warm_mib" in memory:
        out.print(f"malloc in use: {memory['malloc_warm_mib']:.0f} MiB after warm-up, {memory['malloc_last_mib']:.0f} "
                  f"MiB at the end")
    ties = f" ({replays['near_ties']} of the others parted at a near-tie)" if replays.get("near_ties") else ""
    out.print(f"left in the server after the load: {'nothing' if memory['drained'] else 'requests (see memory)'}; "
              f"replayed alone: {replays['equal']}/{replays['checked']} equal{ties}; verdict: "
              f"{'ok' if report['ok'] else 'FAILED'}")

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
    serve: Optional[str] = typer.Option(None, "--serve", help="Start a server for the soak instead: `specdecode "
                                        "serve` with these arguments (one quoted string, e.g. \"--target DIR "
                                        "--threads 1\"), on 127.0.0.1 and a free port (--url is not used), with the "
                                        "cache bounds below; stopped after the report."),
    prefix_cache_tokens: Optional[int] = typer.Option(None, "--prefix-cache-tokens", help="With --serve: the "
                                                      "prefix cache's bound in tokens."),
    suffix_history_tokens: Optional[int] = typer.Option(None, "--suffix-history-tokens", help="With --serve: the "
                                                        "suffix draft history's bound in tokens."),
    grammar_cache: Optional[int] = typer.Option(None, "--grammar-cache", help="With --serve: compiled grammars "
                                                "kept (the json_schema requests cycle through --schemas of them)."),
    kernel_cache: Optional[int] = typer.Option(None, "--kernel-cache", help="With --serve: oneDNN kernels kept "
                                               "(transformers backend on a CPU; one per weight shape and forward "
                                               "width; ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY)."),
    schemas: Optional[int] = typer.Option(None, "--schemas", help="Distinct JSON schemas the json_schema requests "
                                          "cycle through (default 16, or twice --grammar-cache if more)."),
    prime_tokens: int = typer.Option(1024, "--prime-tokens", help="A prompt this long (at most the context) is "
                                     "sent first, so the buffers of the largest forwards are paged in before the "
                                     "warm-up's measurements (0: none)."),
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
        from ..bench.soak_server import CacheBounds, SoakServer

        bounds = CacheBounds(prefix_cache_tokens, suffix_history_tokens, grammar_cache, kernel_cache)
        if bounds.given and not serve:
            raise CLIError("--prefix-cache-tokens, --suffix-history-tokens, --grammar-cache and --kernel-cache set "
                           "the bounds of a server the soak starts: give --serve (a running server's are its own)")
        chosen = tuple(c.strip() for c in classes.split(",") if c.strip()) if classes else CLASSES
        settings = SoakSettings(url=url, duration_s=duration, concurrency=concurrency, max_tokens=max_tokens,
                                classes=chosen, replays=replays, scrape_every_s=scrape_every, timeout_s=timeout,
                                seed=seed, model=model, api_key=api_key,
                                schemas=schemas or max(16, 2 * (grammar_cache or 0)), prime_tokens=prime_tokens)
        if serve:
            server = SoakServer(serve, bounds)
            out.print(f"starting: {' '.join(server.command)}")
            with server:
                settings.url = server.url
                report = run(settings)
            report["serve"] = {"command": server.command[1:], "env": server.env}
        else:
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
    _print_caches(memory)
    ties = f" ({replays['near_ties']} of the others parted at a near-tie)" if replays.get("near_ties") else ""
    out.print(f"left in the server after the load: {'nothing' if memory['drained'] else 'requests (see memory)'}; "
              f"replayed alone: {replays['equal']}/{replays['checked']} equal{ties}; verdict: "
              f"{'ok' if report['ok'] else 'FAILED'}")


def _print_caches(memory: dict) -> None:
    """What each cache held once the load was over, whether it was at its bound when the warm-up ended, and what the
    server kept per request between those two idle points."""
    end, full = memory.get("caches_at_end"), memory.get("filled_in_warmup", {})
    if "rss_second_half_growth" in memory:
        malloc = memory.get("malloc_second_half_growth")
        out.print(f"second half, idle to idle ({memory['second_half_requests']} requests): RSS "
                  f"{memory['rss_second_half_growth']:+.2%}" + (f", malloc in use {malloc:+.2%}" if malloc is not None
                                                                else ""))
    if "rss_second_half_peak_growth" in memory:
        out.print(f"  RSS peak under load (requests in flight): {memory['rss_second_half_peak_mib']:.0f} MiB in the "
                  f"second half, {memory['rss_first_half_peak_mib']:.0f} in the first "
                  f"({memory['rss_second_half_peak_growth']:+.1%})")
    if "rss_kib_per_request" in memory:
        malloc = memory.get("malloc_kib_per_request")
        out.print(f"kept per request after warm-up (idle to idle, {memory['measured_requests']} requests): RSS "
                  f"{memory['rss_kib_per_request']:+.2f} KiB" + (f", malloc in use {malloc:+.2f} KiB"
                                                                 if malloc is not None else ""))
    if not end:
        return

    def state(name: str) -> str:
        return "" if name not in full else "  (at its bound by the end of warm-up)" if full[name] else \
            "  (NOT at its bound by the end of warm-up: growth after it may be this cache filling)"

    cache, history = end["prefix_cache"], end["suffix_history"]
    grammars, texts = end["grammar_cache"], end["token_texts"]
    out.print(f"caches at the end: prefix cache {cache['entries']:.0f} entries, {cache['tokens']:.0f} of "
              f"{cache['max_tokens']:.0f} tokens, {cache['mib']:.1f} MiB, {cache['evictions']:.0f} evictions"
              f"{state('prefix_cache')}")
    out.print(f"  suffix history {history['tokens']:.0f} of {history['max_tokens']:.0f} tokens, {history['mib']:.1f} "
              f"MiB{state('suffix_history')}")
    out.print(f"  grammars {grammars['entries']:.0f} of {grammars['max_entries']:.0f}{state('grammar_cache')}; token "
              f"texts {texts['entries']:.0f} of {texts['max_entries']:.0f} (the vocabulary)")
    out.print(f"  RSS {end['rss_mib']:.0f} MiB, malloc in use {end['malloc_in_use_mib']:.0f} MiB, free in its heaps "
              f"{end['malloc_free_mib']:.0f} MiB")

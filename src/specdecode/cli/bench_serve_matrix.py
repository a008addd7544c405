"""`specdecode bench serve --workload matrix`: starts llama-server plain and in each speculative mode asked for, runs
the matrix (bench/peer_matrix.py) on them and on our server at --url, and prints, writes and plots the report."""

from __future__ import annotations

import contextlib
import platform
from typing import Optional

from .bench_serve_agent import PeerOptions
from .common import CLIError, out


def mode_args(mode: str, draft_gguf: Optional[str]) -> tuple[str, ...]:
    """llama-server's arguments for one mode ("plain" or a --spec-type), each at llama-server's own defaults."""
    if mode == "plain":
        return ()
    if mode.startswith("draft-"):
        if draft_gguf is None:
            raise CLIError(f"--spec-types {mode} needs the draft model: give --draft-gguf (e.g. "
                           f"qwen2.5-coder-0.5b-instruct)")
        return ("--spec-type", mode, "-md", draft_gguf)
    return ("--spec-type", mode)


def cpu_name() -> str:
    """The CPU as lscpu names it (the matrix's figures are this machine's), with the cores this process may use."""
    import os

    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            name = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            have = next(line for line in info if line.startswith("flags")).split()
        flags = " (AVX-512)" if "avx512f" in have else " (AVX2)" if "avx2" in have else ""
    except (OSError, StopIteration):
        pass
    return f"{len(os.sched_getaffinity(0))}-vCPU {name}{flags}"


def run_matrix_cmd(common: dict, peers: PeerOptions, spec_types: str, draft_gguf: Optional[str],
                   only: Optional[str], json_path: Optional[str], plot: Optional[str]) -> None:
    from ..bench.llama_server import LlamaServer
    from ..bench.llamacpp_peers import default_threads, gguf_file
    from ..bench.peer_matrix import MatrixSettings, median_ratio, plot_matrix, run_matrix
    from ..bench.serve import write_report

    gguf, binary = peers.gguf_path(), peers.binary()
    if gguf is None:
        raise CLIError("--workload matrix runs llama-server on the same GGUF: give --peer-gguf")
    draft = None
    if draft_gguf is not None:
        path = gguf_file(draft_gguf)
        if path is None:
            raise CLIError(f"--draft-gguf {draft_gguf!r}: not a .gguf file nor an installed built-in GGUF model")
        draft = str(path)
    modes = ["plain"] + [m.strip() for m in spec_types.split(",") if m.strip()]
    args = {mode: mode_args(mode, draft) for mode in modes}  # every mode checked before any server starts
    settings = MatrixSettings(**common, only=[w.strip() for w in only.split(",")] if only else ())
    threads, context = peers.threads or default_threads(), peers.context or 4096
    with contextlib.ExitStack() as stack:
        servers = {"ours": common["url"]}
        for mode in modes:
            out.print(f"starting llama-server {mode} ...")
            server = stack.enter_context(LlamaServer(binary, gguf, threads, context, extra_args=args[mode]))
            servers["llama-server" if mode == "plain" else f"llama-server {mode}"] = server.url
        report = run_matrix(settings, servers)
    hardware = cpu_name()
    report["config"].update(hardware=hardware, threads=threads, peer_gguf=gguf, draft_gguf=draft,
                            modes={m: list(a) for m, a in args.items()})
    _print_matrix(report)
    if json_path:
        write_report(report, json_path)
        out.print(f"report: {json_path}")
    if plot:
        plot_matrix(report, plot, hardware)
        out.print(f"figure: {plot}")
    if not any(c["ok"] for row in report["cells"].values() for c in row.values()):
        raise CLIError("no workload succeeded on any server")
    best = median_ratio(report["summary"], "vs_best")
    if best is not None:
        out.print(f"median over workloads, ours / the best llama-server mode: {best:.2f}x")


def _print_matrix(report: dict) -> None:
    from rich.table import Table

    out.print(f"{report['config']['hardware']}, {report['config']['threads']} threads, greedy, max_tokens "
              f"{report['config']['max_tokens']}")
    table = Table("workload", "ours tok/s", "llama-server plain", "best llama-server mode", "ours / plain",
                  "ours / best", "answer time: fastest peer / ours", "same text as plain",
                  title="decode rate after the first token (tokens/s)")
    for row in report["summary"]:
        best = "–" if row["best_mode"] is None else f"{row['best_mode_tok_s']:.1f} ({row['best_mode'][13:]})"
        table.add_row(row["workload"], _num(row["ours"]), _num(row["plain"]), best, _times(row["vs_plain"]),
                      _times(row["vs_best"]), _times(row.get("time_vs_fastest")),
                      "–" if row["same_text_as_plain"] is None else "yes" if row["same_text_as_plain"] else "no")
    out.print(table)
    for workload, cells in report["cells"].items():
        for server, cell in cells.items():
            for error in cell["errors"]:
                out.print(f"[yellow]{workload}, {server}: {error}[/yellow]", markup=True)


def _num(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def _times(value) -> str:
    return "–" if value is None else f"{value:.2f}x"

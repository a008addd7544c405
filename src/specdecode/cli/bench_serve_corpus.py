"""`specdecode bench serve --workload corpus`: starts our server (--serve ARGS) and llama-server plain and in each
--spec-types mode, one at a time and afresh each round, runs the corpus (bench/corpus_run.py) on each, and prints and
writes the report."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

from .bench_serve_agent import PeerOptions
from .common import CLIError, out

DEFAULT_SPEC_TYPES = ("ngram-mod", "ngram-map-k", "ngram-simple", "ngram-cache")  # draft-simple: with --draft-gguf


@dataclass(frozen=True)
class CorpusOptions:
    serve: Optional[str]  # `specdecode serve` arguments: ours started afresh each round
    rounds: Optional[int]
    modules: Optional[int]
    edit_kinds: Optional[str]
    chat_kinds: Optional[str]
    think_s: Optional[float]


@dataclass(frozen=True)
class _Running:
    """A server this command did not start (--url): the same one every round."""

    url: str


def _split(value: Optional[str]) -> Optional[tuple[str, ...]]:
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(",") if item.strip())


def run_corpus_cmd(common: dict, peers: PeerOptions, spec_types: Optional[str], draft_gguf: Optional[str],
                   options: CorpusOptions, json_path: Optional[str]) -> None:
    from ..bench.corpus_run import OURS, CorpusSettings, overall, run_corpus
    from ..bench.llama_server import LlamaServer
    from ..bench.llamacpp_peers import default_threads, gguf_file
    from ..bench.serve import write_report
    from ..bench.soak_server import SoakServer
    from .bench_serve_matrix import cpu_name, mode_args
    from rich.markup import escape

    sizes = {"rounds": options.rounds, "modules": options.modules, "edit_kinds": _split(options.edit_kinds),
             "chat_kinds": _split(options.chat_kinds), "think_s": options.think_s}
    try:
        settings = CorpusSettings(**common, **{k: v for k, v in sizes.items() if v is not None})
    except ValueError as e:
        raise CLIError(str(e)) from None
    servers: dict = {}
    if options.serve is not None:
        try:
            SoakServer(options.serve)  # its arguments checked before anything starts
        except ValueError as e:
            raise CLIError(str(e).replace("--serve starts", "--serve: the bench starts")) from None
        servers[OURS] = functools.partial(SoakServer, options.serve)
    else:
        out.print(f"[yellow]ours: the running server at {escape(common['url'])}, not restarted between rounds "
                  f"(its suffix history and caches carry over): give --serve ARGS to start it afresh each "
                  f"round[/yellow]",
                  markup=True)
        servers[OURS] = lambda: contextlib.nullcontext(_Running(common["url"]))
    gguf = peers.gguf_path()
    modes, args, threads, context, draft = [], {}, None, None, None
    if gguf is None:
        if spec_types is not None or draft_gguf is not None:
            raise CLIError("--spec-types and --draft-gguf start llama-server on the same GGUF: give --peer-gguf")
    else:
        binary = peers.binary()
        if draft_gguf is not None:
            path = gguf_file(draft_gguf)
            if path is None:
                raise CLIError(f"--draft-gguf {draft_gguf!r}: not a .gguf file nor an installed built-in GGUF model")
            draft = str(path)
        default = DEFAULT_SPEC_TYPES + (("draft-simple",) if draft else ())
        modes = ["plain", *(_split(spec_types) if spec_types is not None else default)]
        args = {mode: mode_args(mode, draft) for mode in modes}  # every mode checked before any server starts
        threads, context = peers.threads or default_threads(), peers.context or 8192
        for mode in modes:
            servers["llama-server" if mode == "plain" else f"llama-server {mode}"] = functools.partial(
                LlamaServer, binary, gguf, threads, context, extra_args=args[mode])
    about = dict(hardware=cpu_name(), threads=threads, peer_gguf=gguf, draft_gguf=draft, peer_context=context,
                 modes={m: list(a) for m, a in args.items()}, serve=options.serve,
                 ours_fresh_each_round=options.serve is not None,
                 url=None if options.serve is not None else common["url"])

    def finish(report: dict) -> dict:
        report["config"].update(about)
        report["overall"] = overall(report["summary"])
        return report

    try:
        report = finish(run_corpus(settings, servers, log=lambda line: out.print(line, markup=False),
                                   progress=(lambda partial: write_report(finish(partial), json_path))
                                   if json_path else None))
    except ValueError as e:  # too few modules admit the edits asked for
        raise CLIError(str(e)) from None
    print_corpus(report)
    if json_path:
        write_report(report, json_path)
        out.print(f"report: {json_path}")
    if not any(row["ok"] for row in report["requests"]):
        raise CLIError("no request succeeded on any server")


def _short(server: str) -> str:
    return "plain" if server == "llama-server" else server.removeprefix("llama-server ")


def print_corpus(report: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    config = report["config"]
    out.print(f"{config.get('hardware', '')}, {config.get('threads') or '–'} threads (llama-server), greedy, "
              f"max_tokens {config['max_tokens']}, {config['rounds']} rounds, servers one at a time, fresh each "
              f"round{'' if config.get('ours_fresh_each_round', True) else ' (ours: not restarted)'}", markup=False)
    if report["modules"]:
        out.print("modules: " + ", ".join(f"{m['name']} ({m['kind']}, {m['lines']} lines)" for m in report["modules"]),
                  markup=False)
    servers = config["servers"]
    peers = [s for s in servers if s != "ours"]
    table = Table(title="seconds a request to its last token (TTFT), medians over rounds; ours / best: the best "
                  "peer's seconds over ours (above 1: ours faster), min / median / max over rounds")
    for column in ("kind", "n", *(_short(s) for s in servers), *(("best peer", "ours / best") if peers else ()),
                   *(("edit as asked: ours · best",) if report["modules"] else ())):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for row in report["summary"]:
        cells = [row["kind"], str(row["requests"])]
        for server in servers:
            f = row["servers"][server]
            cells.append("–" if f["seconds"] is None else f"{f['seconds']:.2f} ({f['ttft_s']:.2f})"
                         + (f" ✗{f['failed_rounds']}" if f["failed_rounds"] else ""))
        if peers:
            spread = row["vs_best"]
            cells += [_short(row["best_peer"]) if row["best_peer"] else "–", "–" if spread is None else
                      f"{spread['min']:.2f} / {spread['median']:.2f} / {spread['max']:.2f}x"]
        if report["modules"]:
            asked = row.get("as_asked")
            shown = [s for s in ("ours", row["best_peer"]) if s and asked and s in asked]
            cells.append(" · ".join(f"{asked[s][0]}/{asked[s][1]}" for s in shown))
        table.add_row(*cells)
    out.print(table)
    if peers and report.get("overall"):
        parts = [f"{name} {value:.2f}x" for name, value in report["overall"].items() if value is not None]
        if parts:
            out.print("median of the kinds' median ratios to the best peer: " + ", ".join(parts), markup=False)
    cut = {row["kind"]: row["hit_max_tokens"] for row in report["summary"] if row.get("hit_max_tokens")}
    if cut:
        out.print(f"[yellow]answers stopped at max_tokens {config['max_tokens']}, not at their end (their times "
                  f"are of a part of the answer): {escape(str(cut))}[/yellow]", markup=True)
    for row in report["requests"]:
        if not row["ok"]:
            out.print(f"[yellow]round {row['round']}, {row['server']}, {row['kind']}, {row['task']}: "
                      f"{escape(str(row['error']))}[/yellow]", markup=True)
    for s in report["sessions"]:
        if s["warm_up_error"]:
            out.print(f"[yellow]round {s['round']}, {s['server']}: warm-up failed: "
                      f"{escape(s['warm_up_error'])}[/yellow]", markup=True)

"""`specdecode bench serve`: load a running OpenAI-compatible server and report its latencies and throughput.

The command function is registered by the bench command group (`bench_app.command("serve")(bench_serve)`).
Measurements are in specdecode.bench.serve (completions), specdecode.bench.serve_chat (the chat
workloads) and specdecode.bench.serve_edit (iterative editing); this module only reads options and prints.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from .bench_serve_agent import PeerOptions, chat_with_llama_server, run_agent
from .common import CLIError, out, user_errors

WORKLOADS = ("completions", "multi-turn", "shared-system", "edit", "agent", "matrix", "corpus")


def bench_serve(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server's base URL (ours or any "
                            "OpenAI-compatible one); requests go to URL/v1/completions (or /v1/chat/completions for "
                            "the chat and edit workloads) and nowhere else."),
    workload: str = typer.Option("completions", "--workload", help="completions: streamed completions of the "
                                 "prompt set; multi-turn: chats that re-send their history each turn (TTFT and "
                                 "prefix-cache hit rate per turn); shared-system: chats sharing one long system "
                                 "prompt (TTFT of the first request against the later ones); edit: two-turn "
                                 "code edits, each turn sent with the server's speculation and then as plain "
                                 "decoding (num_speculative_tokens 0), in that order: the decode rates, their "
                                 "ratio, and whether the texts match (start the server afresh for each run: a "
                                 "suffix draft remembers earlier answers); agent: tool-using coding sessions "
                                 "through the OpenAI client (list, read and rewrite files; tool_choice auto unless "
                                 "--steer), on each --server, llama-server (--llama-server) and llama-cpp-python's "
                                 "function calling (--peer-gguf); each task's edit checked after the session; "
                                 "matrix: novel code, two whole-file edits, a chat quoting its answer, a JSON schema "
                                 "and an agent's tool loop on our server and on llama-server (--llama-server, "
                                 "--peer-gguf) plain and in each --spec-types mode, started here: decode rates, "
                                 "the best peer mode per workload, our ratios; corpus: whole-file edits of real "
                                 "modules read from the installed standard library and site-packages, and chat "
                                 "questions of six kinds, back to back and with a think-time, on our server "
                                 "(--serve) and llama-server plain and in each --spec-types mode, one at a time, "
                                 "fresh each round: seconds to the last token and TTFT per request, our ratio to "
                                 "the best peer per kind (min/median/max over --rounds)."),
    server: Optional[List[str]] = typer.Option(None, "--server", help="agent: one of our servers as NAME=URL "
                                               "(repeatable; default: ours=--url). A server named plain (start it "
                                               "with --draft none) is the reference of the same-text check."),
    peer_gguf: Optional[str] = typer.Option(None, "--peer-gguf", help="agent, multi-turn, shared-system: the "
                                            "peers' GGUF (a path or a built-in model name, e.g. "
                                            "qwen2.5-coder-1.5b-instruct); agent: llama-cpp-python's own function "
                                            "calling runs on it, in process, unless --no-function-calling."),
    llama_server: Optional[str] = typer.Option(None, "--llama-server", help="agent, multi-turn, shared-system: "
                                               "also run llama.cpp's own server (this llama-server binary; build "
                                               "it with scripts/build_llama_server.sh) on --peer-gguf, started on "
                                               "127.0.0.1 with --jinja, the same threads and context, its prompt "
                                               "cache on."),
    function_calling: bool = typer.Option(True, "--function-calling/--no-function-calling", help="agent: with "
                                          "--peer-gguf, run llama-cpp-python's function calling."),
    plain: bool = typer.Option(False, "--plain/--no-plain", help="agent: also run plain sessions on the first "
                               "server (num_speculative_tokens 0; they share its prefix cache, so prefer a server "
                               "of its own started with --draft none and named plain)."),
    steer: bool = typer.Option(False, "--steer/--no-steer", help="agent: name the tool of the first three turns "
                               "(list, read, write) instead of tool_choice auto."),
    client_parses_calls: bool = typer.Option(True, "--client-parses-calls/--no-client-parses-calls", help="agent: "
                                             "where a peer's answer has no tool_calls but its content is a call in "
                                             "a form our server reads (a <tool_call> block, or a ```json block or "
                                             "bare JSON naming a declared tool), the client reads it with our "
                                             "server's parser and goes on with it, counted apart from the server's "
                                             "calls (our servers' answers are never re-read; default on)."),
    tool_latency: Optional[float] = typer.Option(None, "--tool-latency", help="agent: seconds the client waits "
                                                 "after running a turn's tools, as a real agent's tools take time "
                                                 "(default 0)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="agent, multi-turn, shared-system: the peers' "
                                          "threads (default: as ours)."),
    peer_context: Optional[int] = typer.Option(None, "--peer-context", help="agent, multi-turn, shared-system: "
                                               "the peers' context per sequence (default 8192)."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Prompt set: code, prose, edit (built in), or a "
                                          "file. Default: code; the chat workloads' user messages default to "
                                          "built-in code-review questions; edit: the edit set; agent: a JSON-lines "
                                          "file of tasks {id, instruction, files, check} (default: the 8 built-in "
                                          "ones)."),
    num_requests: Optional[int] = typer.Option(None, "--num-requests", "-n", help="Requests to send in all "
                                               "(default 100; shared-system: 16, the first one alone)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", "-c", help="Fixed concurrency: this many "
                                              "clients, each sending its next request when the last one ends. "
                                              "Default 8 unless --rate is given (shared-system: 4)."),
    conversations: Optional[int] = typer.Option(None, "--conversations", help="multi-turn: chats running at "
                                                "once (default 4)."),
    turns: Optional[int] = typer.Option(None, "--turns", help="multi-turn: turns of each chat (default 5); "
                                        "agent: most turns of a session (default 5)."),
    nb_prompts: Optional[int] = typer.Option(None, "--nb-prompts", help="edit, agent: only the first N prompts "
                                             "(tasks)."),
    follow_up: Optional[str] = typer.Option(None, "--follow-up", help="edit: turn 2's user message (default: add "
                                            "a one-line docstring to every function and output the whole code "
                                            "again)."),
    k: Optional[str] = typer.Option(None, "-k", "--num-speculative-tokens", help="edit: num_speculative_tokens "
                                    "of the speculative sends (default auto: the server's own)."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="Chat workloads: a file holding the "
                                                "system prompt (default: a built-in ~900-token code-review one)."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Poisson arrivals at this many requests per second "
                                         "(instead of --concurrency)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="max_tokens of each request (default "
                                             "64; edit: 256)."),
    min_max_tokens: Optional[int] = typer.Option(None, "--min-max-tokens", help="completions: requests of mixed "
                                                 "lengths: each request's max_tokens is drawn uniformly from "
                                                 "[this, --max-tokens], seeded by --seed and the request's index "
                                                 "(the same requests for every server)."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature of each request (edit: "
                                      "0 only: greedy, so that both sends must give the same text)."),
    model: Optional[str] = typer.Option(None, "--model", help="The model id to send (default: none, the server's "
                                        "own)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDECODE_API_KEY",
                                          help="Sent as 'Authorization: Bearer KEY'."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds a request may take before it counts as "
                                            "failed (default 120; corpus: 900)."),
    duration: Optional[float] = typer.Option(None, "--duration", help="Send no new request after this many seconds."),
    seed: int = typer.Option(0, "--seed", help="Seed of the Poisson arrival times."),
    spec_types: Optional[str] = typer.Option(None, "--spec-types", help="matrix, corpus: llama-server's speculative "
                                             "modes to start beside its plain one, comma-separated (default: "
                                             "ngram-mod, ngram-map-k, ngram-simple, ngram-cache, draft-simple; "
                                             "corpus: draft-simple only with --draft-gguf)."),
    draft_gguf: Optional[str] = typer.Option(None, "--draft-gguf", help="matrix, corpus: the draft GGUF of "
                                             "llama-server's draft-* modes (a path or a built-in model name, e.g. "
                                             "qwen2.5-coder-0.5b-instruct)."),
    only: Optional[str] = typer.Option(None, "--only", help="matrix: only these workloads, comma-separated."),
    serve: Optional[str] = typer.Option(None, "--serve", help="corpus: start our server for each round instead of "
                                        "using --url: `specdecode serve` with these arguments (one quoted string, "
                                        "e.g. \"--threads 2\"; on 127.0.0.1 and a free port)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="corpus: rounds, every server started afresh "
                                         "for each (default 3)."),
    modules: Optional[int] = typer.Option(None, "--modules", help="corpus: modules to edit, one edit each, the "
                                          "edit kinds in turn (default 12; 0: no edits)."),
    edit_kinds: Optional[str] = typer.Option(None, "--edit-kinds", help="corpus: edit kinds, comma-separated "
                                             "(default: rename,type hints,docstrings,delete,constant)."),
    chat_kinds: Optional[str] = typer.Option(None, "--chat-kinds", help="corpus: chat kinds, comma-separated "
                                             "(default: factual,explanation,code,translation,summary,follow-up; "
                                             "'' for none)."),
    think_s: Optional[float] = typer.Option(None, "--think-s", help="corpus: seconds before each request of the "
                                            "chats' second pass and before each edit (default 2; 0: the chats "
                                            "only back to back)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the report (JSON) to this file."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a figure (PNG) of the latencies to this file."),
) -> None:
    """Load a running server with streamed completions: request throughput, output tokens/s, TTFT, inter-token
    latency and end-to-end latency (p50/p90/p99), errors; or with chats (--workload multi-turn, shared-system):
    TTFT and prefix-cache hit rate per turn; or with code edits (--workload edit): speculative against plain
    decoding on the same server."""
    with user_errors():
        if workload not in WORKLOADS:
            raise CLIError(f"--workload {workload!r}: use one of {', '.join(WORKLOADS)}")
        given = {"--conversations": conversations, "--turns": turns, "--system-prompt": system_prompt,
                 "--rate": rate, "--plot": plot, "--num-requests": num_requests, "--concurrency": concurrency,
                 "--nb-prompts": nb_prompts, "--follow-up": follow_up, "-k": k, "--min-max-tokens": min_max_tokens,
                 "--server": server, "--peer-gguf": peer_gguf, "--threads": threads, "--llama-server": llama_server,
                 "--peer-context": peer_context, "--tool-latency": tool_latency, "--steer": steer or None,
                 "--plain": plain or None, "--no-function-calling": None if function_calling else True,
                 "--no-client-parses-calls": None if client_parses_calls else True, "--spec-types": spec_types,
                 "--draft-gguf": draft_gguf, "--only": only, "--serve": serve, "--rounds": rounds,
                 "--modules": modules, "--edit-kinds": edit_kinds, "--chat-kinds": chat_kinds, "--think-s": think_s}
        _check_options(workload, given)
        if timeout is None:
            timeout = 900.0 if workload == "corpus" else 120.0
        common = dict(url=url, temperature=temperature, model=model, api_key=api_key, timeout_s=timeout,
                      duration_s=duration)
        if max_tokens is not None:  # else each workload's default
            common["max_tokens"] = max_tokens
        peers = PeerOptions(peer_gguf, llama_server, threads, peer_context, function_calling)
        if workload == "completions":
            _run_completions(common, prompts or "code", num_requests or 100, concurrency, rate, seed, json_path,
                             plot, min_max_tokens)
        elif workload == "agent":
            run_agent(common, server or [f"ours={url}"], peers, plain=plain, steer=steer, tool_latency=tool_latency,
                      nb_tasks=nb_prompts, turns=turns, json_path=json_path, tasks_path=prompts,
                      client_parses_calls=client_parses_calls)
        elif workload == "matrix":
            from ..bench.peer_matrix import SPEC_MODES
            from .bench_serve_matrix import run_matrix_cmd

            run_matrix_cmd(common, peers, ",".join(SPEC_MODES) if spec_types is None else spec_types, draft_gguf,
                           only, json_path, plot)
        elif workload == "corpus":
            from .bench_serve_corpus import CorpusOptions, run_corpus_cmd

            run_corpus_cmd(common, peers, spec_types, draft_gguf,
                           CorpusOptions(serve, rounds, modules, edit_kinds, chat_kinds, think_s), json_path)
        elif workload == "edit":
            from ..bench.serve_edit import EditBenchSettings, bench_edit

            edits = {"nb_prompts": nb_prompts, "follow_up": follow_up, "k": k}
            settings = EditBenchSettings(prompts=_questions(prompts), **common,
                                         **{name: value for name, value in edits.items() if value is not None})
            _run_workload(settings, bench_edit, _print_edit, prompts or "edit", json_path)
        else:
            from ..bench.serve_chat import ChatBenchSettings, bench_chat

            settings = ChatBenchSettings(workload=workload, questions=_questions(prompts),
                                         system_prompt=_read_text(system_prompt), **common, **_chat_sizes(given))
            run = bench_chat if peers.llama_server is None else chat_with_llama_server(peers)
            _run_workload(settings, run, _print_chat_and_peer, prompts or "built-in questions", json_path)


def _run_completions(common: dict, prompts: str, num_requests: int, concurrency: Optional[int],
                     rate: Optional[float], seed: int, json_path: Optional[str], plot: Optional[str],
                     min_max_tokens: Optional[int] = None) -> None:
    from ..bench.prompts import load_prompts
    from ..bench.serve import ServeBenchSettings, bench_serve as run, plot_serve, write_report

    if concurrency is None and rate is None:
        concurrency = 8
    texts = [p.text for p in load_prompts(prompts)]
    settings = ServeBenchSettings(prompts=texts, num_requests=num_requests, concurrency=concurrency, rate=rate,
                                  seed=seed, min_max_tokens=min_max_tokens, **common)
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
        raise CLIError(f"no request succeeded against {settings.url}: {report['errors']}")


# The options each workload reads: one given to a workload that ignores it is an error, not a silent no-op.
_PEERS = {"--peer-gguf", "--llama-server", "--threads", "--peer-context"}
_APPLIES = {"completions": {"--rate", "--plot", "--num-requests", "--concurrency", "--min-max-tokens"},
            "matrix": {"--spec-types", "--draft-gguf", "--only", "--plot"} | _PEERS,
            "corpus": {"--spec-types", "--draft-gguf", "--serve", "--rounds", "--modules", "--edit-kinds",
                       "--chat-kinds", "--think-s"} | _PEERS,
            "multi-turn": {"--conversations", "--turns", "--system-prompt"} | _PEERS,
            "shared-system": {"--system-prompt", "--num-requests", "--concurrency"} | _PEERS,
            "edit": {"--nb-prompts", "--follow-up", "-k"},
            "agent": {"--nb-prompts", "--turns", "--server", "--tool-latency", "--steer", "--plain",
                      "--no-function-calling", "--no-client-parses-calls"} | _PEERS}


def _check_options(workload: str, given: dict) -> None:
    for flag, value in given.items():
        if value is not None and flag not in _APPLIES[workload]:
            raise CLIError(f"{flag} does not apply to --workload {workload}")
    if given["--concurrency"] is not None and given["--rate"] is not None:
        raise CLIError("give --concurrency or --rate, not both")


def _chat_sizes(given: dict) -> dict:
    """The sizes the user gave, under ChatBenchSettings' names (the others keep its defaults)."""
    names = {"--conversations": "conversations", "--turns": "turns", "--num-requests": "num_requests",
             "--concurrency": "concurrency"}
    return {name: given[flag] for flag, name in names.items() if given[flag] is not None}


def _questions(prompts: Optional[str]) -> list[str]:
    if prompts is None:
        return []  # the built-in questions
    from ..bench.prompts import load_prompts

    return [p.text for p in load_prompts(prompts)]


def _read_text(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    from pathlib import Path

    return Path(path).expanduser().read_text(encoding="utf-8")


def _run_workload(settings, run, show, prompts: str, json_path: Optional[str]) -> None:
    """A chat or edit workload: run(settings) -> its report, show(report) prints it."""
    from ..bench.serve import write_report

    report = run(settings)
    report["config"]["prompts"] = prompts
    show(report)
    if json_path:
        write_report(report, json_path)
        out.print(f"report: {json_path}")
    if report["succeeded"] == 0:
        raise CLIError(f"no request succeeded against {settings.url}: {report['errors']}")


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


def _print_headline(report: dict) -> None:
    out.print(f"{report['workload']}: {report['succeeded']}/{report['requests']} requests succeeded in "
              f"{report['duration_s']:.1f} s ({report['skipped']} not sent): {report['output_tokens_per_s']:.1f} "
              f"output tokens/s")
    if report["errors"]:
        out.print("errors: " + ", ".join(f"{k} x{v}" for k, v in report["errors"].items()))


def _print_chat(report: dict) -> None:
    from rich.table import Table

    _print_headline(report)
    multi = report["workload"] == "multi-turn"
    table = Table("turn" if multi else "requests", "ok", "TTFT median", "TTFT p90", "prompt", "cached", "hit rate",
                  title="TTFT in ms, tokens per request")
    for row in report["per_turn" if multi else "per_group"]:
        table.add_row(str(row["turn"] if multi else row["group"]), f"{row['succeeded']}/{row['requests']}",
                      _ms(row["ttft_median_s"]), _ms(row["ttft_p90_s"]), _num(row["prompt_tokens"]),
                      _num(row["cached_tokens"]), "–" if row["hit_rate"] is None else f"{row['hit_rate']:.0%}")
    out.print(table)
    ratio = report["ttft_last_vs_first"]
    if ratio is not None:
        what = f"turn {len(report['per_turn'])} / turn 1" if multi else "later / first"
        out.print(f"median TTFT {what}: {ratio:.2f}x")


def _print_chat_and_peer(report: dict) -> None:
    _print_chat(report)
    for name, peer in report.get("peers", {}).items():
        out.print(f"{name} ({' '.join(peer['config']['command'])}):", markup=False)
        _print_chat(peer)


def _print_edit(report: dict) -> None:
    from rich.table import Table

    _print_headline(report)
    table = Table("turn", "same text", "spec tok/s", "plain tok/s", "speedup", "of totals", "spec TTFT",
                  "plain TTFT", "tok/step", title="medians of the decode rate after the first token and of the "
                  "TTFT (ms); speedup: the median of the per-prompt ratios, and the ratio of the totals; tok/step: "
                  "tokens per verification (the server's)")
    for row in report["per_turn"]:
        spec, plain = row["speculative"], row["plain"]
        table.add_row(str(row["turn"]), f"{row['identical']}/{row['pairs']}", _num(spec["decode_tok_s_median"], 1),
                      _num(plain["decode_tok_s_median"], 1), _times(row["speedup_median"]),
                      _times(row["speedup_of_totals"]), _ms(spec["ttft_median_s"]), _ms(plain["ttft_median_s"]),
                      _num(spec["mean_accepted_length"], 2))
    out.print(table)
    for row in report["per_turn"]:
        for m in row["mismatches"]:  # greedy decoding is exact: a difference is a finding, never noise to hide
            out.print(f"[bold red]turn {row['turn']}, prompt {m['prompt']}: the speculative and plain texts differ "
                      f"from character {m['first_difference']}[/bold red]")
    if any((row["plain"]["proposed_tokens"] or 0) > 0 for row in report["per_turn"]):
        out.print("[bold red]the server drafted on the plain sends: it ignores num_speculative_tokens 0, so there "
                  "is no plain baseline[/bold red]")
    if any(row["speculative"]["proposed_tokens"] == 0 for row in report["per_turn"]):
        out.print("[yellow]the server proposed no drafts on some turn's speculative sends (no draft, or K 0)"
                  "[/yellow]")


def _times(ratio) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def _ms(seconds) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.1f}"


def _num(value, decimals: int = 0) -> str:
    return "–" if value is None else f"{value:.{decimals}f}"

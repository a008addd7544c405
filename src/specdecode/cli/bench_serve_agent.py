"""`specdecode bench serve --workload agent` and the chat workloads' llama-server peer: options read into the
bench's settings, and the agent report's tables. Measurements are in specdecode.bench.serve_agent and
specdecode.bench.serve_chat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .common import CLIError, out


@dataclass(frozen=True)
class PeerOptions:
    gguf: Optional[str]  # --peer-gguf: a path or a built-in model name
    llama_server: Optional[str]  # --llama-server PATH
    threads: Optional[int]
    context: Optional[int]
    function_calling: bool = True

    def gguf_path(self) -> Optional[str]:
        from ..bench.llamacpp_peers import gguf_file

        if self.gguf is None:
            if self.llama_server is not None:
                raise CLIError("--llama-server needs the GGUF it serves: give --peer-gguf")
            return None
        path = gguf_file(self.gguf)
        if path is None:
            raise CLIError(f"--peer-gguf {self.gguf!r}: not a .gguf file nor an installed built-in GGUF model")
        return str(path)

    def binary(self) -> str:
        from ..bench.llama_server import find_binary

        try:
            return find_binary(self.llama_server)
        except FileNotFoundError as e:
            raise CLIError(str(e)) from None


def run_agent(common: dict, servers: list[str], peers: PeerOptions, plain: bool, steer: bool,
              tool_latency: Optional[float], nb_tasks: Optional[int], turns: Optional[int],
              json_path: Optional[str], tasks_path: Optional[str] = None, client_parses_calls: bool = True) -> None:
    from ..bench.agent_tasks import load_tasks
    from ..bench.serve import write_report
    from ..bench.serve_agent import AgentBenchSettings, bench_agent

    pairs = []
    for item in servers:
        name, sep, address = item.partition("=")
        if not sep or not name or not address:
            raise CLIError(f"--server {item!r}: write NAME=URL, e.g. suffix=http://127.0.0.1:8001")
        pairs.append((name, address))
    gguf = peers.gguf_path()
    sizes = {"max_turns": turns, "nb_tasks": nb_tasks, "max_tokens": common.get("max_tokens"),
             "tool_latency_s": tool_latency, "peer_context": peers.context}
    try:
        tasks = load_tasks(tasks_path) if tasks_path else []
    except (OSError, ValueError) as e:
        raise CLIError(f"--prompts: {e}") from None
    settings = AgentBenchSettings(servers=pairs, plain=plain, peer_gguf=gguf, peer_threads=peers.threads, tasks=tasks,
                                  function_calling=peers.function_calling, steer=steer,
                                  client_parses_calls=client_parses_calls,
                                  llama_server=None if peers.llama_server is None else peers.binary(),
                                  model=common["model"], api_key=common["api_key"], timeout_s=common["timeout_s"],
                                  **{k: v for k, v in sizes.items() if v is not None})
    report = bench_agent(settings)
    print_agent(report)
    if json_path:
        write_report(report, json_path)
        out.print(f"report: {json_path}")
    if report["succeeded"] == 0:
        raise CLIError(f"no request succeeded: {report['errors'][:3]}")


def chat_with_llama_server(peers: PeerOptions):
    """The chat workloads' run: ours, then the same chats on llama-server (bench_chat_and_llama_server)."""
    from ..bench.llamacpp_peers import default_threads
    from ..bench.serve_chat import bench_chat_and_llama_server

    gguf, binary = peers.gguf_path(), peers.binary()
    return lambda settings: bench_chat_and_llama_server(settings, binary, gguf, peers.threads or default_threads(),
                                                        peers.context or 8192)


def print_agent(report: dict) -> None:
    config = report["config"]
    out.print(f"agent: {report['succeeded']}/{report['requests']} turns succeeded in {report['wall_s']:.1f} s "
              f"({len(config['tasks'])} tasks, tool_choice {config['tool_choice']}, tool latency "
              f"{config['tool_latency_s']:g} s)")
    out.print(f"order: {config['order']}", markup=False)
    if config.get("client_reads_calls"):
        out.print(f"calls read by the client: {config['client_reads_calls']}", markup=False)
    _methods_table(report)
    _equal_turns_table(report)
    _turns_table(report)
    same = report["same_text"]
    if same["reference"]:
        out.print(f"same text and calls as {same['reference']}: {same['checked'] - len(same['differences'])}/"
                  f"{same['checked']} turns" + (f"; differ: {', '.join(same['differences'])}"
                                                 if same["differences"] else ""))
    for session in report["sessions"]:
        if not session["completed"]:
            out.print(f"  not completed: {session['method']} {session['task']} ({session['ended']}, "
                      f"{session['turns']} turns): {session['check']}", markup=False)
    for line in report["invalid_calls"] + report["errors"]:
        out.print(f"  {line}", markup=False)


def _methods_table(report: dict) -> None:
    from rich.table import Table

    table = Table(title="per method", title_justify="left")
    columns = ("method", "completed", "calls after turn 1", "turns", f"turns = {report['reference']}",
               "valid calls", "client-parsed", "session time", "decode tok/s", "vs plain", "vs llama-server",
               "vs function calling")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, t in report["methods"].items():
        s = report["speedups"][name]
        table.add_row(name, f"{t['completed']}/{t['tasks']}", f"{t['calls_after_turn_1']}/{t['tasks']}",
                      str(t["turns"]), f"{t['turns_equal_to_reference']}/{t['tasks']}",
                      f"{t['valid_calls']}/{t['calls']}",
                      f"{t['client_parsed_valid_calls']}/{t['client_parsed_calls']}", f"{t['session_s']:.1f} s",
                      _num(t["decode_tokens_per_s"], 1), _times(s["decode_vs_plain"]),
                      _times(s["session_time_vs_llama_server"]), _times(s["session_time_vs_function_calling"]))
    out.print(table)


def _equal_turns_table(report: dict) -> None:
    """Each method against the reference and the peers over only the tasks where both made as many turns."""
    from rich.table import Table

    others = list(dict.fromkeys(o for s in report["speedups"].values() for o in s["equal_turns"]))
    if not others:
        return
    table = Table(title="on sessions of equal length (only the tasks where both made as many turns: session time "
                  "theirs/ours, decode rate ours/theirs, tasks)", title_justify="left")
    table.add_column("method", justify="left")
    for other in others:
        table.add_column(f"vs {other}", justify="right")
    for name, s in report["speedups"].items():
        cells = []
        for other in others:
            r = s["equal_turns"].get(other)
            cells.append("–" if r is None else f"{_times(r['session_time'])} / {_times(r['decode'])} "
                                               f"({r['tasks']} tasks)")
        table.add_row(name, *cells)
    out.print(table)


def _turns_table(report: dict) -> None:
    from rich.table import Table

    table = Table(title="per turn (sums over the tasks; latency and decode rate: medians)", title_justify="left")
    columns = ("turn", "method", "calls", "prefill cold", "from cache", "decode", "forced", "drafted", "kept",
               "idle", "latency", "decode tok/s")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in report["turns"]:
        calls = str(row["calls"]) + (f" + {row['client_parsed_calls']} client" if row["client_parsed_calls"] else "")
        table.add_row(str(row["turn"]), row["method"], calls, _num(row["cold_tokens"]), _num(row["cached_tokens"]),
                      str(row["output_tokens"]), _num(row["forced_tokens"]), _num(row["drafted_tokens"]),
                      _num(row["kept_tokens"]), f"{row['idle_s']:.2f} s", f"{row['median_latency_s']:.2f} s",
                      _num(row["median_decode_tokens_per_s"], 1))
    out.print(table)


def _times(ratio) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def _num(value, decimals: int = 0) -> str:
    return "–" if value is None else f"{value:.{decimals}f}"

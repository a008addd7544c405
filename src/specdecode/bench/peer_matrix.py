"""`specdecode bench serve --workload matrix`: our server against llama.cpp's own server at its best, on a matrix of
the workloads CPU users run: novel code, whole-file edits of two kinds (a change every few lines; a rename), a chat
that quotes its earlier answer, a JSON-schema answer, and an agent's tool loop that writes back a file it has read.

The peers: llama-server (llama_server.py) on the same GGUF, threads and context, started here once per mode: plain and
each `--spec-type` asked for (ngram-mod, ngram-map-k, ngram-simple, ngram-cache, draft-simple with a draft GGUF, ...),
every other setting at its defaults. All servers run at once, idle between their requests; each first answers one
short untimed request (a first request's one-off costs belong to no workload); then each workload is sent to
every server in turn (the order rotated from workload to workload, so a slow drift of the machine is spread over
them), one request at a time, greedy, each on a quiet machine (wait_quiet). A workload's later turns carry that
server's own earlier answers, as a chat client's do.

What is compared: the decode rate after the first token, (tokens - 1) / (last token - first token), the quantity
speculation changes (prefill runs the same llama.cpp kernels on every server), and the whole answers' seconds (where
servers' greedy answers part at a near-tie, or a peer does not constrain a tool call, the rates are of other texts:
the time to the answer each gave is what its user waits for).
Per workload: ours, llama-server plain, and the best of its speculative modes (the best peer is reported, never the
weakest), with our ratio to each. Run it once per fresh set of servers: a suffix drafter (ours) and llama-server's
ngram-cache remember earlier requests, so a rerun measures regenerates. Requests go only to 127.0.0.1 servers this
command started and to the URL given, bounded in number (one pass of the matrix) and in time (the per-request
timeout).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .serve import ClientSettings, RequestRecord, make_client, stream_request

# llama-server's speculative modes as its users start them (its own defaults for each mode's numbers)
SPEC_MODES = ("ngram-mod", "ngram-map-k", "ngram-simple", "ngram-cache", "draft-simple")
QUIET_SHARE = 0.1  # a request starts once the other processes use at most this share of the CPU ...
QUIET_MAX_S = 120.0  # ... or after this long
WARMUP = [{"role": "user", "content": "Say hello."}]  # one untimed request per server before the matrix
WARMUP_TOKENS = 8
EDIT_SYSTEM = ("You are a coding assistant. When asked to change a file, reply with the complete updated file in "
               "one fenced code block, and nothing else.")


def _source_file() -> tuple[str, str]:
    """A real module no one here wrote, read from the standard library at run time (nothing is copied): bisect.py,
    110 lines (~800 Qwen tokens)."""
    import bisect

    return "bisect.py", inspect.getsource(bisect)


def _file_message(name: str, text: str, ask: str) -> str:
    return f"Here is `{name}`:\n\n```python\n{text}```\n\n{ask}"


@dataclass(frozen=True)
class Turn:
    """One request of a workload: its messages, given the answers of the workload's earlier turns on that server."""

    messages: Callable[[list[str]], list[dict]]
    extra: dict = field(default_factory=dict)  # more body fields (response_format, tools, tool_choice)


def workloads() -> dict[str, list[Turn]]:
    """The matrix's rows, in order."""
    name, text = _source_file()
    system = {"role": "system", "content": EDIT_SYSTEM}
    code_ask = ("Write a Python module `inventory.py`: a dataclass Item (name, price, quantity), a class Inventory "
                "with add, remove, total_value and a low_stock(threshold) method, and unit tests with unittest. "
                "Output only the code.")
    first_ask = "Write a Python function that splits one CSV line into fields, honouring double-quoted fields."
    quote_ask = ("Repeat that function exactly as you wrote it, adding a docstring and a comment on each branch; "
                 "output the whole function again.")
    invoice = ("Invoice 2291 from Northwind Traders to Contoso Ltd, dated 3 March: 4 desk lamps at 23.50 each, 2 "
               "office chairs at 149.00 each, 10 packs of A4 paper at 4.20 each, 1 whiteboard at 89.99. Extract it.")
    schema = {"type": "object", "additionalProperties": False,
              "required": ["number", "seller", "buyer", "items"],
              "properties": {"number": {"type": "string"}, "seller": {"type": "string"}, "buyer": {"type": "string"},
                             "items": {"type": "array", "items": {
                                 "type": "object", "additionalProperties": False,
                                 "required": ["description", "quantity", "unit_price"],
                                 "properties": {"description": {"type": "string"}, "quantity": {"type": "integer"},
                                                "unit_price": {"type": "number"}}}}}}
    tools = [{"type": "function", "function": {
        "name": "write_file", "description": "Write the complete new content of a file.",
        "parameters": {"type": "object", "required": ["path", "content"],
                       "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}},
        {"type": "function", "function": {
            "name": "read_file", "description": "Read a file.",
            "parameters": {"type": "object", "required": ["path"], "properties": {"path": {"type": "string"}}}}}]
    agent_messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools to read and write files."},
        # an ask the file does not meet already (bisect.py has a docstring), so that every server writes the whole
        # file back: the copy an agent's edit is
        {"role": "user", "content": f"Add the line `# Edited by the agent.` at the top of {name}, changing nothing "
                                    f"else. Write the whole new file with write_file."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": name})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": text}]
    return {
        "novel code": [Turn(lambda _: [{"role": "user", "content": code_ask}])],
        "edit: type hints": [Turn(lambda _: [system, {"role": "user", "content": _file_message(
            name, text, "Add type hints to every function signature.")}])],
        "edit: rename": [Turn(lambda _: [system, {"role": "user", "content": _file_message(
            name, text, "Rename the function `insort_right` to `insert_right` everywhere.")}])],
        "chat quoting its answer": [
            Turn(lambda _: [{"role": "user", "content": first_ask}]),
            Turn(lambda answers: [{"role": "user", "content": first_ask},
                                  {"role": "assistant", "content": answers[0]},
                                  {"role": "user", "content": quote_ask}])],
        "json schema": [Turn(lambda _: [{"role": "user", "content": invoice}],
                             {"response_format": {"type": "json_schema", "json_schema": {
                                 "name": "invoice", "schema": schema, "strict": True}}})],
        "agent tool loop": [Turn(lambda _: agent_messages, {"tools": tools, "tool_choice": "required"})],
    }


@dataclass
class MatrixSettings(ClientSettings):
    max_tokens: int = 1024  # a whole-file edit re-emits the file
    only: Sequence[str] = ()  # workloads to run (empty: all)

    def __post_init__(self):
        if self.temperature != 0:
            raise ValueError(f"the matrix compares servers on the same greedy answers: temperature must be 0, got "
                             f"{self.temperature:g}")
        unknown = set(self.only) - set(workloads())
        if unknown:
            raise ValueError(f"unknown matrix workload(s) {sorted(unknown)}: use {', '.join(workloads())}")


def decode_rate(record: RequestRecord) -> float | None:
    """Tokens a second after the first token (None where fewer than two tokens, or no timing)."""
    if not record.ok or record.output_tokens < 2 or record.ttft_s is None or record.last_token_s is None:
        return None
    span = record.last_token_s - record.ttft_s
    return (record.output_tokens - 1) / span if span > 0 else None


async def wait_quiet(max_s: float | None = None, window_s: float = 0.5, load=None) -> float:
    """Waits until the machine's other processes (every server here) used at most QUIET_SHARE of its CPU over a
    window, at most max_s; returns the seconds waited. A server's background work after an answer (ours prefills
    it for the next turn while idle; llama-server saves its slot's prompt to host memory) would otherwise slow the
    next server's request: each request starts on a quiet machine. load: draft_timing.OthersLoad's maker (tests)."""
    from ..pairing.draft_timing import OthersLoad

    waited, max_s = 0.0, QUIET_MAX_S if max_s is None else max_s
    while waited < max_s:
        gauge = (load or OthersLoad)()
        with gauge:
            await asyncio.sleep(window_s)
        waited += window_s
        if gauge.share is None or gauge.share <= QUIET_SHARE:
            break
    return waited


async def _warm_up(http, settings: MatrixSettings) -> RequestRecord:
    """One short untimed request: a server's first request pays one-off costs (buffers allocated, code paths
    first run, our policy's first timings) that no later request does; every server pays them here, not in the
    first workload's cell."""
    return await stream_request(http, "/v1/chat/completions", _body(settings, WARMUP, WARMUP_TOKENS),
                                RequestRecord(-1, 0.0))


def _body(settings: MatrixSettings, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    """A streamed greedy chat request, as every server is sent it."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            **({"model": settings.model} if settings.model else {}), **(extra or {}),
            "stream": True, "stream_options": {"include_usage": True}}


async def _run_workload(http, settings: MatrixSettings, turns: list[Turn]) -> list[RequestRecord]:
    answers, records = [], []
    for i, turn in enumerate(turns):
        await wait_quiet()
        body = _body(settings, turn.messages(answers), settings.max_tokens, turn.extra)
        record = await stream_request(http, "/v1/chat/completions", body, RequestRecord(i, 0.0))
        records.append(record)
        if not record.ok:
            break
        answers.append(record.text)
    return records


def _cell(records: list[RequestRecord]) -> dict:
    """One server's figures on one workload (its turns summed)."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    decode_s = sum(r.last_token_s - r.ttft_s for r in ok if decode_rate(r) is not None)
    decoded = sum(r.output_tokens - 1 for r in ok if decode_rate(r) is not None)
    return {"ok": len(ok) == len(records) and bool(records), "requests": len(records), "tokens": tokens,
            "seconds": sum(r.latency_s for r in ok), "ttft_s": sum(r.ttft_s or 0.0 for r in ok),
            "decode_tok_s": decoded / decode_s if decode_s > 0 else None,
            "errors": [r.error for r in records if not r.ok], "texts": [r.text for r in records]}


def run_matrix(settings: MatrixSettings, servers: dict[str, str]) -> dict:
    """Every workload on every server (name -> base URL), interleaved; the report's cells[workload][server]."""
    rows = {name: turns for name, turns in workloads().items() if not settings.only or name in settings.only}
    names = list(servers)
    cells: dict[str, dict[str, dict]] = {}

    warm_up: dict[str, str | None] = {}

    async def main():
        for server in names:
            async with make_client(_at(settings, servers[server]), 1) as http:
                record = await _warm_up(http, settings)
                warm_up[server] = None if record.ok else record.error
        for w, (workload, turns) in enumerate(rows.items()):
            cells[workload] = {}
            for s in range(len(names)):
                server = names[(s + w) % len(names)]
                async with make_client(_at(settings, servers[server]), 1) as http:
                    cells[workload][server] = _cell(await _run_workload(http, settings, turns))
    asyncio.run(main())
    return {"config": {"servers": servers, "max_tokens": settings.max_tokens, "workloads": list(rows),
                       "warm_up_errors": {s: e for s, e in warm_up.items() if e}},
            "cells": cells, "summary": summarize(cells)}


def _at(settings: MatrixSettings, url: str) -> ClientSettings:
    return ClientSettings(url=url, timeout_s=settings.timeout_s, api_key=settings.api_key)


def summarize(cells: dict[str, dict[str, dict]], ours: str = "ours", plain: str = "llama-server") -> list[dict]:
    """Per workload: our decode rate, the peer's plain one, its best speculative mode's, and our ratios to them. A
    server whose requests failed is left out of the best (its figure is no rate)."""
    rows = []
    for workload, by_server in cells.items():
        rate = {s: c["decode_tok_s"] for s, c in by_server.items() if c["ok"] and c["decode_tok_s"]}
        modes = {s: r for s, r in rate.items() if s.startswith(plain + " ")}
        best = max(modes, key=modes.__getitem__, default=None)
        peer_best = max([r for s, r in rate.items() if s != ours], default=None)
        mine = rate.get(ours)
        # the whole answers' seconds (prefill included): what a user waits for the answer each server gave
        seconds = {s: c["seconds"] for s, c in by_server.items() if c["ok"] and c.get("seconds")}
        fastest_peer = min((s for s in seconds if s != ours), key=seconds.__getitem__, default=None)
        fastest = seconds.get(fastest_peer)
        rows.append({"workload": workload, "ours": mine, "plain": rate.get(plain), "best_mode": best,
                     "best_mode_tok_s": modes.get(best), "best_peer_tok_s": peer_best,
                     "vs_plain": _ratio(mine, rate.get(plain)), "vs_best": _ratio(mine, peer_best),
                     "ours_s": seconds.get(ours), "fastest_peer_s": fastest,
                     "fastest_peer": fastest_peer,
                     "time_vs_fastest": _ratio(fastest, seconds.get(ours)),
                     "same_text_as_plain": _same(by_server, ours, plain)})
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def _same(by_server: dict, ours: str, plain: str) -> bool | None:
    if ours not in by_server or plain not in by_server:
        return None
    return by_server[ours]["texts"] == by_server[plain]["texts"]


def median_ratio(summary: list[dict], key: str) -> float | None:
    values = [row[key] for row in summary if row[key] is not None]
    return statistics.median(values) if values else None


def plot_matrix(report: dict, path: str, hardware: str) -> None:
    """Grouped bars: each workload's decode rate on every server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    workloads_ = list(cells)
    servers = list(report["config"]["servers"])
    width = 0.8 / len(servers)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(workloads_)), 4.5))
    for i, server in enumerate(servers):
        values = [cells[w].get(server, {}).get("decode_tok_s") or 0 for w in workloads_]
        ax.bar([x + i * width for x in range(len(workloads_))], values, width, label=server)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads_))], workloads_, rotation=15, ha="right")
    ax.set_ylabel("decode tokens/s (after the first token)")
    ax.set_title(f"specdecode serve vs llama-server's modes, greedy, one request at a time\n{hardware}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

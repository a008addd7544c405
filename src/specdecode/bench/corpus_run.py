"""`specdecode bench serve --workload corpus`: what a user waits for, on work no setting of ours was tuned on. The
tasks are corpus.py's whole-file edits of real modules and corpus_chat.py's chat questions; this module runs them on
each server and reports.

Servers run one at a time and fresh: each round starts ours (`specdecode serve` with the user's arguments) and then
llama-server in each mode, one after another; each server answers one short untimed request (a first request's
one-off costs belong to no task), then every task, and is stopped before the next one starts. So no server's
background work or memory slows another's requests, and no round copies an earlier round's answers (our suffix
history, llama-server's prompt and n-gram caches). The order of the servers is rotated each round, so a slow drift
of the machine is spread over them.

A session sends the chat questions twice: back to back (each request as soon as the previous answer ended, as eval
harnesses, batch jobs and quick follow-ups do: a server's work after an answer delays the next request) and with a
think-time before each request (a user reading the answer); then the edits, a think-time before each. Every request
is streamed, greedy, and runs to its end (its end-of-sequence token or max_tokens): the time to first token and the
seconds to the last token are what is recorded, with the tokens, the text and, for an edit, whether it is the edit
asked for (its timings count whatever it is).

The summary, per kind: each server's seconds a request and TTFT (the kind's requests of a round averaged, the median
over rounds), the best peer (the fewest seconds), and our ratio to it, its seconds over ours (above 1: ours is
faster), min/median/max over rounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, ContextManager

from .corpus import EDIT_KINDS, EditTask, pick_tasks
from .corpus_chat import CHAT_KINDS, ChatTask, chat_tasks
from .serve import ClientSettings, RequestRecord, make_client, stream_request

OURS = "ours"
WARMUP = [{"role": "user", "content": "Say hello."}]
WARMUP_TOKENS = 8
PATH = "/v1/chat/completions"


@dataclass
class CorpusSettings(ClientSettings):
    max_tokens: int = 2048  # a whole-file edit re-emits the file: every answer runs to its end
    timeout_s: float = 900.0
    rounds: int = 3
    modules: int = 12  # edits: one module each, the edit kinds in turn
    edit_kinds: tuple[str, ...] = EDIT_KINDS
    chat_kinds: tuple[str, ...] = CHAT_KINDS
    think_s: float = 2.0  # the gap before each request of the think-time pass and before each edit

    def __post_init__(self):
        if self.temperature != 0:
            raise ValueError(f"the corpus compares servers on their greedy answers: temperature must be 0, got "
                             f"{self.temperature:g}")
        if self.rounds < 1 or self.modules < 0 or self.think_s < 0 or self.max_tokens < 1:
            raise ValueError(f"rounds >= 1, modules >= 0, think_s >= 0 and max_tokens >= 1, got {self.rounds}, "
                             f"{self.modules}, {self.think_s:g}, {self.max_tokens}")
        self.edit_kinds, self.chat_kinds = tuple(self.edit_kinds), tuple(self.chat_kinds)
        for given, known, what in ((self.edit_kinds, EDIT_KINDS, "edit"), (self.chat_kinds, CHAT_KINDS, "chat")):
            if set(given) - set(known):
                raise ValueError(f"unknown {what} kind(s) {sorted(set(given) - set(known))}: use {', '.join(known)}")
        if not (self.modules and self.edit_kinds) and not self.chat_kinds:
            raise ValueError("nothing to send: no module to edit (--modules 0 or no edit kind) and no chat kind")

    def passes(self) -> list[tuple[str, float]]:
        """The chat questions' passes: (name, seconds before each request)."""
        if self.think_s == 0:
            return [("back to back", 0.0)]
        return [("back to back", 0.0), (f"think {self.think_s:g} s", self.think_s)]


def tasks(settings: CorpusSettings) -> tuple[list[EditTask], list[ChatTask]]:
    edits = pick_tasks(settings.modules, settings.edit_kinds, settings.max_tokens) \
        if settings.modules and settings.edit_kinds else []
    return edits, chat_tasks(settings.chat_kinds) if settings.chat_kinds else []


def _body(settings: CorpusSettings, messages: list[dict], max_tokens: int) -> dict:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            **({"model": settings.model} if settings.model else {}), "stream": True,
            "stream_options": {"include_usage": True}}


def _row(record: RequestRecord, max_tokens: int, **where) -> dict:
    seconds = record.latency_s if record.ok else None
    return {**where, "ok": record.ok, "status": record.status, "error": record.error,
            "ttft_s": record.ttft_s if record.ok else None, "seconds": seconds,
            "last_token_s": record.last_token_s, "output_tokens": record.output_tokens,
            "hit_max_tokens": record.ok and record.output_tokens >= max_tokens,  # cut short, not at its end
            "prompt_tokens": record.prompt_tokens, "cached_tokens": record.cached_tokens,
            "tok_s": record.output_tokens / seconds if seconds else None, "speculative": record.speculative,
            "text": record.text}


async def _send(http, settings, messages) -> RequestRecord:
    return await stream_request(http, PATH, _body(settings, messages, settings.max_tokens), RequestRecord(0, 0.0))


async def session(settings: CorpusSettings, url: str, where: dict, edits: list[EditTask],
                  chats: list[ChatTask]) -> tuple[list[dict], str | None]:
    """Every task on one server: (the requests' rows, the warm-up's error or None)."""
    from .peer_matrix import wait_quiet

    await wait_quiet()  # another program's work would slow this server alone (bounded: peer_matrix.QUIET_MAX_S)
    rows = []
    async with make_client(ClientSettings(url=url, timeout_s=settings.timeout_s, api_key=settings.api_key), 1) as http:
        warm = await stream_request(http, PATH, _body(settings, WARMUP, WARMUP_TOKENS), RequestRecord(-1, 0.0))
        for name, gap in settings.passes() if chats else ():
            for task in chats:
                answers: list[str] = []
                for turn, messages in enumerate(task.turns):
                    await asyncio.sleep(gap)
                    record = await _send(http, settings, messages(answers))
                    rows.append(_row(record, settings.max_tokens, **where, kind=f"chat: {task.turn_kind(turn)} ({name})",
                                     task=task.name, turn=turn + 1))
                    if not record.ok:
                        break
                    answers.append(record.text)
        for task in edits:
            await asyncio.sleep(settings.think_s)
            record = await _send(http, settings, task.messages())
            row = _row(record, settings.max_tokens, **where, kind=f"edit: {task.kind}", task=task.module.name, turn=1)
            row["check"] = task.check(record.text) if record.ok else None
            rows.append(row)
    return rows, None if warm.ok else warm.error


def run_corpus(settings: CorpusSettings, servers: dict[str, Callable[[], ContextManager]],
               log: Callable[[str], None] = print, progress: Callable[[dict], None] | None = None) -> dict:
    """Every task on every server (name -> a maker of a context manager whose value has `.url`: it starts the
    server and stops it), each server alone and started afresh, for settings.rounds rounds. progress(report so
    far) after each server's session: a run of hours keeps what it measured if it is stopped."""
    edits, chats = tasks(settings)
    names, rows, sessions = list(servers), [], []
    report = {"config": {"servers": names, "rounds": settings.rounds, "max_tokens": settings.max_tokens,
                         "think_s": settings.think_s, "passes": [name for name, _ in settings.passes()],
                         "edit_kinds": list(settings.edit_kinds), "chat_kinds": list(settings.chat_kinds)},
              "modules": [module_row(task) for task in edits],
              "chats": [{"kind": task.kind, "name": task.name, "turns": len(task.turns)} for task in chats],
              "sessions": sessions, "requests": rows, "summary": []}
    for r in range(settings.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            with servers[name]() as server:
                started = time.perf_counter() - start
                got, warm_error = asyncio.run(session(settings, server.url, {"round": r + 1, "server": name},
                                                      edits, chats))
            ok = [row for row in got if row["ok"]]
            sessions.append({"round": r + 1, "server": name, "startup_s": started, "warm_up_error": warm_error,
                             "requests": len(got), "failed": len(got) - len(ok),
                             "seconds": sum(row["seconds"] for row in ok)})
            rows += got
            log(f"round {r + 1}/{settings.rounds}, {name}: {len(ok)}/{len(got)} requests, "
                f"{sessions[-1]['seconds']:.1f} s" + (f", warm-up failed: {warm_error}" if warm_error else ""))
            report["summary"] = summarize(rows, names)
            if progress is not None:
                progress(report)
    return report


def module_row(task: EditTask) -> dict:
    text = task.module.text
    return {"kind": task.kind, "root": task.module.root, "name": task.module.name, "path": task.module.path,
            "lines": len(text.splitlines()), "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "ask": task.ask, "details": task.details}


# ------------------------------------------------------------------------------------------------ statistics
def kind_rounds(rows: list[dict]) -> dict[str, dict[str, dict[int, dict | None]]]:
    """kind -> server -> round -> the round's totals of that kind's requests (seconds, TTFT, requests, tokens), or
    None where one of them failed (a failed request's time is no time to its answer)."""
    out: dict[str, dict[str, dict[int, dict | None]]] = {}
    for row in rows:
        cell = out.setdefault(row["kind"], {}).setdefault(row["server"], {})
        totals = cell.setdefault(row["round"], {"seconds": 0.0, "ttft_s": 0.0, "requests": 0, "tokens": 0})
        if totals is None:
            continue
        if not row["ok"] or row["seconds"] is None:
            cell[row["round"]] = None
            continue
        totals["seconds"] += row["seconds"]
        totals["ttft_s"] += row["ttft_s"] or 0.0
        totals["requests"] += 1
        totals["tokens"] += row["output_tokens"]
    return out


def spread(values: list[float]) -> dict | None:
    """min, median and max (None where there is no value)."""
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict], servers: list[str], ours: str = OURS) -> list[dict]:
    """Per kind (in the order first sent): each server's median over rounds of its seconds and TTFT a request, the
    best peer (fewest seconds), our ratio to it and to each peer per round (its seconds over ours), and for edits
    how many answers were the edit asked for."""
    summary = []
    for kind, by_server in kind_rounds(rows).items():
        figures = {}
        for server in servers:
            by_round = by_server.get(server, {})
            done = {r: t for r, t in by_round.items() if t is not None}
            figures[server] = {"seconds": _median([t["seconds"] / t["requests"] for t in done.values()]),
                               "ttft_s": _median([t["ttft_s"] / t["requests"] for t in done.values()]),
                               "tokens": _median([t["tokens"] / t["requests"] for t in done.values()]),
                               "rounds": len(done), "failed_rounds": len(by_round) - len(done)}
        peers = [s for s in servers if s != ours and figures[s]["seconds"] is not None]
        best = min(peers, key=lambda s: figures[s]["seconds"], default=None)
        mine = by_server.get(ours, {})

        def ratios(peer):
            theirs = by_server.get(peer, {})
            return [theirs[r]["seconds"] / mine[r]["seconds"] for r in sorted(mine)
                    if mine[r] and theirs.get(r) and mine[r]["seconds"] > 0]
        row = {"kind": kind, "requests": max((t["requests"] for c in by_server.values() for t in c.values() if t),
                                             default=0),
               "servers": figures, "best_peer": best, "vs_best_rounds": ratios(best) if best else [],
               "vs_peer": {peer: _median(ratios(peer)) for peer in peers}}
        row["vs_best"] = spread(row["vs_best_rounds"])
        ttft, best_ttft = figures.get(ours, {}).get("ttft_s"), min(
            (figures[s]["ttft_s"] for s in peers if figures[s]["ttft_s"] is not None), default=None)
        row["ttft_minus_best_peer_s"] = None if ttft is None or best_ttft is None else ttft - best_ttft
        checks = [r for r in rows if r["kind"] == kind and r.get("check") is not None]
        cut = Counter(r["server"] for r in rows if r["kind"] == kind and r.get("hit_max_tokens"))
        row["hit_max_tokens"] = dict(cut)
        if kind.startswith("edit: "):
            row["as_asked"] = {s: [sum(r["check"]["as_asked"] for r in checks if r["server"] == s),
                                   sum(1 for r in rows if r["kind"] == kind and r["server"] == s)] for s in servers}
        summary.append(row)
    return summary


def overall(summary: list[dict]) -> dict:
    """The medians of the kinds' median ratios, of the edits and of the chat kinds apart."""
    def of(prefix):
        return _median([row["vs_best"]["median"] for row in summary if row["kind"].startswith(prefix)
                        and row["vs_best"]])
    return {"edits": of("edit: "), "chat": of("chat: "), "all": of("")}


def markdown_table(report: dict) -> str:
    """A run as a results page shows it: per kind each server's seconds a request (TTFT), the best peer, and our
    ratio to it (min / median / max over rounds)."""
    servers = report["config"]["servers"]
    names = ["llama-server plain" if s == "llama-server" else s for s in servers]
    columns = ["kind", *names, "best peer", "ours / best peer (min / median / max)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in report["summary"]:
        cells = ["–" if f["seconds"] is None else f"{f['seconds']:.2f} s ({f['ttft_s']:.2f})"
                 for f in (row["servers"][s] for s in servers)]
        best = "plain" if row["best_peer"] == "llama-server" else (row["best_peer"] or "–").removeprefix(
            "llama-server ")
        ratio = row["vs_best"]
        spread_ = "–" if ratio is None else f"{ratio['min']:.2f} / {ratio['median']:.2f} / {ratio['max']:.2f}×"
        lines.append(f"| {row['kind']} | " + " | ".join(cells) + f" | {best} | {spread_} |")
    return "\n".join(lines)

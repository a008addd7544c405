"""The agent workload's report (serve_agent.py): per method, per turn and per session, from the records.

Per method: tasks completed (the check passed), sessions that still called tools after turn 1, turns, calls and
how many are valid under their tool's schema, the sessions' time (turn 1's request to the last answer, the tools'
idle time included) and the requests' time, the decode rate after the first token (streamed methods), and the
prompt tokens split into cold (prefilled) and from cache. Per turn number and method: the same split, the decode
tokens, the tokens a grammar forced, the drafts proposed and kept, the idle time before the turn and the medians of
latency and decode rate. Where a server reports no cache count (llama-cpp-python), cold and cached are None.

Calls the client read out of a peer's text answer (serve_agent.read_calls) are counted apart from the server's
calls: `calls`, `valid_calls` and `invalid_calls` are the server's own, `client_parsed_calls` and
`client_parsed_valid_calls` the client's.

Sessions of different lengths do not compare (a peer whose session ends at turn 1 is not 5x faster), so beside
the whole-session ratios each method gets, against the reference (plain, else the first method), llama-server and
llama-cpp-python, the ratios over only the tasks where both sessions made the same number of turns, and how many
tasks that is.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

from .agent_records import CLIENT_PARSED, LLAMA_SERVER, PEER, PLAIN, AgentBenchSettings, SessionRecord, TurnRecord

ORDER = ("each method answered one untimed request of the system prompt and the tools (max_tokens 1) before the "
         "first task, so every method starts its sessions with that prefix in its own cache; the methods then ran "
         "task by task, the order rotated by one each task")
CLIENT_READS = ("where an answer of {methods} had no tool_calls, the client read the calls its content held in a "
                "form our server reads (a <tool_call> block, or at the start of the answer a ```json fence or a bare "
                "object or list naming a declared tool with its arguments) with our server's own parser (Hermes "
                "dialect and start forms), and sent them back as the assistant message's tool_calls, as for our "
                "servers' answers (content: the text before the calls; the fence and any text after the calls "
                "dropped), as an agent with such a fallback would; those calls are counted apart "
                "(client_parsed_calls), not in the server's valid calls; our servers' answers are never re-read")

FUNCTION_CALLING_ARGUMENTS = ("llama-cpp-python was sent the calls' arguments as JSON values, not strings: it hands "
                              "the messages to the template as they are, whose tojson would quote a string; our "
                              "server and llama-server parse them before rendering")


def summarize(sessions: list[SessionRecord], records: list[TurnRecord], wall_s: float,
              settings: AgentBenchSettings, warm: list | None = None, commands: dict | None = None) -> dict:
    methods = settings.methods
    report = {
        "workload": "agent",
        "config": config(settings, commands or {}),
        "requests": len(records), "succeeded": sum(r.ok for r in records), "wall_s": wall_s,
        "errors": [f"{r.method} {r.task} turn {r.turn}: {r.error}" for r in records + (warm or []) if r.error],
        "methods": {m: method_totals([s for s in sessions if s.method == m], [r for r in records if r.method == m])
                    for m in methods},
        "reference": reference(methods),
        "turns": turn_rows(records, methods),
        "invalid_calls": [f"{r.method} {r.task} turn {r.turn}{' (read by the client)' * bool(r.client_parsed_calls)}: "
                          f"{why}" for r in records for why in r.invalid_calls],
        "same_text": same_text(records, methods),
        "sessions": [asdict(s) for s in sessions],
        "records": [asdict(r) for r in records],
    }
    report["speedups"] = speedups(report["methods"])
    equal = equal_turns(sessions, records, methods, report["reference"])
    for m in methods:
        report["methods"][m]["turns_equal_to_reference"] = equal[m]["tasks_equal_to_reference"]
        report["speedups"][m]["equal_turns"] = equal[m]["against"]
    return report


def config(settings: AgentBenchSettings, commands: dict) -> dict:
    order = ORDER if settings.warm else ORDER.split("; ", 1)[1].replace("the methods then", "the methods")
    if not settings.rotate:
        order = order.replace(", the order rotated by one each task", " in the same order")
    if settings.plain and settings.servers:
        order += (f"; `plain` shares the prefix cache of {settings.servers[0][0]!r} (a server of its own, named "
                  f"plain, would not)")
    return {"methods": settings.methods, "servers": dict(settings.servers), "peer_gguf": settings.peer_gguf,
            "peer_threads": settings.peer_threads, "peer_context": settings.peer_context, "commands": commands,
            "tasks": [t.id for t in settings.tasks], "max_turns": settings.max_turns,
            "max_tokens": settings.max_tokens, "tool_choice": "steered first turns" if settings.steer else "auto",
            "tool_latency_s": settings.tool_latency_s, "order": order, "client_reads_calls": client_reads(settings),
            "function_calling_arguments": FUNCTION_CALLING_ARGUMENTS if PEER in settings.methods else None}


def client_reads(settings: AgentBenchSettings) -> str | None:
    """What the client did with the peers' text answers (None: no peer ran)."""
    peers = [m for m in settings.methods if m in CLIENT_PARSED]
    if not peers:
        return None
    if not settings.client_parses_calls:
        return f"off: the answers of {' and '.join(peers)} were taken as their servers returned them"
    return CLIENT_READS.format(methods=" and ".join(peers))


def _sum(values):
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def prompt_split(records: list[TurnRecord]) -> dict:
    """Prompt tokens, cold (prefilled) and from cache, over the records whose server reported both."""
    known = [r for r in records if r.prompt_tokens is not None and r.cached_tokens is not None]
    if not known:
        return {"prompt_tokens": _sum(r.prompt_tokens for r in records), "cold_tokens": None, "cached_tokens": None}
    cached = sum(r.cached_tokens for r in known)
    return {"prompt_tokens": _sum(r.prompt_tokens for r in records),
            "cold_tokens": sum(r.prompt_tokens for r in known) - cached, "cached_tokens": cached}


def draft_counts(records: list[TurnRecord]) -> dict:
    """Forced tokens, drafts proposed and kept: our server's statistics, or llama-server's draft timings."""
    forced = _sum((r.speculative or {}).get("forced_tokens") for r in records)
    drafted = _sum((r.speculative or {}).get("proposed_tokens", (r.timings or {}).get("draft_n")) for r in records)
    kept = _sum((r.speculative or {}).get("accepted_tokens", (r.timings or {}).get("draft_n_accepted"))
                for r in records)
    return {"forced_tokens": forced, "drafted_tokens": drafted, "kept_tokens": kept}


def decode_rate(records: list[TurnRecord]) -> float | None:
    timed = [r for r in records if r.decode_rate]
    return _ratio(sum(r.decode_tokens for r in timed), sum(r.decode_time_s for r in timed)) if timed else None


def method_totals(sessions: list[SessionRecord], records: list[TurnRecord]) -> dict:
    ok = [r for r in records if r.ok]
    server = [r for r in ok if not r.client_parsed_calls]
    client = [r for r in ok if r.client_parsed_calls]  # all of such a turn's calls are the client's
    calls = sum(len(r.tool_calls) for r in server)
    invalid = sum(len(r.invalid_calls) for r in server)
    client_calls = sum(r.client_parsed_calls for r in client)
    return {
        "tasks": len(sessions), "completed": sum(s.completed for s in sessions),
        "calls_after_turn_1": sum(s.calls_after_turn_1 for s in sessions),
        "ended": {end: sum(s.ended == end for s in sessions) for end in sorted({s.ended for s in sessions})},
        "turns": len(records), "succeeded": len(ok), "calls": calls, "valid_calls": calls - invalid,
        "invalid_calls": invalid, "client_parsed_calls": client_calls,
        "client_parsed_valid_calls": client_calls - sum(len(r.invalid_calls) for r in client),
        "output_tokens": sum(r.output_tokens for r in ok),
        "session_s": sum(s.session_s for s in sessions),
        "end_to_end_s": sum(r.latency_s for r in ok), "idle_s": sum(r.idle_s for r in records),
        "tokens_per_s": _ratio(sum(r.output_tokens for r in ok), sum(r.latency_s for r in ok)),
        "decode_tokens_per_s": decode_rate(ok),
        **prompt_split(ok), **draft_counts(ok),
    }


def turn_rows(records: list[TurnRecord], methods: list[str]) -> list[dict]:
    """Per turn number and method: what the turn's time is made of, summed over the tasks, and medians."""
    rows = []
    for turn in sorted({r.turn for r in records}):
        for m in methods:
            group = [r for r in records if r.turn == turn and r.method == m and r.ok]
            if not group:
                continue
            rates = [r.decode_rate for r in group if r.decode_rate]
            rows.append({"turn": turn, "tool_choice": group[0].tool_choice, "method": m, "sessions": len(group),
                         **prompt_split(group), "output_tokens": sum(r.output_tokens for r in group),
                         **draft_counts(group), "idle_s": sum(r.idle_s for r in group),
                         "calls": sum(len(r.tool_calls) for r in group if not r.client_parsed_calls),
                         "client_parsed_calls": sum(r.client_parsed_calls for r in group),
                         "median_decode_tokens_per_s": statistics.median(rates) if rates else None,
                         "median_latency_s": statistics.median(r.latency_s for r in group),
                         "tokens_per_s": _ratio(sum(r.output_tokens for r in group),
                                                sum(r.latency_s for r in group))})
    return rows


def same_text(records: list[TurnRecord], methods: list[str]) -> dict:
    """Each of our methods against `plain`, turn by turn: the text and the calls (names and arguments)."""
    if PLAIN not in methods:
        return {"reference": None, "checked": 0, "differences": []}
    key = {(r.task, r.turn): r for r in records if r.method == PLAIN and r.ok}
    checked, differences = 0, []
    for r in records:
        if r.method in (PLAIN, PEER, LLAMA_SERVER) or not r.ok or (r.task, r.turn) not in key:
            continue
        checked += 1
        ref = key[(r.task, r.turn)]
        if r.text != ref.text or _calls(r) != _calls(ref):
            differences.append(f"{r.method} {r.task} turn {r.turn}")
    return {"reference": PLAIN, "checked": checked, "differences": differences}


def speedups(totals: dict) -> dict:
    """Each method against plain (decode rate after the first token) and against each peer in session time (the
    peer's over ours: the same tasks, though not the same tokens or turns once the answers differ; summarize adds
    the ratios over sessions of equal length, equal_turns)."""
    out = {}
    plain, peer, server = totals.get(PLAIN), totals.get(PEER), totals.get(LLAMA_SERVER)
    for m, t in totals.items():
        out[m] = {"decode_vs_plain": _ratio(t["decode_tokens_per_s"], plain and plain["decode_tokens_per_s"]),
                  "session_time_vs_llama_server": _ratio(server and server["session_s"], t["session_s"]),
                  "session_time_vs_function_calling": _ratio(peer and peer["session_s"], t["session_s"])}
    return out


def reference(methods: list[str]) -> str | None:
    """The method the others' session lengths are compared with: plain, else the first."""
    return PLAIN if PLAIN in methods else (methods[0] if methods else None)


def equal_turns(sessions: list[SessionRecord], records: list[TurnRecord], methods: list[str],
                ref: str | None) -> dict:
    """Per method: the tasks whose session made as many turns as the reference's, and against the reference and
    each peer the ratios over only the tasks where both sessions made the same number of turns: the other's
    session time over ours, our decode rate over the other's."""
    turns = {(s.method, s.task): s.turns for s in sessions}
    out = {}
    for m in methods:
        others = [o for o in dict.fromkeys((ref, LLAMA_SERVER, PEER)) if o in methods and o != m]
        out[m] = {"tasks_equal_to_reference": len(_same_length(turns, m, ref)),
                  "against": {o: _equal_ratios(m, o, _same_length(turns, m, o), sessions, records) for o in others}}
    return out


def _same_length(turns: dict, m: str, other: str | None) -> set:
    """The tasks where the sessions of m and of other made the same number of turns."""
    return {task for method, task in turns if method == m and turns[m, task] == turns.get((other, task))}


def _equal_ratios(m: str, other: str, same: set, sessions: list, records: list) -> dict:
    def session_s(method):
        return sum(s.session_s for s in sessions if s.method == method and s.task in same)

    def rate(method):
        return decode_rate([r for r in records if r.method == method and r.task in same and r.ok])

    return {"tasks": len(same), "session_time": _ratio(session_s(other), session_s(m)) if same else None,
            "decode": _ratio(rate(m), rate(other))}


def _calls(record: TurnRecord) -> list:
    return [(c["name"], c["arguments"]) for c in record.tool_calls]


def _ratio(a, b):
    return a / b if a is not None and b else None

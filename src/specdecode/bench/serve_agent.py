"""`specdecode bench serve --workload agent`: tool-using coding sessions, driven by the OpenAI client.

Each built-in task (bench/prompts/agent.jsonl) is a small repository held in memory and an instruction ("add a
docstring to every function in stats.py ..."). An agent session is the loop every OpenAI-API agent runs: send the
history with `tools` (list_files, read_file, write_file), execute the calls the answer makes against the
repository, append the assistant message and one `role: "tool"` message per call, and send again, until the model
answers with text or the session reaches max_turns. The first three turns are steered with a named `tool_choice`
(list, read, write: the shape of a coding agent's edit, and the same turns for every method); later ones are
"auto". This is the workload rich in tokens a server already knows: tool-call JSON is mostly forced by the schema
(names, keys, braces), the rewrite copies the file the tool result just showed, and every turn re-sends the
growing history.

Methods, run one session at a time and interleaved task by task (all methods do task 1, then task 2, ...):
- our servers given as NAME=URL (e.g. a server started with the default draft, one with `--draft suffix`, one with
  `--draft suffix+MODEL`); each session streams, so the decode rate after the first token is measured;
- `plain`: the first server again with num_speculative_tokens 0 (our extension), sent after that server's own
  session of the task, so a suffix draft never copies a plain answer it has just seen (see serve_edit.py);
- llama-cpp-python's own function calling on a GGUF, in process (`Llama.create_chat_completion(tools=...,
  tool_choice=...)` with the GGUF's own chat template: a named tool_choice decodes the arguments under a grammar
  made from the tool's JSON schema; "auto" decodes free text). Not streamed: it is compared end to end.

Reported: per method and turn, tokens, decode rate, end-to-end time; per method, the sessions' total time and the
decode rate over all turns; the speedups against `plain` and against the peer; every tool call checked against its
tool's JSON schema (jsonschema); and whether each of our methods gave, turn by turn, the same text and calls as
`plain` (greedy decoding is exact, so every difference is counted and listed). Requests go only to the URLs given.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Sequence

from ..errors import OptionError

SYSTEM = ("You are a coding agent working in a small repository. You can only see and change files through the "
          "tools. To change a file, read it, then write the whole new content back with write_file.")
TOOLS = [
    {"type": "function", "function": {
        "name": "list_files", "description": "List the files of the repository.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's whole content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
STEERING = ("list_files", "read_file", "write_file")  # the named tool_choice of the first turns; then "auto"
PLAIN = "plain"
PEER = "llamacpp-function-calling"


@dataclass(frozen=True)
class AgentTask:
    id: str
    instruction: str
    files: dict


def builtin_tasks() -> list[AgentTask]:
    text = resources.files("specdecode.bench.prompts").joinpath("agent.jsonl").read_text(encoding="utf-8")
    return [AgentTask(**json.loads(line)) for line in text.splitlines() if line.strip()]


class Repository:
    """The task's files, changed by the session's write_file calls; what each tool answers."""

    def __init__(self, files: dict):
        self.files = dict(files)

    def run(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"error: the arguments are not JSON ({e.msg})"
        if name == "list_files":
            return "\n".join(sorted(self.files))
        path = args.get("path") if isinstance(args, dict) else None
        if name == "read_file":
            if path not in self.files:
                return f"error: no file {path!r}; the files are: {', '.join(sorted(self.files))}"
            return self.files[path]
        if name == "write_file" and isinstance(path, str) and isinstance(args.get("content"), str):
            self.files[path] = args["content"]
            return f"wrote {len(args['content'].splitlines())} lines to {path}"
        return f"error: cannot run {name} with {arguments}"


@dataclass
class TurnRecord:
    method: str
    task: str
    turn: int
    tool_choice: str  # a tool's name (steered) or "auto"
    ok: bool = False
    error: str | None = None
    text: str = ""
    tool_calls: list = field(default_factory=list)  # [{"id", "name", "arguments"}]
    finish_reason: str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    last_token_s: float | None = None  # None where not streamed (the peer)
    speculative: dict | None = None
    invalid_calls: list = field(default_factory=list)  # "name: why" for each call its schema rejects

    @property
    def decode_s(self) -> float | None:
        """Seconds from the first token to the last (streamed methods only)."""
        if self.ttft_s is None or self.last_token_s is None or self.output_tokens < 2:
            return None
        return self.last_token_s - self.ttft_s


@dataclass
class AgentBenchSettings:
    servers: Sequence[tuple[str, str]]  # (name, base URL) of our servers; the first one also runs `plain`
    plain: bool = True
    peer_gguf: str | None = None  # a GGUF path for llama-cpp-python's function calling (None: no peer)
    peer_threads: int | None = None
    peer_context: int = 4096
    tasks: Sequence[AgentTask] = ()  # empty: the built-in tasks
    nb_tasks: int | None = None
    max_turns: int = 5
    max_tokens: int = 512  # per turn: a rewrite re-emits the whole file
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self):
        if not self.servers and not self.peer_gguf:
            raise OptionError("servers", "give at least one server URL (or a peer)")
        if self.max_turns < len(STEERING) + 1:
            raise OptionError("max_turns", f"max_turns must be >= {len(STEERING) + 1} (list, read, write, answer), "
                                           f"got {self.max_turns}")
        if self.max_tokens < 2:
            raise OptionError("max_tokens", f"max_tokens must be >= 2, got {self.max_tokens}")
        names = [name for name, _ in self.servers]
        if len(set(names)) != len(names) or {PLAIN, PEER} & set(names):
            raise OptionError("servers", f"server names must be distinct and not {PLAIN!r} or {PEER!r}: {names}")
        tasks = list(self.tasks) or builtin_tasks()
        self.tasks = tasks[:self.nb_tasks] if self.nb_tasks else tasks

    @property
    def methods(self) -> list[str]:
        return [n for n, _ in self.servers] + ([PLAIN] if self.plain and self.servers else []) + \
            ([PEER] if self.peer_gguf else [])


# ----------------------------------------------------------------------------------------------- the methods

class OpenAIChat:
    """One of our servers through the OpenAI client, streamed: text, tool calls assembled by index, timings."""

    def __init__(self, url: str, settings: AgentBenchSettings, extra_body: dict | None = None):
        try:
            import openai
        except ImportError as e:
            raise ImportError("the agent workload drives servers with the OpenAI client: pip install openai") from e
        base = url.rstrip("/")
        self.client = openai.OpenAI(base_url=base if base.endswith("/v1") else base + "/v1",
                                    api_key=settings.api_key or "none", timeout=settings.timeout_s, max_retries=0)
        self.model = settings.model or self.client.models.list().data[0].id
        self.extra_body = extra_body or {}
        self.max_tokens = settings.max_tokens

    def __call__(self, messages: list, tool_choice, record: TurnRecord) -> None:
        start = time.perf_counter()
        calls: dict[int, dict] = {}
        stream = self.client.chat.completions.create(
            model=self.model, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0,
            max_tokens=self.max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body=self.extra_body)
        for chunk in stream:
            now = time.perf_counter() - start
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
                record.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                record.cached_tokens = getattr(details, "cached_tokens", None) if details else None
                record.speculative = (chunk.model_extra or {}).get("speculative")
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content or delta.tool_calls:
                    record.ttft_s = now if record.ttft_s is None else record.ttft_s
                    record.last_token_s = now
                record.text += delta.content or ""
                for part in delta.tool_calls or ():
                    call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = part.id or call["id"]
                    if part.function is not None:
                        call["name"] += part.function.name or ""
                        call["arguments"] += part.function.arguments or ""
                record.finish_reason = choice.finish_reason or record.finish_reason
        record.latency_s = time.perf_counter() - start
        record.tool_calls = [calls[i] for i in sorted(calls)]


class LlamaCppFunctionCalling:
    """llama-cpp-python's own function calling on a GGUF, in process, greedy and with no repetition penalty."""

    def __init__(self, settings: AgentBenchSettings):
        from llama_cpp import Llama

        from .llamacpp_peers import default_threads

        self.llama = Llama(model_path=settings.peer_gguf, n_ctx=settings.peer_context, verbose=False,
                           n_threads=settings.peer_threads or default_threads())
        self.max_tokens = settings.max_tokens

    def __call__(self, messages: list, tool_choice, record: TurnRecord) -> None:
        start = time.perf_counter()
        answer = self.llama.create_chat_completion(
            messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0.0, top_k=0, top_p=1.0,
            min_p=0.0, repeat_penalty=1.0, max_tokens=self.max_tokens)
        record.latency_s = time.perf_counter() - start
        choice = answer["choices"][0]
        message = choice["message"]
        record.text = message.get("content") or ""
        record.tool_calls = [{"id": c.get("id"), "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]} for c in message.get("tool_calls") or ()]
        record.finish_reason = choice.get("finish_reason")
        record.output_tokens = answer["usage"]["completion_tokens"]
        record.prompt_tokens = answer["usage"]["prompt_tokens"]


# ---------------------------------------------------------------------------------------------- the sessions

def run_session(chat, method: str, task: AgentTask, settings: AgentBenchSettings) -> list[TurnRecord]:
    """One agent session: turns until a text answer, max_turns, or a turn that failed or was cut at max_tokens."""
    repo = Repository(task.files)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.instruction}]
    records = []
    for turn in range(1, settings.max_turns + 1):
        name = STEERING[turn - 1] if turn <= len(STEERING) else "auto"
        choice = name if name == "auto" else {"type": "function", "function": {"name": name}}
        record = TurnRecord(method, task.id, turn, name)
        records.append(record)
        try:
            chat(messages, choice, record)
        except Exception as exc:  # an HTTP error, a timeout, the peer's error: the session cannot go on
            record.error = f"{type(exc).__name__}: {exc}"
            break
        record.invalid_calls = [why for why in map(invalid_call, record.tool_calls) if why]
        record.ok = True
        if not record.tool_calls or record.finish_reason == "length":
            break  # a text answer ends the session; a call cut at max_tokens cannot be run
        calls = [{**c, "id": c["id"] or f"call_{uuid.uuid4().hex[:12]}"} for c in record.tool_calls]
        # content "" rather than null: some chat templates (SmolLM2's) concatenate it as a string
        messages.append({"role": "assistant", "content": record.text, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": repo.run(c["name"], c["arguments"])}
                     for c in calls]
    return records


def invalid_call(call: dict) -> str | None:
    """Why a call is not a valid call of one of the tools (None: it is)."""
    import jsonschema

    schema = SCHEMAS.get(call["name"])
    if schema is None:
        return f"{call['name']}: no such tool"
    try:
        jsonschema.validate(json.loads(call["arguments"]), schema)
    except json.JSONDecodeError as e:
        return f"{call['name']}: arguments are not JSON ({e.msg})"
    except jsonschema.ValidationError as e:
        return f"{call['name']}: {e.message}"
    return None


def make_methods(settings: AgentBenchSettings) -> dict:
    methods = {name: OpenAIChat(url, settings) for name, url in settings.servers}
    if settings.plain and settings.servers:
        methods[PLAIN] = OpenAIChat(settings.servers[0][1], settings, {"num_speculative_tokens": 0})
    if settings.peer_gguf:
        methods[PEER] = LlamaCppFunctionCalling(settings)
    return methods


def bench_agent(settings: AgentBenchSettings) -> dict:
    methods = make_methods(settings)
    t0 = time.perf_counter()
    records = [r for task in settings.tasks for name, chat in methods.items()
               for r in run_session(chat, name, task, settings)]
    return summarize(records, time.perf_counter() - t0, settings)


# ------------------------------------------------------------------------------------------------ the report

def summarize(records: list[TurnRecord], wall_s: float, settings: AgentBenchSettings) -> dict:
    methods = settings.methods
    report = {
        "workload": "agent",
        "config": {"methods": methods, "servers": dict(settings.servers), "peer_gguf": settings.peer_gguf,
                   "tasks": [t.id for t in settings.tasks], "max_turns": settings.max_turns,
                   "max_tokens": settings.max_tokens},
        "requests": len(records), "succeeded": sum(r.ok for r in records), "wall_s": wall_s,
        "errors": [f"{r.method} {r.task} turn {r.turn}: {r.error}" for r in records if r.error],
        "methods": {m: method_totals([r for r in records if r.method == m]) for m in methods},
        "turns": turn_rows(records, methods),
        "invalid_calls": [f"{r.method} {r.task} turn {r.turn}: {why}" for r in records for why in r.invalid_calls],
        "same_text": same_text(records, methods),
        "records": [asdict(r) for r in records],
    }
    report["speedups"] = speedups(report["methods"])
    return report


def method_totals(records: list[TurnRecord]) -> dict:
    ok = [r for r in records if r.ok]
    streamed = [r for r in ok if r.decode_s]
    decode_tokens = sum(r.output_tokens - 1 for r in streamed)
    decode_s = sum(r.decode_s for r in streamed)
    return {
        "turns": len(records), "succeeded": len(ok), "output_tokens": sum(r.output_tokens for r in ok),
        "calls": sum(len(r.tool_calls) for r in ok), "invalid_calls": sum(len(r.invalid_calls) for r in ok),
        "end_to_end_s": sum(r.latency_s for r in ok),
        "tokens_per_s": _ratio(sum(r.output_tokens for r in ok), sum(r.latency_s for r in ok)),
        "decode_tokens_per_s": _ratio(decode_tokens, decode_s) if streamed else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
    }


def turn_rows(records: list[TurnRecord], methods: list[str]) -> list[dict]:
    """Per turn number and method: tokens, medians of decode rate and latency."""
    rows = []
    for turn in sorted({r.turn for r in records}):
        for m in methods:
            group = [r for r in records if r.turn == turn and r.method == m and r.ok]
            if not group:
                continue
            rates = [(r.output_tokens - 1) / r.decode_s for r in group if r.decode_s]
            rows.append({"turn": turn, "tool_choice": group[0].tool_choice, "method": m, "sessions": len(group),
                         "output_tokens": sum(r.output_tokens for r in group),
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
        if r.method in (PLAIN, PEER) or not r.ok or (r.task, r.turn) not in key:
            continue
        checked += 1
        ref = key[(r.task, r.turn)]
        if r.text != ref.text or _calls(r) != _calls(ref):
            differences.append(f"{r.method} {r.task} turn {r.turn}")
    return {"reference": PLAIN, "checked": checked, "differences": differences}


def speedups(totals: dict) -> dict:
    """Each method against plain (decode rate after the first token) and against the peer, end to end: the
    sessions' total time (the peer's over ours: the same tasks and turns, though not the same tokens, since the peer
    decodes bare arguments where our template wraps a call) and the tokens/s of all turns."""
    out = {}
    plain, peer = totals.get(PLAIN), totals.get(PEER)
    for m, t in totals.items():
        out[m] = {"decode_vs_plain": _ratio(t["decode_tokens_per_s"], plain and plain["decode_tokens_per_s"]),
                  "session_time_vs_peer": _ratio(peer and peer["end_to_end_s"], t["end_to_end_s"]),
                  "tokens_per_s_vs_peer": _ratio(t["tokens_per_s"], peer and peer["tokens_per_s"])}
    return out


def _calls(record: TurnRecord) -> list:
    return [(c["name"], c["arguments"]) for c in record.tool_calls]


def _ratio(a, b):
    return a / b if a is not None and b else None

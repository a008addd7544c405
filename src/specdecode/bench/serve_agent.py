"""`specdecode bench serve --workload agent`: tool-using coding sessions, driven by the OpenAI client.

Each built-in task (agent_tasks.py, prompts/agent.jsonl) is a small repository held in memory and an instruction
of a kind coding agents are given (edit, rename, add a test, fix a bug from a failing test's output, ...). An agent
session is the loop every OpenAI-API agent runs: send the history with `tools` (list_files, read_file, write_file)
and `tool_choice: "auto"`, execute the calls the answer makes against the repository, append the assistant message
and one `role: "tool"` message per call, and send again, until the model answers with text (the session's end) or
max_turns. Nothing is steered by default: the model's own tokens decide whether it calls a tool, as in any agent
framework. `steer=True` (--steer) names the tool of the first three turns (list, read, write) instead. After the
session the task's check runs on the repository as the session left it: completed or not.

Methods, each a server or process of its own:
- our servers given as NAME=URL (e.g. one started with the default draft, one with `--draft none` named `plain`,
  the reference of the same-text check); each session streams, so the decode rate after the first token is seen;
- optionally (plain=True) `plain` as the first server again with num_speculative_tokens 0 (our extension): it
  shares that server's prefix cache, so its sessions may reuse prompts another method just prefilled;
- llama.cpp's own server (`llama-server --jinja`, llama_server.py) on the peer GGUF, started here on 127.0.0.1
  with the same threads and context, its prompt cache on as its users run it; streamed like ours;
- llama-cpp-python's own function calling on the peer GGUF, in process (`Llama.create_chat_completion(tools=...,
  tool_choice=...)` with the GGUF's own chat template), the calls' arguments sent as JSON values, as the template
  must get them (as_template_takes). Not streamed: compared end to end.

The order is fair (issue 44): before the first task every method answers one untimed request holding the system
prompt and the tools (max_tokens 1), so each starts its sessions with that shared prefix in its own cache; then the
methods run task by task, the order rotated by one each task (task i starts with method i mod n), so that no
method always runs first after a cold start or right after another. Methods that are separate processes share no
cache, so no method's session reuses another's prefill.

Between two turns the client runs the tools and then waits tool_latency_s (0 by default; a real agent's tools take
time): a turn's idle time is the time from the previous answer's end to its request. Reported (agent_report.py): per
method, tasks completed, turns, valid calls, session time, decode rate; per turn, prefill tokens (cold and from
cache: usage.prompt_tokens_details.cached_tokens, or llama-server's timings.cache_n), decode tokens, forced tokens,
drafted and kept (our usage chunk's `speculative` statistics), idle time.

Calls read by the client (client_parses_calls, on by default; the peers only): the default model writes its calls
as a ```json block, which our server reads into tool_calls but both peers return as content ("stop"), so their
sessions would end at turn 1 and session times would compare 1 turn with 5. Where a peer's answer has no
tool_calls, the client reads its content with our server's own parser (the Hermes dialect of the default model's
template and the start forms: a <tool_call> block, or at the very start a fenced or bare call object or list naming
a declared tool) and goes on as an agent with such a fallback would: the assistant message sent back carries the
calls, exactly as for our servers' answers, so every method's server renders the same conversation. Those calls are
counted apart (client_parsed_calls), never as the server's own.
"""

from __future__ import annotations

import contextlib
import time
import uuid

from ..structured.tool_calls import Tool, ToolError, rendered_call
from ..structured.tool_dialects import Hermes, ToolFormat
from .agent_records import (CLIENT_PARSED, LLAMA_SERVER, PEER, PLAIN, PROVENANCE, STEERING, WARM_UP,
                            AgentBenchSettings, SessionRecord, TurnRecord)
from .agent_report import summarize
from .agent_tasks import SYSTEM, TOOLS, AgentTask, Repository, check_task, invalid_call


# ----------------------------------------------------------------------------------------------- the methods

class OpenAIChat:
    """A server through the OpenAI client, streamed: text, tool calls assembled by index, timings, usage.

    The decode time after the first token: from our servers' provenance chunks (extra_body {"specdecode":
    {"provenance": true}}: one chunk per token as it is decided, also while a call's text is held back until the
    call is whole), from llama-server's own timings (predicted_n tokens in predicted_ms), else from the chunks of
    text and calls."""

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

    def __call__(self, messages: list, tool_choice, record: TurnRecord, max_tokens: int | None = None) -> None:
        start = time.perf_counter()
        calls: dict[int, dict] = {}
        stream = self.client.chat.completions.create(
            model=self.model, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=0,
            max_tokens=max_tokens or self.max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body=self.extra_body)
        events: list[float] = []  # arrival of each token event (our provenance chunks)
        for chunk in stream:
            now = time.perf_counter() - start
            extra = chunk.model_extra or {}
            record.timings = extra.get("timings") or record.timings
            if chunk.usage is not None:
                _read_usage(record, chunk.usage, extra)
            events += [now] * len((extra.get("specdecode") or {}).get("tokens") or ())
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
        if record.cached_tokens is None and record.timings and "cache_n" in record.timings:
            record.cached_tokens = record.timings["cache_n"]  # llama-server's own count of reused prompt tokens
        _decode_time(record, events)


def _decode_time(record: TurnRecord, events: list[float]) -> None:
    timings = record.timings or {}
    if len(events) >= 2:
        record.decode_tokens, record.decode_time_s = len(events) - 1, events[-1] - events[0]
    elif timings.get("predicted_n", 0) >= 2 and timings.get("predicted_ms"):
        # its generation time starts after the prompt's evaluation, which gave the first token
        record.decode_tokens, record.decode_time_s = timings["predicted_n"] - 1, timings["predicted_ms"] / 1000
    elif record.ttft_s is not None and record.last_token_s is not None and record.output_tokens >= 2:
        record.decode_tokens, record.decode_time_s = record.output_tokens - 1, record.last_token_s - record.ttft_s


def _read_usage(record: TurnRecord, usage, extra: dict) -> None:
    record.output_tokens = usage.completion_tokens
    record.prompt_tokens = usage.prompt_tokens
    details = usage.prompt_tokens_details
    record.cached_tokens = getattr(details, "cached_tokens", None) if details else None
    stats = extra.get("speculative") or (extra.get("specdecode") or {}).get("stats")
    record.speculative = stats or record.speculative


class LlamaCppFunctionCalling:
    """llama-cpp-python's own function calling on a GGUF, in process, greedy and with no repetition penalty."""

    def __init__(self, settings: AgentBenchSettings):
        from llama_cpp import Llama

        from .llamacpp_peers import default_threads

        self.llama = Llama(model_path=settings.peer_gguf, n_ctx=settings.peer_context, verbose=False,
                           n_threads=settings.peer_threads or default_threads())
        self.max_tokens = settings.max_tokens

    def __call__(self, messages: list, tool_choice, record: TurnRecord, max_tokens: int | None = None) -> None:
        start = time.perf_counter()
        answer = self.llama.create_chat_completion(
            messages=as_template_takes(messages), tools=TOOLS, tool_choice=tool_choice, temperature=0.0, top_k=0,
            top_p=1.0, min_p=0.0, repeat_penalty=1.0, max_tokens=max_tokens or self.max_tokens)
        record.latency_s = time.perf_counter() - start
        choice = answer["choices"][0]
        message = choice["message"]
        record.text = message.get("content") or ""
        record.tool_calls = [{"id": c.get("id"), "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]} for c in message.get("tool_calls") or ()]
        record.finish_reason = choice.get("finish_reason")
        record.output_tokens = answer["usage"]["completion_tokens"]
        record.prompt_tokens = answer["usage"]["prompt_tokens"]

    def close(self) -> None:
        self.llama.close()


def as_template_takes(messages: list) -> list:
    """The messages with each call's arguments as a JSON value. llama-cpp-python hands the messages to the chat
    template as they are, and Qwen's writes a call's arguments with tojson, so a string would come back quoted
    ("{\\"path\\": ...}"); our server and llama-server parse them first (rendered_call), so every method
    renders the same history. Arguments that are not JSON stay as they are."""
    return [{**m, "tool_calls": [_as_json(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def _as_json(call: dict) -> dict:
    try:
        return rendered_call(call)
    except ToolError:
        return call


# ------------------------------------------------------------------------------------- calls read by the client

# Our server's parser for the default model's template (Qwen2.5: Hermes) with the start forms, on the bench's tools
CLIENT_FORMAT = ToolFormat(Hermes(), tuple(Tool(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS),
                           "auto", len(TOOLS), strict=False, terms=())


def client_parses(method: str, settings: AgentBenchSettings) -> bool:
    """Whether the client reads calls out of this method's text answers: the peers' only (ours return tool_calls)."""
    return settings.client_parses_calls and method in CLIENT_PARSED


def read_calls(record: TurnRecord) -> None:
    """An answer with no tool_calls: the calls its content holds in a form our server reads, read as our server
    would (the content before them kept, the wrapping and anything after the last call dropped), counted apart."""
    parser = CLIENT_FORMAT.parser()
    parser.feed(record.text)
    parser.finish()
    if parser.calls:
        record.server_text, record.text = record.text, parser.content
        record.tool_calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in parser.calls]
        record.client_parsed_calls = len(parser.calls)


# ---------------------------------------------------------------------------------------------- the sessions

def tool_choice_of(turn: int, settings: AgentBenchSettings) -> str:
    return STEERING[turn - 1] if settings.steer and turn <= len(STEERING) else "auto"


def run_session(chat, method: str, task: AgentTask, settings: AgentBenchSettings, position: int = 0,
                sleep=time.sleep) -> tuple[SessionRecord, list[TurnRecord]]:
    """One agent session (turns until a text answer, max_turns, or a turn that failed or was cut at max_tokens),
    then the task's check on the repository it left."""
    repo = Repository(task.files)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.instruction}]
    session = SessionRecord(method, task.id, task.kind, position)
    records = []
    start = last_end = time.perf_counter()
    for turn in range(1, settings.max_turns + 1):
        name = tool_choice_of(turn, settings)
        choice = name if name == "auto" else {"type": "function", "function": {"name": name}}
        record = TurnRecord(method, task.id, turn, name, idle_s=time.perf_counter() - last_end)
        records.append(record)
        try:
            chat(messages, choice, record)
        except Exception as exc:  # an HTTP error, a timeout, the peer's error: the session cannot go on
            record.error = f"{type(exc).__name__}: {exc}"
            session.ended = "error"
            break
        finally:
            last_end = time.perf_counter()
        if client_parses(method, settings) and not record.tool_calls:
            read_calls(record)
        session.client_parsed_calls += record.client_parsed_calls
        record.invalid_calls = [why for why in map(invalid_call, record.tool_calls) if why]
        record.ok = True
        session.calls_after_turn_1 |= turn > 1 and bool(record.tool_calls)
        if record.finish_reason == "length":
            session.ended = "length"  # a call cut at max_tokens cannot be run
            break
        if not record.tool_calls:
            session.ended = "answer"
            break
        messages += tool_turn(record, repo)
        if settings.tool_latency_s:
            sleep(settings.tool_latency_s)
    session.turns, session.session_s = len(records), last_end - start
    result = check_task(task, repo.files)
    session.completed, session.check, session.changed = result.passed, result.detail, result.changed
    return session, records


def tool_turn(record: TurnRecord, repo: Repository) -> list[dict]:
    """The assistant message of a turn's calls and one tool message per call, the calls run on the repository."""
    calls = [{**c, "id": c["id"] or f"call_{uuid.uuid4().hex[:12]}"} for c in record.tool_calls]
    # content "" rather than null: some chat templates (SmolLM2's) concatenate it as a string
    assistant = {"role": "assistant", "content": record.text, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}
    return [assistant] + [{"role": "tool", "tool_call_id": c["id"], "content": repo.run(c["name"], c["arguments"])}
                          for c in calls]


def warm_up(chat, method: str) -> TurnRecord:
    """One untimed request holding the system prompt and the tools, so that the method's cache starts with them."""
    record = TurnRecord(method, "warm-up", 0, "auto")
    try:
        chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": WARM_UP}], "auto", record,
             max_tokens=1)
        record.ok = True
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def task_order(methods: list[str], index: int, rotate: bool) -> list[str]:
    """The methods' order for task `index`: rotated by one each task (or always the given order)."""
    if not rotate or not methods:
        return list(methods)
    shift = index % len(methods)
    return methods[shift:] + methods[:shift]


@contextlib.contextmanager
def started_methods(settings: AgentBenchSettings):
    """Every method's chat callable, by name in settings.methods' order; llama-server runs while this is open."""
    from .llama_server import LlamaServer, find_binary
    from .llamacpp_peers import default_threads

    with contextlib.ExitStack() as stack:
        methods = {name: OpenAIChat(url, settings, PROVENANCE) for name, url in settings.servers}
        if settings.plain and settings.servers:
            methods[PLAIN] = OpenAIChat(settings.servers[0][1], settings, {**PROVENANCE, "num_speculative_tokens": 0})
        if LLAMA_SERVER in settings.methods:
            server = LlamaServer(find_binary(settings.llama_server or None), settings.peer_gguf,
                                 settings.peer_threads or default_threads(), settings.peer_context)
            stack.enter_context(server)
            methods[LLAMA_SERVER] = OpenAIChat(server.url, settings)
            methods[LLAMA_SERVER].command = server.command
        if PEER in settings.methods:
            methods[PEER] = stack.enter_context(contextlib.closing(LlamaCppFunctionCalling(settings)))
        yield {name: methods[name] for name in settings.methods}


def bench_agent(settings: AgentBenchSettings) -> dict:
    sessions, records, warm = [], [], []
    with started_methods(settings) as methods:
        if settings.warm:
            warm = [warm_up(chat, name) for name, chat in methods.items()]
        t0 = time.perf_counter()
        for index, task in enumerate(settings.tasks):
            for position, name in enumerate(task_order(list(methods), index, settings.rotate)):
                session, turns = run_session(methods[name], name, task, settings, position)
                sessions.append(session)
                records += turns
        wall_s = time.perf_counter() - t0
        commands = {name: chat.command for name, chat in methods.items() if hasattr(chat, "command")}
    return summarize(sessions, records, wall_s, settings, warm=warm, commands=commands)

"""The agent workload's records and settings: what a turn and a session recorded, what a run is asked to do.

Below both the driver (serve_agent.py) and the report (agent_report.py), which read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..errors import OptionError
from .agent_tasks import AgentTask, builtin_tasks

STEERING = ("list_files", "read_file", "write_file")  # --steer: the named tool_choice of the first turns
PLAIN = "plain"
PEER = "llamacpp-function-calling"
LLAMA_SERVER = "llama-server"
CLIENT_PARSED = (LLAMA_SERVER, PEER)  # the methods whose text answers the client may read calls out of
WARM_UP = "Warm-up request: reply OK."
PROVENANCE = {"specdecode": {"provenance": True}}  # our servers: a chunk per token, to time the decoding


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
    cached_tokens: int | None = None  # prompt tokens whose KV came from the server's cache (None: not reported)
    latency_s: float | None = None
    ttft_s: float | None = None  # the first chunk with text or a call (a call may be held back until it is whole)
    last_token_s: float | None = None  # None where not streamed (llama-cpp-python)
    decode_tokens: int | None = None  # tokens after the first, over decode_time_s (None: not measured)
    decode_time_s: float | None = None
    idle_s: float = 0.0  # from the previous turn's answer to this request: the tools' time
    speculative: dict | None = None  # our server's usage-chunk statistics
    timings: dict | None = None  # llama-server's "timings" (prompt_n, cache_n, predicted_n, draft_n, ...)
    invalid_calls: list = field(default_factory=list)  # "name: why" for each call its schema rejects
    client_parsed_calls: int = 0  # tool_calls the client read out of the content (then all of them; 0: the server's)
    server_text: str | None = None  # the content as the server returned it, where the client read calls out of it

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first token (measured methods only)."""
        if not self.decode_tokens or not self.decode_time_s or self.decode_time_s <= 0:
            return None
        return self.decode_tokens / self.decode_time_s


@dataclass
class SessionRecord:
    method: str
    task: str
    kind: str
    position: int  # the method's place in this task's order (0: first)
    turns: int = 0
    ended: str = "max_turns"  # "answer" (text), "max_turns", "length" (a turn cut at max_tokens), "error"
    session_s: float = 0.0  # from turn 1's request to the last answer, idle time included
    completed: bool = False  # the task's check passed on the repository the session left
    check: str = ""
    changed: list = field(default_factory=list)
    calls_after_turn_1: bool = False  # the session still called tools after its first turn
    client_parsed_calls: int = 0  # calls the client read out of the answers' content


@dataclass
class AgentBenchSettings:
    servers: Sequence[tuple[str, str]]  # (name, base URL) of our servers
    plain: bool = False  # also `plain` on the first server (num_speculative_tokens 0; shares its cache)
    peer_gguf: str | None = None  # the GGUF of the peers (None: no peer)
    function_calling: bool = True  # with peer_gguf: llama-cpp-python's function calling
    llama_server: str | None = None  # with peer_gguf: the llama-server binary ("" finds the built one)
    peer_threads: int | None = None
    peer_context: int = 8192
    tasks: Sequence[AgentTask] = ()  # empty: the built-in tasks
    nb_tasks: int | None = None
    max_turns: int = 6
    max_tokens: int = 512  # per turn: a rewrite re-emits the whole file
    steer: bool = False
    client_parses_calls: bool = True  # the peers' text answers holding a call are read by the client (never ours)
    tool_latency_s: float = 0.0
    warm: bool = True
    rotate: bool = True
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self):
        if not self.servers and not self.peer_gguf:
            raise OptionError("servers", "give at least one server URL (or a peer GGUF)")
        least = len(STEERING) + 1 if self.steer else 1
        if self.max_turns < least:
            raise OptionError("max_turns", f"max_turns must be >= {least}"
                              + (" (list, read, write, answer)" if self.steer else "") + f", got {self.max_turns}")
        if self.max_tokens < 2:
            raise OptionError("max_tokens", f"max_tokens must be >= 2, got {self.max_tokens}")
        if self.tool_latency_s < 0:
            raise OptionError("tool_latency", f"tool latency must be >= 0 s, got {self.tool_latency_s}")
        if self.llama_server is not None and not self.peer_gguf:
            raise OptionError("llama_server", "llama-server needs the GGUF to serve: give --peer-gguf")
        names = [name for name, _ in self.servers]
        reserved = {PEER, LLAMA_SERVER} | ({PLAIN} if self.plain else set())
        if len(set(names)) != len(names) or reserved & set(names):
            raise OptionError("servers", f"server names must be distinct and not {sorted(reserved)}: {names}")
        tasks = list(self.tasks) or builtin_tasks()
        self.tasks = tasks[:self.nb_tasks] if self.nb_tasks else tasks

    @property
    def methods(self) -> list[str]:
        names = [n for n, _ in self.servers] + ([PLAIN] if self.plain and self.servers else [])
        if self.peer_gguf and self.llama_server is not None:
            names.append(LLAMA_SERVER)
        return names + ([PEER] if self.peer_gguf and self.function_calling else [])

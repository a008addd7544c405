"""`specdecode bench serve --workload multi-turn | shared-system`: chat workloads that measure prefix reuse.

multi-turn: `conversations` chats run at once, each sending `turns` streamed /v1/chat/completions requests one after
another; turn t sends the whole history (the system prompt, the earlier user messages and the answers as returned)
plus a new user message, as a chat client does. Reported per turn: the median TTFT over the conversations and
cached_tokens / prompt_tokens (usage.prompt_tokens_details.cached_tokens, OpenAI's field).
shared-system: `num_requests` one-turn chats with one long system prompt (built in: a code-review instruction text
of ~900 Qwen tokens, prompts/shared_system.txt) and different user questions; the first is sent alone, so that the
later ones (at `concurrency`) can find its prefix cached. Reported: the TTFT of the first against the median of the
later ones, and the hit rates.

The system prompt starts with a tag naming the run (and, in multi-turn, the conversation): the first prefill of a
run is cold even on a server that has run this benchmark before, and conversations share no prefix, so turn 1
measures a cold prompt and later turns the reuse of their own history. Requests go only to the URL given, bounded
in number (conversations x turns, num_requests) and in time (duration_s, the per-request timeout).

The peer (bench_chat_and_llama_server): llama.cpp's own server (llama_server.py) started here on 127.0.0.1 with
the peer GGUF, threads and context, one slot per chat running at once, its prompt cache on; the same chats are sent
to it after ours, under a tag of their own, so both start cold. It reports cached_tokens in usage as we do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Sequence

from .prompts import parse_prompts
from .serve import (ClientSettings, RequestRecord, closed_loop, make_client, percentiles, request_row, sampling_body,
                    stream_request, totals)

WORKLOADS = ("multi-turn", "shared-system")


def builtin_system_prompt() -> str:
    return resources.files("specdecode.bench.prompts").joinpath("shared_system.txt").read_text(encoding="utf-8")


def builtin_questions() -> list[str]:
    text = resources.files("specdecode.bench.prompts").joinpath("chat_questions.txt").read_text(encoding="utf-8")
    return [p.text for p in parse_prompts(text, "chat_questions.txt")]


@dataclass
class ChatBenchSettings(ClientSettings):
    workload: str = "multi-turn"
    questions: Sequence[str] = ()  # the user messages, cycled (empty: the built-in ones)
    system_prompt: str | None = None  # None: the built-in one
    conversations: int = 4  # multi-turn: chats running at once
    turns: int = 5  # multi-turn: requests of each chat, one after another
    num_requests: int = 16  # shared-system: requests in all, the first one alone
    concurrency: int = 4  # shared-system: clients sending the later requests
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))  # the tag that keeps runs apart

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown chat workload {self.workload!r}: use one of {', '.join(WORKLOADS)}")
        for name in ("conversations", "turns", "num_requests", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.questions = list(self.questions) or builtin_questions()
        if self.system_prompt is None:
            self.system_prompt = builtin_system_prompt()
        if not self.system_prompt.strip():
            raise ValueError("the system prompt is empty")

    @property
    def planned(self) -> int:
        return self.conversations * self.turns if self.workload == "multi-turn" else self.num_requests


@dataclass
class ChatRecord(RequestRecord):
    conversation: int = 0  # multi-turn: the chat; shared-system: the request's number
    turn: int = 1


def system_message(settings: ChatBenchSettings, tag: str) -> dict:
    # The tag leads, its distinct part first, so that no prefix is shared beyond what the workload means to share.
    return {"role": "system", "content": f"[{tag}]\n{settings.system_prompt}"}


async def chat_request(http, settings, messages: list[dict], record: ChatRecord, **extra) -> ChatRecord:
    """One streamed chat request (settings: any ClientSettings); extra: more body fields (the edit workload's K)."""
    body = {"messages": messages, **sampling_body(settings), **extra}
    return await stream_request(http, "/v1/chat/completions", body, record)


async def conversation(http, settings: ChatBenchSettings, index: int, t0: float, end: float | None) -> list:
    """One chat's turns in order; it stops at its first failure, since the next turn needs that answer."""
    messages = [system_message(settings, f"{index + 1}/{settings.conversations}, run {settings.run_id}")]
    records = []
    for turn in range(1, settings.turns + 1):
        if end is not None and time.perf_counter() > end:
            break
        question = (index + turn - 1) % len(settings.questions)
        messages.append({"role": "user", "content": settings.questions[question]})
        record = ChatRecord(question, time.perf_counter() - t0, conversation=index, turn=turn)
        records.append(await chat_request(http, settings, list(messages), record))
        if not record.ok:
            break
        messages.append({"role": "assistant", "content": record.text})
    return records


async def one_turn(http, settings: ChatBenchSettings, index: int, t0: float) -> ChatRecord:
    question = index % len(settings.questions)
    messages = [system_message(settings, f"run {settings.run_id}"),
                {"role": "user", "content": settings.questions[question]}]
    record = ChatRecord(question, time.perf_counter() - t0, conversation=index)
    return await chat_request(http, settings, messages, record)


async def run_multi_turn(settings: ChatBenchSettings) -> tuple[list[ChatRecord], float]:
    async with make_client(settings, settings.conversations) as http:
        t0 = time.perf_counter()
        end = t0 + settings.duration_s if settings.duration_s else None
        chats = await asyncio.gather(*(conversation(http, settings, c, t0, end)
                                       for c in range(settings.conversations)))
        return [r for chat in chats for r in chat], time.perf_counter() - t0


async def run_shared_system(settings: ChatBenchSettings) -> tuple[list[ChatRecord], float]:
    async with make_client(settings, settings.concurrency) as http:
        t0 = time.perf_counter()
        end = t0 + settings.duration_s if settings.duration_s else None

        def send(index):
            return one_turn(http, settings, index, t0)

        records = [await send(0)]  # alone, and finished before the others start: they can reuse its prefix
        records += await closed_loop(send, range(1, settings.num_requests), settings.concurrency, end)
        return records, time.perf_counter() - t0


def group_row(records: list[ChatRecord]) -> dict:
    """TTFT (median, p90) and prompt reuse of a group of requests (a turn, or the first/later requests)."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    # only requests whose server reported both counts: another server may report no cache details at all
    usage = [r for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt, cached = sum(r.prompt_tokens for r in usage), sum(r.cached_tokens for r in usage)
    return {"requests": len(records), "succeeded": len(ok),
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p90_s": percentiles(ttfts)["p90"],
            "prompt_tokens": prompt / len(usage) if usage else None,  # means per request
            "cached_tokens": cached / len(usage) if usage else None,
            "hit_rate": cached / prompt if prompt else None}


def _ratio(last: dict, first: dict) -> float | None:
    if last["ttft_median_s"] is None or not first["ttft_median_s"]:
        return None
    return last["ttft_median_s"] / first["ttft_median_s"]


def summarize_chat(records: list[ChatRecord], wall_s: float, settings: ChatBenchSettings) -> dict:
    config = {k: v for k, v in asdict(settings).items() if k not in ("questions", "system_prompt", "api_key")}
    config.update(num_questions=len(settings.questions), system_prompt_chars=len(settings.system_prompt))
    report = {"workload": settings.workload, "config": config, **totals(records, wall_s),
              "skipped": settings.planned - len(records), "hit_rate": group_row(records)["hit_rate"]}
    if settings.workload == "multi-turn":
        rows = [{"turn": t, **group_row([r for r in records if r.turn == t])} for t in range(1, settings.turns + 1)]
        report["per_turn"] = rows
    else:
        rows = [{"group": "first", **group_row(records[:1])}, {"group": "later", **group_row(records[1:])}]
        report["per_group"] = rows
    # multi-turn: the last turn against turn 1; shared-system: the later requests against the first
    report["ttft_last_vs_first"] = _ratio(rows[-1], rows[0])
    report["per_request"] = [{"conversation": r.conversation, "turn": r.turn, "question": r.prompt_index,
                              **request_row(r)} for r in records]
    return report


def bench_chat(settings: ChatBenchSettings) -> dict:
    run = run_multi_turn if settings.workload == "multi-turn" else run_shared_system
    records, wall_s = asyncio.run(run(settings))
    return summarize_chat(records, wall_s, settings)


def bench_chat_and_llama_server(settings: ChatBenchSettings, binary: str, gguf: str, threads: int,
                                context: int) -> dict:
    """Our server's report with llama-server's beside it, as report["peers"]["llama-server"]."""
    from .llama_server import LlamaServer

    report = bench_chat(settings)
    width = settings.conversations if settings.workload == "multi-turn" else settings.concurrency
    with LlamaServer(binary, gguf, threads, context, parallel=width) as server:
        peer = dataclasses.replace(settings, url=server.url, run_id=secrets.token_hex(4), model=None, api_key=None)
        peer_report = bench_chat(peer)
        peer_report["config"]["command"] = server.command
    report["peers"] = {"llama-server": peer_report}
    return report

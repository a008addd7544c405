"""`specdecode bench serve`: a load generator against a running OpenAI-compatible server (ours or any other).

Requests go only to the URL given, bounded in number (num_requests) and in time (duration_s, per-request
timeout). Arrivals: a fixed concurrency (each of `concurrency` clients sends its next request when the previous one
ends) or Poisson arrivals at `rate` requests/s (exponential gaps, from a seeded generator). Every request streams
(/v1/completions, stream=true, include_usage), so the client sees each chunk: time to first token (TTFT), the gaps
between chunks (inter-token latency, a chunk of n tokens counting its gap / n, n times, when the server reports
usage) and the end-to-end latency. The report: request throughput, output tokens/s, p50/p90/p99 of each latency,
the errors by status; as JSON and, optionally, a matplotlib figure. The chat workloads (multi-turn, shared system
prompt) are in serve_chat.py, the iterative-editing one in serve_edit.py; they share this module's streaming,
client, loop and report helpers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class ClientSettings:
    """What every workload's client sends and how long it waits: the request body's sampling fields, the server."""

    url: str  # the server's base URL, e.g. http://127.0.0.1:8000 (with or without /v1)
    max_tokens: int = 64
    temperature: float = 0.0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 120.0  # per request
    duration_s: float | None = None  # stop sending new requests after this long
    ignore_eos: bool = False  # ask the server to run to max_tokens (our server's extension; others ignore it)


@dataclass(kw_only=True)
class ServeBenchSettings(ClientSettings):
    prompts: Sequence[str]
    num_requests: int = 100
    concurrency: int | None = None  # fixed concurrency (8 when neither it nor a rate is given)
    rate: float | None = None  # Poisson arrivals, requests per second
    seed: int = 0
    min_max_tokens: int | None = None  # mixed lengths: request i's max_tokens drawn from [this, max_tokens]

    def __post_init__(self):
        if self.min_max_tokens is not None and not 1 <= self.min_max_tokens <= self.max_tokens:
            raise ValueError(f"the shortest max_tokens must be 1..max_tokens ({self.max_tokens}), "
                             f"got {self.min_max_tokens}")
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("give either a concurrency or a rate (requests/s), not both")
        if self.concurrency is None and self.rate is None:
            self.concurrency = 8
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.prompts:
            raise ValueError("no prompts to send")


@dataclass
class RequestRecord:
    prompt_index: int
    start: float  # seconds since the run began
    status: int | None = None  # the HTTP status; None: no response (connection error, timeout)
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None  # from the server's usage (None: it reported none)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prompt tokens served from a cache
    last_token_s: float | None = None  # from sending to the last chunk with text (the decode rate's end)
    speculative: dict | None = None  # the usage chunk's "speculative" statistics (our server's extension)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def sampling_body(settings) -> dict:
    """The request fields every workload sends (settings: any of the bench's settings with these attributes)."""
    body = {"max_tokens": settings.max_tokens, "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.model:
        body["model"] = settings.model
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body


async def one_request(http, settings: ServeBenchSettings, index: int, t0: float) -> RequestRecord:
    """Send one streamed completion and time its chunks."""
    prompt_index = index % len(settings.prompts)
    record = RequestRecord(prompt_index, time.perf_counter() - t0)
    body = {"prompt": settings.prompts[prompt_index], **sampling_body(settings)}
    body["max_tokens"] = request_max_tokens(settings, index)
    return await stream_request(http, "/v1/completions", body, record)


def request_max_tokens(settings: ServeBenchSettings, index: int) -> int:
    """Request `index`'s max_tokens: settings.max_tokens, or with min_max_tokens a uniform draw from
    [min_max_tokens, max_tokens] that depends only on (seed, index), so two servers get the same requests."""
    if settings.min_max_tokens is None:
        return settings.max_tokens
    return random.Random(f"{settings.seed}/{index}").randint(settings.min_max_tokens, settings.max_tokens)


async def stream_request(http, path: str, body: dict, record: RequestRecord) -> RequestRecord:
    """POST a streamed request (completions or chat) and fill record with its timings, text and usage."""
    start = time.perf_counter()
    last, chunks, usage = None, [], None
    try:
        async with http.stream("POST", path, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                record.error = _error_message(response)
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    record.error = str(data["error"].get("message", data["error"]))
                    break
                if data.get("usage"):
                    usage, record.speculative = data["usage"], data.get("speculative")
                text = _chunk_text(data)
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    record.ttft_s = now - start
                else:
                    chunks.append(now - last)
                last = now
                record.text += text
    except Exception as exc:  # httpx errors, a connection cut mid-stream, a timeout
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency_s = time.perf_counter() - start
    record.last_token_s = None if last is None else last - start
    _count_tokens(record, usage, chunks, last is not None)
    return record


def _chunk_text(data: dict) -> str:
    # /v1/completions streams choices[].text, /v1/chat/completions choices[].delta.content, and a tool call's
    # arguments as choices[].delta.tool_calls[].function.arguments (an agent's answer is often only a call)
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or _call_text(c.get("delta") or {})
                   for c in data.get("choices", []))


def _call_text(delta: dict) -> str:
    return "".join((call.get("function") or {}).get("arguments") or "" for call in delta.get("tool_calls") or ())


def _count_tokens(record: RequestRecord, usage: dict | None, chunks: list[float], any_text: bool) -> None:
    record.output_tokens = usage["completion_tokens"] if usage else len(chunks) + any_text
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    # Spread the chunk gaps over the tokens after the first (a speculative step may deliver several at once).
    after_first = max(record.output_tokens - 1, 0)
    if chunks and after_first:
        per_token = sum(chunks) / after_first
        record.itl_s = [per_token] * after_first


def _error_message(response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except Exception:
        return response.text[:200]


def make_client(settings, width: int):
    """An httpx client on the server's base URL that holds `width` connections (one per concurrent request)."""
    import httpx

    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    return httpx.AsyncClient(base_url=base_url(settings.url), headers=headers, limits=limits,
                             timeout=settings.timeout_s)


async def run_load(settings: ServeBenchSettings) -> tuple[list[RequestRecord], float]:
    """(records, wall seconds) of one run."""
    async with make_client(settings, settings.concurrency or 256) as http:
        t0 = time.perf_counter()
        end = t0 + settings.duration_s if settings.duration_s else None
        if settings.concurrency is not None:
            records = await closed_loop(lambda i: one_request(http, settings, i, t0),
                                        range(settings.num_requests), settings.concurrency, end)
        else:
            records = await _poisson(http, settings, t0, end)
        return records, time.perf_counter() - t0


async def closed_loop(send, indices, concurrency: int, end: float | None) -> list:
    """`concurrency` clients, each awaiting send(index) for the next index until none is left or `end` passes."""
    counter = iter(indices)
    records = []

    async def client():
        for index in counter:
            if end is not None and time.perf_counter() > end:
                return
            records.append(await send(index))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


async def _poisson(http, settings, t0, end) -> list[RequestRecord]:
    rng = random.Random(settings.seed)
    tasks = []
    for index in range(settings.num_requests):
        if end is not None and time.perf_counter() > end:
            break
        tasks.append(asyncio.create_task(one_request(http, settings, index, t0)))
        await asyncio.sleep(rng.expovariate(settings.rate))
    return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 and the mean (nearest-rank), or None values when there are none."""
    if not values:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))] for p in PERCENTILES}
    out["mean"] = sum(ordered) / len(ordered)
    return out


def count_errors(records: list[RequestRecord]) -> dict[str, int]:
    """Failed requests by their HTTP status, or by the exception's name when there was no response."""
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = str(r.status) if r.status not in (None, 200) else (r.error or "error").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return errors


def totals(records: list[RequestRecord], wall_s: float) -> dict:
    """The counts, throughputs and latency percentiles of a run (every workload reports these)."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "succeeded": len(ok), "failed": len(records) - len(ok),
        "errors": count_errors(records),
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "latency_s": percentiles([r.latency_s for r in ok if r.latency_s is not None]),
    }


def request_row(r: RequestRecord) -> dict:
    return {"start_s": r.start, "status": r.status, "error": r.error, "ttft_s": r.ttft_s, "latency_s": r.latency_s,
            "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}


def summarize(records: list[RequestRecord], wall_s: float, settings: ServeBenchSettings) -> dict:
    config = {k: v for k, v in asdict(settings).items() if k not in ("prompts", "api_key")}
    config["num_prompts"] = len(settings.prompts)
    return {"config": config, **totals(records, wall_s),
            "per_request": [{"prompt": r.prompt_index, **request_row(r)} for r in records]}


def bench_serve(settings: ServeBenchSettings) -> dict:
    records, wall_s = asyncio.run(run_load(settings))
    return summarize(records, wall_s, settings)


def write_report(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


def plot_serve(report: dict, path: str | Path) -> Path:
    """TTFT and end-to-end latency of each request against its start time, and the latency percentiles."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    rows = [r for r in report["per_request"] if r["latency_s"] is not None]
    fig = Figure(figsize=(12, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_time, ax_pct = fig.subplots(1, 2)
    ax_time.scatter([r["start_s"] for r in rows], [r["latency_s"] for r in rows], s=10, label="end-to-end")
    ax_time.scatter([r["start_s"] for r in rows], [r["ttft_s"] for r in rows], s=10, label="TTFT")
    failed = [r for r in report["per_request"] if r["latency_s"] is None]
    if failed:
        ax_time.scatter([r["start_s"] for r in failed], [0] * len(failed), marker="x", color="red", label="failed")
    ax_time.set_xlabel("request start (s)")
    ax_time.set_ylabel("seconds")
    ax_time.legend()
    names = ("ttft_s", "itl_s", "latency_s")
    for offset, p in enumerate(PERCENTILES):
        values = [report[n][f"p{p}"] or 0.0 for n in names]
        ax_pct.bar([i + (offset - 1) * 0.27 for i in range(len(names))], values, width=0.27, label=f"p{p}")
    ax_pct.set_xticks(range(len(names)), ["TTFT", "inter-token", "end-to-end"])
    ax_pct.set_yscale("log")
    ax_pct.set_ylabel("seconds")
    ax_pct.legend()
    config = report["config"]
    load = f"concurrency {config['concurrency']}" if config.get("concurrency") else f"{config['rate']:g} req/s"
    fig.suptitle(f"{config['url']}: {report['succeeded']}/{report['requests']} ok, {load}, "
                 f"{report['request_throughput']:.2f} req/s, {report['output_tokens_per_s']:.1f} tok/s", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path

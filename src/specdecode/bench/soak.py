"""`specdecode bench soak`: a bounded, mixed, faulty load against a running server, and what it must survive.

For `duration_s`, `concurrency` clients each send request after request, each of a class drawn in turn from CLASSES
(a fixed, seeded order): well-formed requests of every kind the server takes (streamed and not, json_schema, tools,
logprobs, n > 1, seeded sampling) and faults (a stream dropped mid-way, a request cancelled, a malformed body, a
prompt longer than the context, an unknown model, a client timeout). Every prompt carries its request's number, so
an answer given to the wrong request shows; the json_schema requests cycle through `schemas` distinct schemas, so a
grammar cache smaller than that fills. Meanwhile /metrics is read every `scrape_every_s`: the process's RSS, what
malloc holds, and what each bounded cache holds against its bound (soak_memory.py). The first quarter of the run is
a warm-up: then the load pauses until the server holds no request, and that idle point is what the rest is measured
against (whether each cache had reached its bound, and what the server kept per request by the idle point after the
load); the load pauses so once more halfway, for what the second half kept.

After the load, each greedy and seeded request kept aside (`replays` of them) is sent again alone: its answer must
equal the one it got under load (nothing lost or cross-wired between requests). A greedy completion that parts is
sent once more with logprobs: where the two likeliest tokens are within NEAR_TIE_NATS it is reported as a near-tie
flip (llama.cpp rounds by the forward's shape, docs/CORRECTNESS.md), not as a failure; anywhere else it fails. The report holds per class the
status codes, p50/p99 latency and the violations (a 5xx; a bad request answered anything but a 4xx with an error
message; a good one not answered 200 with the expected shape), the memory over time, and `ok`: no violation, no
replay mismatch, memory flat after warm-up, the caches within their bounds, and no request left in the server
(running or queued) once the load is over. Requests go to the URL given only.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from .soak_memory import RSS_GROWTH_LIMIT, WARMUP_FRACTION, memory_summary, scrape  # noqa: F401  (where they were)

CLASSES = ("completion", "chat_stream", "json_schema", "tools", "logprobs", "n_choices", "seeded", "drop_stream",
           "cancel", "malformed", "too_long", "unknown_model", "client_timeout")
BAD_INPUT = {"malformed", "too_long", "unknown_model"}  # must be answered 4xx with a message
NO_ANSWER = {"drop_stream", "cancel", "client_timeout"}  # the client goes away: no status to judge
NEAR_TIE_NATS = 0.05  # a greedy replay that parts where the two likeliest tokens are this close: a near-tie flip
KEEPALIVE_S = 2.0  # seconds an idle connection is kept for the next request
DRAIN_S = 15.0  # after the load, the server must hold no request within this long (nothing left behind)
WORDS = ("def", "sort", "list", "value", "return", "class", "import", "print", "data", "loop", "index", "key")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}}, "required": ["name", "count"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


@dataclass
class SoakSettings:
    url: str
    duration_s: float = 60.0
    concurrency: int = 4
    max_tokens: int = 16
    timeout_s: float = 120.0  # per request (a client_timeout request waits far less)
    scrape_every_s: float = 2.0
    replays: int = 8  # greedy and seeded requests sent again alone afterwards
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    classes: tuple = CLASSES
    schemas: int = 16  # distinct json schemas the json_schema requests cycle through (what a grammar cache holds)
    prime_tokens: int = 1024  # a prompt this long (at most the context) first: the largest forwards' buffers touched

    def __post_init__(self):
        unknown = set(self.classes) - set(CLASSES)
        if unknown:
            raise ValueError(f"unknown soak classes: {', '.join(sorted(unknown))}; use some of {', '.join(CLASSES)}")
        if not self.classes:
            raise ValueError("give at least one soak class")
        if self.duration_s <= 0 or self.concurrency < 1 or self.max_tokens < 1 or self.scrape_every_s <= 0 \
                or self.schemas < 1 or self.prime_tokens < 0:
            raise ValueError("duration_s and scrape_every_s must be > 0, concurrency, max_tokens and schemas >= 1, "
                             "prime_tokens >= 0")
        self.url = self.url.rstrip("/").removesuffix("/v1")


@dataclass
class Outcome:
    cls: str
    index: int
    status: int | None = None  # None: no HTTP status (the client went away, or the connection failed)
    latency_s: float = 0.0
    error: str | None = None  # why this request broke a rule (None: it did not)
    note: str | None = None  # e.g. "not_implemented" for tools answered 400
    replay: dict | None = None  # (path, body, answer) of a greedy or seeded request, to send again alone


@dataclass
class Server:
    """What the soak learns from the server before it starts."""

    model: str
    context_length: int | None
    samples: list = field(default_factory=list)  # memory over time
    warm: dict | None = None  # the idle scrape at the end of the warm-up
    half: dict | None = None  # the idle scrape halfway
    end: dict | None = None  # the idle scrape after the load
    measured: int = 0  # requests sent between the warm-up's and the load's idle scrapes
    second_half: int = 0  # requests sent between the halfway and the load's idle scrapes
    primed: dict | None = None  # the long prompt sent first: its tokens and status


def _prompt(index: int, rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    return f"request {index}: {words}"


def _body(cls: str, index: int, rng: random.Random, s: SoakSettings, server: Server) -> tuple[str, dict | bytes]:
    """The path and body of request `index` of class `cls`."""
    base = {"model": server.model, "max_tokens": rng.randint(1, s.max_tokens)}
    text = _prompt(index, rng)
    chat = [{"role": "user", "content": text}]
    if cls == "completion":
        return "/v1/completions", {**base, "prompt": text, "temperature": 0}
    if cls == "chat_stream":
        return "/v1/chat/completions", {**base, "messages": chat, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}
    if cls == "json_schema":
        return "/v1/chat/completions", {**base, "messages": chat, "temperature": 0, "max_tokens": s.max_tokens,
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "thing", "schema": _schema(index % s.schemas)}}}
    if cls == "tools":
        return "/v1/chat/completions", {**base, "messages": chat, "tools": TOOLS, "temperature": 0}
    if cls == "logprobs":
        return "/v1/completions", {**base, "prompt": text, "logprobs": 2, "temperature": 0}
    if cls == "n_choices":
        return "/v1/completions", {**base, "prompt": text, "n": 2, "temperature": 0.8, "seed": index}
    if cls == "seeded":
        return "/v1/chat/completions", {**base, "messages": chat, "temperature": 0.9, "top_p": 0.95,
                                        "seed": 1000 + index}
    if cls in ("drop_stream", "client_timeout"):
        return "/v1/completions", {**base, "prompt": text, "max_tokens": s.max_tokens, "ignore_eos": True,
                                   "temperature": 0, "stream": cls == "drop_stream"}
    if cls == "cancel":
        return "/v1/chat/completions", {**base, "messages": chat, "max_tokens": s.max_tokens, "ignore_eos": True}
    if cls == "malformed":
        return "/v1/" + rng.choice(["completions", "chat/completions"]), rng.choice(MALFORMED)
    if cls == "too_long":
        length = (server.context_length or 32768) + 16
        return "/v1/completions", {**base, "prompt": [7] * length}
    if cls == "unknown_model":
        return "/v1/chat/completions", {**base, "model": f"no-such-model-{index}", "messages": chat}
    raise ValueError(cls)


def _schema(variant: int) -> dict:
    """SCHEMA with its name's maxLength moved by `variant`: another grammar for the server to compile and keep."""
    name = {**SCHEMA["properties"]["name"], "maxLength": SCHEMA["properties"]["name"]["maxLength"] + variant}
    return {**SCHEMA, "properties": {**SCHEMA["properties"], "name": name}}


MALFORMED = [b"{not json", b"", b"[1, 2, 3]", b'{"prompt": 3}', b'{"messages": "hi"}', b'{"prompt": "a", "n": -1}',
             b'{"prompt": "a", "max_tokens": "many"}', b'{"prompt": "a", "temperature": 1e999}',
             b'{"messages": [{"role": "wizard", "content": "x"}]}', b'{"prompt": "\\ud800"}',
             b'{"prompt": "a", "logprobs": 99}', b'{"messages": [{"role": "user"}], "tools": 5}',
             b'{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": 7}}}',
             '{"prompt": "caf\u00e9", "stop": ["", ""]}'.encode(), b'{"prompt": [1000000000, 5]}', b'{"prompt": [-1]}',
             b'{"prompt": "a", "n": 100000}', b'{"prompt": "a", "seed": 1180591620717411303424}',
             b'{"prompt": ["", "a"]}', b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
             b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
             b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
             b'"json_schema": {"name": "a", "schema": {"type": "string", "pattern": "(a"}}}}']


async def _send(http: httpx.AsyncClient, cls: str, index: int, path: str, body, s: SoakSettings) -> Outcome:
    outcome = Outcome(cls, index)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    start = time.perf_counter()
    try:
        if cls == "drop_stream":
            async with http.stream("POST", path, content=content, headers=headers) as r:
                outcome.status = r.status_code
                async for _ in r.aiter_bytes():
                    break  # the first chunk, then the client goes away
        elif cls == "cancel":
            # a client of its own, closed with its connection: a request cancelled mid-way can leave its connection
            # held in a shared pool, and a cancel-only soak then starved the other requests and the scrapes
            async with httpx.AsyncClient(base_url=http.base_url, headers=http.headers, timeout=http.timeout) as own:
                task = asyncio.ensure_future(own.post(path, content=content, headers=headers))
                await asyncio.sleep(0.05 + 0.2 * (index % 5) / 5)
                if task.done():
                    outcome.status = task.result().status_code
                else:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
        elif cls == "client_timeout":
            try:
                r = await http.post(path, content=content, headers=headers, timeout=0.05 + 0.05 * (index % 3))
                outcome.status = r.status_code
            except httpx.TimeoutException:
                pass
        else:
            r = await http.post(path, content=content, headers=headers)
            outcome.status = r.status_code
            outcome.error, outcome.note, answer = _judge(cls, r, body)
            if answer is not None:
                outcome.replay = {"path": path, "body": body, "answer": answer}
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.perf_counter() - start
    if outcome.status is not None and outcome.status >= 500:
        outcome.error = outcome.error or f"{outcome.status} for {cls}"
    return outcome


def _judge(cls: str, r: httpx.Response, body) -> tuple[str | None, str | None, str | None]:
    """(the rule broken or None, a note, the answer to replay or None) for a request the client waited for."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}", None, None
    if r.status_code >= 400:
        message = _error_message(r)
        if not message:
            return f"{r.status_code} without an error message: {r.text[:300]}", None, None
        if cls in BAD_INPUT:
            return None, None, None
        if cls == "tools" and r.status_code == 400:
            return None, "not_implemented", None  # tool calling not served (yet): counted, not a violation
        return f"a well-formed {cls} request answered {r.status_code}: {message[:300]}", None, None
    if cls in BAD_INPUT:
        return f"bad input answered {r.status_code}, not 4xx", None, None
    try:
        if cls == "chat_stream":
            return _check_stream(r.text), None, None
        data = r.json()
        choices = data["choices"]
        if cls == "n_choices" and len(choices) != 2:
            return f"n=2 answered {len(choices)} choices", None, None
        if cls == "logprobs" and not (choices[0].get("logprobs") or {}).get("tokens"):
            return "logprobs asked, none answered", None, None
        if cls == "json_schema" and choices[0]["finish_reason"] == "stop":
            json.loads(choices[0]["message"]["content"])  # a finished constrained answer is JSON
        answer = choices[0].get("text") if "text" in choices[0] else choices[0]["message"].get("content")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"answer of the wrong shape ({type(exc).__name__}: {exc}): {r.text[:300]}", None, None
    return None, None, answer if cls in ("completion", "seeded", "logprobs") else None


def _check_stream(text: str) -> str | None:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "a stream that did not end with [DONE]"
    for event in events[:-1]:
        if "error" in json.loads(event):
            return f"an error event in a stream: {event[:300]}"
    return None


def _error_message(r: httpx.Response) -> str | None:
    try:
        error = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("message") if isinstance(error, dict) and isinstance(error.get("message"), str) else None


async def _watch(http: httpx.AsyncClient, server: Server, t0: float, every: float, stop: asyncio.Event) -> None:
    while True:
        try:
            r = await http.get("/metrics", timeout=10)
            if r.status_code == 200:
                server.samples.append({"t_s": time.perf_counter() - t0, **scrape(r.text)})
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            continue


async def _drain(http: httpx.AsyncClient, server: Server, t0: float, within_s: float = DRAIN_S) -> None:
    """Scrape until the server holds no request (the cancelled and timed-out ones freed too), at most within_s:
    the last sample tells whether anything was left behind."""
    deadline = time.perf_counter() + within_s
    while True:
        try:
            r = await http.get("/metrics", timeout=10)
            if r.status_code == 200:
                server.samples.append({"t_s": time.perf_counter() - t0, **scrape(r.text)})
                if not server.samples[-1].get("running") and not server.samples[-1].get("queued"):
                    return
        except httpx.HTTPError:
            pass
        if time.perf_counter() > deadline:
            return
        await asyncio.sleep(0.25)


async def _idle(http: httpx.AsyncClient, server: Server, t0: float) -> dict | None:
    """The scrape once the server holds no request (None if it still held some after DRAIN_S)."""
    await _drain(http, server, t0)
    last = server.samples[-1] if server.samples else {}
    return None if last.get("running") or last.get("queued") or "rss_bytes" not in last else last


async def _prime(http: httpx.AsyncClient, server: Server, tokens: int) -> dict | None:
    """One long prompt before the load. A backend's buffers for a forward are paged in by the first forward that
    large (llama.cpp's compute buffers: malloc counts them whole from the start, RSS only as they are touched; on
    SmolLM2 a 512-token prompt took RSS 13 MiB past a short one's), so a soak of short requests saw RSS step up
    whenever its forwards happened to be wider than before. This pages them in at the start."""
    tokens = min(tokens, (server.context_length or tokens) - 2)
    if tokens < 1:
        return None
    r = await http.post("/v1/completions", json={"model": server.model, "prompt": [7] * tokens, "max_tokens": 1,
                                                 "temperature": 0})
    return {"tokens": tokens, "status": r.status_code}


async def _describe(http: httpx.AsyncClient, s: SoakSettings) -> Server:
    r = await http.get("/v1/models")
    r.raise_for_status()
    card = r.json()["data"][0]
    return Server(model=s.model or card["id"], context_length=card.get("max_model_len"))


async def run_soak(s: SoakSettings) -> tuple[list[Outcome], list[dict], Server, float]:
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    # idle connections dropped before a server's keep-alive ends (uvicorn's: 5 s, httpx's default too): a request
    # sent on one the server is closing fails with a ReadError (1 in 7,003 in a soak with idle pauses)
    limits = httpx.Limits(max_connections=s.concurrency * 2 + 4, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=s.url, timeout=s.timeout_s, headers=headers, limits=limits) as http, \
            httpx.AsyncClient(base_url=s.url, timeout=s.timeout_s, headers=headers) as monitor:
        # the scrapes and replays on connections of their own: whatever the load does to its pool, they get through
        server = await _describe(monitor, s)
        server.primed = await _prime(monitor, server, s.prime_tokens)
        outcomes: list[Outcome] = []
        counter = iter(range(10**9))
        rngs = [random.Random(f"{s.seed}/{c}") for c in range(s.concurrency)]
        t0 = time.perf_counter()
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(monitor, server, t0, s.scrape_every_s, stop))

        async def client(c: int, until: float):
            while time.perf_counter() < until:
                index = next(counter)
                cls = s.classes[index % len(s.classes)]
                path, body = _body(cls, index, rngs[c], s, server)
                outcomes.append(await _send(http, cls, index, path, body, s))

        # three stretches of load, each followed by an idle scrape: the warm-up (the caches reach their bounds), the
        # first half's rest, the second half; growth between idle points is kept, not in flight
        idle, sent = [], []
        for share in (WARMUP_FRACTION, 0.5 - WARMUP_FRACTION, 0.5):
            until = time.perf_counter() + share * s.duration_s
            await asyncio.gather(*(client(c, until) for c in range(s.concurrency)))
            if len(idle) == 2:
                wall = time.perf_counter() - t0
                stop.set()
                await watcher
            idle.append(await _idle(monitor, server, t0))
            sent.append(len(outcomes))
        server.warm, server.half, server.end = idle
        server.measured, server.second_half = sent[2] - sent[0], sent[2] - sent[1]
        replays = await _replay(monitor, outcomes, s.replays)
        return outcomes, replays, server, wall


async def _replay(http: httpx.AsyncClient, outcomes: list[Outcome], count: int) -> list[dict]:
    """Greedy and seeded requests sent again, alone, one after another: the same answer as under load?"""
    kept = [o for o in outcomes if o.replay is not None]
    picked = [o for o in kept if o.cls == "seeded"][: (count + 1) // 2]
    picked += [o for o in kept if o.cls != "seeded"][: count - len(picked)]
    results = []
    for o in picked:
        r = await http.post(o.replay["path"], json=o.replay["body"])
        again = None
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            again = choice.get("text") if "text" in choice else choice["message"].get("content")
        result = {"class": o.cls, "index": o.index, "status": r.status_code, "equal": again == o.replay["answer"],
                  "under_load": o.replay["answer"], "alone": again}
        if not result["equal"] and again is not None:
            result["tie_gap_nats"] = await _tie_gap(http, o.replay)
            result["near_tie"] = result["tie_gap_nats"] is not None and result["tie_gap_nats"] <= NEAR_TIE_NATS
        results.append(result)
    return results


async def _tie_gap(http: httpx.AsyncClient, replay: dict) -> float | None:
    """A greedy completion answered otherwise under load than alone: sent alone once more with logprobs, the gap
    between its two likeliest tokens where the answers part (llama.cpp's kernels round by the forward's shape, and
    a near-tie can flip beside other rows; a cross-wired answer parts at a clear choice). None: not a greedy
    completion, or no parting found."""
    body = replay["body"]
    if replay["path"] != "/v1/completions" or body.get("temperature") != 0:
        return None
    r = await http.post(replay["path"], json={**body, "logprobs": 2})
    if r.status_code != 200:
        return None
    logprobs = r.json()["choices"][0].get("logprobs") or {}
    text, under_load = "", replay["answer"]
    for token, top in zip(logprobs.get("tokens") or [], logprobs.get("top_logprobs") or []):
        if not under_load.startswith(text + token):
            values = sorted((top or {}).values(), reverse=True)
            return values[0] - values[1] if len(values) > 1 else None
        text += token
    return None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize_soak(outcomes: list[Outcome], replays: list[dict], server: Server, wall_s: float,
                   s: SoakSettings) -> dict:
    per_class = {}
    for cls in s.classes:
        mine = [o for o in outcomes if o.cls == cls]
        answered = [o.latency_s for o in mine if o.status is not None]
        errors = [f"#{o.index}: {o.error}" for o in mine if o.error]
        per_class[cls] = {"sent": len(mine), "status": dict(Counter(str(o.status) if o.status is not None
                                                                   else "none" for o in mine)),
                          "p50_s": statistics.median(answered) if answered else None,
                          "p99_s": _percentile(answered, 0.99), "violations": len(errors),
                          "examples": errors[:5], "notes": dict(Counter(o.note for o in mine if o.note))}
    memory = memory_summary(server.samples, wall_s, server.warm, server.end, server.measured, server.half,
                            server.second_half)
    server_errors = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    violations = sum(c["violations"] for c in per_class.values())
    mismatched = [r for r in replays if not r["equal"]]
    ties = [r for r in mismatched if r.get("near_tie")]
    ok = (violations == 0 and len(mismatched) == len(ties) and memory["flat"] and memory["drained"]
          and memory["cache_within_bound"] and memory["history_within_bound"] and memory["grammar_within_bound"])
    config = {k: v for k, v in asdict(s).items() if k != "api_key"}
    return {"config": config, "model": server.model, "context_length": server.context_length, "wall_s": wall_s,
            "requests": len(outcomes), "server_errors": server_errors, "violations": violations,
            "classes": per_class, "replays": {"checked": len(replays), "equal": len(replays) - len(mismatched),
                                              "near_ties": len(ties), "mismatched": mismatched},
            "memory": memory, "memory_samples": server.samples, "ok": ok,
            "warmup_end_s": server.warm["t_s"] if server.warm else WARMUP_FRACTION * wall_s,
            "halfway_s": server.half["t_s"] if server.half else None, "primed": server.primed}


def bench_soak(s: SoakSettings) -> dict:
    outcomes, replays, server, wall = asyncio.run(run_soak(s))
    return summarize_soak(outcomes, replays, server, wall, s)


def plot_memory(report: dict, path) -> None:
    """The server's RSS and the caches' tokens over the run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["memory_samples"]
    t = [x["t_s"] for x in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(t, [x.get("rss_bytes", 0) / 2**20 for x in samples], label="RSS")
    if any(x.get("malloc_bytes") for x in samples):  # in use: what a leak would grow; RSS less it, the rest
        top.plot(t, [x.get("malloc_bytes", 0) / 2**20 for x in samples], label="malloc in use")
    warm_end = report.get("warmup_end_s", WARMUP_FRACTION * report["wall_s"])
    top.axvline(warm_end, color="grey", linestyle=":", label="end of warm-up (idle)")
    if report.get("halfway_s"):
        top.axvline(report["halfway_s"], color="grey", linestyle="--", label="halfway (idle)")
    top.set_ylabel("MiB")
    top.legend(loc="lower right")
    for name, label in (("cache", "prefix cache"), ("history", "suffix history")):
        if any(x.get(f"{name}_max_tokens") for x in samples):
            bottom.plot(t, [x.get(f"{name}_tokens", 0) for x in samples], label=f"{label} tokens")
    bottom.set_ylabel("tokens held")
    bottom.set_xlabel("seconds")
    if bottom.lines:
        bottom.legend(loc="upper left")
    fig.suptitle(f"soak: {report['requests']} requests in {report['wall_s']:.0f} s, {report['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""Where a server's memory goes, one request kind at a time (issue 41): the tiny test models served in this process
on 127.0.0.1, N requests of one kind from 6 client threads (in a process of their own), then RSS, the live objects
by type that grew, and (with --trace) tracemalloc's top allocation sites, between a warm-up and the measured
requests. For RSS per request kind against a real `specdecode serve`, `specdecode bench soak --classes KIND`
reads the server's own figures (docs/BENCHMARKS.md, "Memory under a long soak").

    python scripts/server_memory_probe.py --kinds json_schema,too_long --requests 300 [--trace] [--referrers Job]

--soak S instead sends `specdecode bench soak`'s mix (every class) for S seconds twice, and compares the second
run's end with the first's: what a long soak's last half holds that its first did not (its clients run in this
process, so its RSS counts theirs too). --load DIR loads the
tiny models saved in DIR/target and DIR/draft (--save-models DIR) as `specdecode serve` does (prepacked target,
int8 draft).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}}, "required": ["name", "count"]}
PROMPT = "request {i}: def sort list value return"


def body(kind: str, i: int, context: int) -> tuple[str, dict]:
    chat = [{"role": "user", "content": PROMPT.format(i=i)}]
    if kind == "json_schema":
        return "/v1/chat/completions", {"messages": chat, "max_tokens": 16, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}
    if kind == "too_long":
        return "/v1/completions", {"prompt": [7] * (context + 16), "max_tokens": 4}
    if kind == "completion":
        return "/v1/completions", {"prompt": PROMPT.format(i=i), "max_tokens": 12, "temperature": 0}
    if kind == "seeded":
        return "/v1/chat/completions", {"messages": chat, "max_tokens": 12, "temperature": 0.9, "seed": i}
    if kind == "logprobs":
        return "/v1/completions", {"prompt": PROMPT.format(i=i), "max_tokens": 8, "logprobs": 2, "n": 2,
                                   "temperature": 0.8, "seed": i}
    if kind == "drop_stream":
        return "/v1/completions", {"prompt": PROMPT.format(i=i), "max_tokens": 16, "ignore_eos": True,
                                   "stream": True, "temperature": 0}
    raise ValueError(kind)


def send(http: httpx.Client, kind: str, i: int, context: int) -> int:
    path, payload = body(kind, i, context)
    if kind == "drop_stream":
        with http.stream("POST", path, json=payload) as r:
            for _ in r.iter_bytes():
                break
            return r.status_code
    return http.post(path, json=payload).status_code


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_mib() -> str:
    """glibc's view: bytes allocated (in use, heap + mmapped) and bytes free inside its heaps. RSS that grows while
    'in use' does not is the allocator's (fragmentation), not a leak."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return f"malloc in use {(info.uordblks + info.hblkhd) >> 20} MiB, free in heaps {info.fordblks >> 20} MiB"


def type_counts() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def run(url: str, kind: str, n: int, context: int) -> collections.Counter:
    """n requests of one kind from 6 client threads in a process of their own: clients in the server's process add
    their own memory to its RSS (the 9.3 KiB a prompt over the context seemed to keep, issue 50, was theirs: from
    a process of their own the server kept 0.0 KiB a request)."""
    found = subprocess.run([sys.executable, __file__, "--client", url, kind, str(n), str(context)], check=True,
                           capture_output=True, text=True).stdout
    return collections.Counter({int(code): count for code, count in json.loads(found).items()})


def client(url: str, kind: str, n: int, context: int) -> None:
    statuses = collections.Counter()
    with httpx.Client(base_url=url, timeout=120) as http, ThreadPoolExecutor(6) as pool:
        for code in pool.map(lambda i: send(http, kind, i, context), range(n)):
            statuses[code] += 1
    print(json.dumps(statuses))


def show_referrers(name: str, depth: int = 3) -> None:
    found = [o for o in gc.get_objects() if type(o).__qualname__ == name][:2]
    for obj in found:
        print(f"  referrers of a live {name}:")
        chain = [obj]
        for _ in range(depth):
            refs = [r for r in gc.get_referrers(chain[-1]) if r is not chain and not isinstance(r, type(sys._getframe()))
                    and r is not found]
            if not refs:
                break
            ref = refs[0]
            print(f"    <- {type(ref).__qualname__}: {repr(ref)[:160]}")
            chain.append(ref)


def record_kernel_shapes() -> set:
    """The (rows, in, out) shapes prepacked linears ran at: oneDNN keeps a kernel for each."""
    from specdecode.models import optimize

    shapes, kernel = set(), optimize._pointwise

    def recording(x, weight, bias):
        y = kernel(x, weight, bias)
        shapes.add((x.shape[0], x.shape[1], y.shape[1]))
        return y

    optimize._pointwise = recording
    return shapes


def soak_twice(url: str, seconds: float, trace: bool) -> None:
    from specdecode.bench.soak import SoakSettings, run_soak
    import asyncio

    shapes = record_kernel_shapes()
    start, stop = time.perf_counter(), threading.Event()

    def timeline():  # RSS and kernel shapes every 10 s, for where a growth comes from
        while not stop.wait(10):
            print(f"  t {time.perf_counter() - start:.0f} s: RSS {rss_kib() // 1024} MiB, {malloc_mib()}, "
                  f"{len(shapes)} kernel shapes", flush=True)

    threading.Thread(target=timeline, daemon=True).start()
    for run_index in range(2):
        if run_index == 1:
            before_types, before_rss = type_counts(), rss_kib()
            if trace:
                tracemalloc.start(12)
                snap0 = tracemalloc.take_snapshot()
        outcomes, *_ = asyncio.run(run_soak(SoakSettings(url=url, duration_s=seconds, concurrency=6, replays=0,
                                                         seed=run_index)))
        print(f"soak {run_index}: {len(outcomes)} requests, RSS {rss_kib()} KiB, {len(shapes)} prepacked kernel "
              f"shapes so far")
    stop.set()
    after_types, after_rss = type_counts(), rss_kib()
    print(f"second soak: RSS {before_rss} -> {after_rss} KiB ({(after_rss - before_rss) / len(outcomes):+.1f} KiB a "
          f"request)")
    grown = sorted(((n, after_types[n] - before_types[n]) for n in after_types), key=lambda g: -g[1])[:20]
    print("  live objects grown:", ", ".join(f"{n} +{d}" for n, d in grown if d > 0))
    if trace:
        snap1 = tracemalloc.take_snapshot()
        for stat in snap1.compare_to(snap0, "traceback")[:10]:
            print(f"  {stat.size_diff / 1024:+.0f} KiB in {stat.count_diff:+d} blocks")
            for line in stat.traceback.format()[-6:]:
                print("     ", line)


def main() -> None:
    if sys.argv[1:2] == ["--client"]:  # run()'s client process
        url, kind, n, context = sys.argv[2:6]
        return client(url, kind, int(n), int(context))
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="json_schema,too_long")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--referrers", default="")
    ap.add_argument("--release", action="store_true", help="drop the session's finished rows after each kind")
    ap.add_argument("--soak", type=float, default=0.0)
    ap.add_argument("--load", default="", help="DIR with target/ and draft/: load them as the CLI does")
    ap.add_argument("--save-models", default="", help="save the tiny test models to DIR/target, DIR/draft and exit "
                                                      "(what `specdecode serve --target DIR/target` then serves)")
    ap.add_argument("--context", type=int, default=0, help="the target's context (0: the fixture's 512)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from conftest import build_tokenizer, perturbed_copy, tiny_qwen
    from test_server_helpers import LiveServer

    from specdecode import SpeculativeGenerator
    from specdecode.server import ServerSettings, create_app

    if args.save_models:
        tok = build_tokenizer()
        target = tiny_qwen(len(tok), seed=0, eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
        for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3, seed=1))):
            model.save_pretrained(f"{args.save_models}/{name}")
            tok.save_pretrained(f"{args.save_models}/{name}")
        return
    settings = ServerSettings(max_batch_size=8, max_queue=32)
    if args.load:
        from specdecode.pairing.pair import ModelOptions, load_pair, make_generator

        opts = ModelOptions(target=f"{args.load}/target", draft=f"{args.load}/draft", threads=1)
        target, draft = load_pair(opts, rows=settings.model_rows)
        generator, tok = make_generator(target, draft, opts.num_speculative_tokens), target.tokenizer
    else:
        tok = build_tokenizer()
        target = tiny_qwen(len(tok), seed=0, eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
        draft = perturbed_copy(target, 0.3, seed=1)
        if args.context:  # rotary positions are computed on the fly: only the limit the server checks changes
            target.config.max_position_embeddings = draft.config.max_position_embeddings = args.context
        generator = SpeculativeGenerator(target, draft, num_speculative_tokens=4, tokenizer=tok)
    app = create_app(generator, "tiny-target", tok, settings)
    context = generator.context_length
    with LiveServer(app).start() as server:
        if args.soak:
            return soak_twice(server.url, args.soak, args.trace)
        for kind in args.kinds.split(","):
            run(server.url, kind, args.warmup, context)
            before_types, before_rss = type_counts(), rss_kib()
            if args.trace:
                tracemalloc.start(12)
                snap0 = tracemalloc.take_snapshot()
            t0 = time.perf_counter()
            statuses = run(server.url, kind, args.requests, context)
            wall = time.perf_counter() - t0
            after_types, after_rss = type_counts(), rss_kib()
            print(f"{kind}: {args.requests} requests in {wall:.0f} s, statuses {dict(statuses)}; RSS {before_rss} -> "
                  f"{after_rss} KiB ({(after_rss - before_rss) / args.requests:+.1f} KiB a request)")
            grown = [(name, after_types[name] - before_types[name]) for name in after_types]
            grown = sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:15]
            print("  live objects grown:", ", ".join(f"{n} +{d}" for n, d in grown))
            if args.trace:
                snap1 = tracemalloc.take_snapshot()
                tracemalloc.stop()
                for stat in snap1.compare_to(snap0, "traceback")[:8]:
                    print(f"  {stat.size_diff / 1024:+.0f} KiB in {stat.count_diff:+d} blocks")
                    for line in stat.traceback.format()[-8:]:
                        print("     ", line)
            if args.release:  # what the session's finished rows hold: RSS after they are dropped and trimmed
                session = app.state.batcher.session
                for index in [i for i, r in session.rows.items() if r.finish_reason is not None]:
                    del session.rows[index]
                gc.collect()
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                print(f"  finished rows dropped, malloc_trim: RSS {rss_kib()} KiB")
            for name in filter(None, args.referrers.split(",")):
                show_referrers(name)


if __name__ == "__main__":
    main()

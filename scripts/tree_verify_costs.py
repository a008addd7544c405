"""v(n) of llama.cpp forwards as a chain and as a token tree, on this CPU: the cost of verifying n tokens in one
forward, in single-token steps, with and without the shared KV stream that trees need (kv_unified).

    python scripts/tree_verify_costs.py --target qwen2.5-coder-1.5b-instruct --json FILE
    python scripts/tree_verify_costs.py --ns 1,2,5,9,17,33,65 --kinds chain --json FILE   # long copies' forwards

One row with a context of --context tokens; each measurement decodes the forward, then trims it away, so every
forward sees the same context. Interleaved over n and repeated; medians. Trees hang half their nodes below the root
and the rest in a chain (the shapes the suffix drafter grows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.backends.llamacpp import LlamaCppBackend
from specdecode.models import catalog
from specdecode.pairing.loading import locate_model
from specdecode.exact.token_tree import chain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ns", help="the forward sizes n, comma-separated (default 1..--max-n)")
    ap.add_argument("--kinds", default="chain,chain_unified,tree", help="which of chain, chain_unified, tree")
    ap.add_argument("--json")
    args = ap.parse_args()
    ns = sorted({int(n) for n in args.ns.split(",")} | {1}) if args.ns else list(range(1, args.max_n + 1))
    kinds = tuple(k for k in ("chain", "chain_unified", "tree") if k in args.kinds.split(","))
    if "chain" not in kinds:
        ap.error("--kinds needs chain: v(n) is an n-token chain's forward over a one-token chain's")
    path = locate_model(args.target, "llamacpp").path if catalog.is_registered(args.target) else args.target
    n_ctx = max(2048, args.context + max(ns) + 64)
    streams = LlamaCppBackend(path, n_ctx=n_ctx, n_threads=args.threads)  # a KV stream per row (the default)
    shared = LlamaCppBackend(path, n_ctx=n_ctx, n_threads=args.threads, token_trees=True) \
        if kinds != ("chain",) else None  # one stream, trees
    context = torch.randint(1000, 30000, (1, args.context), generator=torch.Generator().manual_seed(0))
    for backend in (b for b in (streams, shared) if b is not None):
        backend.reset(1)
        backend.forward(context, last_only=True)
    times = {(kind, n): [] for n in ns for kind in kinds}
    for _ in range(args.repeats):
        for n in ns:
            ids = torch.randint(1000, 30000, (1, n))
            for kind in kinds:
                if kind == "tree" and n < 3:
                    continue
                backend = streams if kind == "chain" else shared
                t = time.perf_counter()
                if kind == "tree":
                    backend.forward_tree(ids, [chain(n - 1 - (n - 1) // 2) + [-1] * ((n - 1) // 2)])
                    backend.keep_paths([[]])
                else:
                    backend.forward(ids)
                times[(kind, n)].append(time.perf_counter() - t)
                backend.trim([args.context])
    step = statistics.median(times[("chain", 1)])
    table = {kind: {n: statistics.median(times[(kind, n)]) / step for n in ns if times[(kind, n)]}
             for kind in kinds}
    print(f"one-token step {step * 1000:.1f} ms; v(n) = an n-token forward / that step")
    for kind, row in table.items():
        print(f"{kind:>14}: " + "  ".join(f"v({n})={v:.2f}" for n, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "threads": args.threads, "context": args.context, "step_s": step,
                       "v": table, "repeats": args.repeats}, f, indent=1)


if __name__ == "__main__":
    main()

"""Would prefill inside the decode step pay on llama.cpp? The running rows' step and a joining prompt's prefill chunk
as two llama_decode calls (what the session does) against one call holding both (chunked prefill as vLLM does it).
Target of the default pair, 2 threads, random tokens after a 200-token context; medians of 7.

    python scripts/prefill_beside_step.py
"""
import statistics
import time

import numpy as np
import torch

from specdecode import load_model

m = load_model("qwen2.5-coder-1.5b-instruct", threads=2, max_rows=8)
be = m.model
rng = np.random.default_rng(0)


def run(rows, width, chunk, reps=7):
    res = {"sep": [], "joint": [], "step": [], "chunk": []}
    for _ in range(reps):
        be.reset(rows)
        be.forward(torch.tensor(rng.integers(100, 20000, (rows, 200))), last_only=True)
        fork = be.fork(1)
        step_ids = torch.tensor(rng.integers(100, 20000, (rows, width)))
        chunk_ids = torch.tensor(rng.integers(100, 20000, (1, chunk)))
        lengths = be.lengths
        t0 = time.perf_counter(); be.forward(step_ids); t1 = time.perf_counter()
        fork.forward(chunk_ids, last_only=True); t2 = time.perf_counter()
        res["step"].append(t1 - t0); res["chunk"].append(t2 - t1); res["sep"].append(t2 - t0)
        be.trim(lengths); fork.trim([0])
        # one call: the rows' step tokens then the chunk, as one batch of several sequences
        sh = be._shared
        toks = np.concatenate([step_ids.numpy().reshape(-1), chunk_ids.numpy().reshape(-1)]).astype(np.int32)
        pos = np.concatenate([np.repeat(lengths, width) + np.tile(np.arange(width), rows), np.arange(chunk)]).astype(np.int32)
        seq = np.concatenate([np.repeat(be._seqs, width), np.full(chunk, fork._seqs[0])]).astype(np.int32)
        out = np.zeros(len(toks), dtype=bool); out[: rows * width] = True; out[-1] = True
        t0 = time.perf_counter(); sh.decode(toks, pos, seq, out); t1 = time.perf_counter()
        res["joint"].append(t1 - t0)
        fork.close()
    return {k: statistics.median(v) * 1000 for k, v in res.items()}


for rows, width in ((1, 1), (4, 1), (4, 2)):
    for chunk in (64, 256):
        r = run(rows, width, chunk)
        print(f"rows {rows} width {width} chunk {chunk}: step {r['step']:.1f} ms, chunk {r['chunk']:.1f} ms, "
              f"separate {r['sep']:.1f} ms, one call {r['joint']:.1f} ms, saved {1 - r['joint'] / r['sep']:.1%}", flush=True)

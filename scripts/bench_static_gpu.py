"""Greedy decoding speed on a GPU: specdecode with StaticBackend (CUDA graphs) vs with HFBackend vs transformers
generate() vs transformers assisted generation, on random-weight models of real Qwen2.5 shapes (no download).

Random weights make acceptance meaningless, so the draft is the target itself (every draft accepted): the
speculative rows measure the machinery's best case at a fixed K, identical for ours and for assisted generation.
The plain rows (AR) measure the backends' per-token overhead directly.
    python bench_static_gpu.py --size 1.5B --batch 1 --new 256 -k 4
"""
import argparse
import sys
import time
from pathlib import Path

import torch

from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.backends.hf import HFBackend
from specdecode.backends.static import StaticBackend
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ lives in the checkout, not the package
from benchmarks.random_models import SHAPES, build_qwen  # noqa: E402  (shared with the device check)


def timed(fn, device, repeats):
    fn()  # warm-up (and CUDA graph capture for StaticBackend: shapes are captured on their second sighting)
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1.5B", choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model = build_qwen(args.size, device, dtype)
    prompts = torch.randint(0, 1000, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)).tolist()
    max_len = args.prompt + args.new
    new = dict(max_new_tokens=args.new, temperature=0.0, ignore_eos=True)
    hf_kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    ids = torch.tensor(prompts, device=device)
    static = StaticBackend(model, max_batch=args.batch, max_len=max_len)
    static_draft = StaticBackend(model, max_batch=args.batch, max_len=max_len)
    runs = {
        "transformers generate()": lambda: model.generate(ids, **hf_kwargs)[:, args.prompt:].tolist(),
        "ours AR, HFBackend": lambda: AutoregressiveGenerator(HFBackend(model)).generate(prompts, **new).token_ids,
        "ours AR, StaticBackend": lambda: AutoregressiveGenerator(static).generate(prompts, **new).token_ids,
    }
    if args.batch == 1:  # transformers' assisted generation takes one row at a time
        runs[f"transformers assisted, K={args.k}"] = lambda: model.generate(
            ids, assistant_model=model, num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant",
            **hf_kwargs)[:, args.prompt:].tolist()
    runs[f"ours speculative K={args.k}, HFBackend"] = lambda: SpeculativeGenerator(
        HFBackend(model), HFBackend(model), num_speculative_tokens=args.k).generate(prompts, **new).token_ids
    runs[f"ours speculative K={args.k}, StaticBackend"] = lambda: SpeculativeGenerator(
        static, static_draft, num_speculative_tokens=args.k).generate(prompts, **new).token_ids
    print(f"Qwen2.5-{args.size} shapes, {args.dtype}, batch {args.batch}, prompt {args.prompt}, {args.new} new "
          f"tokens, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    reference = None
    for name, fn in runs.items():
        seconds, tokens = timed(fn, device, args.repeats)
        reference = tokens if reference is None else reference
        same = "same tokens" if tokens == reference else "DIFFERENT tokens (bf16 batching noise?)"
        print(f"{name:45s} {args.batch * args.new / seconds:8.1f} tok/s  ({seconds:.3f} s, {same})")
    print(f"CUDA graphs captured: target {static.captured_graphs}, draft {static_draft.captured_graphs}")


if __name__ == "__main__":
    main()

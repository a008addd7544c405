"""The decoding loop's own cost per token on tiny random models (where the models cost almost nothing), for
before/after comparisons of the step: run it with PYTHONPATH pointing at two checkouts, interleaved.

    python scripts/step_overhead.py [--rows 4] [--k 3] [--tokens 64] [--calls 5]

Prints the median milliseconds per generated token over `calls` generate() calls (after one warm-up call).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny(seed: int, vocab: int = 320) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from specdecode import SpeculativeGenerator

    gen = SpeculativeGenerator(tiny(0), tiny(1), num_speculative_tokens=args.k)
    prompts = [[5 + i, 17, 42, 99 + i, 7] for i in range(args.rows)]
    times = []
    for call in range(args.calls + 1):
        start = time.perf_counter()
        res = gen.generate(prompts, max_new_tokens=args.tokens, temperature=args.temperature, seed=call, ignore_eos=True)
        elapsed = time.perf_counter() - start
        if call:
            times.append(1000 * elapsed / sum(len(t) for t in res.token_ids))
    print(f"{statistics.median(times):.3f} ms/token (median of {args.calls}; {args.rows} rows, K={args.k}, T={args.temperature})")


if __name__ == "__main__":
    main()

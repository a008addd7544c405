"""Long copies against a cap of 8, in one process: the matrix's rename edit (bench/peer_matrix.py: a standard-library
module re-emitted whole) decoded greedily by plain decoding and by the suffix drafter under `auto` with free copies capped at 8
and at 64 tokens a step, arms interleaved per round. Prints each arm's decode rate after the first token, their
medians and ratios, and whether every arm gave plain decoding's text.

    python scripts/long_copies_in_process.py [ROUNDS] [MAX_NEW_TOKENS] [WORKLOAD]
"""

from __future__ import annotations

import statistics
import sys
import time

from specdecode import AutoregressiveGenerator, SpeculativeGenerator, SuffixDrafter, load_model
from specdecode.bench.peer_matrix import workloads


def timed(gen, prompt, max_new_tokens):
    stream = gen.stream([prompt], max_new_tokens=max_new_tokens, temperature=0.0)
    first = last = None
    for _ in stream:
        last = time.perf_counter()
        first = first or last
    tokens = stream.result.token_ids[0]
    return tokens, (len(tokens) - 1) / (last - first)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    workload = sys.argv[3] if len(sys.argv) > 3 else "edit: rename"
    target = load_model("qwen2.5-coder-1.5b-instruct")
    tokenizer = target.tokenizer
    messages = workloads()[workload][0].messages([])
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    arms = {"plain": AutoregressiveGenerator(target),
            "copies <= 8": SpeculativeGenerator(target, SuffixDrafter(history_tokens=0), "auto", max_copy_tokens=8),
            "copies <= 64": SpeculativeGenerator(target, SuffixDrafter(history_tokens=0), "auto")}
    rates = {name: [] for name in arms}
    texts = {}
    print(f"{workload}: prompt {len(prompt)} tokens, {max_new} new tokens, {rounds} rounds")
    for r in range(rounds):
        order = list(arms)[r % 3:] + list(arms)[:r % 3]
        for name in order:
            tokens, rate = timed(arms[name], prompt, max_new)
            rates[name].append(rate)
            texts.setdefault(name, tokens)
            print(f"round {r} {name}: {rate:.2f} tok/s ({len(tokens)} tokens)", flush=True)
    plain = statistics.median(rates["plain"])
    for name, values in rates.items():
        k = arms[name].policy.summary().get("k_histogram") if name != "plain" else None
        print(f"{name}: median {statistics.median(values):.2f} tok/s, {statistics.median(values) / plain:.2f}x plain; "
              f"same text as plain: {texts[name] == texts['plain']}; K histogram over its runs: {k}")


if __name__ == "__main__":
    main()

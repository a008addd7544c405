"""In one process, on the same loaded models (Qwen2.5-Coder-1.5B on llama.cpp, SmolLM2-135M as a draft of another
tokenizer): what the speculative loop costs on steps it decodes plainly. Short greedy answers (too short for any
trial under a CPU's starting costs, so `-k auto` drafts nothing) by plain decoding, by `-k auto` and by K = 0 fixed,
the arms' order reversed every round; prints the medians, means and quartiles of the per-round ratios to plain
(> 1: faster). `-k auto` below K = 0 is the policy's and the drafter's per-step cost.

    python scripts/loop_overhead_in_process.py [TOKENS=64] [ROUNDS=30]
"""
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, load_model  # noqa: E402
from specdecode.policy.choose import make_policy  # noqa: E402
from specdecode.policy.estimates import CostPrior  # noqa: E402

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
ARMS = ["plain", "auto", "k0"]
PROMPT = "def quicksort(arr):"
target = load_model("qwen2.5-coder-1.5b-instruct", backend="llamacpp")
draft = load_model("smollm2-135m-instruct", backend="llamacpp")
spec = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
plain = AutoregressiveGenerator(target)
seconds = {arm: [] for arm in ARMS}
for r in range(ROUNDS):
    for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
        gen = plain
        if arm != "plain":
            spec.cost_prior = CostPrior.cpu()  # what the CLI starts a real model on a CPU from, nothing recorded
            spec.policy = make_policy("auto" if arm == "auto" else 0, 8, spec.cost_prior)
            gen = spec
        start = time.perf_counter()
        out = gen.generate([PROMPT], max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        seconds[arm].append(time.perf_counter() - start)
        drafted = getattr(out.stats, "k_histogram", None)
        if drafted and set(drafted) != {0}:
            print(r, arm, "drafted:", drafted, flush=True)
for arm in ARMS[1:]:
    ratios = [p / x for p, x in zip(seconds["plain"], seconds[arm])]
    print(arm, "median", round(statistics.median(ratios), 4), "mean", round(statistics.mean(ratios), 4),
          "quartiles", [round(q, 4) for q in statistics.quantiles(ratios, n=4)], flush=True)

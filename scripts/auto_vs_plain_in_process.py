"""In one process, on the same loaded models: plain decoding against -k auto with a draft of another tokenizer
(SmolLM2-135M for Qwen2.5-Coder-1.5B on llama.cpp), its policy started from this machine's recorded costs of the
target and from the default prior, 128 greedy tokens each, alternating; prints each run's tokens/s and K histogram
and the per-round ratios.

    python scripts/auto_vs_plain_in_process.py [ROUNDS]
"""
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, load_model
from specdecode.policy.choose import make_policy
from specdecode.pairing.pair import ModelOptions, recorded_cost_prior
target = load_model("qwen2.5-coder-1.5b-instruct", backend="llamacpp")
draft = load_model("smollm2-135m-instruct", backend="llamacpp")
prior = recorded_cost_prior(ModelOptions(draft="smollm2-135m-instruct"), target.model if hasattr(target, "model") else target)
print("prior", prior, flush=True)
plain = AutoregressiveGenerator(target)
spec = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
P = "def quicksort(arr):"
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5
rates = {"plain": [], "prior": [], "default": []}
for r in range(N):
    for arm in rates:
        if arm == "plain":
            gen = plain
        else:
            spec.cost_prior = prior if arm == "prior" else None
            spec.policy = make_policy("auto", 8, spec.cost_prior)
            gen = spec
        t = time.perf_counter()
        res = gen.generate([P], max_new_tokens=128, temperature=0.0, ignore_eos=True)
        dt = time.perf_counter() - t
        rates[arm].append(128 / dt)
        print(r, arm, round(128 / dt, 2), getattr(res.stats, "k_histogram", None), flush=True)
for arm in ("prior", "default"):
    ratios = [a / b for a, b in zip(rates[arm], rates["plain"])]
    print(arm, [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))

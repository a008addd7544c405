"""Interleaved runs of `specdecode generate` (128 tokens of a code prompt): plain (--draft none) against -k auto with
a draft of another tokenizer (SmolLM2-135M), with this machine's costs of the target recorded in the cache and
without (NOREC_CACHE: a cache directory holding the same gguf/, tokenizers/ and models/ but no costs.json).
Prints each run's tokens/s and K histogram, then the per-round ratios and their median.

    python scripts/auto_vs_plain.py [ROUNDS] [TOKENS]
"""
import json
import os
import statistics
import subprocess
import sys

N = int(sys.argv[1]) if len(sys.argv) > 1 else 3
TOK = sys.argv[2] if len(sys.argv) > 2 else "128"
arms = {"plain": ["--draft", "none"], "smol-auto": ["--draft", "smollm2-135m-instruct", "-k", "auto"],
        "smol-auto-norec": ["--draft", "smollm2-135m-instruct", "-k", "auto"]}
res = {a: [] for a in arms}
for i in range(N):
    for arm, extra in arms.items():
        out = subprocess.run(["specdecode", "generate", "def quicksort(arr):", "--max-new-tokens", TOK, "--json", "--ignore-eos", *extra],
                             capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **({"SPECDECODE_CACHE": os.environ.get("NOREC_CACHE", "/tmp/cache_norec")} if arm.endswith("norec") else {})})
        line = [l for l in out.stdout.splitlines() if l.startswith("{")]
        if not line:
            print(arm, "FAILED", out.stderr[-2000:]); continue
        st = json.loads(line[-1])["stats"]
        tps = st.get("tokens_per_second")
        res[arm].append(tps)
        print(i, arm, tps, st.get("k_histogram"), flush=True)
m = {a: statistics.median(v) for a, v in res.items() if v}
print("medians", m)
for arm in arms:
    if arm != "plain":
        ratios = [s / p for s, p in zip(res[arm], res["plain"])]
        print(arm, "per-run ratios", [round(r, 3) for r in ratios], "median", round(statistics.median(ratios), 3))

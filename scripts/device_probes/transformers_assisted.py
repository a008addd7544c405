"""Ours on the transformers backend against transformers' assisted generation, acceptance 1, batch 1: interleaved
times and a cProfile of each. On the lent machine: install the carried wheels into a folder, then
PYTHONPATH=that:src python3 scripts/device_probes/transformers_assisted.py (--dry: tiny shapes on the CPU)."""
import cProfile, io, json, os, pstats, sys, time
from common import setup  # first: it puts the checkout's root (benchmarks/) on sys.path
import torch
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.backends.hf import HFBackend
from benchmarks.device_sections import _sync

plan, out, device, target, draft, vocab = setup()
k = 4
prompts = torch.randint(0, vocab, (1, plan.context), generator=torch.Generator().manual_seed(3)).tolist()
ids = torch.tensor(prompts, device=device)
hf = dict(max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens, do_sample=False, pad_token_id=0)
new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
ours = SpeculativeGenerator(HFBackend(target), HFBackend(draft), num_speculative_tokens=k)
runs = {
    "hf_plain": lambda: target.generate(ids, **hf),
    "hf_assisted": lambda: target.generate(ids, assistant_model=draft, num_assistant_tokens=k,
                                           num_assistant_tokens_schedule="constant", **hf),
    "ours_plain": lambda: AutoregressiveGenerator(HFBackend(target)).generate(prompts, **new),
    "ours_spec": lambda: ours.generate(prompts, **new),
    "ours_spec_fresh": lambda: SpeculativeGenerator(HFBackend(target), HFBackend(draft), num_speculative_tokens=k)
    .generate(prompts, **new),
}
times = {n: [] for n in runs}
for rep in range(4):
    for n, fn in runs.items():
        _sync(device); t = time.perf_counter(); fn(); _sync(device)
        if rep:
            times[n].append(round((time.perf_counter() - t) * 1e3, 1))
report = {"times_ms": times}
r = ours.generate(prompts, **new)
report["ours_stats"] = {"k_histogram": r.stats.k_histogram, "draft_s": r.stats.draft_time_s,
                        "verify_s": r.stats.verify_time_s, "other_s": r.stats.other_time_s}
for n in ("hf_assisted", "ours_spec"):
    pr = cProfile.Profile(); pr.enable(); runs[n](); _sync(device); pr.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(35)
        report[f"profile_{n}_{key}"] = s.getvalue()
json.dump(report, open(f"{out}/probe_hf.json", "w"), indent=1)
print(json.dumps(report["times_ms"]), json.dumps(report["ours_stats"]))
print(report["profile_ours_spec_tottime"][:6000])

"""auto after the cold-forward fix: plain vs auto vs fixed K at known acceptance, batch 1 and 4, interleaved."""
import json, os, statistics, sys, time
from common import setup  # first: it puts the checkout's root (benchmarks/) on sys.path
import torch
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from benchmarks.device_sections import _static, _sync
from benchmarks.replay_drafter import ReplayDrafter
from specdecode.drafters.model import ModelDrafter

plan, out, device, target, draft, vocab = setup()
dry = device.type == "cpu"
new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
report = {}
for batch in ((1,) if dry else (1, 4)):
    prompts = torch.randint(0, vocab, (batch, plan.context), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = plan.context + plan.new_tokens + 10
    tb, db = _static(target, plan, batch, tokens), _static(draft, plan, batch, tokens)
    plain = AutoregressiveGenerator(tb)
    rec = plain.generate(prompts, **new).token_ids
    res = {}
    for rep in range(4):
        for name, k, alpha in (("plain", None, None), ("auto_a0.9", "auto", 0.9), ("k2_a0.9", 2, 0.9),
                               ("auto_a0.8", "auto", 0.8), ("auto_a0.6", "auto", 0.6)):
            if k is None:
                fn = lambda: plain.generate(prompts, **new)
            else:
                g = SpeculativeGenerator(tb, ReplayDrafter(rec, alpha, vocab, seed=batch, model=ModelDrafter(db)),
                                         num_speculative_tokens=k, max_speculative_tokens=8)
                fn = lambda: g.generate(prompts, **new)
            _sync(device); t = time.perf_counter(); r = fn(); _sync(device); s = time.perf_counter() - t
            e = res.setdefault(name, {"ms": [], "same": True, "k_hist": []})
            e["ms"].append(round(s * 1e3, 1)); e["same"] &= r.token_ids == rec
            e["k_hist"].append(dict(r.stats.k_histogram))
    base = statistics.median(res["plain"]["ms"][1:])
    for name, e in res.items():
        e["x_plain_median_reps_2_4"] = round(base / statistics.median(e["ms"][1:]), 3)
    report[batch] = res
    summary = {n: (e["x_plain_median_reps_2_4"], e["ms"], e["same"], e["k_hist"][-1]) for n, e in res.items()}
    print(batch, json.dumps(summary), flush=True)
    del tb, db
json.dump(report, open(f"{out}/probe_auto2.json", "w"), indent=1)

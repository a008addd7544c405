"""Where a speculative step with K=0 (and auto's probes) spends time against plain decoding, batch 1 and 4."""
import cProfile, io, json, os, pstats, sys, time, statistics
from common import setup  # first: it puts the checkout's root (benchmarks/) on sys.path
import torch
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from benchmarks.device_sections import _static, _sync
from benchmarks.replay_drafter import ReplayDrafter
from specdecode.drafters.model import ModelDrafter

plan, out, device, target, draft, vocab = setup()
dry = device.type == "cpu"
tokens = plan.context + plan.new_tokens + 10
report = {"plan": plan.target, "batches": {}}
new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)


def stepped(gen, prompts, k):
    stream = gen.stream(prompts, num_speculative_tokens=k, **new)
    s = stream.session
    steps = []
    _sync(device)
    t_all = time.perf_counter()
    while not s.idle:
        before = dict(s.stats.k_histogram)
        _sync(device); t = time.perf_counter()
        s.step()
        _sync(device)
        after = s.stats.k_histogram
        ks = [kk for kk in after if after[kk] != before.get(kk, 0)]
        steps.append((ks[0] if ks else -1, (time.perf_counter() - t) * 1e3))
    total = time.perf_counter() - t_all
    return steps, total, s.result(stream.rows)


def summary(steps):
    by = {}
    for k, ms in steps:
        by.setdefault(k, []).append(ms)
    return {str(k): {"n": len(v), "median_ms": round(statistics.median(v), 3), "max_ms": round(max(v), 3),
                     "sum_ms": round(sum(v), 1)} for k, v in sorted(by.items())}


def profile(fn):
    pr = cProfile.Profile(); pr.enable(); fn(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    return s.getvalue()


for batch in (1, 4) if not dry else (1,):
    prompts = torch.randint(0, vocab, (batch, plan.context), generator=torch.Generator().manual_seed(3)).tolist()
    tb, db = _static(target, plan, batch, tokens), _static(draft, plan, batch, tokens)
    plain_gen = AutoregressiveGenerator(tb)
    rec = plain_gen.generate(prompts, **new).token_ids
    res = {}
    for rep in range(3):  # interleaved: plain, K=0 with a drafter, auto, K=2
        for name, k, alpha in (("plain", None, None), ("k0_with_drafter", 0, 0.9), ("auto_a0.9", "auto", 0.9),
                               ("k2_a0.9", 2, 0.9), ("k1_a0.9", 1, 0.9)):
            if k is None:
                gen, kk = plain_gen, None
            else:
                dr = ReplayDrafter(rec, alpha, vocab, seed=batch, model=ModelDrafter(db))
                gen, kk = SpeculativeGenerator(tb, dr, num_speculative_tokens="auto", max_speculative_tokens=8), k
            steps, total, result = stepped(gen, prompts, kk)
            r = res.setdefault(name, {"totals_ms": [], "same": []})
            r["totals_ms"].append(round(total * 1e3, 2)); r["same"].append(result.token_ids == rec)
            r["steps"] = summary(steps)
            if name == "auto_a0.9":
                r["k_sequence"] = "".join(str(k) if k >= 0 else "j" for k, _ in steps)
                r["step_ms_sequence"] = [round(ms, 2) for _, ms in steps[:40]]
    # unsynced totals too (stepping with syncs hides async overlap)
    for name in ("plain", "k0_with_drafter"):
        ts = []
        for rep in range(3):
            if name == "plain":
                fn = lambda: plain_gen.generate(prompts, **new)
            else:
                dr = ReplayDrafter(rec, 0.9, vocab, seed=batch, model=ModelDrafter(db))
                g = SpeculativeGenerator(tb, dr, num_speculative_tokens="auto")
                fn = lambda: g.generate(prompts, num_speculative_tokens=0, **new)
            _sync(device); t = time.perf_counter(); fn(); _sync(device)
            ts.append(round((time.perf_counter() - t) * 1e3, 2))
        res[name]["unsynced_totals_ms"] = ts
    dr = ReplayDrafter(rec, 0.9, vocab, seed=batch, model=ModelDrafter(db))
    g = SpeculativeGenerator(tb, dr, num_speculative_tokens="auto")
    res["profile_plain"] = profile(lambda: plain_gen.generate(prompts, **new))
    res["profile_k0"] = profile(lambda: g.generate(prompts, num_speculative_tokens=0, **new))
    dr = ReplayDrafter(rec, 0.9, vocab, seed=batch, model=ModelDrafter(db))
    g = SpeculativeGenerator(tb, dr, num_speculative_tokens="auto")
    res["profile_auto"] = profile(lambda: g.generate(prompts, **new))
    report["batches"][batch] = res
    print(json.dumps({n: {k: v for k, v in r.items() if k != "step_ms_sequence"} for n, r in res.items()
                      if not n.startswith("profile")}, indent=0)[:3500], flush=True)
    del tb, db
json.dump(report, open(f"{out}/probe.json", "w"), indent=1)
print(report["batches"][1]["profile_k0"][:3000])

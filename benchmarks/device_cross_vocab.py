"""The device check's "cross_vocab" section: the step costs that decide whether a draft of another family and
tokenizer (SmolLM2-135M, llama, 49k tokens; drafters/cross_vocab.py) pays for a Qwen2.5 target, on the GPU and on the
machine's cores. Goal (the issue): a 135M-shape cross-family draft against a 7B-shape target, predicted and measured
>= 1.5x plain at the measured acceptance; this section predicts (the engine's measured speedup is not run yet).

1. device: a random-weight SmolLM2-135M-shape draft and the Qwen2.5-7B shape (costs' shapes, its static backend and
   timing: forward_costs) on plan.device, n-token forwards n = 1..cross_max_n (the target's to 9): c and v(n).
2. bridge: the drafter's host cost per drafted target token, the real CrossVocabDrafter (SLEM, then TLI) between the
   real tokenizers (device_tokenizers.py: carried, or from the installed GGUF packages; the rows are skipped with the
   reason where neither is here) around models of no cost that write a known text (text_oracle.py: the built-in
   prompt sets' text; the draft erring at each of cross_error_rates), K = cross_k, on the host's CPU: the time in
   the drafter's methods less its model's forwards, per proposed target token; and its draft forwards' token
   counts, priced with the measured draft's n-token forwards (SLEM runs a forward per draft token, which are
   shorter than the target's, and feeds the accepted text back in one). With the plan's device a GPU, it runs with
   the logits handed over there first (TLI projects them there), then on the CPU (the cores' case).
3. cores: llama.cpp on plan.llama_threads threads, the 1.5B shape in Q4_K_M (the default target's quantization) and
   the 135M shape in Q4_1 (SmolLM2's GGUF's), random GGUFs as the llamacpp section makes them (kept for reuse).
4. predictions: Leviathan's speedup, best K, per acceptance row (docs/results/cross-vocab-drafts.json: SmolLM2
   drafting for Qwen2.5-Coder-1.5B on a CPU, per method, prompt set and temperature, its per-position acceptance; else
   the fallback grid alpha = 0.5, 0.6, 0.7), with c_eff = the draft's forwards per drafted position priced in
   target steps (c_forwards) + the bridge's host seconds per drafted position over the target's step (c_bridge)
   (a position: one draft of every row of the batch), beside the speedup with c alone (a draft of the target's own
   tokenizer at the same cost). The bridge run used is the one whose first-draft acceptance is nearest."""

from __future__ import annotations

import json
import time
import traceback

from .device_sections import REPO, Deadline, Plan, _device, _dtype, _static, best_k, forward_costs

ACCEPTANCE_RESULT = REPO / "docs" / "results" / "cross-vocab-drafts.json"
FALLBACK_ALPHAS = (0.5, 0.6, 0.7)
METHODS = ("slem", "tli")
GOAL = 1.5
PROMPT_TOKENS = 64
MAX_K = 8


def section_cross_vocab(plan: Plan, deadline: Deadline, journal) -> dict:
    out = {"goal": f"a {plan.cross_draft}-shape cross-family draft against a {plan.cross_target}-shape target "
                   f"predicted >= {GOAL}x plain at the measured acceptance (measured: not run yet)",
           "k": plan.cross_k, "dtype": plan.dtype, "device": plan.device}
    out["acceptance"] = acceptance_sources()
    journal.put("acceptance", out["acceptance"])
    out["steps"] = device_steps(plan, deadline, journal)
    out["bridge"], skipped = ([], "the deadline passed") if deadline.passed() else bridge_costs(plan, deadline,
                                                                                                  journal, out)
    if skipped:
        out["bridge_skipped"] = skipped
        journal.put("bridge_skipped", skipped)
    out["predictions"] = []
    for batch in plan.cross_batches:
        out["predictions"] += predictions(out["steps"], "device", batch, out["bridge"], out["acceptance"], journal,
                                          plan.device)
    cores, skipped = ([], "the deadline passed") if deadline.passed() else llamacpp_steps(plan, deadline, journal)
    if skipped:
        out["cores_skipped"] = skipped
        journal.put("cores_skipped", skipped)
    out["steps"] += cores
    out["predictions"] += predictions(cores, "cores", 1, out["bridge"], out["acceptance"], journal, "cpu")
    return out


# ---------------------------------------------------------------------------------------------- 1. the device
def device_steps(plan: Plan, deadline: Deadline, journal) -> list[dict]:
    """Median ms of n-token forwards of the target and draft shapes on plan.device, static backend, per batch."""
    import gc

    import torch

    from .random_models import SHAPES, build_model

    device, rows = _device(plan), []
    for role, size in (("target", plan.cross_target), ("draft", plan.cross_draft)):
        if deadline.passed():
            break
        journal.log(f"building the {size} shape ({role})")
        model = build_model(size, device, _dtype(plan.dtype))
        ns = list(range(1, (min(plan.cross_max_n, MAX_K + 1) if role == "target" else plan.cross_max_n) + 1))
        backend = _static(model, plan, max(plan.cross_batches), plan.context + max(ns))
        for batch in plan.cross_batches:
            if deadline.passed():
                break
            t = forward_costs(backend, batch, plan.context, ns, plan.repeats, deadline, SHAPES[size][5])
            rows.append({"setting": "device", "model": role, "size": size, "backend": f"static, {plan.dtype}",
                         "batch": batch, "step_ms": 1000 * t[1], "ms": {n: 1000 * s for n, s in t.items()}})
            journal.add("steps", rows[-1])
            journal.log(f"{size} ({role}) batch {batch}: step {1000 * t[1]:.2f} ms")
        del model, backend
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- 2. the bridge
def reference_text() -> str:
    """What the oracles write: the built-in code, edit and prose prompts, three times over (rows start apart)."""
    from specdecode.bench.prompts import load_prompts

    corpus = "\n\n".join(p.text for name in ("edit", "code", "prose") for p in load_prompts(name))
    return "\n\n".join([corpus] * 3)


def row_prompts(codec, text: str, batch: int) -> list[list[int]]:
    """Each row's prompt: PROMPT_TOKENS target tokens of the text from a line start, rows a third of it apart."""
    third = len(text) // 3
    prompts = []
    for b in range(batch):
        start = text.find("\n", b * third // batch) + 1
        prompts.append(codec.encode(text[start:start + 8 * PROMPT_TOKENS])[:PROMPT_TOKENS])
    return prompts


def bridge_costs(plan: Plan, deadline: Deadline, journal, out: dict) -> tuple[list[dict], str | None]:
    """(rows, None), or ([], why not): per device (the plan's, then the CPU's), method, batch and draft error rate,
    the drafter's cost beside its model's forwards; where the tokenizers came from and the bridge's build time into
    out."""
    import torch

    from specdecode.drafters.cross_vocab import CrossVocabDrafter

    from .device_tokenizers import DRAFT_TOKENIZER, TARGET_TOKENIZER, load_tokenizer
    from .text_oracle import TextOracle

    tokenizers, where = {}, {}
    for role, name in (("target", TARGET_TOKENIZER), ("draft", DRAFT_TOKENIZER)):
        tokenizers[role], where[role] = load_tokenizer(name)
        if tokenizers[role] is None:
            return [], f"no real {role} tokenizer: {where[role]}"
        journal.log(f"{role} tokenizer {name}: {where[role]}")
    out["tokenizers"] = where
    journal.put("tokenizers", where)
    text = reference_text()
    started = time.perf_counter()
    draft = TextOracle(text)
    drafter = CrossVocabDrafter((draft, tokenizers["draft"]), tokenizers["target"], "slem")
    draft.use(drafter.bridge.draft)
    out["bridge_build_s"] = time.perf_counter() - started  # both vocabularies read, the shared one paired
    journal.put("bridge_build_s", out["bridge_build_s"])
    target = TextOracle(text, drafter.bridge.target)
    spent = _timed_methods(drafter)
    rows = []
    for device in dict.fromkeys([plan.device, "cpu"]):  # the GPU's logits (TLI projects them there), the cores'
        draft.device = target.device = torch.device(device)
        for method in METHODS:
            if method == "tli" and not drafter.bridge.tli_possible:
                continue
            drafter.method = method  # one drafter (one bridge) for both methods: only _methods() reads it
            for batch in plan.cross_batches:
                for rate in plan.cross_error_rates:
                    if deadline.passed():
                        return rows, None
                    try:
                        rows.append({"device": device, **_bridge_run(plan, drafter, draft, target, spent, method,
                                                                     batch, rate, text)})
                    except Exception as exc:  # noqa: BLE001 - recorded; the other runs and parts still run
                        error = {"device": device, "method": method, "batch": batch, "error_rate": rate,
                                 "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
                        out.setdefault("bridge_errors", []).append(error)
                        journal.add("bridge_errors", error)
                        journal.log(f"bridge on {device}, {method}, batch {batch}: failed: {error['error'][:200]}")
                        continue
                    journal.add("bridge", rows[-1])
                    journal.log(f"bridge on {device}, {method}, batch {batch}, error rate {rate}: "
                                f"{rows[-1]['host_ms_per_token']:.3f} ms per drafted token, "
                                f"{rows[-1]['forwards_per_token']:.2f} draft forwards per drafted token")
    return rows, None


def _timed_methods(drafter, names=("relayout", "outlook", "propose", "observe")) -> dict:
    """Wraps the drafter's methods the engine calls; returns the seconds spent in each (accumulating)."""
    spent = dict.fromkeys(names, 0.0)
    for name in names:
        def timed(*args, _method=getattr(drafter, name), _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start
        setattr(drafter, name, timed)
    return spent


def _bridge_run(plan: Plan, drafter, draft, target, spent: dict, method: str, batch: int, rate: float,
                text: str) -> dict:
    from specdecode import SpeculativeGenerator

    draft.error_rate, draft.seed = rate, batch
    prompts = row_prompts(target.codec, text, batch)
    generator = SpeculativeGenerator(target, drafter, num_speculative_tokens=plan.cross_k,
                                     vocab_size=target.vocab_size)
    new = dict(temperature=0.0, ignore_eos=True)
    generator.generate(prompts, max_new_tokens=2 * plan.cross_k, **new)  # warm: the same code paths once
    for key in spent:
        spent[key] = 0.0
    draft.stats.update(draft.new_stats())
    calls, shorts = drafter.forward_calls, drafter.counts["short_slots"]
    start = time.perf_counter()
    result = generator.generate(prompts, max_new_tokens=plan.cross_new_tokens, **new)
    wall = time.perf_counter() - start
    stats, proposed = result.stats, max(1, result.stats.proposed_tokens)
    widths = {w: n for w, n in sorted(draft.stats["widths"].items()) if w <= plan.cross_max_n}
    host = sum(spent.values()) - draft.stats["forward_s"]
    first = stats.proposed_per_position[0] if stats.proposed_per_position else 0
    return {"method": method, "batch": batch, "error_rate": rate, "k": plan.cross_k,
            "new_tokens": plan.cross_new_tokens, "proposed_tokens": stats.proposed_tokens,
            "steps": stats.verification_steps, "acceptance": stats.acceptance_rate,
            "first_draft_acceptance": stats.accepted_per_position[0] / first if first else None,
            "host_ms_per_token": 1000 * host / proposed,
            "host_ms_by_method": {k: 1000 * s / proposed for k, s in spent.items()},
            "oracle_forward_ms_per_token": 1000 * draft.stats["forward_s"] / proposed,
            "draft_forwards": drafter.forward_calls - calls, "widths": widths,
            "prefill_forwards": sum(n for w, n in draft.stats["widths"].items() if w > plan.cross_max_n),
            "forwards_per_token": sum(widths.values()) / proposed,
            "short_slots": drafter.counts["short_slots"] - shorts, "wall_s": wall}


# ---------------------------------------------------------------------------------------------- 3. the cores
def llamacpp_steps(plan: Plan, deadline: Deadline, journal) -> tuple[list[dict], str | None]:
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return [], (f"llama_cpp is not importable ({exc}): carry .device_wheels/ built by scripts/device_check.sh "
                    f"--prepare")
    from .device_sections import gguf_step_costs

    rows = []
    for role, size, quantization, top in (("target", plan.cross_llama_target, "Q4_K_M", MAX_K + 1),
                                          ("draft", plan.cross_llama_draft, "Q4_1", plan.cross_max_n)):
        if deadline.passed():
            break
        ns = list(range(1, min(plan.cross_max_n, top) + 1))
        info, t = gguf_step_costs(size, plan, ns, deadline, journal, f"cores {role}", quantization)
        rows.append({"setting": "cores", "model": role, "size": size,
                     "backend": f"llama.cpp {quantization}, {plan.llama_threads} threads", "batch": 1,
                     "step_ms": 1000 * t[1], "ms": {n: 1000 * s for n, s in t.items()}, "gguf": info})
        journal.add("steps", rows[-1])
    return rows, None


# ---------------------------------------------------------------------------------------------- 4. predictions
def conditional(survival: list[float]) -> list[float]:
    """Per-position acceptance a_i (draft i kept given drafts 1..i-1 were) from S_i = P(drafts 1..i kept), which is
    what accepted_per_position / proposed_per_position gives at a fixed K."""
    out, before = [], 1.0
    for s in survival:
        out.append(min(1.0, s / before) if before > 0 else 0.0)
        before = s
    return out


def acceptance_sources(path=ACCEPTANCE_RESULT) -> dict:
    """The acceptance rows to predict at: SmolLM2's measured per-position acceptance (per method, prompt set and
    temperature), or the fallback grid (both methods at each alpha)."""
    from .device_tokenizers import DRAFT_TOKENIZER

    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if path.exists():
        report = json.loads(path.read_text())
        runs = report["drafts"][DRAFT_TOKENIZER]["runs"]
        return {"source": f"{name} ({DRAFT_TOKENIZER} for {report['target']}, K = {report['k']}, "
                          f"{report.get('backend', 'llama.cpp')} on a CPU)",
                "rows": [{"label": f"{r['method']} {r['prompts']} T={r['temperature']}", "method": r["method"],
                          "acceptance": conditional([a for a in r["acceptance_per_position"] if a is not None])}
                         for r in runs if r["method"] in METHODS]}
    return {"source": f"fallback grid: {name} is not there yet (scripts/cross_vocab_acceptance.py writes it)",
            "rows": [{"label": f"alpha {a}", "method": m, "alpha": a} for a in FALLBACK_ALPHAS for m in METHODS]}


def _ms(ms: dict, n: int) -> float:
    """A forward's ms at n tokens (keys int or, read back from JSON, str); the largest measured below if absent."""
    known = {int(k): v for k, v in ms.items()}
    return known[n] if n in known else known[max(k for k in known if k <= n)]


def predictions(steps: list[dict], setting: str, batch: int, bridge: list[dict], acceptance: dict, journal,
                device: str = "cpu") -> list[dict]:
    """Leviathan's prediction per acceptance row for the setting's measured target and draft at this batch, with
    the bridge measured with logits on `device` (any device's where that one's is missing)."""
    mine = {r["model"]: r for r in steps if r["setting"] == setting and r["batch"] == batch}
    if set(mine) != {"target", "draft"}:
        return []
    t, d = mine["target"]["ms"], mine["draft"]["ms"]
    t1 = _ms(t, 1)
    v = {int(n): ms / t1 for n, ms in t.items()}
    max_k = min(MAX_K, max(v) - 1)
    c = _ms(d, 1) / t1
    rows = []
    for source in acceptance["rows"]:
        if not source.get("acceptance") and "alpha" not in source:
            continue
        first = source["alpha"] if "alpha" in source else source["acceptance"][0]
        runs = [b for b in bridge if b["method"] == source["method"] and b["batch"] == batch]
        runs = [b for b in runs if b.get("device", "cpu") == device] or runs
        run = min(runs, key=lambda b: abs((b["first_draft_acceptance"] or 0) - first)) if runs else None
        if run is not None:  # per drafted position of a row (a batch's forwards and host work serve all its rows)
            positions = run["proposed_tokens"] / run["batch"]
            forwards = sum(n * _ms(d, int(w)) for w, n in run["widths"].items()) / (positions * t1)
            bridge_c = run["host_ms_per_token"] * run["batch"] / t1
        else:
            forwards, bridge_c = c, None
        c_eff = forwards + (bridge_c or 0.0)
        row = {"setting": setting, "batch": batch, "method": source["method"], "acceptance_label": source["label"],
               "first_acceptance": first, "c": c, "c_forwards": forwards, "c_bridge": bridge_c, "c_effective": c_eff,
               "bridge_error_rate": run["error_rate"] if run else None,
               "bridge_device": run.get("device", "cpu") if run else None,
               "v": {n: v[n] for n in sorted(v) if n <= max_k + 1}}
        if "alpha" in source:
            row["best_k"], row["predicted_speedup"] = best_k(source["alpha"], c_eff, v, max_k)
            row["speedup_without_bridge"] = best_k(source["alpha"], c, v, max_k)[1]
        else:
            row["best_k"], row["predicted_speedup"] = _best_k_positions(source["acceptance"], c_eff, v, max_k)
            row["speedup_without_bridge"] = _best_k_positions(source["acceptance"], c, v, max_k)[1]
        row["goal_met"] = row["predicted_speedup"] >= GOAL
        rows.append(row)
        journal.add("predictions", row)
    return rows


def _best_k_positions(acceptance: list[float], c: float, v: dict, max_k: int) -> tuple[int, float]:
    """best_k for measured per-position acceptance (expected_speedup, which leviathan is at a constant alpha)."""
    from specdecode.policy.estimates import expected_speedup

    ks = [k for k in range(1, min(max_k, len(acceptance)) + 1) if k + 1 in v]
    return max(((k, expected_speedup(acceptance, k, c, v)) for k in ks), key=lambda kv: kv[1])


# ---------------------------------------------------------------------------------------------- the report
def render(result: dict, table) -> list[str]:
    lines = [f"Goal: {result.get('goal', '—')}. Acceptance: {result.get('acceptance', {}).get('source', '—')}.", ""]
    steps = result.get("steps", [])
    if steps:
        lines += table(["setting", "model", "shape", "backend", "batch", "step ms", "v(2)", "v(5)", "draft n=4 ms"],
                       [[r["setting"], r["model"], r["size"], r["backend"], r["batch"], r["step_ms"],
                         _ms(r["ms"], 2) / r["step_ms"] if r["model"] == "target" else None,
                         _ms(r["ms"], 5) / r["step_ms"] if r["model"] == "target" else None,
                         _ms(r["ms"], 4) if r["model"] == "draft" else None] for r in steps]) + [""]
    for key in ("bridge_skipped", "cores_skipped"):
        if result.get(key):
            lines += [f"{key.replace('_', ' ')}: {result[key]}", ""]
    for e in result.get("bridge_errors", []):
        lines += [f"- bridge run failed (logits on {e['device']}, {e['method']}, batch {e['batch']}): {e['error']}"]
    lines += [""] if result.get("bridge_errors") else []
    if result.get("bridge"):
        lines += ["Bridge (the drafter's host work between the tokenizers, per drafted target token; "
                  "tokenizers: " + "; ".join(f"{k}: {v}" for k, v in result.get("tokenizers", {}).items()) + "):", ""]
        lines += table(["logits on", "method", "batch", "draft error rate", "acceptance", "first-draft acceptance",
                        "host ms / token", "draft forwards / token"],
                       [[b.get("device", "cpu"), b["method"], b["batch"], b["error_rate"], b["acceptance"],
                         b["first_draft_acceptance"], b["host_ms_per_token"], b["forwards_per_token"]]
                        for b in result["bridge"]]) + [""]
    if result.get("predictions"):
        lines += table(["setting", "batch", "method", "acceptance", "c", "c forwards", "c bridge", "c eff", "best K",
                        "predicted ×", "× without bridge", f">= {GOAL}"],
                       [[p["setting"], p["batch"], p["method"], p["acceptance_label"], p["c"], p["c_forwards"],
                         p["c_bridge"], p["c_effective"], p["best_k"], p["predicted_speedup"],
                         p["speedup_without_bridge"], p["goal_met"]] for p in result["predictions"]]) + [""]
    return lines

"""The device check's "compiled" section (issue 45, 53): the static backend's 1-token step and its verification
against the bandwidth floor of its shape (the bytes a step reads, weights and the attended K/V, over the GPU's
bandwidth: its nominal figure and a measured device copy), per variant (VARIANTS), and the draft cost ratio c of
the smallest shape against each larger one.

Its order is its budget's defence (an H200 run on 2026-11-28 spent the whole section compiling, wrote nothing, and
left no trace of where the time went): every shape's CUDA-graph step and its profile first (known to work, seconds),
then the compiled variants, shape by shape, smallest first; every row is journaled as it is measured. A row warms
up only the step shapes it measures (the 1-token step and the verification at the measured context: two compiles,
not a server's whole warm-up), each shape timed with its dynamo compiles counted and the compile phases' seconds,
one progress line each. A server's full warm-up (every bucketed shape at batch 1, bounded by plan.warmup_seconds)
is timed last, per variant on the smallest shape, while time is left."""

from __future__ import annotations

import gc
import statistics
import time

from .device_sections import Deadline, Plan, _device, _dtype, _sync, forward_costs

# The backends measured, by StaticBackend's keywords: CUDA graphs of the eager step; torch.compile's default on CUDA
# ("reduce-overhead": Inductor's kernels replayed in its own CUDA graphs, recorded per shape); Inductor's kernels
# (mode "default": no autotuning, so compiles stay short) captured in this backend's own CUDA graphs, one per shape.
VARIANTS = {"static": {"compile": False}, "compiled": {"compile": True},
            "compiled-own-graphs": {"compile": "default"}}
MAX_SIGHTS = 4  # as backends/warmup.py: a shape still cold after this many steps never warms


# Nominal memory bandwidth (bytes/s) by GPU name, most specific first; the measured copy is printed beside it.
NOMINAL_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                     ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                     ("L40S", 0.864e12), ("L4", 0.3e12))


def nominal_bandwidth(name: str | None) -> float | None:
    return next((bw for key, bw in NOMINAL_BANDWIDTH if name and key in name), None)


def copy_bandwidth(device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once), median of repeats."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def bytes_per_step(model, span: int) -> dict:
    """What a 1-token step at batch 1 reads: every weight once (the input embedding only one row, unless it is also
    the output layer) and the K/V of the attended slots."""
    config = model.config
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    weights, seen = 0, set()
    for p in model.parameters():
        if id(p) in seen or (p is embed and p is not head):
            continue
        seen.add(id(p))
        weights += p.numel() * p.element_size()
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = config.num_key_value_heads or config.num_attention_heads
    kv = 2 * config.num_hidden_layers * heads * dim * span * embed.element_size()
    return {"weights": weights, "kv": kv, "total": weights + kv}


def step_profile(backend, context: int, vocab: int, steps: int = 5) -> dict:
    """Where a warm 1-token step's time goes: wall time per step with a sync after each (what the loop pays), the
    same steps queued back to back (the GPU's pace: below the first, the host is the limit), and the kernels the
    profiler saw per step (count, busy time, the costliest). Kernels replayed from CUDA graphs are reported too."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = backend.device
    backend.reset(1)
    backend.forward(torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(5)).to(device),
                    last_only=True)
    base, ids = backend.lengths, torch.zeros(1, 1, dtype=torch.long, device=device)

    def run(n: int, sync_each: bool) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            backend.forward(ids)
            backend.trim(base)
            if sync_each:
                _sync(device)
        _sync(device)
        return (time.perf_counter() - start) / n

    run(3, True)
    out = {"synced_ms": 1000 * run(20, True), "queued_ms": 1000 * run(20, False)}
    try:
        activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            run(steps, True)
        kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        total = sum(e.self_device_time_total for e in kernels)
        out.update(kernels_per_step=sum(e.count for e in kernels) / steps, kernel_ms_per_step=total / 1000 / steps,
                   top=[{"kernel": e.key[:90], "per_step": e.count / steps,
                         "ms_per_step": e.self_device_time_total / 1000 / steps}
                        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]])
    except Exception as exc:  # noqa: BLE001 - the profile is a diagnosis; the timings above stand without it
        out["profile_error"] = f"{type(exc).__name__}: {exc}"
    return out


def dynamo_counts() -> dict:
    """Graphs dynamo has compiled so far in this process (each a trace and, with Inductor, a code generation)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"]}


def compile_phases() -> dict:
    """Seconds spent so far per compile phase (dynamo's trace, the backend compiler, Inductor), torch's own totals."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {name: float(value) for name, value in zip(names, values)}
    except Exception:  # noqa: BLE001 - a diagnosis only; its form changes between torch versions
        return {}


def timed_warm_up(backend, shapes, seconds: float, journal, label: str) -> dict:
    """backends/warmup.py's warm-up, every shape timed: each run until warm (at most MAX_SIGHTS steps), none
    started after `seconds`; one progress line per shape with its time and its dynamo compiles, and the compile
    phases' seconds of the shapes that compiled."""
    device, start, per_shape, skipped = backend.device, time.perf_counter(), [], []
    journal.log(f"{label}: warm-up of {len(shapes)} step shapes started (bound {seconds:.0f} s, compile mode "
                f"{backend.compile_mode})")
    graphs_before = dynamo_counts()["graphs"]
    for shape in shapes:
        if time.perf_counter() - start > seconds:
            skipped.append(shape)
            continue
        if backend.compile_mode and not backend.is_warm(shape):  # a compile may take minutes: say which, first
            journal.log(f"{label}: shape {tuple(shape)}: compiling")
        counts, phases, began, sights = dynamo_counts(), compile_phases(), time.perf_counter(), 0
        while not backend.is_warm(shape) and sights < MAX_SIGHTS:
            backend.warm_shape(shape)
            sights += 1
        _sync(device)
        took = time.perf_counter() - began
        compiles = dynamo_counts()["graphs"] - counts["graphs"]
        entry = {"shape": list(shape), "seconds": round(took, 3), "sights": sights, "compiles": compiles}
        if compiles:
            after = compile_phases()
            entry["phases_s"] = {k: round(v - phases.get(k, 0.0), 2) for k, v in after.items()
                                 if v - phases.get(k, 0.0) >= 0.05}
        per_shape.append(entry)
        if sights:  # a shape already warm (or one with nothing to warm: eager on a CPU) is no news
            journal.log(f"{label}: shape {tuple(shape)} warm in {took:.2f} s ({sights} steps, {compiles} compiles)")
    warmed = [tuple(x["shape"]) for x in per_shape]
    backend.warmed = list(getattr(backend, "warmed", [])) + warmed
    total = time.perf_counter() - start
    journal.log(f"{label}: warm-up finished: {len(warmed)} shapes in {total:.1f} s, {len(skipped)} left cold, "
                f"{dynamo_counts()['graphs'] - graphs_before} compiles")
    return {"seconds": total, "shapes": len(shapes), "warmed": len(warmed), "left_cold": len(skipped),
            "compiles": dynamo_counts()["graphs"] - graphs_before, "per_shape": per_shape}


def measured_shapes(backend, plan: Plan) -> list[tuple]:
    """The step shapes a row measures: the prompt's forward when it is small enough to be a step (tiny plans), the
    1-token step and the K+1-token verification at the measured context."""
    shapes = [backend.step_shape(1, n, plan.context) for n in (1, plan.fixed_k + 1)]
    if plan.context <= backend.graph_max_tokens:
        shapes.insert(0, backend.step_shape(1, plan.context, 0, last_only=True))
    return list(dict.fromkeys(shapes))


def _variant_row(model, size: str, variant: str, plan: Plan, deadline: Deadline, bandwidth: dict, journal) -> dict:
    from specdecode.backends.static import StaticBackend

    from .random_models import SHAPES

    start = time.perf_counter()
    backend = StaticBackend(model, max_batch=1, max_len=plan.warmup_max_len, **VARIANTS[variant])
    # unbounded: a shape left cold would compile inside the timed steps (the section's deadline still holds)
    warm = timed_warm_up(backend, measured_shapes(backend, plan), float("inf"), journal, f"{size} {variant}")
    warm_s = time.perf_counter() - start
    cold = backend.cold_forwards
    verify = plan.fixed_k + 1
    t = forward_costs(backend, 1, plan.context, [1, verify], plan.repeats, deadline, SHAPES[size][5])
    span = backend.step_shape(1, 1, plan.context)[2]
    nbytes = bytes_per_step(model, span)
    floors = {name: nbytes["total"] / bw for name, bw in bandwidth.items() if bw}
    row = {"size": size, "variant": variant, "compile_mode": backend.compile_mode, "warm_up_s": warm_s,
           "warmed_shapes": warm["warmed"], "left_cold": warm["left_cold"], "compiles": warm["compiles"],
           "warm_up": warm["per_shape"], "cold_after_warm_up": backend.cold_forwards - cold,
           "graphs": backend.captured_graphs, "step_ms": 1000 * t[1], "verify_ms": 1000 * t[verify],
           "verify_tokens": verify, "bytes_per_step": nbytes, "span": span,
           **{f"floor_ms_{k}": 1000 * f for k, f in floors.items()}}
    floor = floors.get("nominal") or floors["measured_copy"]
    row.update(x_floor=t[1] / floor, bandwidth_share=floor / t[1])
    journal.add("rows", row)
    journal.log(f"{size} {variant}: step {row['step_ms']:.2f} ms ({row['x_floor']:.1f}x its floor), verify "
                f"{row['verify_ms']:.2f} ms, warm-up {warm_s:.1f} s with {warm['compiles']} compiles")
    if not deadline.passed():
        row["profile"] = step_profile(backend, plan.context, SHAPES[size][5])
        journal.add("profiles", {"size": size, "variant": variant, **row["profile"]})
        journal.log(f"{size} {variant}: profiled (synced {row['profile']['synced_ms']:.2f} ms, queued "
                    f"{row['profile']['queued_ms']:.2f} ms)")
    return row


def full_warm_up(model, size: str, variant: str, plan: Plan, journal) -> dict:
    """What a server pays at load (StaticBackend.warm_up at batch 1): every bucketed step shape of the default
    context, timed shape by shape, bounded by plan.warmup_seconds."""
    from specdecode.backends.static import StaticBackend
    from specdecode.backends.warmup import step_shapes

    backend = StaticBackend(model, max_batch=1, max_len=plan.warmup_max_len, **VARIANTS[variant])
    warm = timed_warm_up(backend, step_shapes(backend, (1,)), plan.warmup_seconds, journal,
                         f"{size} {variant} full warm-up")
    return {"size": size, "variant": variant, "compile_mode": backend.compile_mode, **warm}


def section_compiled(plan: Plan, deadline: Deadline, journal) -> dict:
    """Per variant (static first), per shape (smallest first): the measured shapes' warm-up, step and verification
    time, bytes per step, floors, profile; then c; then a server's full warm-up per variant while time is left."""
    import torch

    from .random_models import build_qwen

    device = _device(plan)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    bandwidth = {"nominal": nominal_bandwidth(name), "measured_copy": copy_bandwidth(device, plan.copy_bytes)}
    for key, value in (("gpu", name), ("dtype", plan.dtype), ("context", plan.context), ("bandwidth", bandwidth)):
        journal.put(key, value)
    models, rows, warm_ups = {}, [], []

    def model_of(size):
        if size not in models:  # kept for the next variant: 19 GB for the three shapes in bf16
            began = time.perf_counter()
            models[size] = build_qwen(size, device, _dtype(plan.dtype))
            journal.log(f"built {size} in {time.perf_counter() - began:.1f} s")
        return models[size]

    # the first variant (the CUDA-graph step) at every shape, then the compiled ones shape by shape, so that a stop
    # still leaves every compiled variant of the smallest shape beside each other
    first, compiled = plan.step_variants[:1], plan.step_variants[1:]
    for size, variant in [(s, v) for v in first for s in plan.sizes] + [(s, v) for s in plan.sizes for v in compiled]:
        if not deadline.passed():
            rows.append(_variant_row(model_of(size), size, variant, plan, deadline, bandwidth, journal))
    order = {(s, v): i for i, (s, v) in enumerate((s, v) for s in plan.sizes for v in plan.step_variants)}
    rows.sort(key=lambda r: order[(r["size"], r["variant"])])  # the table reads shape by shape
    draft, c = plan.sizes[0], []
    for row in rows:
        mine = next((r for r in rows if r["size"] == draft and r["variant"] == row["variant"]), None)
        if row["size"] != draft and mine:
            c.append({"draft": draft, "target": row["size"], "variant": row["variant"],
                      "c": mine["step_ms"] / row["step_ms"]})
    journal.put("c", c)
    complete = len(rows) == len(plan.sizes) * len(plan.step_variants)
    for variant in plan.step_variants if plan.full_warm_up and complete else ():
        if not deadline.passed():
            warm_ups.append(full_warm_up(model_of(plan.sizes[0]), plan.sizes[0], variant, plan, journal))
            journal.add("warm_ups", warm_ups[-1])
    del models
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"gpu": name, "dtype": plan.dtype, "context": plan.context, "bandwidth": bandwidth, "rows": rows,
            "c": c, "warm_ups": warm_ups, "complete": complete,
            "goals": "1.5B step <= 2x its floor; 7B >= 70 % of the bandwidth; c(0.5B -> 7B) <= 0.2; "
                     "warm-up <= 60 s"}


def render(result: dict, table) -> list[str]:
    """The section's markdown (device_report.py), with its table helper; a partial result (a killed section's
    journal) lacks c, warm_ups and complete."""
    bw = result.get("bandwidth") or {}
    nominal = f"{bw['nominal'] / 1e12:.2f} TB/s nominal, " if bw.get("nominal") else ""
    copy = f"{bw['measured_copy'] / 1e12:.3f} TB/s measured (a device copy); " if bw.get("measured_copy") else ""
    lines = [f"{result.get('gpu') or 'CPU'}: {nominal}{copy}{result.get('dtype')}, batch 1, context "
             f"{result.get('context')}; goals: {result.get('goals', '—')}.", ""]
    rows = result.get("rows", [])
    lines += table(["shape", "variant", "warm-up s (compiles)", "shapes (cold left)", "step ms", "verify ms",
                    "GB per step", "floor ms (nominal)", "floor ms (copy)", "x floor", "bandwidth share"],
                   [[r["size"], r["variant"], f"{r['warm_up_s']:.1f} ({r.get('compiles', '—')})",
                     f"{r['warmed_shapes']} ({r['left_cold']})", r["step_ms"], r["verify_ms"],
                     r["bytes_per_step"]["total"] / 1e9, r.get("floor_ms_nominal"), r.get("floor_ms_measured_copy"),
                     r["x_floor"], r["bandwidth_share"]] for r in rows])
    profiles = [dict(p, size=r["size"], variant=r["variant"]) for r in rows for p in [r.get("profile")] if p] or \
        result.get("profiles", [])
    if profiles:
        lines += ["", "Where a 1-token step's time goes (synced: a sync after each step; queued: steps back to back; "
                      "kernels as the profiler saw them):", ""]
        lines += table(["shape", "variant", "synced ms", "queued ms", "kernels per step", "kernel ms per step",
                        "costliest kernel"],
                       [[p["size"], p["variant"], p["synced_ms"], p["queued_ms"], p.get("kernels_per_step"),
                         p.get("kernel_ms_per_step"), (p.get("top") or [{}])[0].get("kernel", p.get("profile_error"))]
                        for p in profiles])
    if result.get("c"):
        lines += ["", "Draft cost ratio c:", ""]
        lines += table(["draft", "target", "variant", "c"],
                       [[x["draft"], x["target"], x["variant"], x["c"]] for x in result["c"]])
    if result.get("warm_ups"):
        lines += ["", "A server's warm-up at load (every bucketed shape at batch 1, bounded):", ""]
        lines += table(["shape", "variant", "seconds", "shapes warmed / all", "compiles", "slowest shape s"],
                       [[w["size"], w["variant"], w["seconds"], f"{w['warmed']} / {w['shapes']}", w["compiles"],
                         max((x["seconds"] for x in w["per_shape"]), default=None)] for w in result["warm_ups"]])
    return lines + [""]

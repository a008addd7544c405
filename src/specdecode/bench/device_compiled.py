"""The device check's "compiled" section (issue 45): the static backend's step, plain (CUDA graphs of the eager
step) and compiled (StaticBackend(compile=True): torch.compile "reduce-overhead" on CUDA), each warmed up at load
as a server would (warm_up(): every bucketed step shape of the default context at batch 1), against the bandwidth
floor of its shape: the bytes a step reads (weights, the attended K/V) over the GPU's bandwidth, both its nominal
figure and a measured device copy; and the draft cost ratio c of the smallest shape against each larger one."""

from __future__ import annotations

import gc
import statistics
import time

from .device_sections import Deadline, Plan, _device, _dtype, _sync, forward_costs

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


def _variant_row(model, size: str, variant: str, plan: Plan, deadline: Deadline, bandwidth: dict) -> dict:
    from specdecode.backends.static import StaticBackend
    from specdecode.bench.random_models import SHAPES

    start = time.perf_counter()
    backend = StaticBackend(model, max_batch=1, max_len=plan.warmup_max_len, compile=variant == "compiled")
    report = backend.warm_up(batches=(1,), seconds=plan.warmup_seconds, log=None)
    warm_s = time.perf_counter() - start
    cold = backend.cold_forwards
    verify = plan.fixed_k + 1
    t = forward_costs(backend, 1, plan.context, [1, verify], plan.repeats, deadline, SHAPES[size][5])
    span = backend.step_shape(1, 1, plan.context)[2]
    nbytes = bytes_per_step(model, span)
    floors = {name: nbytes["total"] / bw for name, bw in bandwidth.items() if bw}
    row = {"size": size, "variant": variant, "compile_mode": backend.compile_mode, "warm_up_s": warm_s,
           "warmed_shapes": len(report.warmed), "left_cold": len(report.skipped),
           "cold_after_warm_up": backend.cold_forwards - cold, "graphs": backend.captured_graphs,
           "step_ms": 1000 * t[1], "verify_ms": 1000 * t[verify], "verify_tokens": verify,
           "bytes_per_step": nbytes, "span": span, **{f"floor_ms_{k}": 1000 * f for k, f in floors.items()}}
    floor = floors.get("nominal") or floors["measured_copy"]
    row.update(x_floor=t[1] / floor, bandwidth_share=floor / t[1])
    if not deadline.passed():
        row["profile"] = step_profile(backend, plan.context, SHAPES[size][5])
    return row


def section_compiled(plan: Plan, deadline: Deadline) -> dict:
    """Per shape and variant: warm-up, step and verification time, bytes per step, floors; then c."""
    import torch

    from specdecode.bench.random_models import build_qwen

    device = _device(plan)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    bandwidth = {"nominal": nominal_bandwidth(name), "measured_copy": copy_bandwidth(device, plan.copy_bytes)}
    rows = []
    for size in plan.sizes:
        if deadline.passed():
            break
        model = build_qwen(size, device, _dtype(plan.dtype))
        for variant in plan.step_variants:
            if not deadline.passed():
                rows.append(_variant_row(model, size, variant, plan, deadline, bandwidth))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    draft, c = plan.sizes[0], []
    for row in rows:
        mine = next((r for r in rows if r["size"] == draft and r["variant"] == row["variant"]), None)
        if row["size"] != draft and mine:
            c.append({"draft": draft, "target": row["size"], "variant": row["variant"],
                      "c": mine["step_ms"] / row["step_ms"]})
    return {"gpu": name, "dtype": plan.dtype, "context": plan.context, "bandwidth": bandwidth, "rows": rows,
            "c": c, "complete": len(rows) == len(plan.sizes) * len(plan.step_variants),
            "goals": "1.5B step <= 2x its floor; 7B >= 70 % of the bandwidth; c(0.5B -> 7B) <= 0.2; "
                     "warm-up <= 60 s"}


def render(result: dict, table) -> list[str]:
    """The section's markdown (device_check.render_markdown), with its table helper."""
    bw = result["bandwidth"]
    nominal = f"{bw['nominal'] / 1e12:.2f} TB/s nominal, " if bw.get("nominal") else ""
    lines = [f"{result['gpu'] or 'CPU'}: {nominal}{bw['measured_copy'] / 1e12:.3f} TB/s measured (a device copy); "
             f"{result['dtype']}, batch 1, context {result['context']}; goals: {result['goals']}.", ""]
    lines += table(["shape", "variant", "warm-up s", "shapes (cold left)", "step ms", "verify ms",
                    "GB per step", "floor ms (nominal)", "floor ms (copy)", "x floor", "bandwidth share"],
                   [[r["size"], r["variant"], r["warm_up_s"], f"{r['warmed_shapes']} ({r['left_cold']})",
                     r["step_ms"], r["verify_ms"], r["bytes_per_step"]["total"] / 1e9, r.get("floor_ms_nominal"),
                     r["floor_ms_measured_copy"], r["x_floor"], r["bandwidth_share"]] for r in result["rows"]])
    profiled = [r for r in result["rows"] if r.get("profile")]
    if profiled:
        lines += ["", "Where a 1-token step's time goes (synced: a sync after each step; queued: steps back to back; "
                      "kernels as the profiler saw them):", ""]
        lines += table(["shape", "variant", "synced ms", "queued ms", "kernels per step", "kernel ms per step",
                        "costliest kernel"],
                       [[r["size"], r["variant"], r["profile"]["synced_ms"], r["profile"]["queued_ms"],
                         r["profile"].get("kernels_per_step"), r["profile"].get("kernel_ms_per_step"),
                         (r["profile"].get("top") or [{}])[0].get("kernel", r["profile"].get("profile_error"))]
                        for r in profiled])
    lines += ["", "Draft cost ratio c:", ""]
    lines += table(["draft", "target", "variant", "c"],
                   [[x["draft"], x["target"], x["variant"], x["c"]] for x in result["c"]]) + [""]
    return lines

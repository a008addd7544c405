"""The device check's sections (device_check.py runs each in a process of its own) and the plan they measure: the
machine, the carried wheels, the suite's device tests, v(n) and c, the engine's overhead against the prediction, and
llama.cpp on the machine's cores."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from .device_wheels import REPO, WHEELS, wheel_report

DEFAULT_PAIR_RESULT = REPO / "docs" / "results" / "llamacpp-code.json"


@dataclass
class Plan:
    """What a run measures: the full check on the lent machine, or tiny shapes on the CPU (dry run)."""

    device: str
    dtype: str
    sizes: tuple  # random-weight shapes whose v(n) is measured, smallest first (c: each against each larger)
    batches: tuple
    max_n: int
    context: int
    repeats: int
    target: str  # the overhead section's pair
    draft: str
    alphas: tuple
    fixed_k: int
    new_tokens: int
    overhead_batches: tuple
    llama_target: str
    llama_draft: str
    llama_threads: int
    llama_context: int
    budgets: dict  # seconds per section (it stops measuring new rows at 85 % of it; killed 10 s after it)
    torch_threads: int | None = None  # None: torch's default
    step_variants: tuple = ("static", "compiled")  # the compiled section's backends (device_compiled.py)
    warmup_max_len: int | None = None  # its backends' max_len (None: the default, 4096 tokens)
    warmup_seconds: float = 60.0
    copy_bytes: int = 2**30  # the measured copy's size
    overhead_compile: bool = False  # the overhead section's backends: StaticBackend(compile=True), warmed up first
    overhead_warmup_seconds: float = 30.0  # each of its backends' warm-up bound (compiled only)
    assisted: bool = True  # the overhead section's transformers assisted-generation row (batch 1)

    @classmethod
    def full(cls) -> "Plan":
        return cls(device="cuda", dtype="bfloat16", sizes=("0.5B", "1.5B", "7B"), batches=(1, 4, 16), max_n=16,
                   context=128, repeats=7, target="7B", draft="0.5B", alphas=(0.6, 0.8, 0.9), fixed_k=4,
                   new_tokens=128, overhead_batches=(1, 4), llama_target="1.5B", llama_draft="0.5B",
                   llama_threads=min(16, os.cpu_count() or 1), llama_context=512,
                   budgets={"environment": 20, "wheels": 20, "gpu_tests": 120, "costs": 110, "overhead": 170,
                            "llamacpp": 100, "compiled": 240}, overhead_compile=True, assisted=False)

    @classmethod
    def dry(cls) -> "Plan":
        return cls(device="cpu", dtype="float32", sizes=("tiny-draft", "tiny"), batches=(1, 2), max_n=4,
                   context=16, repeats=2, target="tiny", draft="tiny-draft", alphas=(0.6, 0.8, 0.9), fixed_k=3,
                   new_tokens=12, overhead_batches=(1,), llama_target="tiny", llama_draft="tiny-draft",
                   llama_threads=min(2, os.cpu_count() or 1), llama_context=64,
                   budgets={"environment": 30, "wheels": 30, "gpu_tests": 90, "costs": 60, "overhead": 60,
                            "llamacpp": 60, "compiled": 60}, torch_threads=1,
                   # compiling on two CPU cores takes ~40 s a graph: tests/test_compiled_step.py covers it
                   step_variants=("static",), warmup_max_len=64, warmup_seconds=10.0, copy_bytes=2**24)


# ---------------------------------------------------------------------------------------------- helpers
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + 0.85 * seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def forward_costs(backend, batch: int, context: int, ns, repeats: int, deadline: Deadline, vocab: int) -> dict:
    """Median seconds of an n-token forward per n on a warm cache of `context` tokens per row (trimmed back after
    each), interleaved over n and repeated; any ModelBackend (static, transformers, llama.cpp)."""
    import torch

    device = backend.device
    gen = torch.Generator().manual_seed(batch)
    backend.reset(batch)
    backend.forward(torch.randint(0, vocab, (batch, context), generator=gen).to(device), last_only=True)
    base = backend.lengths
    inputs = {n: torch.randint(0, vocab, (batch, n), generator=gen).to(device) for n in ns}
    times = {n: [] for n in ns}
    warm = 2  # untimed rounds: the static backend captures a step's CUDA graph the second time it sees its shape
    for rep in range(repeats + warm):
        for n in ns:
            _sync(device)
            start = time.perf_counter()
            backend.forward(inputs[n])
            _sync(device)
            if rep >= warm:
                times[n].append(time.perf_counter() - start)
            backend.trim(base)
        if rep >= warm + 1 and deadline.passed():
            break
    return {n: statistics.median(t) for n, t in times.items() if t}


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _device(plan: Plan):
    import torch

    return torch.device(plan.device)


def _static(model, plan: Plan, rows: int, tokens: int, vocab: int | None = None, compile: bool = False):
    from specdecode.backends.static import StaticBackend

    return StaticBackend(model, vocab_size=vocab, max_batch=rows, max_len=tokens + 64, compile=compile)


# ---------------------------------------------------------------------------------------------- sections
def section_environment(plan: Plan, deadline: Deadline) -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "cuda_available": torch.cuda.is_available()}
    try:
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("model name")), None)
    except OSError:
        info["cpu"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    try:
        import llama_cpp

        info["llama_cpp"] = llama_cpp.__version__
    except Exception as exc:  # noqa: BLE001 - recorded: the llamacpp section then says why it cannot run
        info["llama_cpp"] = f"not importable: {exc}"
    return info


def section_wheels(plan: Plan, deadline: Deadline) -> dict:
    return wheel_report(Path(os.environ.get("SPECDECODE_DEVICE_WHEELS", WHEELS)))


def section_gpu_tests(plan: Plan, deadline: Deadline) -> dict:
    """The suite's device paths, run by pytest on plan.device; per-test outcomes from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, SPECDECODE_TEST_DEVICE=plan.device, SPECDECODE_TEST_THREADS="4")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                   "-o", "addopts=", f"--junitxml={xml}", "tests/test_device_paths.py",
                   "tests/test_static_backend.py", "-k", "device or cuda or gpu"]
        if plan.device == "cuda":  # the compiled step's tests: on a CPU they compile for minutes (CI runs them)
            command[-3:-3] = ["tests/test_compiled_step.py"]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=max(10, deadline.end - time.monotonic()))
        tests = _junit(xml) if xml.exists() else []
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {"device": plan.device, "command": " ".join(command[1:]), "exit_code": done.returncode, **counts,
            "failures": [t for t in tests if t["outcome"] == "failed"],
            "skipped_tests": [t["name"] for t in tests if t["outcome"] == "skipped"],
            "output_tail": done.stdout[-2000:] + done.stderr[-1000:]}


def _junit(xml: Path) -> list[dict]:
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome, message = name, (found.get("message") or "")[:500]
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "time_s": float(case.get("time") or 0), "message": message})
    return tests


def section_costs(plan: Plan, deadline: Deadline) -> dict:
    """v(n) per shape, backend and batch (static with CUDA graphs on a GPU, transformers), and c."""
    import gc

    import torch

    from specdecode.backends.hf import HFBackend
    from specdecode.bench.random_models import SHAPES, build_qwen

    device, ns, rows = _device(plan), list(range(1, plan.max_n + 1)), []
    for size in plan.sizes:
        model = build_qwen(size, device, _dtype(plan.dtype))
        vocab = SHAPES[size][5]
        backends = {"static": _static(model, plan, max(plan.batches), plan.context + plan.max_n),
                    "transformers": HFBackend(model)}
        for name, backend in backends.items():
            for batch in plan.batches:
                if deadline.passed():
                    break
                t = forward_costs(backend, batch, plan.context, ns, plan.repeats, deadline, vocab)
                rows.append({"size": size, "backend": name, "batch": batch, "step_ms": 1000 * t[1],
                             "ms": {n: 1000 * s for n, s in t.items()}, "v": {n: s / t[1] for n, s in t.items()},
                             "graphs": getattr(backend, "captured_graphs", None)})
        del model, backends
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    c = []
    for i, draft in enumerate(plan.sizes):
        for target in plan.sizes[i + 1:]:
            for row in rows:
                if row["size"] != target:
                    continue
                mine = next((r for r in rows if r["size"] == draft and r["backend"] == row["backend"]
                             and r["batch"] == row["batch"]), None)
                if mine:
                    c.append({"draft": draft, "target": target, "backend": row["backend"], "batch": row["batch"],
                              "c": mine["step_ms"] / row["step_ms"]})
    return {"dtype": plan.dtype, "context": plan.context, "repeats": plan.repeats, "rows": rows, "c": c,
            "complete": len(rows) == len(plan.sizes) * 2 * len(plan.batches)}


def leviathan(alpha: float, k: int, c: float, v: dict) -> float:
    from specdecode.policy.estimates import expected_speedup

    return expected_speedup([alpha] * k, k, c, v)


def best_k(alpha: float, c: float, v: dict, max_k: int) -> tuple[int, float]:
    return max(((k, leviathan(alpha, k, c, v)) for k in range(1, max_k + 1) if k + 1 in v), key=lambda kv: kv[1])


def _timed(fn, device, repeats: int = 2):
    """(median seconds, last result) of `repeats` calls after one warm-up (which also captures CUDA graphs)."""
    out, times = fn(), []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def section_overhead(plan: Plan, deadline: Deadline) -> dict:
    """Ours at known acceptance against plain decoding and Leviathan's prediction; then transformers' assisted
    generation beside ours with a draft that is always right (both models copy their current token)."""
    import torch

    from specdecode import AutoregressiveGenerator, SpeculativeGenerator
    from specdecode.backends.hf import HFBackend
    from specdecode.bench.random_models import SHAPES, build_qwen
    from specdecode.bench.replay_drafter import ReplayDrafter
    from specdecode.drafters.model import ModelDrafter

    device, dtype, max_k = _device(plan), _dtype(plan.dtype), 8
    # copying models: their greedy continuation survives half-precision rounding (random_models.build_qwen)
    target = build_qwen(plan.target, device, dtype, seed=0, copying=True)
    draft = build_qwen(plan.draft, device, dtype, seed=1, copying=True)
    vocab = min(SHAPES[plan.target][5], SHAPES[plan.draft][5])  # the 7B shape's output layer has 128 more rows
    tokens = plan.context + plan.new_tokens + max_k + 2
    rows, assisted, warm_ups = [], [], []
    # One backend per model for every batch size, as a server holds them: compiled graphs and CUDA graphs are per
    # backend, so a backend per batch would compile again.
    top = max(plan.overhead_batches)
    target_backend = _static(target, plan, top, tokens, vocab, plan.overhead_compile)
    draft_backend = _static(draft, plan, top, tokens, vocab, plan.overhead_compile)
    if plan.overhead_compile:
        for name, backend in (("target", target_backend), ("draft", draft_backend)):
            start = time.perf_counter()
            report = backend.warm_up(batches=plan.overhead_batches, seconds=plan.overhead_warmup_seconds,
                                     log=None)
            warm_ups.append({"model": name, "seconds": time.perf_counter() - start, "warmed": len(report.warmed),
                             "left_cold": len(report.skipped), "compile_mode": backend.compile_mode})
    for batch in plan.overhead_batches:
        prompts = torch.randint(0, vocab, (batch, plan.context), generator=torch.Generator().manual_seed(3)).tolist()
        costs = forward_costs(target_backend, batch, plan.context, range(1, max_k + 2), plan.repeats, deadline, vocab)
        d1 = forward_costs(draft_backend, batch, plan.context, [1], plan.repeats, deadline, vocab)[1]
        v, c = {n: s / costs[1] for n, s in costs.items()}, d1 / costs[1]
        new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
        plain_s, plain = _timed(lambda: AutoregressiveGenerator(target_backend).generate(prompts, **new), device)
        plain_tps = batch * plan.new_tokens / plain_s
        record = plain.token_ids
        for alpha in plan.alphas:
            for k in (plan.fixed_k, "auto"):
                if deadline.passed():
                    break
                drafters = []

                def run():
                    drafter = ReplayDrafter(record, alpha, vocab, seed=batch, model=ModelDrafter(draft_backend))
                    drafters.append(drafter)
                    generator = SpeculativeGenerator(target_backend, drafter, num_speculative_tokens=k,
                                                     max_speculative_tokens=max_k)
                    return generator.generate(prompts, **new)

                seconds, result = _timed(run, device)
                stats = result.stats
                predicted_k, predicted = (k, leviathan(alpha, k, c, v)) if k != "auto" else best_k(alpha, c, v, max_k)
                measured = plain_s / seconds
                rows.append({"batch": batch, "alpha": alpha, "k": k, "predicted_best_k": predicted_k,
                             "tokens_per_s": batch * plan.new_tokens / seconds, "plain_tokens_per_s": plain_tps,
                             "speedup": measured, "predicted_speedup": predicted, "ratio": measured / predicted,
                             "acceptance": stats.accepted_tokens / max(1, stats.proposed_tokens),
                             "first_draft_acceptance": (stats.accepted_per_position[0] / stats.proposed_per_position[0]
                                                        if stats.proposed_per_position
                                                        and stats.proposed_per_position[0] else None),
                             "k_histogram": {str(a): b for a, b in stats.k_histogram.items()},
                             "same_as_plain": result.token_ids == record,
                             "off_record_tokens": drafters[-1].off_record, "c": c,
                             "v": {n: round(x, 4) for n, x in v.items()}})
        if batch == 1 and plan.assisted and not deadline.passed():
            assisted = _assisted(target, draft, prompts, plan, device, deadline)
    return {"target": plan.target, "draft": plan.draft, "dtype": plan.dtype, "new_tokens": plan.new_tokens,
            "context": plan.context, "compiled": plan.overhead_compile, "warm_ups": warm_ups, "rows": rows,
            "assisted": assisted,
            "goal": "ratio = measured speedup / Leviathan's prediction >= 0.9"}


def _assisted(target, draft, prompts, plan: Plan, device, deadline: Deadline) -> list[dict]:
    """transformers generate() and assisted generation (K fixed, constant schedule) against ours on the transformers
    backend, one row, both models copying (acceptance 1); each against its own plain decoding and the prediction."""
    import torch

    from specdecode import AutoregressiveGenerator, SpeculativeGenerator
    from specdecode.backends.hf import HFBackend

    k, ids = plan.fixed_k, torch.tensor(prompts, device=device)
    hf = dict(max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens, do_sample=False, pad_token_id=0)
    new = dict(max_new_tokens=plan.new_tokens, temperature=0.0, ignore_eos=True)
    vocab = target.config.vocab_size
    t = forward_costs(HFBackend(target), 1, plan.context, range(1, k + 2), plan.repeats, deadline, vocab)
    d1 = forward_costs(HFBackend(draft), 1, plan.context, [1], plan.repeats, deadline, vocab)[1]
    v, c = {n: s / t[1] for n, s in t.items()}, d1 / t[1]
    predicted = leviathan(1.0, k, c, v)
    runs = {
        "transformers": (lambda: target.generate(ids, **hf)[:, ids.shape[1]:].tolist(),
                         lambda: target.generate(ids, assistant_model=draft, num_assistant_tokens=k,
                                                 num_assistant_tokens_schedule="constant", **hf)[:, ids.shape[1]:]
                         .tolist()),
        "ours (transformers backend)": (
            lambda: AutoregressiveGenerator(HFBackend(target)).generate(prompts, **new).token_ids,
            lambda: SpeculativeGenerator(HFBackend(target), HFBackend(draft), num_speculative_tokens=k)
            .generate(prompts, **new).token_ids),
    }
    out = []
    for name, (plain_fn, spec_fn) in runs.items():
        if deadline.passed():
            break
        plain_s, plain = _timed(plain_fn, device)
        spec_s, spec = _timed(spec_fn, device)
        out.append({"method": name, "k": k, "plain_tokens_per_s": plan.new_tokens / plain_s,
                    "tokens_per_s": plan.new_tokens / spec_s, "speedup": plain_s / spec_s,
                    "predicted_speedup": predicted, "ratio": plain_s / spec_s / predicted, "c": c,
                    "same_as_plain": spec == plain})
    return out


def default_pair_alpha(path: Path = DEFAULT_PAIR_RESULT) -> dict:
    """The default pair's first-draft acceptance on llama.cpp (code prompts), from the committed benchmark: the
    fixed-K run with the largest K."""
    report = json.loads(path.read_text())
    fixed = [(s["k"], s["methods"]["specdecode"]["alpha"]) for s in report["sweep"]
             if isinstance(s["k"], int) and "specdecode" in s["methods"]]
    k, alpha = max(fixed)
    return {"alpha": alpha, "k": k, "source": f"{path.relative_to(REPO)} (specdecode, K={k}, "
                                             f"{report['config']['target']} <- {report['config']['draft']})"}


def section_llamacpp(plan: Plan, deadline: Deadline) -> dict:
    """llama.cpp on the machine's cores: random-weight GGUFs written with gguf, quantized to Q4_K_M by llama.cpp."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"llama_cpp is not importable ({exc}): carry .device_wheels/ built by "
                           f"scripts/device_check.sh --prepare (a portable llama-cpp-python wheel)"}
    from specdecode.backends.llamacpp import LlamaCppBackend
    from specdecode.bench.random_models import SHAPES, quantize_gguf, write_qwen_gguf

    out = {"threads": plan.llama_threads, "context": plan.llama_context, "quantization": "Q4_K_M"}
    ns = list(range(1, plan.max_n + 1))
    with tempfile.TemporaryDirectory() as tmp:
        steps = {}
        for role, size in (("target", plan.llama_target), ("draft", plan.llama_draft)):
            start = time.perf_counter()
            f16 = write_qwen_gguf(size, Path(tmp) / f"{size}-f16.gguf")
            written = time.perf_counter()
            q4 = quantize_gguf(f16, Path(tmp) / f"{size}-q4_k_m.gguf", plan.llama_threads)
            f16.unlink()
            out[f"{role}_gguf"] = {"size": size, "write_s": written - start, "quantize_s": time.perf_counter() - written,
                                   "bytes": q4.stat().st_size}
            backend = LlamaCppBackend(str(q4), n_ctx=plan.llama_context + plan.max_n + 8,
                                      n_threads=plan.llama_threads)
            steps[role] = forward_costs(backend, 1, plan.llama_context // 2, ns if role == "target" else [1],
                                        plan.repeats, deadline, SHAPES[size][5])
            del backend
    t = steps["target"]
    v, c = {n: s / t[1] for n, s in t.items()}, steps["draft"][1] / t[1]
    out.update(step_ms=1000 * t[1], ms={n: 1000 * s for n, s in t.items()}, v=v, c=c,
               draft_step_ms=1000 * steps["draft"][1])
    try:
        pair = default_pair_alpha()
        k, speedup = best_k(pair["alpha"], c, v, min(8, plan.max_n - 1))
        out["prediction"] = {**pair, "best_k": k, "predicted_speedup": speedup,
                             "by_k": {kk: leviathan(pair["alpha"], kk, c, v) for kk in range(1, min(8, plan.max_n - 1) + 1)}}
    except Exception as exc:  # noqa: BLE001
        out["prediction"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


SECTION_FUNCTIONS = {"environment": section_environment, "wheels": section_wheels, "gpu_tests": section_gpu_tests,
                     "costs": section_costs, "overhead": section_overhead, "llamacpp": section_llamacpp}

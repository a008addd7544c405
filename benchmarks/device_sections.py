"""The device check's sections (device_check.py runs each in a process of its own) and the plan they measure: the
machine, the carried wheels, the suite's device tests, v(n) and c, and llama.cpp on the machine's cores (the
engine's overhead against the prediction: device_overhead.py; the compiled step: device_compiled.py). Every section
takes (plan, deadline, journal) and journals its rows and steps as it goes (device_journal.py)."""

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
    # The compiled section's backends (device_compiled.VARIANTS), measured in this order for every shape before the
    # next variant starts: the CUDA-graph step known to work first, each compiled variant after it.
    step_variants: tuple = ("static", "compiled")
    warmup_max_len: int | None = None  # the full warm-up's max_len (None: the default, 4096 tokens)
    warmup_seconds: float = 60.0  # the full warm-up's bound (the compiled section's last step)
    full_warm_up: bool = True  # the compiled section ends with a server's warm-up, per variant, smallest shape
    copy_bytes: int = 2**30  # the measured copy's size
    # The overhead section's backends, in order: "static" (CUDA graphs) first, then "compiled" (StaticBackend(
    # compile=True), warmed up on the shapes its run needs first).
    overhead_variants: tuple = ("static",)
    overhead_warmup_seconds: float = 30.0  # each compiled backend's warm-up bound there
    assisted: bool = True  # the overhead section's transformers assisted-generation row (batch 1)
    # The cross_vocab section (device_cross_vocab.py): a draft of another family (SmolLM2-135M's shape, llama) for a
    # Qwen2.5 target, on the plan's device (static backend) and with llama.cpp on the cores; the bridge's host cost
    # measured at K = cross_k over cross_new_tokens tokens per row, with the draft erring at each of cross_error_rates.
    cross_target: str = "7B"
    cross_draft: str = "135M"
    cross_llama_target: str = "1.5B"
    cross_llama_draft: str = "135M"
    cross_batches: tuple = (1,)
    cross_max_n: int = 16  # forwards of 1..cross_max_n tokens timed (the target's up to 9: K <= 8)
    cross_k: int = 4
    cross_new_tokens: int = 192
    cross_error_rates: tuple = (0.0, 0.25)

    @classmethod
    def full(cls) -> "Plan":
        return cls(device="cuda", dtype="bfloat16", sizes=("0.5B", "1.5B", "7B"), batches=(1, 4, 16), max_n=16,
                   context=128, repeats=7, target="7B", draft="0.5B", alphas=(0.6, 0.8, 0.9), fixed_k=4,
                   new_tokens=128, overhead_batches=(1, 4), llama_target="1.5B", llama_draft="0.5B",
                   llama_threads=min(16, os.cpu_count() or 1), llama_context=512,
                   # compiled: the whole of a ~5-minute call beside the environment (docs/BENCHMARKS.md's plan)
                   budgets={"environment": 20, "wheels": 20, "gpu_tests": 120, "costs": 110, "overhead": 170,
                            "llamacpp": 100, "compiled": 260, "cross_vocab": 150},
                   step_variants=("static", "compiled", "compiled-own-graphs"),
                   overhead_variants=("static", "compiled"), assisted=False)

    @classmethod
    def dry(cls) -> "Plan":
        return cls(device="cpu", dtype="float32", sizes=("tiny-draft", "tiny"), batches=(1, 2), max_n=4,
                   context=16, repeats=2, target="tiny", draft="tiny-draft", alphas=(0.6, 0.8, 0.9), fixed_k=3,
                   new_tokens=12, overhead_batches=(1,), llama_target="tiny", llama_draft="tiny-draft",
                   llama_threads=min(2, os.cpu_count() or 1), llama_context=64,
                   # gpu_tests: pytest's start alone took 70 s on a 2-core CPU shared with other work (load 10)
                   budgets={"environment": 30, "wheels": 30, "gpu_tests": 150, "costs": 60, "overhead": 60,
                            "llamacpp": 60, "compiled": 60, "cross_vocab": 60}, torch_threads=1,
                   # compiling on two CPU cores takes ~40 s a graph: tests/test_compiled_step.py covers it
                   step_variants=("static",), warmup_max_len=64, warmup_seconds=10.0, copy_bytes=2**24,
                   cross_target="tiny", cross_draft="tiny-llama", cross_llama_target="tiny",
                   cross_llama_draft="tiny-llama", cross_max_n=8, cross_new_tokens=32)


# ---------------------------------------------------------------------------------------------- helpers
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Deadline:
    """A section's time: it starts no new row after 85 % of it (end); a subprocess it waits on may run to the last
    few seconds before the driver's kill (hard_end)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + 0.85 * seconds
        self.hard_end = time.monotonic() + seconds - 5

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


def _static(model, plan: Plan, rows: int, tokens: int, vocab: int | None = None, compile: bool | str = False):
    from specdecode.backends.static import StaticBackend

    return StaticBackend(model, vocab_size=vocab, max_batch=rows, max_len=tokens + 64, compile=compile)


# ---------------------------------------------------------------------------------------------- sections
def section_environment(plan: Plan, deadline: Deadline, journal) -> dict:
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
    try:  # what bounds a compile's time: Inductor's worker count and its cache (scripts/device_check.sh sets them)
        from torch._inductor import config as inductor

        info.update(inductor_compile_threads=inductor.compile_threads,
                    inductor_fx_graph_cache=inductor.fx_graph_cache,
                    inductor_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    except Exception as exc:  # noqa: BLE001
        info["inductor"] = f"not readable: {exc}"
    journal.put("info", info)
    try:
        import llama_cpp

        info["llama_cpp"] = llama_cpp.__version__
    except Exception as exc:  # noqa: BLE001 - recorded: the llamacpp section then says why it cannot run
        info["llama_cpp"] = f"not importable: {exc}"
    return info


def section_wheels(plan: Plan, deadline: Deadline, journal) -> dict:
    return wheel_report(Path(os.environ.get("SPECDECODE_DEVICE_WHEELS", WHEELS)))


def section_gpu_tests(plan: Plan, deadline: Deadline, journal) -> dict:
    """The suite's device paths, run by pytest on plan.device; per-test outcomes from its JUnit XML, or, when the
    deadline stops it, from its verbose lines as they came (each also journaled with its time)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, SPECDECODE_TEST_DEVICE=plan.device, SPECDECODE_TEST_THREADS="4")
        command = [sys.executable, "-m", "pytest", "-v", "-p", "no:randomly", "-p", "no:cacheprovider",
                   "-o", "addopts=", f"--junitxml={xml}", "tests/test_device_paths.py",
                   "tests/test_static_backend.py", "-k", "device or cuda or gpu"]
        if plan.device == "cuda":  # the compiled step's tests, last (they compile): on a CPU for minutes (CI runs them)
            command[-2:-2] = ["tests/test_compiled_step.py"]
        journal.log("pytest " + " ".join(command[4:]))
        exit_code, streamed, output = _stream(command, env, deadline.hard_end - time.monotonic(), journal)
        tests = _junit(xml) if xml.exists() else streamed
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {"device": plan.device, "command": " ".join(command[1:]), "exit_code": exit_code, **counts,
            "timed_out": exit_code is None, "seconds": time.monotonic() - journal.start,
            "failures": [t for t in tests if t["outcome"] == "failed"],
            "skipped_tests": [t["name"] for t in tests if t["outcome"] == "skipped"],
            "output_tail": output[-3000:]}


def _stream(command, env, seconds: float, journal) -> tuple[int | None, list[dict], str]:
    """(exit code or None when stopped at `seconds`, outcomes from pytest -v lines, output): each outcome line is
    journaled as it comes, so a stop still says which tests ran and how long each took."""
    import re
    import threading

    outcome = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped", "XFAIL": "skipped",
             "XPASS": "passed"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    lines, tests = [], []

    def read():
        for line in process.stdout:
            lines.append(line)
            found = outcome.match(line)
            if found:
                tests.append({"name": found.group(1), "outcome": names[found.group(2)]})
                journal.add("tests", tests[-1])
                journal.log(line.strip()[:160])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=max(10.0, seconds))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
        journal.log(f"pytest stopped at the section's deadline ({seconds:.0f} s), {len(tests)} tests reported")
    reader.join(timeout=5)
    return code, tests, "".join(lines)


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


def section_costs(plan: Plan, deadline: Deadline, journal) -> dict:
    """v(n) per shape, backend and batch (static with CUDA graphs on a GPU, transformers), and c."""
    import gc

    import torch

    from specdecode.backends.hf import HFBackend
    from .random_models import SHAPES, build_qwen

    device, ns, rows = _device(plan), list(range(1, plan.max_n + 1)), []
    journal.put("dtype", plan.dtype)
    for size in plan.sizes:
        journal.log(f"building {size}")
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
                journal.add("rows", rows[-1])
                journal.log(f"{size} {name} batch {batch}: step {1000 * t[1]:.2f} ms")
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


def default_pair_alpha(path: Path = DEFAULT_PAIR_RESULT) -> dict:
    """The default pair's first-draft acceptance on llama.cpp (code prompts), from the committed benchmark: the
    fixed-K run with the largest K."""
    report = json.loads(path.read_text())
    fixed = [(s["k"], s["methods"]["specdecode"]["alpha"]) for s in report["sweep"]
             if isinstance(s["k"], int) and "specdecode" in s["methods"]]
    k, alpha = max(fixed)
    return {"alpha": alpha, "k": k, "source": f"{path.relative_to(REPO)} (specdecode, K={k}, "
                                             f"{report['config']['target']} <- {report['config']['draft']})"}


GGUF_CACHE = Path(tempfile.gettempdir()) / "specdecode-device-ggufs"  # shared by the sections of a run


def random_gguf(size: str, quantization: str, threads: int, journal, role: str) -> tuple[Path, dict]:
    """A random-weight GGUF of the shape, written with gguf and quantized by llama.cpp, kept in GGUF_CACHE for the
    next section that needs it (the 1.5B shape takes ~12 s on 16 cores): (its path, what making it took)."""
    import hashlib

    from .random_models import LLAMA, SHAPES, quantize_gguf, write_gguf

    source = Path(__file__).with_name("random_models.py").read_bytes()  # a change there makes new files
    key = hashlib.sha256(repr((SHAPES[size], LLAMA.get(size))).encode() + source).hexdigest()[:8]
    dest = GGUF_CACHE / f"{size}-{quantization.lower()}-{key}.gguf"
    if dest.exists():
        journal.log(f"{role}: the {size} GGUF ({quantization}) made earlier, in {GGUF_CACHE}")
        return dest, {"size": size, "quantization": quantization, "reused": True, "bytes": dest.stat().st_size}
    GGUF_CACHE.mkdir(parents=True, exist_ok=True)
    for stale in GGUF_CACHE.glob(f"{size}-{quantization.lower()}-*"):  # of an earlier random_models.py
        stale.unlink()
    journal.log(f"{role}: writing and quantizing the {size} GGUF ({quantization})")
    start = time.perf_counter()
    f16 = write_gguf(size, dest.with_suffix(".f16.partial"))
    written = time.perf_counter()
    partial = quantize_gguf(f16, dest.with_suffix(".partial"), threads, quantization)
    f16.unlink()
    os.replace(partial, dest)  # whole or absent: a killed section leaves no torn file to reuse
    return dest, {"size": size, "quantization": quantization, "write_s": written - start,
                  "quantize_s": time.perf_counter() - written, "bytes": dest.stat().st_size}


def gguf_step_costs(size: str, plan: Plan, ns, deadline: Deadline, journal, role: str,
                    quantization: str = "Q4_K_M") -> tuple[dict, dict]:
    """(the GGUF's facts, median seconds per n-token forward) of random_gguf's file on plan.llama_threads threads,
    batch 1, at half of plan.llama_context."""
    from specdecode.backends.llamacpp import LlamaCppBackend
    from .random_models import SHAPES

    path, info = random_gguf(size, quantization, plan.llama_threads, journal, role)
    journal.put(f"{role}_gguf", info)
    backend = LlamaCppBackend(str(path), n_ctx=plan.llama_context + max(plan.max_n, *ns) + 8,
                              n_threads=plan.llama_threads)
    costs = forward_costs(backend, 1, plan.llama_context // 2, list(ns), plan.repeats, deadline, SHAPES[size][5])
    journal.log(f"{role}: step {1000 * costs[1]:.1f} ms")
    del backend
    return info, costs


def section_llamacpp(plan: Plan, deadline: Deadline, journal) -> dict:
    """llama.cpp on the machine's cores: random-weight GGUFs written with gguf, quantized to Q4_K_M by llama.cpp."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"skipped": f"llama_cpp is not importable ({exc}): carry .device_wheels/ built by "
                           f"scripts/device_check.sh --prepare (a portable llama-cpp-python wheel)"}
    out = {"threads": plan.llama_threads, "context": plan.llama_context, "quantization": "Q4_K_M"}
    ns = list(range(1, plan.max_n + 1))
    steps = {}
    for role, size in (("target", plan.llama_target), ("draft", plan.llama_draft)):
        out[f"{role}_gguf"], steps[role] = gguf_step_costs(size, plan, ns if role == "target" else [1], deadline,
                                                           journal, role)
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
                     "costs": section_costs, "llamacpp": section_llamacpp}

"""The device check: one command that measures a lent GPU machine (an H100 with 16 CPU cores) in under 8 minutes,
and its --dry-run, every step on the CPU with tiny shapes, which CI runs so the check cannot rot before a machine
is lent. scripts/device_check.sh drives it (installing the project and carried wheels on the machine first).

Sections, each a subprocess of its own with a time budget, so that a crash or a hang is recorded, not fatal:
  environment  the machine, torch, the GPU;
  wheels       the project's requirements missing from the machine's image, and whether the carried wheels cover
               them (scripts/device_check.sh --prepare downloads and builds them into .device_wheels/);
  gpu_tests    the suite's device paths (tests/test_device_paths.py with SPECDECODE_TEST_DEVICE, and the CUDA-graph
               tests of tests/test_static_backend.py): pass/fail per test;
  costs        v(n) = an n-token forward / a 1-token one, n = 1..16, batch 1, 4, 16, for random-weight Qwen2.5
               0.5B, 1.5B and 7B shapes in bf16, on the static backend (CUDA graphs) and transformers, and the
               draft cost ratio c of each smaller shape against each larger one;
  overhead     the engine at a known acceptance (replay_drafter.py: the target's own greedy continuation with
               errors at rate 1 - alpha, a 0.5B-shape draft model paying real draft costs), K fixed and auto,
               against plain decoding and against Leviathan's prediction from v(n) and c measured just before;
               transformers' assisted generation beside ours at acceptance 1;
  llamacpp     llama.cpp v(n) with 16 threads on a random-weight GGUF of the 1.5B shape quantized to Q4_K_M by
               llama.cpp's own quantize, c of the 0.5B shape, and the speedup predicted there at the default pair's
               acceptance (read from docs/results/llamacpp-code.json).

    python -m specdecode.bench.device_check --out DIR [--dry-run] [--budget SECONDS]
    python -m specdecode.bench.device_check --prepare [--wheels .device_wheels]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

# The repository (tests/, docs/results/): scripts/device_check.sh names it, since the package it installs on the
# machine runs from a folder of its own.
REPO = Path(os.environ.get("SPECDECODE_REPO") or Path(__file__).resolve().parents[3])
WHEELS = REPO / ".device_wheels"
SCHEMA = "specdecode.device_check/1"
SECTIONS = ("environment", "wheels", "gpu_tests", "costs", "overhead", "llamacpp")

# The Python packages of the lent machines' image ('cuda'), as the device tool's KINDS.md lists them (read on a
# machine on 2026-11-17). Anything the project needs beyond these travels as a wheel.
DEVICE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp""".split())
# What the check itself needs beside the project's own requirements (the CPU section's llama.cpp).
EXTRA_REQUIREMENTS = ("llama-cpp-python",)
PORTABLE_LLAMA_CMAKE = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                        "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
                        "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX_VNNI=OFF "
                        "-DGGML_OPENMP=OFF "  # ggml's own thread pool: no libgomp.so.1 needed on the machine
                        # what the binding loads only, as CI builds it (.ci/run): no multimodal or common library
                        f"-DLLAVA_BUILD=OFF -DCMAKE_PROJECT_INCLUDE={REPO / 'deploy' / 'llama-cpp-lean.cmake'}")
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

    @classmethod
    def full(cls) -> "Plan":
        return cls(device="cuda", dtype="bfloat16", sizes=("0.5B", "1.5B", "7B"), batches=(1, 4, 16), max_n=16,
                   context=128, repeats=7, target="1.5B", draft="0.5B", alphas=(0.6, 0.8, 0.9), fixed_k=4,
                   new_tokens=128, overhead_batches=(1, 4), llama_target="1.5B", llama_draft="0.5B",
                   llama_threads=min(16, os.cpu_count() or 1), llama_context=512,
                   budgets={"environment": 20, "wheels": 20, "gpu_tests": 70, "costs": 110, "overhead": 150,
                            "llamacpp": 100})

    @classmethod
    def dry(cls) -> "Plan":
        return cls(device="cpu", dtype="float32", sizes=("tiny-draft", "tiny"), batches=(1, 2), max_n=4,
                   context=16, repeats=2, target="tiny", draft="tiny-draft", alphas=(0.6, 0.8, 0.9), fixed_k=3,
                   new_tokens=12, overhead_batches=(1,), llama_target="tiny", llama_draft="tiny-draft",
                   llama_threads=min(2, os.cpu_count() or 1), llama_context=64,
                   budgets={"environment": 30, "wheels": 30, "gpu_tests": 90, "costs": 60, "overhead": 60,
                            "llamacpp": 60}, torch_threads=1)


# ---------------------------------------------------------------------------------------------------- wheels
def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


DEVICE_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                      "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                      "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def _requirement_name(line: str) -> tuple[str, bool]:
    """(name, needed on the machine) of a Requires-Dist line, its marker evaluated for the machine's CPython 3.12
    on x86-64 Linux with no extras."""
    from packaging.requirements import Requirement

    requirement = Requirement(line)
    needed = requirement.marker is None or requirement.marker.evaluate(DEVICE_ENVIRONMENT)
    return normalize(requirement.name), needed


def required_packages(roots=("specdecode",) + EXTRA_REQUIREMENTS) -> dict[str, str]:
    """Every package the roots need, recursively through installed metadata, with the version installed here:
    {name: version}. A package the machine has is taken with its own requirements, which its image meets (torch
    there is its CUDA build): it is named, not walked."""
    found, todo = {}, [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[name] = None
            continue
        found[name] = dist.version
        if name in DEVICE_PACKAGES:
            continue
        for line in dist.requires or []:
            dep, needed = _requirement_name(line)
            if needed:
                todo.append(dep)
    return found


def missing_on_device(required: dict[str, str]) -> dict[str, str]:
    """The required packages the machine's image lacks (the project itself installs from the tree)."""
    return {n: v for n, v in sorted(required.items()) if n not in DEVICE_PACKAGES and n != "specdecode"}


def wheel_names(folder: Path) -> dict[str, str]:
    """{normalized distribution name: file name} of the wheels in a folder."""
    if not folder.is_dir():
        return {}
    return {normalize(p.name.split("-")[0]): p.name for p in sorted(folder.glob("*.whl"))}


def wheel_report(folder: Path = WHEELS) -> dict:
    required = required_packages()
    missing = missing_on_device(required)
    carried = wheel_names(folder)
    absent = sorted(n for n in missing if n not in carried)
    return {"folder": str(folder), "prepared": folder.is_dir(), "required": len(required),
            "missing_on_device": missing, "carried": sorted(carried.values()), "absent": absent,
            "complete": folder.is_dir() and not absent,
            "unknown_here": sorted(n for n, v in required.items() if v is None)}


def prepare(folder: Path = WHEELS, build_llama: bool = True) -> dict:
    """Download (pip download, CPython 3.12 manylinux) every missing package's wheel at the version installed here,
    and build a portable llama-cpp-python wheel (no native-only instructions), retagged for any CPython."""
    folder.mkdir(parents=True, exist_ok=True)
    missing = missing_on_device(required_packages())
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28, 31, 34, 35)] + \
        ["--platform=manylinux2014_x86_64", "--platform=linux_x86_64"]
    for name, version in missing.items():
        if name == "llama-cpp-python" or name in wheel_names(folder):
            continue
        spec = f"{name}=={version}" if version else name
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), spec],
                       check=True)
    if build_llama and "llama-cpp-python" not in wheel_names(folder):
        build_portable_llama(folder, missing.get("llama-cpp-python") or "0.3.36")
    return wheel_report(folder)


def build_portable_llama(folder: Path, version: str) -> Path:
    """llama-cpp-python built from source without -march=native (AVX2/FMA/F16C; no AVX-512, no AMX), so it runs on
    any x86-64 machine of the last decade. It loads libllama through ctypes: the Python code is version-free, so the
    wheel is (or is re-tagged) py3-none and installs on the machine's Python 3.12."""
    with tempfile.TemporaryDirectory() as build:
        env = dict(os.environ, CMAKE_ARGS=PORTABLE_LLAMA_CMAKE, FORCE_CMAKE="1", CMAKE_BUILD_PARALLEL_LEVEL="2")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary=llama-cpp-python",
                        "--no-cache-dir", "-w", build, f"llama-cpp-python=={version}"], check=True, env=env)
        built = retag_py3_none(next(Path(build).glob("llama_cpp_python-*.whl")))
        return Path(shutil.move(str(built), str(folder / built.name)))


def retag_py3_none(path: Path) -> Path:
    """The wheel renamed and re-tagged py3-none-PLATFORM (its WHEEL file's Tag lines and RECORD hash rewritten),
    for a package whose Python code works on any CPython 3 (llama-cpp-python loads its library with ctypes)."""
    name, version, python, abi, plat = path.name[: -len(".whl")].split("-")
    if (python, abi) == ("py3", "none"):  # llama-cpp-python's own build tags it so
        return path
    new = path.with_name(f"{name}-{version}-py3-none-{plat}.whl")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(new, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        wheel_name = record_name[: -len("RECORD")] + "WHEEL"
        tags = [line for line in src.read(wheel_name).decode().splitlines() if not line.startswith("Tag:")]
        wheel = ("\n".join(tags + [f"Tag: py3-none-{plat}"]) + "\n").encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(wheel).digest()).rstrip(b"=").decode()
        record = [f"{wheel_name},sha256={digest},{len(wheel)}" if line.startswith(wheel_name + ",") else line
                  for line in src.read(record_name).decode().splitlines()]
        for item in src.infolist():
            data = {wheel_name: wheel, record_name: ("\n".join(record) + "\n").encode()}.get(item.filename)
            dst.writestr(item, data if data is not None else src.read(item))
    path.unlink()
    return new


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


def _static(model, plan: Plan, rows: int, tokens: int):
    from specdecode.backends.static import StaticBackend

    return StaticBackend(model, max_batch=rows, max_len=tokens + 64)


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
    from specdecode.policy_estimates import expected_speedup

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
    vocab = SHAPES[plan.target][5]
    tokens = plan.context + plan.new_tokens + max_k + 2
    rows, assisted = [], []
    for batch in plan.overhead_batches:
        prompts = torch.randint(0, vocab, (batch, plan.context), generator=torch.Generator().manual_seed(3)).tolist()
        target_backend = _static(target, plan, batch, tokens)
        draft_backend = _static(draft, plan, batch, tokens)
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
        if batch == 1 and not deadline.passed():
            assisted = _assisted(target, draft, prompts, plan, device, deadline)
        del target_backend, draft_backend
    return {"target": plan.target, "draft": plan.draft, "dtype": plan.dtype, "new_tokens": plan.new_tokens,
            "context": plan.context, "rows": rows, "assisted": assisted,
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


# ---------------------------------------------------------------------------------------------- driver
def run_section(name: str, plan: Plan, result_file: Path, seconds: float | None = None) -> None:
    """Child process: one section, its result (or its error) written as JSON; seconds: its time (default: the
    plan's budget for it)."""
    start = time.perf_counter()
    if plan.torch_threads:
        import torch

        torch.set_num_threads(plan.torch_threads)  # tiny shapes: one thread is fastest, and spares a shared CPU
    try:
        result = {"ok": True, "result": SECTION_FUNCTIONS[name](plan, Deadline(seconds or plan.budgets[name]))}
    except Exception as exc:  # noqa: BLE001 - a failed step is a result of the check, not its end
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - start
    result_file.write_text(json.dumps(result, indent=1, default=str))


def run_check(out: Path, dry_run: bool, sections=SECTIONS, budget: float = 480.0) -> dict:
    """Every section in turn, none past the total budget (seconds): a section that would start too late is
    recorded as skipped, and one that runs over its own budget is killed and recorded."""
    plan = Plan.dry() if dry_run else Plan.full()
    out.mkdir(parents=True, exist_ok=True)
    report = {"schema": SCHEMA, "dry_run": dry_run, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "plan": asdict(plan), "sections": {}}
    start = time.perf_counter()
    for name in sections:
        part = out / f"section-{name}.json"
        part.unlink(missing_ok=True)
        command = [sys.executable, "-m", "specdecode.bench.device_check", "--section", name, "--result", str(part)]
        command += ["--dry-run"] if dry_run else []
        began = time.perf_counter()
        left = budget - (began - start)
        if left < 20:
            report["sections"][name] = {"ok": False, "error": f"skipped: {budget - left:.0f} s of the {budget:.0f} s "
                                                              f"budget were spent", "wall_s": 0.0}
            continue
        timeout = min(plan.budgets[name] + 10, left)
        command += ["--seconds", str(timeout - 10)]
        try:
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            tail = (done.stdout[-1500:] + done.stderr[-2500:]).strip()
            if part.exists():
                entry = json.loads(part.read_text())
            else:
                entry = {"ok": False, "error": f"the section's process exited with {done.returncode} and wrote "
                                               f"nothing", "output_tail": tail}
        except subprocess.TimeoutExpired:
            entry = {"ok": False, "error": f"killed after {timeout:.0f} s (its budget: {plan.budgets[name]} s)"}
        entry["wall_s"] = time.perf_counter() - began
        part.unlink(missing_ok=True)
        report["sections"][name] = entry
        print(f"[device check] {name}: {'ok' if entry['ok'] else 'FAILED: ' + entry['error']} "
              f"({entry['wall_s']:.0f} s)", flush=True)
    report["elapsed_s"] = time.perf_counter() - start
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    markdown = render_markdown(report)
    (out / "device_check.md").write_text(markdown)
    print(markdown, flush=True)
    return report


# ---------------------------------------------------------------------------------------------- markdown
def _f(x, digits=2) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(_f(x) for x in row) + " |" for row in rows]


def render_markdown(report: dict) -> str:
    s = report["sections"]
    lines = [f"# Device check{' (dry run: CPU, tiny shapes)' if report['dry_run'] else ''}", "",
             f"{report['created']}, {report['elapsed_s']:.0f} s.", ""]

    def body(name):
        entry = s.get(name, {})
        if not entry.get("ok"):
            lines.extend([f"**{name} failed**: {entry.get('error', 'not run')}", ""])
            return None
        return entry["result"]

    lines.append("## Environment")
    env = body("environment")
    if env:
        lines += _table(["key", "value"], [[k, v] for k, v in env.items()]) + [""]
    lines.append("## Carried wheels")
    wheels = body("wheels")
    if wheels:
        lines += [f"Missing on the machine: {', '.join(wheels['missing_on_device']) or 'none'}. Carried "
                  f"({wheels['folder']}): {len(wheels['carried'])} wheels; absent: "
                  f"{', '.join(wheels['absent']) or 'none'}; complete: {wheels['complete']}.", ""]
    lines.append("## GPU tests")
    tests = body("gpu_tests")
    if tests:
        lines += [f"On {tests['device']}: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} "
                  f"skipped (pytest exit {tests['exit_code']}).", ""]
        lines += [f"- FAILED {t['name']}: {t['message']}" for t in tests["failures"]] + [""]
    lines.append("## v(n): an n-token forward over a 1-token one")
    costs = body("costs")
    if costs:
        n_max = max((max(r["v"], key=int) for r in costs["rows"]), default=1, key=int)
        ns = list(range(1, int(n_max) + 1))
        lines += _table(["shape", "backend", "batch", "step ms"] + [f"v({n})" for n in ns],
                        [[r["size"], r["backend"], r["batch"], r["step_ms"]] + [r["v"].get(n, r["v"].get(str(n)))
                                                                               for n in ns] for r in costs["rows"]])
        lines += ["", "Draft cost ratio c (draft step / target step):", ""]
        lines += _table(["draft", "target", "backend", "batch", "c"],
                        [[x["draft"], x["target"], x["backend"], x["batch"], x["c"]] for x in costs["c"]]) + [""]
    lines.append("## Engine overhead at known acceptance")
    over = body("overhead")
    if over:
        lines += [f"Target {over['target']}, draft {over['draft']} (random weights, {over['dtype']}, static "
                  f"backend), {over['new_tokens']} new tokens; {over['goal']}.", ""]
        lines += _table(["batch", "alpha", "K", "first-draft acceptance", "tok/s", "plain tok/s", "× plain", "predicted ×",
                         "ratio", "same tokens"],
                        [[r["batch"], r["alpha"], r["k"] if r["k"] != "auto" else f"auto (best {r['predicted_best_k']})",
                          r["first_draft_acceptance"], r["tokens_per_s"], r["plain_tokens_per_s"], r["speedup"],
                          r["predicted_speedup"], r["ratio"], r["same_as_plain"]] for r in over["rows"]]) + [""]
        if over["assisted"]:
            lines += _table(["acceptance 1, batch 1", "K", "tok/s", "plain tok/s", "× plain", "predicted ×", "ratio"],
                            [[a["method"], a["k"], a["tokens_per_s"], a["plain_tokens_per_s"], a["speedup"],
                              a["predicted_speedup"], a["ratio"]] for a in over["assisted"]]) + [""]
    lines.append("## llama.cpp on the CPU cores")
    llama = body("llamacpp")
    if llama and "skipped" in llama:
        lines += [f"Skipped: {llama['skipped']}", ""]
    elif llama:
        ns = sorted(llama["v"], key=int)
        lines += [f"{llama['threads']} threads, Q4_K_M, context {llama['context'] // 2}: step "
                  f"{llama['step_ms']:.1f} ms, draft step {llama['draft_step_ms']:.1f} ms, c = {llama['c']:.3f}.", ""]
        lines += _table([f"v({n})" for n in ns], [[llama["v"][n] for n in ns]]) + [""]
        pred = llama["prediction"]
        if "error" in pred:
            lines += [f"Prediction failed: {pred['error']}", ""]
        else:
            lines += [f"Predicted speedup at alpha = {pred['alpha']:.3f} ({pred['source']}): "
                      f"{pred['predicted_speedup']:.2f}× at K = {pred['best_k']}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for device_check.json and device_check.md")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all sections together")
    ap.add_argument("--prepare", action="store_true", help="download and build the carried wheels")
    ap.add_argument("--wheels", default=str(WHEELS))
    ap.add_argument("--no-llama-build", action="store_true", help="--prepare without building llama-cpp-python")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:
        run_section(args.section, Plan.dry() if args.dry_run else Plan.full(), Path(args.result), args.seconds)
        return 0
    if args.prepare:
        report = prepare(Path(args.wheels), build_llama=not args.no_llama_build)
        print(json.dumps(report, indent=1))
        return 0 if report["complete"] else 1
    if not args.out:
        ap.error("--out DIR is needed (scripts/device_check.sh picks $OUT)")
    sections = tuple(x for x in args.sections.split(",") if x)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    run_check(Path(args.out), args.dry_run, sections, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())

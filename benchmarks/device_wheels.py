"""The wheels the device check carries to a lent machine (scripts/device_check.sh --prepare): the project's
requirements that the machine's image lacks, found through installed metadata, downloaded for its CPython 3.12, and a
portable llama-cpp-python built here and re-tagged for any CPython."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

# The repository (tests/, docs/results/): scripts/device_check.sh names it, since the package it installs on the
# machine runs from a folder of its own.
REPO = Path(os.environ.get("SPECDECODE_REPO") or Path(__file__).resolve().parents[1])
WHEELS = REPO / ".device_wheels"

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

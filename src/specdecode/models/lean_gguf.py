"""A draft GGUF re-quantized to 4 bits, so that drafting costs less: a copy of the file with its heavier matrices
in Q4_0, made once into the cache, and used only where it was measured to draft faster on this machine at the
threads the draft runs with.

Why the draft only: a draft changes q and nothing else, so the output keeps exactly the target's distribution
whatever the draft's weights are; the target always runs as its file is quantized. Why Q4_0: a CPU step reads
every weight once, and llama.cpp repacks Q4_0 for its own x86 and ARM matrix kernels, while heavier types (Q8_0,
Q5_0, Q6_K, F16) read more bytes, through kernels that are not repacked. The built-in 0.5B draft ships Q5_0 and
Q6_K layers and a Q8_0 head: in Q4_0 its step took 8.8 ms against 16.6 on a 2-vCPU AMD EPYC (Zen 5, AVX-512),
and its greedy tokens matched the 1.5B target's on 94.5 % of a code answer against 96 %. Whether the copy is
faster is measured here, once per CPU and thread count (step_ms, interleaved), not assumed for a kind of CPU.

The input embedding stays as it is (a step reads one row of it), and so do vectors (norms, biases) and every matrix
already as light as Q4_0 (Q4_K, Q4_0, IQ4, lower), or whose rows are not whole Q4_0 blocks.

The cache holds at most one copy per source path (<cache>/gguf/lean/, named by the path; the source's size and time
are in the record beside it, and a changed source replaces its copy), and none where no timing found it faster:
then only the record stays, so the copy is not made and timed at every start. `specdecode models list` shows them,
`specdecode models remove --lean [SOURCE]` deletes them (list_copies, remove_copies).
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import hashlib
import json
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .catalog import cache_dir
from .gguf_header import gguf_tensors
from .machine import machine_name, usable_cores

log = logging.getLogger("specdecode.lean_gguf")

LEAN_TYPE = "Q4_0"
# Types with more than Q4_0's 4.5 bits a weight: what the copy re-quantizes.
HEAVIER = ("F32", "F16", "BF16", "Q8_0", "Q8_1", "Q6_K", "Q5_0", "Q5_1", "Q5_K")
KEPT = ("token_embd.weight",)  # a step reads one row of the input embedding: its width costs nothing
FASTER_BY = 0.9  # the copy is used where its step takes at most this much of the original's
STEPS = 12  # one-token steps timed per model and round
SPARE_BYTES = 256 * 2**20  # free room left beside a new copy: a cache filled to the last byte fails other writes


def heavier_tensors(path: Path) -> list[str]:
    """The names of the matrices of a GGUF file that the lean copy re-quantizes (none: the copy would be the same),
    read from its header."""
    return [name for name, dims, kind in gguf_tensors(path) or () if _converts(name, dims, _type_name(kind))]


def _type_name(kind: int) -> str:
    """The ggml type's name; a type gguf-py does not know (a newer llama.cpp's) is never re-quantized."""
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"unknown type {kind}"


def _converts(name: str, dims: tuple, kind: str) -> bool:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[LEAN_TYPE]][0]
    return name not in KEPT and len(dims) == 2 and kind in HEAVIER and int(dims[0]) % block == 0


def lean_size(path: Path) -> int | None:
    """The bytes the lean copy of a GGUF file would take, the alignment of its tensors aside (its size where nothing
    is heavier), from the header; None when the file cannot be read as a GGUF."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = gguf_tensors(path)
    if tensors is None:
        return None
    lean_block, lean_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[LEAN_TYPE]]
    saved = 0
    for name, dims, kind in tensors:
        if _converts(name, dims, _type_name(kind)):
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            count = int(np.prod(dims))
            saved += count // block * size - count // lean_block * lean_bytes
    return os.path.getsize(path) - saved


def lean_dir() -> Path:
    return cache_dir() / "gguf" / "lean"


def lean_path(source: Path) -> Path:
    """Where the lean copy of `source` lives: named by the source's place only, so that a source whose size or time
    changed (both recorded beside the copy) replaces its copy instead of adding another."""
    tag = hashlib.sha256(str(_resolved(source)).encode()).hexdigest()[:12]
    return lean_dir() / f"{Path(source).stem}-{tag}.{LEAN_TYPE.lower()}.gguf"


def record_path(source: Path) -> Path:
    """The copy's record: the source's place, size and time, the copy's size, and the verdicts of its timings."""
    return lean_path(source).with_suffix(".json")


def lean_files(source: Path) -> list[Path]:
    """The files the cache holds for the lean copy of `source` (the copy, its record), and the copies named like it
    that no record vouches for (an earlier version's, never used): those that exist."""
    copy = lean_path(source)
    return sorted({p for p in (copy, copy.with_suffix(".json")) if p.exists()} | set(_orphans(source)))


def source_of(path: Path | str) -> str | None:
    """The file a lean copy was made from (as its record says), or None where `path` is no lean copy."""
    path = Path(path)
    if path.suffix != ".gguf" or _resolved(path.parent) != _resolved(lean_dir()):
        return None
    return _read(path.with_suffix(".json")).get("source")


def _resolved(source: Path) -> Path:
    return Path(source).expanduser().resolve()


def _orphans(source: Path) -> list[Path]:
    """Copies and records named like `source`'s whose record names no source: left by an earlier version of this
    module, which named copies by the source's size and time too; nothing uses them."""
    pattern = f"{glob.escape(Path(source).stem)}-{'[0-9a-f]' * 12}.{LEAN_TYPE.lower()}.*"
    return [p for p in lean_dir().glob(pattern) if "source" not in _read(p.with_suffix(".json"))]



def write_lean_copy(source: Path, dest: Path, progress: Callable | None = None) -> Path:
    """Write the copy of `source` with its heavier matrices in Q4_0 (the rest byte for byte, the metadata as it
    is) to `dest`, through a temporary file renamed at the end, so no reader sees half a file."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(source))
    lean = GGMLQuantizationType[LEAN_TYPE]
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    writer = GGUFWriter(str(partial), reader.fields[Keys.General.ARCHITECTURE].contents())
    try:
        for field in reader.fields.values():
            if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # the writer's own fields
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
        tensors = []
        for i, tensor in enumerate(reader.tensors):
            data, kind = tensor.data, tensor.tensor_type
            if _converts(tensor.name, tuple(tensor.shape), kind.name):
                data, kind = quantize(dequantize(data, kind).astype(np.float32), lean), lean
            tensors.append((data, kind))
            writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, kind)
            if progress:
                progress("re-quantizing the draft to 4 bits (once)", i + 1, len(reader.tensors))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data, _ in tensors:
            writer.write_tensor_data(data)
        writer.close()
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def step_ms(paths: list[Path], threads: int | None, rounds: int = 2) -> list[float]:
    """Each GGUF's one-token decode step on llama.cpp, in ms: the median over `rounds` interleaved rounds of
    STEPS steps each after a short prompt, so a drift of the machine's speed does not favour one file."""
    import llama_cpp

    models = [llama_cpp.Llama(str(p), n_ctx=128, n_threads=threads, n_threads_batch=threads, flash_attn=True,
                              verbose=False) for p in paths]
    times: list[list[float]] = [[] for _ in paths]
    prompt = list(range(100, 116))
    for _ in range(rounds):
        for model, spent in zip(models, times):
            model.reset()
            model.eval(prompt)
            model.eval([120])  # a first step warms the caches
            for i in range(STEPS):
                start = time.perf_counter()
                model.eval([121 + i])
                spent.append((time.perf_counter() - start) * 1000)
    return [statistics.median(spent) for spent in times]


def lean_gguf(source: Path, threads: int | None = None, progress: Callable | None = None,
              timer: Callable | None = None) -> Path:
    """The file to draft with: the lean copy of `source` where it was measured to step faster on this machine at
    `threads` (None: every core this process may use, as the llama.cpp backend then runs), else `source`.

    The copy is written once (under a lock, so processes starting together write it once) and timed against the
    original once per machine and thread count (`timer`: the two files' step times, step_ms); the verdicts are kept
    in a record beside it. A copy found faster at no thread count is deleted, its record kept, so it is neither
    kept nor made and timed again; a source whose size or time changed replaces its copy. Any failure on the way (a
    read-only or full cache, a type gguf-py cannot read, a copy llama.cpp cannot load) leaves `source`, with one
    warning that says why."""
    source = Path(source)
    threads = threads or usable_cores()
    try:
        if not heavier_tensors(source):
            return source  # nothing to make lighter (and nothing written)
        return _chosen(source, threads, progress, timer or step_ms)
    except Exception as error:  # noqa: BLE001  (the copy only saves time; the original always drafts)
        _warn(source, error)
        return source


def open_draft(source: Path, threads: int, open_file: Callable, progress: Callable | None = None):
    """open_file(path) on the file lean_gguf chooses; where that is the copy and it fails to open while `source`
    opens, `source`'s, and the copy is dropped (unusable). `threads`: those the draft runs with (the timing's)."""
    source = Path(source)
    run = lean_gguf(source, threads, progress)
    try:
        return open_file(run)
    except Exception as error:  # noqa: BLE001  (the copy's fault only where the source itself opens)
        if run == source:
            raise
        model = open_file(source)
        unusable(source, threads, error)
        return model


class LeanCopyError(Exception):
    """Why no lean copy can be made, where no other error says it."""


def _chosen(source: Path, threads: int, progress: Callable | None, timer: Callable) -> Path:
    from filelock import FileLock

    dest, record_file = lean_path(source), record_path(source)
    stamp, key = _stamp(source), _key(threads)
    record = _read(record_file)
    verdict = record.get("verdicts", {}).get(key) if _same_source(record, stamp) else None
    if verdict is not None and (not verdict.get("lean") or _intact(dest, record)):
        return dest if verdict.get("lean") else source
    unknown = sorted({kind for _, _, kind in gguf_tensors(source) or () if _type_name(kind).startswith("unknown")})
    if unknown:
        raise LeanCopyError(f"ggml type(s) {', '.join(map(str, unknown))} that gguf-py cannot read")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.with_name(f".{dest.name}.lock"))):
        try:
            record = _read(record_file)
            if not _same_source(record, stamp):  # a new source, or a new version of it: the old copy goes
                record = {**stamp, "verdicts": {}}
                for stale in [dest, *_orphans(source)]:
                    stale.unlink(missing_ok=True)
                _prune_gone()
            verdict = record["verdicts"].get(key)
            if verdict is None or verdict.get("lean") and not _intact(dest, record):
                verdict = _measure(source, dest, record, key, threads, progress, timer)
            if not any(v.get("lean") for v in record["verdicts"].values()):
                dest.unlink(missing_ok=True)  # faster at no thread count timed: only the verdicts are kept
                record.pop("copy_bytes", None)
            _write(record_file, record)
        except BaseException:
            with contextlib.suppress(OSError):  # no copy stays that its record does not vouch for
                if not _intact(dest, _read(record_file)):
                    dest.unlink(missing_ok=True)
            raise
    return dest if verdict.get("lean") else source


def _measure(source: Path, dest: Path, record: dict, key: str, threads: int, progress, timer) -> dict:
    """Write the copy where the record vouches for none, time it against the source, and record the verdict."""
    if not _intact(dest, record):
        need, free = lean_size(source) or 0, shutil.disk_usage(dest.parent).free
        if need + SPARE_BYTES > free:  # say so before minutes of re-quantizing, not when the disk is full
            raise LeanCopyError(f"{need / 1e6:.0f} MB needed for the copy, {free / 1e6:.0f} MB free in {dest.parent}")
        for partial in dest.parent.glob(f".{glob.escape(dest.name)}.partial-*"):
            partial.unlink(missing_ok=True)  # a writer killed midway: under the lock no other one is writing
        write_lean_copy(source, dest, progress)
        record["copy_bytes"] = dest.stat().st_size
    original_ms, lean_ms = timer([source, dest], threads)
    record["verdicts"][key] = {"original_ms": round(original_ms, 3), "lean_ms": round(lean_ms, 3),
                               "lean": lean_ms <= FASTER_BY * original_ms, "threads": threads,
                               "measured": datetime.date.today().isoformat()}
    return record["verdicts"][key]


def unusable(source: Path, threads: int | None, error: BaseException) -> None:
    """The lean copy failed to load where `source` loaded: one warning says why, the copy is deleted, and this
    machine and thread count's verdict becomes "not used", so that later starts draft on `source` at once."""
    from filelock import FileLock

    _warn(source, error)
    source, threads = Path(source), threads or usable_cores()
    dest, record_file = lean_path(source), record_path(source)
    with contextlib.suppress(Exception), FileLock(str(dest.with_name(f".{dest.name}.lock"))):
        record = _read(record_file)
        if _same_source(record, _stamp(source)):
            record["verdicts"][_key(threads)] = {"lean": False, "failed": _why(error), "threads": threads,
                                                 "measured": datetime.date.today().isoformat()}
            record.pop("copy_bytes", None)
            _write(record_file, record)
        dest.unlink(missing_ok=True)


def _warn(source: Path, error: BaseException) -> None:
    log.warning("the draft runs %s as it is, not its lean Q4_0 copy: %s", source, _why(error))


def _why(error: BaseException) -> str:
    if isinstance(error, LeanCopyError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}{f': {error.filename}' if error.filename else ''}"
    return f"{type(error).__name__}: {error}"


def _key(threads: int) -> str:
    return f"{machine_name()} | threads={threads}"


def _stamp(source: Path) -> dict:
    stat = source.stat()
    return {"source": str(_resolved(source)), "source_bytes": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}


def _same_source(record: dict, stamp: dict) -> bool:
    return isinstance(record.get("verdicts"), dict) and all(record.get(k) == v for k, v in stamp.items())


def _intact(dest: Path, record: dict) -> bool:
    """The copy is there whole: the size its record says (a truncated or replaced file is made again)."""
    try:
        return record.get("copy_bytes") == dest.stat().st_size
    except OSError:
        return False


def _prune_gone() -> None:
    """Delete the copies and records of sources that are gone: nothing can draft on them again."""
    for copy in list_copies():
        if copy.source is not None and not os.path.exists(copy.source):
            for path in copy.files:
                path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- the cache's copies
@dataclass
class LeanCopy:
    """A lean copy's files in the cache: the copy (absent where it was measured not to pay) and its record."""

    files: list[Path]
    source: str | None  # None: a copy no record vouches for (an earlier version's), never used
    bytes: int
    kept: bool  # the copy itself is on disk, and its record vouches for it
    verdicts: dict

    def describe(self) -> str:
        """Its verdicts in words: on this machine at each thread count, and how many other machines timed it."""
        if self.source is None:
            return "unused (made by an earlier version)"
        here = machine_name() + " | "
        words = []
        for key, v in sorted(self.verdicts.items()):
            if key.startswith(here):
                timed = f" ({v['lean_ms']:.1f} vs {v['original_ms']:.1f} ms a step)" if "lean_ms" in v else ""
                failed = f" (failed: {v['failed']})" if "failed" in v else ""
                words.append(f"{'used' if v.get('lean') else 'not used'} at {v.get('threads', '?')} threads"
                             f"{timed}{failed}")
        elsewhere = sum(not key.startswith(here) for key in self.verdicts)
        words += [f"timed on {elsewhere} other machine(s)"] if elsewhere else []
        state = "" if self.kept else "copy deleted; "
        return state + ("; ".join(words) or "not timed")


def list_copies() -> list[LeanCopy]:
    """Every lean copy the cache holds, or holds the record of."""
    groups: dict[str, list[Path]] = {}
    suffix = f".{LEAN_TYPE.lower()}"
    for path in lean_dir().glob(f"*{suffix}.*") if lean_dir().is_dir() else ():
        if path.suffix in (".gguf", ".json") and path.stem.endswith(suffix):
            groups.setdefault(path.stem, []).append(path)
    copies = []
    for files in groups.values():
        copy = next((p for p in files if p.suffix == ".gguf"), None)
        record = _read(files[0].with_suffix(".json"))
        size = sum(p.stat().st_size for p in files if p.exists())
        copies.append(LeanCopy(sorted(files), record.get("source"), size,
                               copy is not None and _intact(copy, record), record.get("verdicts", {})))
    return sorted(copies, key=lambda c: (c.source or "", str(c.files[0])))


def remove_copies(sources: list[Path] | None = None) -> int:
    """Delete the lean copies and records of `sources` (None: every one, and what killed writers left); the bytes
    freed. The sources themselves are never touched; a source used again is copied and timed again."""
    if sources is None:
        doomed = [p for c in list_copies() for p in c.files]
        doomed += list(lean_dir().glob(".*.partial-*")) if lean_dir().is_dir() else []
    else:
        doomed = sorted({p for source in sources for p in lean_files(source)})
    freed = 0
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            size = path.stat().st_size
            path.unlink()
            freed += size
    return freed


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)

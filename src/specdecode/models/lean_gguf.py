"""A draft GGUF re-quantized to 4 bits, so that drafting costs less: a copy of the file with its heavier matrices
in Q4_0, made once and kept in the cache, and used only where it drafts faster on this machine.

Why the draft only: a draft changes q and nothing else, so the output keeps exactly the target's distribution
whatever the draft's weights are; the target always runs as its file is quantized. Why Q4_0: a CPU step reads
every weight once, and llama.cpp repacks Q4_0 for its own x86 and ARM matrix kernels, while heavier types (Q8_0,
Q5_0, Q6_K, F16) read more bytes, through kernels that are not repacked. The built-in 0.5B draft ships Q5_0 and
Q6_K layers and a Q8_0 head: in Q4_0 its step took 8.8 ms against 16.6 on a 2-vCPU AMD EPYC (Zen 5, AVX-512),
and its greedy tokens matched the 1.5B target's on 94.5 % of a code answer against 96 %. Whether the copy is
faster is measured here, once per CPU and thread count (step_ms, interleaved), not assumed for a kind of CPU.

The input embedding stays as it is (a step reads one row of it), and so do vectors (norms, biases) and every matrix
already as light as Q4_0 (Q4_K, Q4_0, IQ4, lower), or whose rows are not whole Q4_0 blocks.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .catalog import cache_dir
from .gguf_header import gguf_tensors
from .machine import machine_name

LEAN_TYPE = "Q4_0"
# Types with more than Q4_0's 4.5 bits a weight: what the copy re-quantizes.
HEAVIER = ("F32", "F16", "BF16", "Q8_0", "Q8_1", "Q6_K", "Q5_0", "Q5_1", "Q5_K")
KEPT = ("token_embd.weight",)  # a step reads one row of the input embedding: its width costs nothing
FASTER_BY = 0.9  # the copy is used where its step takes at most this much of the original's
STEPS = 12  # one-token steps timed per model and round


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


def lean_path(source: Path) -> Path:
    """Where the lean copy of `source` lives: named by the source's place, size and time, so a changed file gets a
    new copy."""
    stat = source.stat()
    tag = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / "lean" / f"{source.stem}-{tag}.{LEAN_TYPE.lower()}.gguf"


def lean_copies(source: Path) -> list[Path]:
    """The lean copies (and their verdicts) the cache holds of files named like `source`, whatever their version."""
    return sorted((cache_dir() / "gguf" / "lean").glob(f"{source.stem}-{'[0-9a-f]' * 12}.{LEAN_TYPE.lower()}.*"))


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
    """The file to draft with: the lean copy of `source` where it is faster on this machine, else `source`.

    The copy is written once (under a lock, so processes starting together write it once) and timed against the
    original once per machine and thread count; the verdict is kept beside the copy. `timer` returns the two
    files' step times (step_ms)."""
    from filelock import FileLock

    source = Path(source)
    dest = lean_path(source)
    verdicts_file = dest.with_suffix(".json")
    key = f"{machine_name()} | threads={threads or 'all'}"
    verdict = _read(verdicts_file).get(key)
    if verdict is not None and verdict.get("lean") and not dest.is_file():
        verdict = None  # the copy was removed from the cache: made again
    if verdict is None:
        if not heavier_tensors(source):
            return source  # nothing to make lighter (and nothing written)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(dest.with_name(f".{dest.name}.lock"))):
            verdicts = _read(verdicts_file)
            if key not in verdicts or verdicts[key].get("lean") and not dest.is_file():
                if not dest.is_file():
                    write_lean_copy(source, dest, progress)
                original_ms, lean_ms = (timer or step_ms)([source, dest], threads)
                verdicts[key] = {"original_ms": round(original_ms, 3), "lean_ms": round(lean_ms, 3),
                                 "lean": lean_ms <= FASTER_BY * original_ms,
                                 "measured": datetime.date.today().isoformat()}
                _write(verdicts_file, verdicts)
            verdict = verdicts[key]
    return dest if verdict.get("lean") and dest.is_file() else source


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(partial, path)

"""What a GGUF file's header says, read without gguf-py: the architecture, and from it the tokenizer type to hand
transformers so that it builds the tokenizer without first rebuilding the model's config."""

from __future__ import annotations

import os
import struct
from pathlib import Path

# Architectures whose tokenizer transformers builds the same (byte for byte: tests/test_prepare_gguf.py) when told
# the tokenizer's type up front. Without it AutoTokenizer first rebuilds the model's config through gguf-py's
# reader, which makes numpy views of every metadata item: 20 s of a 2-core CPU's time for a 152k-token vocabulary,
# against 2 s for the tokenizer itself. (llama's "llama" is no tokenizer type of transformers 5; mistral files
# say "llama" too.)
FAST_TOKENIZER_ARCHITECTURES = ("qwen2", "gemma3")


def tokenizer_type_of(gguf: Path) -> dict:
    """{"tokenizer_type": the GGUF's architecture} where it is one of FAST_TOKENIZER_ARCHITECTURES and
    transformers knows it as a tokenizer type, else {} (AutoTokenizer works it out itself)."""
    architecture = gguf_architecture(gguf)
    if architecture not in FAST_TOKENIZER_ARCHITECTURES:
        return {}
    try:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:
        return {}
    return {"tokenizer_type": architecture} if TOKENIZER_MAPPING_NAMES.get(architecture) else {}


_GGUF_SCALARS = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}  # value type -> bytes


def gguf_architecture(path: Path) -> str | None:
    """general.architecture from a GGUF file's metadata (GGUF v2/v3; writers put it first, and the walk stops
    there), or None when the file is not such a GGUF or has none."""
    try:
        with open(path, "rb") as f:
            count = _header(f)[1]
            for _ in range(count):
                key = f.read(struct.unpack("<Q", f.read(8))[0])
                (kind,) = struct.unpack("<I", f.read(4))
                if kind == 8 and key == b"general.architecture":
                    return f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8")
                _skip(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def gguf_tensors(path: Path) -> list[tuple[str, tuple[int, ...], int]] | None:
    """Each tensor's (name, dims with the row length first, ggml type id) from a GGUF file's header, read past the
    metadata without building it (gguf-py's reader takes ~6 s of a 2-core CPU on a 152k-token vocabulary), or
    None when the file is not a GGUF v2/v3."""
    try:
        with open(path, "rb") as f:
            tensors, count = _header(f)
            for _ in range(count):
                f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
                _skip(f, struct.unpack("<I", f.read(4))[0])
            found = []
            for _ in range(tensors):
                name = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8")
                (n_dims,) = struct.unpack("<I", f.read(4))
                dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                kind, _offset = struct.unpack("<IQ", f.read(12))
                found.append((name, dims, kind))
            return found
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None


def _header(f) -> tuple[int, int]:
    """(tensor count, metadata count) after checking the magic and version; ValueError for anything else."""
    magic, version, tensors, count = struct.unpack("<4sIQQ", f.read(24))
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError("not a GGUF v2/v3 file")
    return tensors, count


def _skip(f, kind: int) -> None:
    """Move past one metadata value of type `kind`."""
    if kind == 8:
        f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
    elif kind in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[kind], os.SEEK_CUR)
    elif kind == 9:
        item, n = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALARS:
            f.seek(n * _GGUF_SCALARS[item], os.SEEK_CUR)
        elif item == 8:
            for _ in range(n):
                f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
        else:
            raise ValueError(f"an array of metadata type {item}")
    else:
        raise ValueError(f"metadata type {kind}")

"""Where a forward's tokens go in llama.cpp's batch (LlamaCppBackend, llamacpp.py): the row-major layout of a [B, n]
input (each real token's row, id, position, whether it wants logits, where they land in the flat output), the
llama_decode calls it is cut into, and the longest cached prefix after which a prefill meets the kernels of a cold
one."""

from __future__ import annotations

import functools

import numpy as np
import torch

# A prefill forward's numbers depend on its size in two ways (llama.cpp of llama-cpp-python 0.3.36, CPU): flash
# attention takes its tiled kernel from GGML_FA_TILE_Q = 64 tokens on, and repacked matrix products take rows 4
# at a time (the remainder through gemv). A cached prefix is reused in multiples of 64 tokens, and only where the
# rest of the prompt then meets the same kernels as in a cold prefill (reusable_prefix).
FA_TILE = 64
# A one-token step splits its attention over the KV cells between its threads and merges their partial softmaxes
# once the stream's padded KV reaches 512 cells (ggml's split-KV path: one query, f16 KV, n_kv >= 512, KV padded to
# 256 cells), so from position 256 on with 2 or more threads; a forward of 2+ tokens never takes that path and
# rounds differently there (up to ~0.5 in a logit on the default target). The exact mode feeds one token per
# forward from this position on.
SPLIT_ATTENTION_FROM = 256


def layout(input_ids, valid: torch.Tensor | None, lengths: list[int], max_positions: int, n_vocab: int,
           last_only: bool):
    """The real tokens in row-major order: (row, token, position, wants logits, index into the flat output), for
    rows holding `lengths` tokens already."""
    # token ids as they are (checked below, then written to llama.cpp's int32 batch): no conversion op per step
    if isinstance(input_ids, np.ndarray):
        ids = input_ids
    elif input_ids.device.type == "cpu" and input_ids.dtype in (torch.int64, torch.int32):
        ids = input_ids.numpy()
    else:
        ids = input_ids.detach().to("cpu", torch.int64).numpy()
    rows_n, width = ids.shape
    if valid is None:  # every token real (a decoding step): the shape's index arrays are cached
        return _unpadded_layout(ids, lengths, max_positions, n_vocab, last_only)
    mask = valid.detach().to("cpu", torch.bool).numpy()
    rows, cols = np.nonzero(mask)
    rank, counts = (np.cumsum(mask, axis=1) - 1)[rows, cols], mask.sum(axis=1)
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths + counts > max_positions).any():
        b = int(np.argmax(lengths + counts > max_positions))
        _too_long(b, int(lengths[b] + counts[b]), max_positions)
    tokens = ids[rows, cols]
    check_tokens(tokens, n_vocab)
    pos = (lengths[rows] + rank).astype(np.int32)
    if last_only:  # each row's last real token, into [B, 1, V]
        return rows, tokens, pos, rank == counts[rows] - 1, rows
    return rows, tokens, pos, np.ones(len(tokens), dtype=bool), rows * width + cols


def _unpadded_layout(ids: np.ndarray, lengths: list[int], max_positions: int, n_vocab: int, last_only: bool):
    """layout of a batch without padding, in as few numpy calls as it takes: a plain step runs it every token,
    right after llama.cpp has swept the caches, where each call costs several times its warm time."""
    rows_n, width = ids.shape
    rows, cols, everything, flat = _grid(rows_n, width)
    longest = max(lengths, default=0)
    if longest + width > max_positions:
        _too_long(lengths.index(longest), longest + width, max_positions)
    tokens = ids.reshape(-1)
    check_tokens(tokens, n_vocab)
    pos = np.asarray(lengths, dtype=np.int32)[rows] + cols
    if last_only:
        return rows, tokens, pos, cols == width - 1, rows
    return rows, tokens, pos, everything, flat


def _too_long(b: int, n: int, max_positions: int):
    raise ValueError(f"row {b} would hold {n} tokens, more than the llama.cpp context of {max_positions}: "
                     f"build the backend with a larger n_ctx")


def check_tokens(tokens: np.ndarray, n_vocab: int) -> None:
    if len(tokens) <= 64:  # a decoding step's few tokens: Python's min and max are ~10x cheaper than numpy's here
        values = tokens.tolist()
        if values and (min(values) < 0 or max(values) >= n_vocab):
            raise ValueError(f"token ids outside the model's vocabulary [0, {n_vocab})")
    elif tokens.min() < 0 or tokens.max() >= n_vocab:
        raise ValueError(f"token ids outside the model's vocabulary [0, {n_vocab})")


def chunks(rows: np.ndarray, pos: np.ndarray, last_only: bool, n_batch: int,
           max_tokens_per_forward: int | None, single_from: int | None = None) -> list[slice]:
    """The llama_decode calls, as slices of the row-major tokens: n_batch tokens at a time; in the exact mode
    (max_tokens_per_forward set) one row at a time, and a verification (all positions wanted) by
    max_tokens_per_forward tokens, and by one token at positions from single_from on. A prefill (last_only) is also
    cut where a row reaches a multiple of n_batch, as a cold prefill from position 0 is (llama-cpp-python's own
    chunks), so a row that starts from a cached prefix runs the same forwards as a cold one from its next multiple of
    n_batch on."""
    if len(rows) == 1:  # a plain step of one row: one call, nothing to cut
        return [slice(0, len(rows))]
    cuts = {0}
    if max_tokens_per_forward is not None:
        cuts.update(np.flatnonzero(np.diff(rows, prepend=-1)).tolist())
        if single_from is not None and not last_only:
            alone = np.flatnonzero(pos >= single_from)
            cuts.update(alone.tolist(), (alone + 1).tolist())
    if last_only:
        cuts.update(np.flatnonzero((pos % n_batch == 0) & (pos > 0)).tolist())
    step = n_batch if last_only or max_tokens_per_forward is None else min(n_batch, max_tokens_per_forward)
    starts = sorted(c for c in cuts if c < len(rows))
    return [slice(s, min(s + step, end)) for start, end in zip(starts, [*starts[1:], len(rows)])
            for s in range(start, end, step)]


def reusable_prefix(length: int, matched: int, budget: int | None, n_batch: int) -> int:
    """The longest cached prefix (a multiple of FA_TILE, at most `matched`, leaving at least the last token)
    after which a single row's prefill runs its last forward through the same kernels as a cold prefill: the
    same last forward, or both last forwards of at least FA_TILE tokens (every other forward holds a multiple
    of FA_TILE tokens: the tiled kernel, whole groups of 4 rows). budget: tokens per prefill forward; with one,
    a prefill's last forward starts at the prompt's last multiple of FA_TILE (the session cuts it there:
    prefill_tile), so a turn re-sending a cached prompt prefills fewer than FA_TILE tokens again."""
    if budget is not None and budget % FA_TILE:
        return 0
    cold = _last_forward_start(0, length, budget, n_batch)
    for start in range(min(matched, length - 1) // FA_TILE * FA_TILE, 0, -FA_TILE):
        warm = _last_forward_start(start, length, budget, n_batch)
        if warm == cold or (length - warm >= FA_TILE and length - cold >= FA_TILE):
            return start
    return 0


def _last_forward_start(start: int, length: int, budget: int | None, n_batch: int) -> int:
    """Where the last prefill forward of positions [start, length) begins: forwards are cut at multiples of
    `budget` (the session's prefill chunks) and of n_batch (the backend's, chunks), counted from position 0, and
    with a budget also at the last multiple of FA_TILE (the session's prefill_tile cut)."""
    cuts = [start, (length - 1) // n_batch * n_batch]
    if budget:
        cuts += [(length - 1) // budget * budget, (length - 1) // FA_TILE * FA_TILE]
    return max(c for c in cuts if c < length)


@functools.lru_cache(maxsize=64)
def _grid(rows_n: int, width: int) -> tuple[np.ndarray, ...]:
    """Of every token of an unpadded [rows_n, width] batch in row-major order: its row, its column, True (it wants
    logits) and its flat index; read-only. The same few shapes come back every step."""
    rows, cols = np.repeat(np.arange(rows_n), width), np.tile(np.arange(width, dtype=np.int32), rows_n)
    arrays = rows, cols, np.ones(rows_n * width, dtype=bool), np.arange(rows_n * width)
    for a in arrays:
        a.flags.writeable = False
    return arrays

"""llama.cpp's model and context behind a LlamaCppBackend and its forks: the sequence ids they share, the batch
buffers, the prefix cache's parked sequences, and opening a GGUF file (through llama-cpp-python's C API)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import weakref
from pathlib import Path

import numpy as np

from .base import Interrupted
from .huge_pages import HugePages, anonymous_regions

_BACKEND_READY = False
TREE_CELLS = 256  # KV cells per row beyond n_ctx for token trees: a step's nodes (at most K + 1), and held branches
HELD_CELLS = 192  # the exact mode holds a row's rejected branches in at most this many cells (_Context.hold)


def _quiet(verbose: bool):
    """Silence llama.cpp's loading chatter unless verbose, as llama-cpp-python's Llama does: its log level, and
    stdout/stderr redirected while loading (some messages bypass the level)."""
    from llama_cpp._logger import set_verbose
    from llama_cpp._utils import suppress_stdout_stderr

    set_verbose(verbose)
    return suppress_stdout_stderr(disable=verbose)


class _Batch:
    """A llama_batch whose arrays are numpy buffers, filled with vectorised writes and reused across calls.

    llama_batch_init would allocate one seq_id array per token (a pointer each), which can only be written in a
    Python loop; here every token's seq_id pointer points into one int32 array instead.
    """

    def __init__(self, lib, capacity: int):
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        int_p = ctypes.POINTER(ctypes.c_int32)
        self._seq_ptrs = (int_p * capacity)(*[ctypes.cast(self.seq.ctypes.data + 4 * i, int_p)
                                              for i in range(capacity)])
        self._single = (int_p * capacity)()
        ctypes.memmove(self._single, self._seq_ptrs, ctypes.sizeof(self._seq_ptrs))
        self._multi: np.ndarray | None = None  # the seq ids of a fill_multi, while the pointers point into it
        self.struct = lib.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(int_p), embd=None, pos=self.pos.ctypes.data_as(int_p),
            n_seq_id=self.n_seq_id.ctypes.data_as(int_p), seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(int_p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))

    def fill(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, outputs: np.ndarray) -> None:
        n = len(tokens)
        if self._multi is not None:
            self._point_at_seq()
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = tokens, pos, seq, outputs
        self.struct.n_tokens = n

    def fill_multi(self, tokens: np.ndarray, pos: np.ndarray, seqs: list[list[int]], outputs: np.ndarray) -> None:
        """Like fill, each token in the sequences seqs[i] (a token tree's: llama.cpp attends from a token's first
        sequence to the cells that hold it)."""
        n = len(tokens)
        self._multi = np.asarray([s for group in seqs for s in group], dtype=np.int32)
        int_p = ctypes.POINTER(ctypes.c_int32)
        at = 0
        for i, group in enumerate(seqs):
            self._seq_ptrs[i] = ctypes.cast(self._multi.ctypes.data + 4 * at, int_p)
            at += len(group)
        self.token[:n], self.pos[:n], self.logits[:n] = tokens, pos, outputs
        self.n_seq_id[:n] = [len(group) for group in seqs]
        self.struct.n_tokens = n

    def _point_at_seq(self) -> None:
        ctypes.memmove(self._seq_ptrs, self._single, ctypes.sizeof(self._seq_ptrs))
        self.n_seq_id[:] = 1
        self._multi = None


class _Context:
    """What a backend and its forks share: llama.cpp's model and context, the batch buffers, the sequence ids."""

    def __init__(self, lib, model, ctx, n_ctx: int, llama=None, tree_seqs: int = 0):
        self.lib, self.model, self.ctx, self.llama = lib, model, ctx, llama
        self.memory = lib.llama_get_memory(ctx)
        self.n_batch = lib.llama_n_batch(ctx)
        self.n_seq = lib.llama_n_seq_max(ctx) - tree_seqs  # rows; the last tree_seqs ids are a token tree's
        self.tree_seqs = list(range(self.n_seq, self.n_seq + tree_seqs))
        self.holds: dict[int, tuple[int, int]] = {}  # a row's sequence -> (the sequence holding its branches, cells)
        # llama.cpp rounds each row's KV stream up to a multiple of 256 cells; the trained context still bounds it
        self.max_positions = min(lib.llama_n_ctx_seq(ctx), n_ctx)
        self.batch = _Batch(lib, self.n_batch)
        self.owners: dict[int, weakref.ref] = {}  # sequence id -> the backend (main or fork) whose row it is
        self._views: dict[tuple, np.ndarray] = {}  # (address, rows, width) -> a view of llama.cpp's output buffer
        self.huge_pages = HugePages([])  # the collapse of its memory into huge pages (_open starts it)
        self.before_free: list = []  # called before llama.cpp frees the context and model
        self.abort_when = None  # while interruptible() runs: what llama.cpp asks between graph nodes
        if llama is None:
            weakref.finalize(self, _free, lib, ctx, model, self.before_free)

    def acquire(self, owner, n: int) -> list[int]:
        free = [s for s in range(self.n_seq) if s not in self.owners or self.owners[s]() is None]
        if len(free) < n:
            raise ValueError(
                f"this llama.cpp backend has max_rows={self.n_seq} (rows at a time, as llama.cpp sequences) and "
                f"{self.n_seq - len(free)} are in use, so {n} more do not fit: build it with max_rows >= "
                f"{self.n_seq - len(free) + n} (load_model(..., backend_options={{'max_rows': N}})) or pass fewer "
                f"prompts")
        for s in free[:n]:
            if s in self.owners:  # left behind by a fork that was dropped unmerged
                self.lib.llama_memory_seq_rm(self.memory, s, -1, -1)
                self.drop_hold(s)
            self.owners[s] = weakref.ref(owner)
        return free[:n]

    def free(self) -> int:
        return sum(1 for s in range(self.n_seq) if s not in self.owners or self.owners[s]() is None)

    def release(self, seqs: list[int]) -> None:
        for s in seqs:
            self.lib.llama_memory_seq_rm(self.memory, s, -1, -1)
            self.owners.pop(s, None)
            self.drop_hold(s)

    # token trees: spare sequences for branches, and the exact mode's held cells
    def spare_tree_seqs(self) -> list[int]:
        held = {h for h, _ in self.holds.values()}
        return [s for s in self.tree_seqs if s not in held]

    def hold(self, seq: int, p0: int, sources: list[int], cells: int) -> None:
        """Keep the cells of a tree step's nodes (from position p0, in these sequences) occupied, so that later
        tokens of the row are not placed in the cells of rejected nodes, before cells it kept: llama.cpp would then
        attend over its cells in another order and round differently. Past HELD_CELLS the old ones are let go."""
        hold, count = self.holds.get(seq) or (self.spare_tree_seqs()[0], 0)
        if count + cells > HELD_CELLS:
            self.lib.llama_memory_seq_rm(self.memory, hold, -1, -1)
            count = 0
        for src in sources:
            self.lib.llama_memory_seq_cp(self.memory, src, hold, p0, -1)
        self.holds[seq] = (hold, count + cells)

    def drop_hold(self, seq: int) -> None:
        if seq in self.holds:
            self.lib.llama_memory_seq_rm(self.memory, self.holds.pop(seq)[0], -1, -1)

    @contextlib.contextmanager
    def interruptible(self, abort_when):
        """Decodes inside may stop between two graph nodes (milliseconds) once abort_when() is true: llama_decode
        then returns 2 and decode() raises Interrupted. The callback is installed only here (each call into it takes
        the GIL: never on a step's forward), and removed after."""
        callback = self.lib.ggml_abort_callback(lambda _data: bool(abort_when()))
        self.abort_when = abort_when
        self.lib.llama_set_abort_callback(self.ctx, callback, None)
        try:
            yield
        finally:
            self.lib.llama_set_abort_callback(self.ctx, self.lib.ggml_abort_callback(), None)
            self.abort_when = None

    def decode(self, tokens, pos, seq, outputs) -> None:
        """One llama_decode; seq: a sequence id per token, or (a token tree) a list of them per token."""
        if isinstance(seq, list):
            self.batch.fill_multi(tokens, pos, seq, outputs)
        else:
            self.batch.fill(tokens, pos, seq, outputs)
        if self.llama is not None:  # a Llama whose context this is would reuse "its" cached prompt, now ours
            self.llama.n_tokens = 0
            self.llama._requires_eval = True
        code = self.lib.llama_decode(self.ctx, self.batch.struct)
        if code == 2 and self.abort_when is not None:
            raise Interrupted(f"llama_decode was interrupted on {len(tokens)} tokens: other work came first")
        if code == 1:
            raise RuntimeError(f"llama.cpp found no room in its KV cache for {len(tokens)} tokens: build the backend "
                               f"with a larger n_ctx")
        if code != 0:
            raise RuntimeError(f"llama_decode failed with code {code} on {len(tokens)} tokens")

    def outputs(self, getter: str, n: int, width: int) -> np.ndarray:
        """A numpy view of llama.cpp's output buffer (getter: "llama_get_logits" or "llama_get_embeddings"): n rows,
        in the order of the batch's flagged tokens, valid until the next decode. The buffer moves only when llama.cpp
        grows it, so views are kept per address: building one costs ~30 us after a forward, every step."""
        address = _address_getter(self.lib, getter)(self.ctx)
        if not address:
            raise RuntimeError(f"{getter} returned no buffer: the last decode asked for no outputs")
        key = (address, n, width)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 64:
                self._views.clear()
            view = np.frombuffer(_floats(n * width).from_address(address), dtype=np.float32).reshape(n, width)
            self._views[key] = view
        return view


@functools.lru_cache(maxsize=64)
def _floats(n: int):
    return ctypes.c_float * n


@functools.lru_cache(maxsize=None)
def _address_getter(lib, name: str):
    """llama.cpp's output getter returning the address as an int (llama-cpp-python's returns a float pointer, whose
    cast costs more than the call): a prototype of its own, leaving the library's untouched."""
    function = lib.llama_cpp._lib[name]  # indexing a CDLL makes a new function object
    function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_void_p
    return function


class _ParkedSequence:
    """A finished row's sequence kept for the prefix cache; its KV is freed for reuse once this is dropped."""

    def __init__(self, shared: _Context, seq: int, length: int):
        self.seq, self.length = seq, length
        shared.owners[seq] = weakref.ref(self)


class _RunningSequence:
    """A running row's sequence, to copy a prefix from at once (owned by its backend)."""

    def __init__(self, seq: int, length: int):
        self.seq, self.length = seq, length


def _open(lib, path: Path, n_ctx, max_rows, n_threads, n_threads_batch, n_batch, flash_attn, use_mmap, repack,
          verbose, tree_seqs: int = 0, huge_pages: bool = True) -> _Context:
    global _BACKEND_READY
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    if not 1 <= max_rows <= lib.llama_max_parallel_sequences():
        raise ValueError(f"max_rows must be between 1 and {lib.llama_max_parallel_sequences()} (llama.cpp's limit "
                         f"on sequences), got {max_rows}")
    before = anonymous_regions() if huge_pages else None
    with _quiet(verbose):
        if not _BACKEND_READY:
            lib.llama_backend_init()
            _BACKEND_READY = True
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if use_mmap else lib.LLAMA_LOAD_MODE_NONE
        model_params.use_extra_bufts = repack  # llama.cpp's repacked CPU kernels ("--no-repack" turns them off)
        model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            raise ValueError(f"llama.cpp could not load {path}: not a GGUF model it supports (verbose=True shows why)")
        trained = lib.llama_model_n_ctx_train(model)
        n_ctx = min(n_ctx, trained) if trained > 0 else n_ctx
        threads = n_threads or _cores()
        params = lib.llama_context_default_params()
        # Each row gets its own KV stream of n_ctx cells (kv_unified off splits n_ctx over the sequences). Token
        # trees need a token in several sequences, which only one shared stream allows (kv_unified on: every row's
        # attention then spans the cells in use, so it is asked for only with trees), and cells for a tree's nodes.
        params.n_ctx = n_ctx * max_rows + (TREE_CELLS * max_rows if tree_seqs else 0)
        params.n_seq_max = max_rows + tree_seqs
        params.kv_unified = bool(tree_seqs)
        params.n_batch = min(n_ctx * max_rows, n_batch)
        params.n_ubatch = min(params.n_batch, 512)
        params.n_threads = threads
        params.n_threads_batch = n_threads_batch or threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        lib.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens x {max_rows} rows for {path} "
                           f"(out of memory?): lower n_ctx or max_rows")
    shared = _Context(lib, model, ctx, n_ctx, tree_seqs=tree_seqs)
    if huge_pages:  # the weights, KV cache and buffers llama.cpp just allocated (huge_pages.py)
        shared.huge_pages = HugePages.since(before)
        shared.before_free.append(shared.huge_pages.stop)
    return shared


def _end_of_generation_ids(lib, vocab, n_vocab: int) -> set[int]:
    # llama.cpp's own generation stops at every end-of-generation token it knows (the GGUF's eos and eot, and
    # tokens such as <|im_end|> or <|endoftext|> it recognises), not only at eos; the API only answers per token,
    # so this asks once per token at load time (~0.1 s for 152k tokens).
    ids = {t for t in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)) if t >= 0}
    return ids | {t for t in range(n_vocab) if lib.llama_vocab_is_eog(vocab, t)}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free(lib, ctx, model, before_free: list) -> None:
    for call in before_free:
        call()
    lib.llama_free(ctx)
    lib.llama_model_free(model)

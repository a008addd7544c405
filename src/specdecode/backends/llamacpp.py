"""A GGUF model on llama.cpp's CPU kernels (through llama-cpp-python) behind the backend interface.

llama.cpp only computes logits and keeps the KV cache; sampling, drafting and verification stay ours, so the
output is exactly the target's distribution as llama.cpp computes it. Rows of a batch are llama.cpp sequences,
each with a KV stream of its own; rejected drafts are forgotten with llama_memory_seq_rm. A fork (rows that
prefill beside the running batch) takes free sequence ids of the same context, so merging it moves nothing.

Two facts about llama.cpp's numbers shape this module (measured on an AMD EPYC Zen 4 with AVX-512, with the
llama.cpp of llama-cpp-python 0.3.36; tests/test_llamacpp.py checks them):
- Without flash attention, a token evaluated in a forward of 2 or more tokens gets different logits (up to ~1 on
  SmolLM2-135M) from the same token decoded alone. With flash attention (on by default here, as in llama.cpp's
  own tools; llama-cpp-python's Llama defaults to off) forwards of up to 3 tokens are bit for bit token-by-token
  decoding below position 256; from 4 tokens on, weights repacked for x86 (Q4_0, Q4_K, IQ4_NL, ...) go through a
  matrix kernel that differs by up to ~0.5. From position 256 on, with 2 or more threads, a one-token step splits
  its attention between the threads (llamacpp_layout.SPLIT_ATTENTION_FROM), which no longer forward does: there
  only one-token forwards match. Either way the output is exactly the target's distribution as llama.cpp computes
  it for that forward, but greedy output can then differ from llama.cpp's own. The exact mode,
  max_tokens_per_forward=3, splits every verification (a forward that returns all positions) into forwards of at
  most 3 tokens, one row at a time, and of one token from position 256 on (where the session then drafts
  nothing), which reproduces llama.cpp's token-by-token decoding bit for bit, at the price of more, smaller
  forwards; past position 256 it decodes as plain decoding does.
- Prompts (forwards that only want the last position) go through llama.cpp's batched prefill, n_batch tokens at
  a time with the logits of the last token only, as llama-cpp-python's own generation does, so that both start
  from the same cache.

Token trees (token_trees=True, forward_tree / keep_paths) put a tree's tokens in several sequences at once, which
llama.cpp allows only in one KV stream shared by every row (kv_unified). A row's branches take spare sequence ids.
llama.cpp also rounds by the order of a row's cells: a later token placed in the freed cell of a rejected node,
before a kept one, gets other logits. So the exact mode holds rejected branches' cells for a while (_Context.hold).

Where a forward's tokens go in llama.cpp's batch, and how a forward is cut into decode calls, is llamacpp_layout.py;
the model and context a backend and its forks share, llamacpp_context.py.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import register_backend
from .base import Interrupted
from ..exact.token_tree import children, depths
from .llamacpp_context import _Context, _ParkedSequence, _RunningSequence, _cores, _end_of_generation_ids, _open
from .llamacpp_layout import FA_TILE, SPLIT_ATTENTION_FROM, chunks, layout, reusable_prefix

INSTALL_HINT = ('the llama.cpp backend needs llama-cpp-python: pip install -e ".[llamacpp]" '
                '(builds from source: needs cmake and a C++ compiler; a few minutes with the flags of '
                'deploy/llama-cpp.env: bash scripts/install.sh)')
EXACT_TOKENS_PER_FORWARD = 3  # below the 4 tokens at which llama.cpp switches to its repacked matrix kernel


def _llama_cpp():
    """The llama_cpp module, imported on first use; a one-line ImportError naming the fix if it is missing."""
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return llama_cpp


class LlamaCppBackend:
    """A GGUF model run by llama.cpp; float32 logits as torch tensors on the CPU.

    model: a .gguf path, or a llama_cpp.Llama (its context is used as it is: its n_ctx, threads, flash attention
    and n_seq_max; its own prompt cache is invalidated whenever this backend runs). n_ctx: context length per
    row (capped at the model's). max_rows: rows at a time, forks included (llama.cpp sequences, at most 256).
    n_threads: defaults to the cores this process may use. max_tokens_per_forward: split every verification
    into forwards of at most this many tokens, one row at a time; 3 (EXACT_TOKENS_PER_FORWARD) makes every logit
    equal llama.cpp's token-by-token decoding; None = unsplit (fewer, larger forwards). flash_attn: llama.cpp's
    flash attention (the exact mode needs it). token_trees: verify token trees (forward_tree): one KV stream shared
    by all rows (llama.cpp's kv_unified, where a token can sit in several sequences) and spare sequences for the
    branches; a batch of several rows then attends over every row's cells, so it is off by default. use_mmap: map
    the file instead of reading it; off by default
    because on x86 llama.cpp repacks most quantized weights into buffers of its own anyway, and the mapping then
    keeps a second, file-backed copy resident (the Qwen 1.5B + 0.5B pair: 2.5 GiB peak RSS mapped, 1.9 GiB
    read). vocab_size: width of the returned logits (the vocabulary shared with the other model), at most the
    model's n_vocab. huge_pages: collapse the memory llama.cpp allocated for the model into transparent huge pages,
    in a background thread (huge_pages.py: ~8 % faster steps on a 1.5B model here, the same outputs).
    """

    def __init__(self, model, *, n_ctx: int = 4096, max_rows: int = 1, n_threads: int | None = None,
                 n_threads_batch: int | None = None, n_batch: int = 512,
                 max_tokens_per_forward: int | None = None, flash_attn: bool = True, use_mmap: bool = False,
                 repack: bool = True, token_trees: bool = False, huge_pages: bool = True,
                 vocab_size: int | None = None, name: str | None = None, verbose: bool = False):
        lib = _llama_cpp()
        if max_tokens_per_forward is not None and (isinstance(max_tokens_per_forward, bool)
                                                   or not isinstance(max_tokens_per_forward, int)
                                                   or max_tokens_per_forward < 1):
            raise ValueError(f"max_tokens_per_forward must be an integer >= 1 or None, got {max_tokens_per_forward!r}")
        if isinstance(model, (str, os.PathLike)):
            tree_seqs = min(lib.llama_max_parallel_sequences() - max_rows, 32 * max_rows) if token_trees else 0
            self._shared = _open(lib, Path(model), n_ctx, max_rows, n_threads, n_threads_batch, n_batch,
                                 flash_attn, use_mmap, repack, verbose, tree_seqs, huge_pages)
            self.name = name or Path(model).name
            self.gguf_path = Path(model)  # the file it runs (a draft's lean copy, where it runs one)
        elif isinstance(model, lib.Llama):
            self._shared = _Context(lib, model.model, model.ctx, lib.llama_n_ctx_seq(model.ctx), llama=model)
            self.name = name or Path(model.model_path).name
            self.gguf_path = Path(model.model_path)
        else:
            raise TypeError(f"LlamaCppBackend takes a .gguf path or a llama_cpp.Llama, not {type(model).__name__}")
        vocab = lib.llama_model_get_vocab(self._shared.model)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        if vocab_size is not None and not 1 <= vocab_size <= self.n_vocab:
            raise ValueError(f"vocab_size={vocab_size} but the model has {self.n_vocab} tokens")
        self.vocab_size = vocab_size or self.n_vocab
        self.n_embd = lib.llama_model_n_embd(self._shared.model)
        self.device = torch.device("cpu")
        self.max_positions = self._shared.max_positions
        self.max_rows = self._shared.n_seq
        self.max_tokens_per_forward = max_tokens_per_forward
        # From this position on the exact mode verifies one token per forward (llamacpp_layout.SPLIT_ATTENTION_FROM),
        # so a draft there costs a forward of its own and the session drafts none (session.py, _choose_k)
        threads = lib.llama_n_threads(self._shared.ctx)
        self.single_token_from = SPLIT_ATTENTION_FROM if max_tokens_per_forward is not None and threads > 1 else None
        self.eos_token_ids = _end_of_generation_ids(lib, vocab, self.n_vocab)
        self._seqs: list[int] = []
        self._lengths: list[int] = []
        self.reset(1)

    @property
    def huge_pages(self):
        """The collapse of this model's memory into huge pages (huge_pages.HugePages): wait() for it, or read its
        chunks and how many are collapsed."""
        return self._shared.huge_pages

    # ------------------------------------------------------------------ the backend interface
    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    def reset(self, batch_size: int) -> None:
        self._shared.release(self._seqs)
        self._seqs, self._lengths = [], []
        self._seqs = self._shared.acquire(self, batch_size)
        self._lengths = [0] * batch_size

    def fork(self, batch_size: int) -> "LlamaCppBackend":
        """batch_size new, empty rows in the same llama.cpp context (free sequence ids), for merge()."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._seqs, other._lengths = [], []
        other.reset(batch_size)
        return other

    def merge(self, other: "LlamaCppBackend") -> None:
        if other._shared is not self._shared:
            raise ValueError("only a fork of this backend can be merged into it")
        for s in other._seqs:
            self._shared.owners[s] = weakref.ref(self)
        self._seqs += other._seqs
        self._lengths += other._lengths
        other._seqs, other._lengths = [], []

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
                output_hidden: bool = False):
        rows_n, width = input_ids.shape
        out_width = 1 if last_only else width
        logits = torch.empty(rows_n, out_width, self.vocab_size, dtype=torch.float32)
        hidden = torch.empty(rows_n, out_width, self.n_embd, dtype=torch.float32) if output_hidden else None
        flat_logits = logits.numpy().reshape(-1, self.vocab_size)  # views: llama.cpp's rows are copied straight in
        flat_hidden = hidden.numpy().reshape(-1, self.n_embd) if output_hidden else None

        def take(where, rows):  # padding positions keep zeros (llama.cpp never sees them)
            flat_logits[where] = rows[:, : self.vocab_size]
            if output_hidden:
                flat_hidden[where] = self._shared.outputs("llama_get_embeddings", len(where),
                                                          self.n_embd)

        if output_hidden:
            flat_hidden[:] = 0
        self._run(input_ids, valid, last_only, output_hidden, take, flat_logits)
        return (logits, hidden) if output_hidden else logits

    def forward_argmax(self, input_ids, allowed=None):
        """The argmax [B, n] of each position's logits that forward(input_ids) would return, read straight off
        llama.cpp's output buffer, as the kind it was given: a tensor for a tensor (long), a numpy array for an array
        or lists (int64). A greedy step needs neither the logits nor a tensor: copying 152k floats a position into
        torch and reducing them there cost ~0.2 ms a step, and each tensor built right after a forward ~20-40 us.
        Same index as greedy(forward(input_ids)). allowed[b][j]: a grammar's TokenMask for row b's position j (None,
        or past the row's list: every token), whose argmax is taken of the logits it allows (TokenMask.argmax_of),
        the index greedy(forward(input_ids) + its bias) gives; a JSON row's step then builds no [V] mask either."""
        tensor = isinstance(input_ids, torch.Tensor)
        ids = input_ids if tensor else np.asarray(input_ids, dtype=np.int64)
        rows_n, width = ids.shape
        tokens = np.zeros(rows_n * width, dtype=np.int64)

        def take(where, rows):
            if allowed is None:
                tokens[where] = np.argmax(rows[:, : self.vocab_size], axis=-1)
                return
            for i, flat in enumerate(where.tolist()):
                b, j = divmod(flat, width)
                mask = allowed[b][j] if j < len(allowed[b]) else None
                scores = rows[i, : self.vocab_size]
                tokens[flat] = np.argmax(scores) if mask is None else mask.argmax_of(scores)

        self._run(ids, None, False, False, take, None)
        tokens = tokens.reshape(rows_n, width)
        return torch.from_numpy(tokens) if tensor else tokens

    def _run(self, input_ids, valid: torch.Tensor | None, last_only: bool, output_hidden: bool, take,
             flat_logits: np.ndarray | None) -> None:
        """Decode input_ids into the cache; take(where, logits) gets each forward's output rows (a view of llama.cpp's
        buffer, valid until the next decode) and where they go in the flat [B * width] output."""
        rows_n, width = input_ids.shape
        if rows_n != len(self._lengths):
            raise ValueError(f"forward got {rows_n} rows but the cache holds {len(self._lengths)}: call "
                             f"reset(batch) first")
        rows, tokens, pos, outputs, dest = layout(input_ids, valid, self._lengths, self.max_positions,
                                                  self.n_vocab, last_only)
        if flat_logits is not None and valid is not None and outputs.sum() < len(flat_logits):
            flat_logits[np.setdiff1d(np.arange(len(flat_logits)), dest[outputs])] = 0
        shared, lib = self._shared, self._shared.lib
        seq = np.asarray(self._seqs, dtype=np.int32)[rows]
        if output_hidden:
            lib.llama_set_embeddings(shared.ctx, True)
        try:
            parts = chunks(rows, pos, last_only, shared.n_batch, self.max_tokens_per_forward, self.single_token_from)
            for part in parts:
                shared.decode(tokens[part], pos[part], seq[part], outputs[part])
                if valid is None and len(parts) == 1:  # every row took its width
                    self._lengths = [n + width for n in self._lengths]
                else:
                    for b, n in enumerate(np.bincount(rows[part], minlength=rows_n).tolist()):
                        self._lengths[b] += n
                where = dest[part][outputs[part]]
                if len(where):
                    take(where, shared.outputs("llama_get_logits", len(where), self.n_vocab))
        finally:
            if output_hidden:
                lib.llama_set_embeddings(shared.ctx, False)

    def trim(self, lengths: list[int]) -> None:
        lengths = list(lengths)
        if len(lengths) != len(self._lengths):
            raise ValueError(f"trim got {len(lengths)} lengths for {len(self._lengths)} rows")
        for b, (keep, have) in enumerate(zip(lengths, self._lengths)):
            if not 0 <= keep <= have:
                raise ValueError(f"row {b} holds {have} tokens and cannot keep {keep}")
            if keep < have and not self._shared.lib.llama_memory_seq_rm(self._shared.memory, self._seqs[b], keep, -1):
                raise RuntimeError(f"llama.cpp cannot remove tokens from this model's memory (a recurrent "
                                   f"model?): {self.name} cannot be used for speculative decoding")
        self._lengths = lengths

    def select_rows(self, rows: list[int]) -> None:
        rows = list(rows)
        if rows == list(range(len(self._seqs))):
            return
        kept = {self._seqs[r] for r in rows}
        self._shared.release([s for s in self._seqs if s not in kept])
        self._seqs = [self._seqs[r] for r in rows]
        self._lengths = [self._lengths[r] for r in rows]

    # ------------------------------------------------------------------ prefix caching (prefix_cache.py)
    def free_rows(self) -> int:
        return self._shared.free()

    def park(self, rows: list[int]) -> list[_ParkedSequence]:
        """Drop these rows from the batch, keeping their sequences (and KV) as handles for the prefix cache."""
        handles = [_ParkedSequence(self._shared, self._seqs[r], self._lengths[r]) for r in rows]
        gone = set(rows)
        keep = [r for r in range(len(self._seqs)) if r not in gone]
        self._seqs = [self._seqs[r] for r in keep]
        self._lengths = [self._lengths[r] for r in keep]
        return handles

    def kv_ref(self, row: int) -> _RunningSequence:
        return _RunningSequence(self._seqs[row], self._lengths[row])

    def load_prefixes(self, prefixes: list) -> None:
        """Row b starts from the first n tokens of a handle's sequence: a copy of the whole KV stream (llama.cpp
        copies across streams whole, at its next decode), then everything from n on is removed."""
        lib, memory = self._shared.lib, self._shared.memory
        for b, item in enumerate(prefixes):
            if item is None:
                continue
            handle, n = item
            if self._lengths[b] or not 0 < n <= handle.length:
                raise ValueError(f"row {b} cannot take {n} cached tokens (it holds {self._lengths[b]}, the cache "
                                 f"{handle.length})")
            lib.llama_memory_seq_cp(memory, handle.seq, self._seqs[b], -1, -1)
            lib.llama_memory_seq_rm(memory, self._seqs[b], n, -1)
            self._lengths[b] = n

    def prefill_parked(self, handle: _ParkedSequence, start: int, ids: list[int],
                       abort_when: Callable[[], bool] | None = None) -> _ParkedSequence:
        """In place (the prefix cache's idle prefill of an answer): the parked sequence forgets its tokens from
        `start` on and prefills ids there through the decode calls a row's prefill makes; no spare sequence, no
        copy of the KV stream. abort_when: checked by llama.cpp between graph nodes; once true the prefill stops
        within milliseconds, the sequence keeps its first `start` tokens and Interrupted is raised (a request that
        arrives meanwhile waits for no chunk)."""
        if not 0 <= start <= handle.length:
            raise ValueError(f"a parked sequence of {handle.length} tokens cannot be prefilled from {start}")
        shared = self._shared
        shared.lib.llama_memory_seq_rm(shared.memory, handle.seq, start, -1)
        handle.length = start
        row = object.__new__(type(self))  # a one-row view of the parked sequence, owned by the handle still
        row.__dict__.update(self.__dict__)
        row._seqs, row._lengths = [handle.seq], [start]
        try:
            with shared.interruptible(abort_when) if abort_when is not None else contextlib.nullcontext():
                row.forward(torch.tensor([ids], dtype=torch.long), last_only=True)
        except Interrupted:  # the chunks it finished and the one it stopped in go: the sequence is as it was
            shared.lib.llama_memory_seq_rm(shared.memory, handle.seq, start, -1)
            raise
        handle.length = row._lengths[0]
        return handle

    # ------------------------------------------------------------------ token trees (token_tree.py)
    @property
    def supports_trees(self) -> bool:
        return bool(self._shared.tree_seqs)

    @property
    def tree_leaves(self) -> int:
        """The leaves a row's tree may have whatever the other rows' trees: each leaf past its first takes a spare
        sequence, each row may hold one in the exact mode (_Context.hold), and one stays free."""
        rows, spare = self._shared.n_seq, len(self._shared.tree_seqs)
        return 1 + max(0, (spare - 1 - rows) // rows)

    def forward_tree(self, input_ids: torch.Tensor, parents: list[list[int]]) -> torch.Tensor:
        """Logits [B, N+1, V] of a tree step: row b's last token (the root) and its N nodes, parents[b] their tree.
        Each leaf gets a sequence (the row's own for the first, spare ones for the others, holding the row's
        context too) and every token sits in the sequences of the leaves below it, so a node attends to the
        context and its ancestors only. Positions are depths. keep_paths then keeps one path."""
        if not self.supports_trees:
            raise ValueError(f"{self.name}: token trees need the backend built with token_trees=True")
        ids = input_ids.detach().to("cpu", torch.int32).numpy()
        rows_n, width = ids.shape
        lib, memory, spare = self._shared.lib, self._shared.memory, self._shared.spare_tree_seqs()
        tokens, pos, seqs, self._tree = [], [], [], []
        for b, par in enumerate(parents):
            kids = children(list(par))
            leaves = [i for i in range(len(par)) if not kids[i + 1]]
            if len(leaves) - 1 > len(spare) - 1:  # one stays free for the exact mode's held cells
                raise ValueError(f"row {b}'s token tree has {len(leaves)} leaves: with the rows before it that needs "
                                 f"more spare sequences than this llama.cpp context has left ({len(spare)} of "
                                 f"{len(self._shared.tree_seqs)}); trees of at most tree_leaves={self.tree_leaves} "
                                 f"leaves per row always fit: lower K or the tree width, or max_rows")
            own = self._seqs[b]
            leaf_seq = {i: own if j == 0 else spare.pop() for j, i in enumerate(leaves)}
            temps = [t for t in leaf_seq.values() if t != own]
            for t in temps:  # the branch sees the row's context
                lib.llama_memory_seq_cp(memory, own, t, -1, -1)
            below: dict[int, list[int]] = {}
            for i in reversed(range(len(par))):  # the leaves below each node, the first one first (its query)
                below[i] = [leaf_seq[i]] if i in leaf_seq else [s for c in kids[i + 1] for s in below[c]]
            base, depth = self._lengths[b], [0] + depths(list(par))
            for j in range(width):
                tokens.append(int(ids[b, j]))
                pos.append(base + depth[j])
                seqs.append([own] + temps if j == 0 else below[j - 1])
            self._tree.append((base, {i: below[i][0] for i in below}, temps))
        logits = torch.empty(rows_n, width, self.vocab_size, dtype=torch.float32)
        flat = logits.numpy().reshape(-1, self.vocab_size)
        tokens, pos = np.asarray(tokens, dtype=np.int32), np.asarray(pos, dtype=np.int32)
        step = self.max_tokens_per_forward or self._shared.n_batch  # parents come before children: chunks are fine
        for start in range(0, len(tokens), step):
            part = slice(start, min(start + step, len(tokens)))
            n = part.stop - part.start
            self._shared.decode(tokens[part], pos[part], seqs[part], np.ones(n, dtype=bool))
            flat[part] = self._shared.outputs("llama_get_logits", n, self.n_vocab)[:, : self.vocab_size]
        self._lengths = [n + width for n in self._lengths]
        return logits

    def keep_paths(self, paths: list[list[int]]) -> None:
        """After forward_tree: row b keeps its root and the nodes of paths[b]; the branches are forgotten (their
        spare sequences emptied, their cells freed; held for a while in the exact mode, see _Context.hold)."""
        lib, memory = self._shared.lib, self._shared.memory
        for b, ((base, query, temps), path) in enumerate(zip(self._tree, paths)):
            own, kept = self._seqs[b], base + 1 + len(path)
            if self.max_tokens_per_forward is not None and temps:  # the exact mode: keep the cells in order
                self._shared.hold(own, base + 1, [own, *temps], len(query))
            leaf = query[path[-1]] if path else own
            if leaf != own:  # the kept path lies on a branch: the row's sequence takes it over
                lib.llama_memory_seq_rm(memory, own, base + 1, -1)
                lib.llama_memory_seq_cp(memory, leaf, own, base + 1, kept)
            else:
                lib.llama_memory_seq_rm(memory, own, kept, -1)
            for t in temps:
                lib.llama_memory_seq_rm(memory, t, -1, -1)
            self._lengths[b] = kept
        self._tree = []

    # A session with a prefill budget ends a row's prefill with a forward from the prompt's last multiple of this
    # (admission.py), so that a later prompt re-sending it reuses all but that forward, bit for bit
    prefill_tile = FA_TILE

    def reusable_prefix(self, length: int, matched: int, budget: int | None) -> int:
        """The longest cached prefix after which a single row's prefill meets a cold prefill's kernels
        (llamacpp_layout.reusable_prefix)."""
        return reusable_prefix(length, matched, budget, self._shared.n_batch)

    def close(self) -> None:
        """Forget this backend's rows; llama.cpp's model and context are freed with the last backend using them
        (a Llama passed in is left to its owner)."""
        self._shared.release(self._seqs)
        self._seqs, self._lengths = [], []


    def __repr__(self) -> str:
        mode = "exact" if self.max_tokens_per_forward == EXACT_TOKENS_PER_FORWARD else (
            f"max {self.max_tokens_per_forward} tokens/forward" if self.max_tokens_per_forward else "unsplit")
        return (f"LlamaCppBackend({self.name!r}, vocab {self.vocab_size}, n_ctx {self.max_positions}, "
                f"rows <= {self.max_rows}, {mode})")


# ---------------------------------------------------------------------------------------------- loading
def claims(source, options) -> bool:
    """backend="auto" runs a GGUF model (a .gguf file or a built-in name) on llama.cpp when it is to run on the CPU."""
    from ..models.sources import is_gguf

    return isinstance(source, (str, os.PathLike)) and is_gguf(str(source)) and options.on_cpu


def load(source, options):
    """The llama.cpp backend's loader: the GGUF as it is (no conversion) and the tokenizer built from it.

    options.backend_options are LlamaCppBackend's keywords; exact_greedy asks for the exact mode, max_rows for that
    many rows, threads for llama.cpp's threads."""
    from concurrent.futures import ThreadPoolExecutor

    from ..models.sources import LoadedModel, is_gguf, locate
    from ..models.prepare import PreparedGguf, gguf_tokenizer_dir, preparing_gguf

    if not isinstance(source, (str, os.PathLike)):
        raise ValueError("the llama.cpp backend loads GGUF files, not a transformers model object: pass the "
                         "model's name or .gguf path")
    name = str(source)
    if not is_gguf(name):
        locate(name, progress=False)  # a clear ModelNotFoundError when it is nothing at all
        raise ValueError(f"the llama.cpp backend runs GGUF models: {name!r} is neither a .gguf file nor a "
                         f"built-in model; use backend transformers")
    if not options.on_cpu:
        raise ValueError(f"the llama.cpp backend runs on the CPU, and device {options.device!r}"
                         f"{'' if options.device_map is None else f' / device_map {options.device_map!r}'} was "
                         f"asked for: use device cpu, or backend transformers for a GPU")
    _llama_cpp()  # the install hint, before any preparation
    path = Path(os.path.expanduser(name))
    keywords = dict(options.backend_options or {})
    if options.exact_greedy:
        keywords.setdefault("max_tokens_per_forward", EXACT_TOKENS_PER_FORWARD)
    if options.max_rows is not None and options.max_rows > 1:
        keywords.setdefault("max_rows", options.max_rows)
    if options.threads is not None:
        keywords["n_threads"] = options.threads
    if options.token_trees:
        keywords.setdefault("token_trees", True)
    keywords.setdefault("huge_pages", options.huge_pages)
    # The tokenizer is built (a first use) and loaded in a thread while llama.cpp loads the model in C, without the
    # GIL: on a 2-core CPU the two overlap instead of adding up (preparing_gguf checks a new file meanwhile too).
    with ThreadPoolExecutor(1, thread_name_prefix="specdecode-tokenizer") as pool, (
            contextlib.nullcontext(PreparedGguf(path, pool.submit(gguf_tokenizer_dir, path))) if path.is_file()
            else preparing_gguf(name, options.progress)) as prepared:
        tokenizer = pool.submit(_tokenizer, prepared)  # after gguf_tokenizer_dir: one worker takes them in turn
        if options.lean_gguf:  # a draft: on the lean copy of its file where that drafts faster here
            from ..models.lean_gguf import open_draft

            progress = options.progress if callable(options.progress) else None  # a bool means no callback
            model = open_draft(prepared.path, keywords.get("n_threads") or _cores(),
                               lambda run: LlamaCppBackend(run, name=name, **keywords), progress)
        else:
            model = LlamaCppBackend(prepared.path, name=name, **keywords)
        tokenizer = tokenizer.result()
    if tokenizer is not None and len(tokenizer) < model.n_vocab:
        # An embedding padded past the tokenizer: logits of ids that no text can produce are dropped, as the
        # generators do for transformers models.
        model.vocab_size = len(tokenizer)
    return LoadedModel(model, tokenizer, name, str(prepared.path), backend="llamacpp")


def _tokenizer(prepared):
    """The Hugging Face tokenizer saved for the GGUF (None where transformers cannot build one)."""
    directory = prepared.tokenizer_dir()
    # imported only now: the thread that built the tokenizer may be importing transformers, whose lazy module
    # answers a second thread's import midway with "cannot import name"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory)) if directory is not None else None


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


register_backend("llamacpp", load, claims=claims, available=_installed,
                 help="GGUF models on llama.cpp's CPU kernels; auto picks it for a GGUF on the CPU when "
                      "llama-cpp-python is installed")

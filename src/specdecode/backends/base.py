"""The narrow interface between the decoding loop and a model.

A backend holds one KV cache for a batch of rows. The loop only ever asks it to run new tokens and to forget
tokens: that is all speculative decoding needs, so other backends (llama.cpp for CPUs, a static-cache compiled
one for GPUs) are one file each, without touching the sampler or the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


class Interrupted(RuntimeError):
    """A forward stopped before its end because other work came first (an idle prefill when a request arrives): the
    tokens it was writing are not in the cache; what was there before it is untouched."""


class ModelBackend(Protocol):
    vocab_size: int  # width of the logits returned (the vocabulary shared with the other model)
    device: torch.device
    max_positions: int | None  # the model's context length, when known
    # Optional: capabilities (a Capabilities: what it offers beyond these methods; by default worked out from the
    # optional attributes, see `capabilities`), eos_token_ids (set[int]), model (the underlying model object), name.

    def reset(self, batch_size: int) -> None:
        """Start an empty cache for batch_size rows."""

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False,
                output_hidden: bool = False):
        """Append input_ids [B, n] to the cache; return float logits [B, n, V] ([B, 1, V] if last_only).

        valid [B, n] marks real tokens; False marks padding (left padding of ragged inputs), which is never
        attended to. Each row's real tokens are placed at the positions that follow its cached tokens.
        With output_hidden, return (logits, hidden) where hidden [B, n, H] are the last layer's states of every
        new position (for drafters that read the target's features); off by default, and then free.
        """

    def trim(self, lengths: list[int]) -> None:
        """Row b keeps its first lengths[b] real tokens and forgets the rest (rejected drafts)."""

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows stop costing work)."""

    @property
    def lengths(self) -> list[int]:
        """Real tokens cached per row."""

    def fork(self, batch_size: int) -> "ModelBackend":
        """An empty cache for batch_size new rows on the same weights, to prefill prompts beside the running rows."""

    def merge(self, other: "ModelBackend") -> None:
        """Append the rows of a fork (after its prefill) to this batch, after the existing rows."""


class PrefixCaching(Protocol):
    """What a backend offers the prefix cache (optional: `caches_prefixes` says whether a backend has it).

    reusable_prefix: optional (see the function of that name). free_rows: rows that can still be forked now.
    """

    def reusable_prefix(self, length: int, matched: int, budget: int | None) -> int: ...

    def free_rows(self) -> int: ...

    def park(self, rows: list[int]) -> list:
        """Remove these rows from the batch (as select_rows of the others would) but keep their KV, one handle per
        row; the handle's KV lives until the handle is dropped (KVHandle.release or garbage collection)."""

    def kv_ref(self, row: int):
        """A handle to a running row's KV, valid until the row changes (copy from it at once)."""

    def load_prefixes(self, prefixes: list) -> None:
        """On a fresh fork: row b starts from the first n tokens of handle's KV, for each (handle, n) (None: empty)."""

    # Optional: prefill_parked(handle, start, ids) -> handle, in place (see the function of that name).


class TokenTrees(Protocol):
    """What a backend offers to verify token trees (optional: `verifies_trees` says whether a backend has it now).

    supports_trees: whether this instance can (a transformers model without sliding windows; llama.cpp built with
    spare sequences)."""

    @property
    def supports_trees(self) -> bool: ...

    def forward_tree(self, input_ids: torch.Tensor, parents: list[list[int]]) -> torch.Tensor:
        """Logits [B, N+1, V]: input_ids [B, N+1] are each row's last token and its N nodes, parents[b] their tree
        (token_tree.py: parents[b][i] is node i's parent, -1 the root). Every node's KV is held until keep_paths."""

    def keep_paths(self, paths: list[list[int]]) -> None:
        """Row b keeps the nodes paths[b] (a root-to-node path, in order) of the last tree and forgets the others."""

    # Optional: tree_leaves (int), the most leaves a row's tree may have whatever the other rows' trees (llama.cpp:
    # each leaf past the first takes a spare sequence); read through tree_leaves() below, None when absent.


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond ModelBackend's methods, as one value: the loop reads it once, when a session is
    built, and never asks a backend for anything by name."""

    max_rows: int | None = None  # rows its cache holds at once, forks included (llama.cpp's sequences); None: no limit
    prefix_caching: bool = False  # PrefixCaching (park, kv_ref, load_prefixes, free_rows): prompts start from parked KV
    trees: bool = False  # TokenTrees on this instance (forward_tree, keep_paths): a step may verify token trees
    tree_leaves: int | None = None  # the most leaves a row's tree may have whatever the other rows' trees; None: any
    forward_argmax: Callable | None = None  # ids -> argmax per new position, no logits handed over (argmax_forward)
    argmax_masks: bool = False  # forward_argmax(ids, allowed) takes each position's grammar mask (argmax_takes_masks)
    single_token_from: int | None = None  # from this position a forward holds one token per row: no draft pays there
    prefill_tile: int | None = None  # its forwards' numbers depend on their size: a prefill ends at a multiple of it
    cold_forwards: Callable[[], int] | None = None  # its count of forwards far slower than steady (cold_forwards)


def capabilities(backend) -> Capabilities:
    """The backend's Capabilities: its own `capabilities` when it declares one, else worked out from the optional
    methods and attributes this module documents (the one place that reads a backend by name)."""
    declared = getattr(backend, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    counted = hasattr(backend, "cold_forwards")
    return Capabilities(max_rows=max_rows(backend), prefix_caching=caches_prefixes(backend),
                        trees=verifies_trees(backend), tree_leaves=tree_leaves(backend),
                        forward_argmax=argmax_forward(backend), argmax_masks=argmax_takes_masks(backend),
                        single_token_from=getattr(backend, "single_token_from", None),
                        prefill_tile=getattr(backend, "prefill_tile", None),
                        cold_forwards=(lambda: backend.cold_forwards) if counted else None)


def verifies_trees(backend) -> bool:
    return all(callable(getattr(backend, name, None)) for name in ("forward_tree", "keep_paths")) and \
        bool(backend.supports_trees)


def tree_leaves(backend) -> int | None:
    return getattr(backend, "tree_leaves", None)


def caches_prefixes(backend) -> bool:
    return all(callable(getattr(backend, name, None)) for name in ("park", "kv_ref", "load_prefixes", "free_rows"))


def reusable_prefix(backend, length: int, matched: int, budget: int | None) -> int:
    """How many of the first `matched` cached tokens a prompt of `length` tokens may take from a copy, so that the
    rest is prefilled exactly as a cold prefill would (budget: prompt tokens per prefill forward, None = all).
    A backend whose forwards do not depend on their size takes all but the last token, whose logits are needed."""
    own = getattr(backend, "reusable_prefix", None)
    if own is not None:
        return own(length, matched, budget)
    return max(0, min(matched, length - 1))


def prefill_parked(backend, handle, start: int, ids: list[int], abort_when: Callable[[], bool] | None = None):
    """A parked row's KV (a handle of `park`) with its tokens from `start` on replaced by ids, prefilled as a row of
    this backend prefills them (one forward that wants the last logits only, cut as the backend cuts a prefill);
    the handle that holds the result. A backend may do it in place (llama.cpp: the parked sequence); otherwise a
    fork takes the first `start` tokens, prefills, and is parked. abort_when: a backend that can stop a forward
    midway (llama.cpp) stops once it is true and raises Interrupted, the handle then holding its first `start`
    tokens; the others run the forward to its end."""
    own = getattr(backend, "prefill_parked", None)
    if own is not None:
        return own(handle, start, ids, abort_when)
    fork = backend.fork(1)
    if start:
        fork.load_prefixes([(handle, start)])
    fork.forward(torch.tensor([ids], dtype=torch.long, device=backend.device), last_only=True)
    return fork.park([0])[0]


def max_rows(backend) -> int | None:
    return getattr(backend, "max_rows", None)


def cold_forwards(backend) -> int:
    """Forwards so far that ran far slower than their shape's steady cost: a CUDA-graph backend's first sight and
    capture of a step shape (StaticBackend). A step whose forwards include one is timed, but its time is not a
    sample of what that step costs (the policy does not learn from it). 0 for backends without such a warm-up."""
    return getattr(backend, "cold_forwards", 0)


def argmax_forward(backend):
    """The backend's forward_argmax(input_ids) -> the argmax [B, n] of each new position's logits (no padding), as
    greedy(forward(input_ids)) gives it, without handing the logits over (llama.cpp); a tensor for a tensor, a numpy
    array for an array (what the loop passes: no tensor built on its greedy path). None for a backend without one."""
    return getattr(backend, "forward_argmax", None)


def argmax_takes_masks(backend) -> bool:
    """Whether the backend's forward_argmax takes `allowed`: per row and position a grammar's TokenMask, whose argmax
    it returns (greedy(forward(ids) + the masks' bias), the constrained greedy token)."""
    import inspect

    method = argmax_forward(backend)
    try:
        return method is not None and "allowed" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def logits_and_hidden(backend, ids, valid, hidden_wanted: bool, last_only: bool = False):
    """(logits, hidden or None): hidden states are asked for only when the drafter needs them."""
    if hidden_wanted:
        return backend.forward(ids, valid, last_only=last_only, output_hidden=True)
    return backend.forward(ids, valid, last_only=last_only), None


def eos_token_ids(backend) -> set[int]:
    return set(getattr(backend, "eos_token_ids", ()))


def underlying_model(backend):
    return getattr(backend, "model", None)


def is_backend(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("forward", "trim", "reset", "select_rows", "fork",
                                                                 "merge"))


def pad(rows: list[list[int]], device, side: str = "left") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token lists of different lengths → ids [B, n] and a validity mask (None when nothing is padded)."""
    width = max(len(r) for r in rows)
    if all(len(r) == width for r in rows):
        return torch.tensor(rows, dtype=torch.long, device=device), None
    # Built on the host in one piece and moved once: a copy per row into a device tensor would be a host-to-device
    # copy each (on a GPU each waits for the copy), which a ragged batch of B rows paid B times per step.
    fill = [[0] * (width - len(r)) for r in rows]
    ids = torch.tensor([f + r if side == "left" else r + f for f, r in zip(fill, rows)], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows]).unsqueeze(1)
    positions = torch.arange(width)
    valid = positions >= width - lengths if side == "left" else positions < lengths
    return ids.to(device), valid.to(device)

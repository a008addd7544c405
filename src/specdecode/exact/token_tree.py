"""Token trees: several deterministic draft continuations sharing prefixes, verified in one target forward.

A tree of N drafted nodes is given in topological order by `parents` [N]: node i holds a token and hangs below
parents[i] (-1: below the root, the row's last emitted token; otherwise a node before i). A chain of K drafts is the
tree parents = [-1, 0, 1, ..., K-2]. The target scores every node at once: scores[0] is its distribution after the
root, scores[i + 1] after node i (the tree's attention: each node sees the context and its own ancestors).

Acceptance walks down from the root. At a node whose distribution is p and whose children propose the tokens
x_1, x_2, ... (deterministic candidates, in order, each token once): keep x_1 with probability p(x_1); on a
rejection take x_1 out (p <- normalize(p with x_1 removed)) and try x_2 with the residual's probability, and so on.
This is the rejection rule of a one-hot draft applied to each candidate in turn (SpecInfer's multi-draft rule for
deterministic candidates), so the token kept or drawn at that node is distributed exactly as p: x_1 comes out with
p(x_1), x_2 with (1 - p(x_1)) * p(x_2) / (1 - p(x_1)) = p(x_2), and a token left when all are rejected is drawn
from the final residual, p restricted to the other tokens. A kept child becomes the next node; the walk ends with
the token drawn at the last node reached (the bonus when it has no children). Greedy: the child equal to the
argmax, else the argmax. Gumbel-coupled rows: the same, on the scores plus the noise of the output position (the
node's depth), so their text does not depend on the tree at all.

Each node's test uses its own uniform u[i] (one per node, fresh each step), the final draw u[N]: no uniform is
read twice, which is what keeps the walk exact.
"""

from __future__ import annotations

import torch

from .rejection import one_hot_residual
from .sampling import greedy, sample_with_uniforms


def chain(k: int) -> list[int]:
    """The parents of a chain of k drafts."""
    return list(range(-1, k - 1))


def padded(parents: list[int], width: int) -> list[int]:
    """A row's tree with nodes up to `width`: the padding (drafts past its num_drafts, never verified) continues
    the last node as a chain (starts one below the root when the row has none), so it adds no leaf. On llama.cpp each
    leaf takes a sequence: padding below the root took one per node, and a batch whose rows had few real nodes ran
    out of spare sequences."""
    return list(parents) + list(range(len(parents) - 1, width - 1))


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 below the root."""
    out: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: a tree lists each node after its parent (-1: the root)")
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def children(parents: list[int]) -> list[list[int]]:
    """children[0] lists the root's children, children[i + 1] node i's, in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        kids[parent + 1].append(i)
    return kids


def ancestors_mask(parents: list[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool: entry (i, j) says whether tree position j (0: the root, i: node i - 1) is position i or
    one of its ancestors, i.e. what position i attends to among the step's new tokens."""
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i + 1] |= mask[parent + 1]
    return mask


def is_chain(parents: list[int]) -> bool:
    return parents == chain(len(parents))


def verify_tree_greedy(tokens: list[int], parents: list[int], scores: torch.Tensor) -> tuple[list[int], int]:
    """(path, next_token): the nodes kept (root to leaf) while each node's argmax is one of its children, then the
    argmax where the walk stops. scores [N + 1, V] (noise already added for coupled rows)."""
    best = greedy(scores[: len(tokens) + 1]).tolist()
    kids = children(parents)
    path: list[int] = []
    at = 0  # tree position: 0 the root, i + 1 node i
    while True:
        nxt = next((c for c in kids[at] if tokens[c] == best[at]), None)
        if nxt is None:
            return path, best[at]
        path.append(nxt)
        at = nxt + 1


def verify_tree_sampled(tokens: list[int], parents: list[int], probs: torch.Tensor,
                        u: torch.Tensor) -> tuple[list[int], int]:
    """(path, next_token) by the multi-candidate rule (module docstring). probs [N + 1, V]: the target's
    distributions at the tree positions; u [N + 1]: u[i] tests node i, u[N] draws the last token."""
    kids = children(parents)
    path: list[int] = []
    at = 0
    while True:
        p = probs[at]
        kept = None
        for c in kids[at]:
            x = tokens[c]
            if float(u[c]) < float(p[x]):
                kept = c
                break
            p = one_hot_residual(p, torch.tensor(x, device=p.device))
        if kept is None:
            return path, int(sample_with_uniforms(p, u[len(tokens)]))
        path.append(kept)
        at = kept + 1

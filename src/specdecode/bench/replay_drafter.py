"""A drafter of known acceptance: it proposes the target's own greedy continuation (recorded by a plain run first),
each draft replaced by a wrong token with probability 1 - alpha. Greedy verification then keeps each draft with
probability alpha, independently: exactly the i.i.d. acceptance Leviathan et al.'s speedup formula assumes, so the
engine's measured speed can be held against the formula's prediction to see what the engine itself costs.

With a draft model, the model runs its forwards as a ModelDrafter would (same cache, same catch-up) so each step
pays a real draft's cost; its tokens are discarded for the replayed ones. Whether a draft is wrong is a function
of (seed, row, position) alone, so runs at different K see the same errors.
"""

from __future__ import annotations

import random

import torch

from ..drafters.base import Drafter, Proposal
from ..drafters.model import ModelDrafter


class ReplayDrafter(Drafter):
    def __init__(self, continuations: list[list[int]], alpha: float, vocab_size: int, seed: int = 0,
                 model: ModelDrafter | None = None):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if any(not c for c in continuations):
            raise ValueError("every row needs a recorded continuation of at least one token")
        self.continuations = [list(c) for c in continuations]
        self.alpha, self.vocab_size, self.seed = alpha, vocab_size, seed
        self.model = model
        self.max_rows = model.max_rows if model is not None else None
        self.catch_up_window = model.catch_up_window if model is not None else None
        self._rows: list[int] = []  # each batch row's index into continuations
        self._joined = [0]  # rows handed out to forks so far, shared by all forks (rows join in request order)
        self._pos: list[int] = []  # tokens emitted so far per row: where its next draft sits in its continuation
        self.off_record = 0  # emitted tokens that differ from the record (the target's greedy output moved)

    @property
    def forward_calls(self) -> int:
        return self.model.forward_calls if self.model is not None else 0

    def draft_token(self, row: int, position: int) -> int:
        record = self.continuations[row]
        true = record[min(position, len(record) - 1)]
        rng = random.Random(hash((self.seed, row, position)))
        if rng.random() < self.alpha:
            return true
        return (true + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size  # any token but the right one

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, hidden=None) -> None:
        rows = self._rows or list(range(input_ids.shape[0]))  # a fork's rows, or a batch's from the first
        if len(rows) != input_ids.shape[0] or rows[-1] >= len(self.continuations):
            raise ValueError(f"{input_ids.shape[0]} prompts for rows {rows}, {len(self.continuations)} recorded "
                             f"continuations")
        self._rows, self._pos = rows, [0] * len(rows)
        if self.model is not None:
            self.model.prefill(input_ids, valid, hidden)

    def fork(self, batch_size: int) -> "ReplayDrafter":
        """The drafter of the next batch_size rows to join (continuous batching admits them in request order)."""
        other = ReplayDrafter(self.continuations, self.alpha, self.vocab_size, self.seed,
                              self.model.fork(batch_size) if self.model is not None else None)
        other._joined = self._joined
        other._rows = list(range(self._joined[0], self._joined[0] + batch_size))
        self._joined[0] += batch_size
        return other

    def merge(self, other: "ReplayDrafter") -> None:
        self._rows += other._rows
        self._pos += other._pos
        self.off_record += other.off_record
        if self.model is not None:
            self.model.merge(other.model)

    def max_drafts(self, k: int) -> list[int]:
        return [k] * len(self._rows)

    def behind(self) -> list[int] | None:
        return self.model.behind() if self.model is not None else None

    def limit_catch_up(self) -> None:
        if self.model is not None:
            self.model.limit_catch_up()

    def propose(self, k: int, context, uniforms, num_drafts) -> Proposal:
        tokens = torch.tensor([[self.draft_token(r, p + i) for i in range(k)] for r, p in zip(self._rows, self._pos)],
                              dtype=torch.long)
        if self.model is None:
            return Proposal(tokens, free=True)
        paid = self.model.propose(k, context, uniforms, num_drafts)
        return Proposal(tokens.to(paid.tokens.device), None, paid.catch_up_s, paid.catch_up_tokens, clean=paid.clean)

    def update(self, emitted: list[list[int]], kept: list[int], hidden=None) -> None:
        for b, row in enumerate(self._rows):
            record = self.continuations[row]
            start = self._pos[b]
            self.off_record += sum(t != record[j] for j, t in enumerate(emitted[b], start) if j < len(record))
            self._pos[b] += len(emitted[b])
        if self.model is not None:
            self.model.update(emitted, kept, hidden)

    def select_rows(self, rows: list[int]) -> None:
        self._rows = [self._rows[r] for r in rows]
        self._pos = [self._pos[r] for r in rows]
        if self.model is not None:
            self.model.select_rows(rows)

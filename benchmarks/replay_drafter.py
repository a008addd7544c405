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
from dataclasses import replace

import torch

from specdecode.backends.rows import RowChange
from specdecode.drafters.base import DraftChoice, DraftContext, Drafter, DraftOutcome, DraftOutlook, DraftRows, Proposal
from specdecode.drafters.model import ModelDrafter


class ReplayDrafter(Drafter):
    """Row i of a session (its row id, the order rows are added in) replays continuations[i]; where its next draft
    sits is how many tokens the row has emitted, read from its text."""

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

    def _count(self, row: int, start: int, emitted: list[int]) -> None:
        record = self.continuations[row]
        self.off_record += sum(t != record[j] for j, t in enumerate(emitted, start) if j < len(record))

    def relayout(self, change: RowChange) -> None:
        for text in change.appended:
            if text.id >= len(self.continuations):
                raise ValueError(f"row {text.id} joined, {len(self.continuations)} recorded continuations")
            self._count(text.id, 0, text.output)  # its first token
        if self.model is not None:
            self.model.relayout(change)

    def outlook(self, rows: DraftRows) -> DraftOutlook:
        drafts = [rows.widest] * len(rows.texts)
        if self.model is None:
            return DraftOutlook(drafts)
        paid = self.model.outlook(rows)
        return DraftOutlook(drafts, behind=paid.behind, probe_behind=paid.probe_behind, plan=paid)

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        tokens = torch.tensor([[self.draft_token(t.id, len(t.output) + i) for i in range(choice.k)]
                               for t in context.texts], dtype=torch.long)
        if self.model is None:
            return Proposal(tokens, free=True)
        paid = self.model.propose(replace(choice, outlook=choice.outlook.plan), context)
        return Proposal(tokens.to(paid.tokens.device), None, paid.catch_up_s, paid.catch_up_tokens, clean=paid.clean,
                        forward_calls=paid.forward_calls, plan=paid)

    def observe(self, outcome: DraftOutcome) -> None:
        for text, emitted in zip(outcome.texts, outcome.emitted):
            self._count(text.id, len(text.output), emitted)
        if self.model is not None:
            self.model.observe(replace(outcome, proposal=outcome.proposal.plan if outcome.proposal else None))

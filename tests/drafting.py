"""A drafter driven by hand, as a session drives it (relayout, outlook, propose, observe), from token lists: what
the tests of one drafter use instead of a session."""

from __future__ import annotations

from itertools import count

from specdecode.drafters import (DraftChoice, DraftContext, DraftOutcome, DraftOutlook, DraftRows, Proposal, RowChange,
                                 RowText)
from specdecode.exact.sampling import BatchSampling, SamplingParams


class Driver:
    """Rows join (join), leave (keep), draft (outlook, propose) and emit (observe), one verb at a time."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.texts: list[RowText] = []
        self.outlooks: DraftOutlook | None = None
        self.proposal: Proposal | None = None
        self._ids = count()

    def join(self, prompts, outputs=None) -> list[int]:
        """Rows of these prompts (and these first outputs; none by default) join after the others: their ids."""
        new = [RowText(next(self._ids), list(p), list(o)) for p, o in zip(prompts, outputs or [[] for _ in prompts])]
        self.drafter.relayout(RowChange(tuple(range(len(self.texts) + len(new))), tuple(new)))
        self.texts += new
        return [t.id for t in new]

    def part(self, drafter) -> "Driver":
        """A driver of another drafter (a part of this one) over the same rows."""
        other = Driver(drafter)
        other.texts = self.texts
        return other

    def keep(self, rows) -> None:
        """Only these rows (indices, in order) stay."""
        self.drafter.relayout(RowChange(tuple(rows)))
        self.texts = [self.texts[i] for i in rows]

    def outlook(self, k: int, ks=None, trees: bool = False, leaves=None) -> DraftOutlook:
        """The drafter's outlook with every row at K = k (or at its own ks)."""
        ks = list(ks) if ks is not None else [k] * len(self.texts)
        self.outlooks = self.drafter.outlook(DraftRows(self.texts, ks, k, trees, leaves))
        return self.outlooks

    def max_drafts(self, k: int, **kwargs) -> list[int]:
        return self.outlook(k, **kwargs).drafts

    def propose(self, k: int, k_rows=None, sampling=None, uniforms=None, trial: bool = False, **kwargs) -> Proposal:
        """k drafts per row (k_rows: each row's; default k), after the outlook at k unless one was just taken."""
        if self.outlooks is None:
            self.outlook(k, **kwargs)
        sampling = sampling or BatchSampling([SamplingParams(0.0)] * len(self.texts))
        context = DraftContext(self.texts, sampling, uniforms)
        k_rows = list(k_rows) if k_rows is not None else [k] * len(self.texts)
        self.proposal = self.drafter.propose(DraftChoice(self.outlooks, k_rows, k, trial), context)
        self.outlooks = None
        return self.proposal

    def observe(self, emitted, kept=None, hidden=None) -> None:
        """Each row emitted these tokens, of which the first kept[b] were its drafts (default none)."""
        kept = list(kept) if kept is not None else [0] * len(emitted)
        self.drafter.observe(DraftOutcome(self.texts, [list(e) for e in emitted], kept, self.proposal, hidden))
        for text, tokens in zip(self.texts, emitted):
            text.output.extend(tokens)
        self.proposal, self.outlooks = None, None


def asked(drafter) -> list[DraftRows]:
    """Every DraftRows the drafter's outlook is asked with from now on (what the session allows it each step: its
    rows' K, trees, leaves), recorded in the list returned."""
    seen, real = [], drafter.outlook

    def outlook(rows):
        seen.append(rows)
        return real(rows)

    drafter.outlook = outlook
    return seen

"""The one owner of which row runs where.

Four things hold per-row state of the running batch, all in the same row order: the target's cache (whose leaving
rows the prefix cache may park), the drafter (its model's KV, its suffix index), and the RowBatch (each row's host
state). Rows join (admission), leave (finished, cancelled) or move as one RowChange (backends/rows.py: after it the
rows are (rows before + appended)[keep]), which `RowLayout.apply` hands to every holder, always in that order.
"""

from __future__ import annotations

from ..backends.rows import RowChange, move_rows
from .row_batch import RowBatch


class RowLayout:
    """The running rows and every holder of their state: target (a backend), prefix_cache (a PrefixCache or None),
    drafter (or None), and `batch`, the RowBatch."""

    def __init__(self, target, prefix_cache, drafter, vocab_size: int):
        self.target, self.prefix_cache, self.drafter, self.vocab_size = target, prefix_cache, drafter, vocab_size
        self.batch = RowBatch.of([], vocab_size, target.device)

    def apply(self, change: RowChange, fork=None, appended: RowBatch | None = None) -> None:
        """Every holder takes the change, in one order. fork: the target's fork holding the appended rows' KV;
        appended: their RowBatch (both required when rows are appended)."""
        move_rows(self.target, change, self.batch.texts, self.prefix_cache, fork)
        if self.drafter is not None:
            self.drafter.relayout(change)
        self.batch = self.batch.apply(change, appended)

    def reset(self, broken: bool = False) -> None:
        """Every row leaves and the target's cache empties (nothing of it parked); broken: after a failed step, so
        the drafter keeps nothing of its caches either. Also what a new session starts with: a drafter may still
        hold rows of an earlier session that was left unfinished."""
        self.target.reset(0)
        if self.drafter is not None:
            self.drafter.relayout(RowChange((), broken=broken))
        self.batch = RowBatch.of([], self.vocab_size, self.target.device)

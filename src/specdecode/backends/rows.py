"""The running rows as the holders of per-row state see them: a row's text (RowText, the session's own token lists,
read in place) and one change of which rows run where (RowChange), which the target's cache, the prefix cache, the
drafter and the session's row batch all apply (engine/layout.py). `move_rows` applies it to a backend's cache.

A change is (keep, appended): after it the rows are (rows before + appended)[keep]. One value says a join (rows
appended; those that finished at their first token not kept), a leave (keep without them) or a reorder, so every
holder moves its rows by the same rule, in the same order, without being told each case apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True, eq=False)
class RowText:
    """One row's text, read where the session keeps it: a holder never copies it, and never writes to it."""

    id: int  # the session's row id (TokenEvent.row): a row's per-row state is keyed by it; never reused
    prompt: list[int]  # the prompt's token ids
    output: list[int]  # the tokens emitted so far; the session appends each step's after the step

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self) -> list[int]:
        """Prompt and output, as one new list."""
        return self.prompt + self.output

    def since(self, start: int) -> list[int]:
        """The tokens from position `start` on (what a cache that holds the first `start` lacks), in O(their count)."""
        cut = start - len(self.prompt)
        return self.output[cut:] if cut >= 0 else self.prompt[start:] + self.output

    def tail(self, n: int) -> list[int]:
        """The last n tokens (fewer in a shorter text)."""
        if n <= len(self.output):
            return self.output[len(self.output) - n:]
        return self.prompt[max(0, len(self) - n):] + self.output


@dataclass(frozen=True, slots=True)
class RowChange:
    """Rows joining, leaving or moving, as one value: after it the rows are (rows before + appended)[keep]."""

    keep: tuple[int, ...]  # [B'] indices into the rows before, then the appended rows, in their new order
    appended: tuple[RowText, ...] = ()  # [J] rows joining after the rows before (prompt prefilled, first token drawn)
    hidden: torch.Tensor | None = None  # [J, n, H] the target's last hidden states over the appended rows' prompts
    broken: bool = False  # after a failed step: caches may be half written, so nothing of them is kept for later

    def split(self, before: int) -> tuple[list[int], list[int]]:
        """(the rows before that stay, the appended rows that stay), each as indices into its own list, in keep's
        order."""
        return [i for i in self.keep if i < before], [i - before for i in self.keep if i >= before]

    def leaving(self, before: int) -> list[int]:
        """Indices into (rows before + appended) of the rows that do not stay, in that order."""
        kept = set(self.keep)
        return [i for i in range(before + len(self.appended)) if i not in kept]


def move_rows(backend, change: RowChange, before: Sequence[RowText], cache=None, fork=None,
              lendable: Sequence[bool] | None = None) -> None:
    """Apply a change to a backend's cache, whose rows are `before` (in order); `fork`: a fork of it holding the
    appended rows' KV (prompts prefilled), required when rows are appended. With a prefix cache the rows that leave
    are parked in it (their prefilled prompt lent to later prompts; rows[b] not lendable[b]: freed) instead of
    dropped, unless the change is broken. The rows before go first, then the fork's, which then merge."""
    kept_before, kept_appended = change.split(len(before))
    gone = [b for b in range(len(before)) if b not in set(kept_before)]
    if gone:
        if cache is not None and not change.broken:
            cache.park(backend, gone, [before[b].tokens() if lendable is None or lendable[b] else None for b in gone],
                       [len(before[b].prompt) for b in gone])
            kept_before = _ranks(kept_before)  # park() kept the others in their order
        else:
            backend.select_rows(kept_before)
            kept_before = list(range(len(kept_before)))
    if kept_before != list(range(len(kept_before))):
        backend.select_rows(kept_before)
    if change.appended:
        left = [j for j in range(len(change.appended)) if j not in set(kept_appended)]
        if cache is None or not left or change.broken:
            fork.select_rows(kept_appended)
        else:
            cache.park(fork, left, [change.appended[j].tokens() for j in left],
                       [len(change.appended[j].prompt) for j in left])
            if kept_appended != sorted(kept_appended):
                fork.select_rows(_ranks(kept_appended))
        if kept_appended:
            backend.merge(fork)
    order = [i for i in change.keep if i < len(before)] + [i for i in change.keep if i >= len(before)]
    if order != list(change.keep):  # appended rows placed among the rows before
        backend.select_rows([order.index(i) for i in change.keep])


def _ranks(indices: list[int]) -> list[int]:
    """Where each index sits among them sorted (the order to select once the others are gone)."""
    ranked = {i: r for r, i in enumerate(sorted(indices))}
    return [ranked[i] for i in indices]

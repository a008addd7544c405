"""Where a row's copy of its prompt stands: a cursor for SuffixDrafter's drafts from the row's own text.

An edit re-emits a file of the prompt in order, changing it here and there. The suffix search
(suffix_drafts.speculate) finds the longest match of the context's tail anywhere and follows the most frequent, then
the most recent, continuation: right inside a long unique match, wrong where the file repeats itself (two docstrings
that share a sentence, the indentation after every signature), where the most recent occurrence is usually a later
part of the file than the one being copied.

The cursor is the prompt position the copy has reached (`at`: the next token expected is log[at]). Of the places in
the WINDOW prompt tokens from `at` on where the context's tail matches, the longest match wins, the nearest on ties;
where it is as long as the search's best match, the draft is what follows it, longer after a short match than the
search's own (COPY_FACTOR, COPY_OFFSET). The cursor moves with what the row emits: along the copy it drafted from
(any token kept moves it), or to a prompt position the search's own draft came from once CONFIRM tokens of it were
kept (a single token copied from afar is as often chance).

Drafts stay deterministic and the cursor is a function of the row's own past (its tokens and where its steps fell),
never of a step's random numbers: the output keeps exactly the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .suffix_drafts import Draft, draft_limit
from .suffix_index import MAX_MATCH, SEP, TokenLog

WINDOW = 256  # prompt tokens from the cursor on searched for the copy's next match
CONFIRM = 2  # tokens kept of a draft copied from elsewhere in the prompt before the cursor moves there
_CANDIDATES = 64  # positions in the window read at most (the nearest)
# A cursor copy after a match of m tokens drafts up to m * COPY_FACTOR + COPY_OFFSET (the search's rule where that
# is longer): a copy the row has been following goes on past a short match far more often than a match found
# anywhere (the policy still chooses how much of it to verify; the measurements: docs/JOURNAL.md, "The copy cursor").
COPY_FACTOR, COPY_OFFSET = 2.0, 8.0


def _backward_match(tok, end: int, tail: list[int]) -> int:
    """How many tokens before position `end` of the log equal the tail's last ones (at most MAX_MATCH)."""
    m, longest = 0, min(len(tail), end, MAX_MATCH)
    while m < longest and tok[end - 1 - m] == tail[-1 - m]:
        m += 1
    return m


@dataclass
class CopyCursor:
    """One row's cursor (see the module docstring). prompt: the row's prompt length (log positions below it are
    the prompt). offered: the log position the step's draft copies from and whether it was the cursor's own (set by
    `draft`, read by `observe`)."""

    prompt: int
    at: int | None = None
    offered: tuple[int, bool] | None = None

    def draft(self, log: TokenLog, tail: list[int], k: int, own: Draft, factor: float, offset: float) -> Draft:
        """The row's own-context draft: the copy after the cursor where it matches as far back as the search's
        `own`, else `own`."""
        self.offered = (own.ends[0] + 1, False) if own.tokens and own.ends else None
        if self.at is None or k <= 0 or not tail:
            return own
        start, m = self._match_after(log, tail)
        if not m or m < own.match:
            return own
        tokens = log.following([start - 1], draft_limit(m, k, max(factor, COPY_FACTOR), max(offset, COPY_OFFSET)))[0]
        tokens = tokens[:tokens.index(SEP)] if SEP in tokens else tokens
        if not tokens:
            return own
        self.offered = (start, True)
        # Scored as the search's rule would cut it: against the history's drafts the longer copy claims nothing
        # more (an escaped document's copy of the same text goes on where the raw prompt's stops).
        score = float(min(len(tokens), draft_limit(m, k, factor, offset)))
        return Draft(tokens, score, m, [start - 1], limit=len(tokens))

    def _match_after(self, log: TokenLog, tail: list[int]) -> tuple[int, int]:
        """(start, m): the longest match of the tail ending just before a start in the window (the nearest of
        equals), and its length; m = 0 where none."""
        lo, hi = max(self.at, 1), min(self.at + WINDOW, self.prompt, log.size - 1)
        if hi <= lo:
            return 0, 0
        before = log._tok[lo - 1:hi - 1]  # the token before each start in [lo, hi)
        best, best_m = 0, 0
        for q in (np.flatnonzero(before == tail[-1])[:_CANDIDATES] + lo).tolist():
            m = _backward_match(log._tokv, q, tail)
            if m > best_m:
                best, best_m = q, m
        return best, best_m

    def observe(self, log: TokenLog, emitted: list[int]) -> None:
        """The step emitted these tokens (not yet in the log): the cursor follows them along the copy offered, or
        along its own position where nothing was."""
        offered, self.offered = self.offered, None
        start, own = offered if offered is not None else (self.at, True)
        if start is None or start >= self.prompt:
            return
        tok, size, n = log._tokv, log.size, 0
        while n < len(emitted) and start + n < size and tok[start + n] == emitted[n]:
            n += 1
        if n >= (1 if own else CONFIRM):
            self.at = start + n

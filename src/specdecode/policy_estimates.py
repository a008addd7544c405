"""The estimates the speculation policy keeps (policy.py decides with them): a row's decayed acceptance evidence,
a cost as the median of recent timings, and Leviathan et al.'s expected tokens and speedup."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Mapping, Sequence

SHRINK = 4.0               # pseudo-observations a coarser estimate is worth
COST_WINDOW = 15           # a cost is the median of its last 15 timings: stalls (GC, another process) are not trends
WARM_SAMPLES = 2           # the first timings of a shape may include a warm-up: keep their minimum, and count a
                           # K as untried (worth exploring) until it has this many


class RowState:
    """One row's decayed acceptance evidence: accepted[i] / seen[i] estimates a_{i+1}."""

    __slots__ = ("accepted", "seen", "cap", "behind", "probe_behind", "remaining", "draft_class")

    def __init__(self, max_k: int):
        self.accepted = [0.0] * max_k
        self.seen = [0.0] * max_k
        self.cap: int | None = None  # this step's cap, remembered by choose() for observe()
        # Set by Policy.decide from the step's Outlook: tokens the draft would feed before drafting for this row (its backlog),
        # what a probe would feed (the backlog bounded by the drafter's window), and tokens the row still wants.
        self.behind = self.probe_behind = 0
        self.remaining: int | None = None
        self.draft_class: int | None = None  # this step's draft class (Outlook.classes)


class Cost:
    """A measured cost in seconds: the median of the last COST_WINDOW timings (the minimum of the first two, which
    may include a warm-up), so stalls on a shared machine do not bias it and it still follows a drift."""

    __slots__ = ("value", "count", "_recent")

    def __init__(self):
        self.value, self.count = 0.0, 0
        self._recent: deque[float] = deque(maxlen=COST_WINDOW)

    def add(self, seconds: float) -> None:
        self.count += 1
        self._recent.append(seconds)
        self.value = min(self._recent) if self.count <= WARM_SAMPLES else statistics.median(self._recent)

    def restart(self) -> None:
        """Forget the timings: the next ones are taken as a new shape's (their minimum while warming up)."""
        self.count = 0
        self._recent.clear()


def scale_evidence(counts: list[list[float]], factor: float) -> None:
    for c in counts:
        c[:] = [x * factor for x in c]


def record_outcome(row_or_batch: RowState, drafted: int, kept: int) -> None:  # or a Policy: the batch's evidence
    """Positions 1..kept were accepted and kept+1 rejected (if drafted); later ones were never tried."""
    for i in range(min(kept + 1, drafted)):
        row_or_batch.seen[i] += 1.0
        row_or_batch.accepted[i] += i < kept


def shrunk(accepted: float, seen: float, prior: float) -> float:
    return (accepted + SHRINK * prior) / (seen + SHRINK)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(K) = 1 + sum_{j<=K} prod_{i<=j} a_i: tokens a step with K drafts yields (the 1 is the resampled or bonus
    token), with a_i the acceptance of draft i given drafts 1..i-1 were kept."""
    if not 0 <= k <= len(acceptance):
        raise ValueError(f"K={k} needs acceptance for positions 1..{k}, got {len(acceptance)}")
    tokens, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        tokens += run
    return tokens


def expected_speedup(acceptance: Sequence[float], k: int, draft_step: float, verify: Mapping[int, float]) -> float:
    """Leviathan et al.'s speedup over plain decoding with measured costs: E(K) / (K c + v(K+1)), where c (draft_step)
    and v(n) (verify[n], a target forward of n tokens) are in target steps, so a plain step costs v(1) = 1."""
    return expected_tokens(acceptance, k) / (k * draft_step + verify[k + 1])

"""The estimates the speculation policy keeps (policy.py decides with them): a row's decayed acceptance evidence,
a cost as the median of recent timings, Leviathan et al.'s expected tokens and speedup, and PolicyEstimates, what a
policy has measured (acceptance per position, row and draft class; costs per batch size) and what it predicts."""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

SHRINK = 4.0               # pseudo-observations a coarser estimate is worth
COST_WINDOW = 15           # a cost is the median of its last 15 timings: stalls (GC, another process) are not trends
WARM_SAMPLES = 2           # the first timings of a shape may include a warm-up: keep their minimum, and count a
                           # K as untried (worth exploring) until it has this many
PRIOR_ACCEPTANCE = 0.7     # before any evidence; drives only the first step or two
PRIOR_DRAFT_STEPS = 0.3    # an unmeasured draft step, in target steps
PRIOR_VERIFY_SLOPE = 0.15  # an unmeasured forward of n tokens is 1 + 0.15 (n - 1) target steps (a GPU's shape)
CPU_VERIFY_SLOPE = 0.5     # ... a CPU's (CostPrior.cpu): 2-core CPUs measured 0.43-0.72 a token for a 1.5B model
DECAY = 0.97               # evidence kept per step: a half-life of ~23 steps (~60 tokens at 3 tokens a step)
PRIOR_CATCH_UP = 0.2       # an unmeasured catch-up, in draft steps per token fed


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


@dataclass(frozen=True)
class CostPrior:
    """What a step costs before the policy has timed it, in target steps: v(n), a target forward of n tokens, and a
    draft step. The defaults are a GPU's shape (verifying a few tokens costs about one step); a CPU's is much
    steeper (2 tokens 1.6-1.7 steps on 2 cores), so there the defaults spend a run's first steps on drafts that
    cannot pay. `verify` holds a machine's measured (n, v(n)) points (the costs `--draft auto` recorded for this
    target, pairing/draft_choice.py): between them v is interpolated, past the last extended along the last two.
    Without them v is a line of `slope`: `cpu()` is a CPU's shape, which the CLI starts a real model from where
    nothing is recorded (pairing.pair.recorded_cost_prior): it decodes plainly until its explorations, bounded by
    their catch-up's budget, time the curve."""

    verify: tuple[tuple[int, float], ...] = ()
    draft_step: float = PRIOR_DRAFT_STEPS
    slope: float = PRIOR_VERIFY_SLOPE  # v(n) = 1 + slope (n - 1) where fewer than two points are given

    def __post_init__(self):
        points = dict(self.verify)
        if any(n < 1 or v <= 0 for n, v in points.items()) or not self.draft_step > 0 or not self.slope >= 0:
            raise ValueError(f"a cost prior needs v(n) > 0 for n >= 1, a draft step > 0 and a slope >= 0, got {self}")
        # read by the policy on every step: built once
        object.__setattr__(self, "_points", points)
        object.__setattr__(self, "_ns", sorted(points))

    @classmethod
    def measured(cls, verify: Mapping[int, float], draft_step: float | None = None) -> "CostPrior":
        return cls(tuple(sorted({1: 1.0, **{int(n): float(v) for n, v in verify.items()}}.items())),
                   PRIOR_DRAFT_STEPS if draft_step is None else float(draft_step))

    @classmethod
    def cpu(cls) -> "CostPrior":
        return cls(slope=CPU_VERIFY_SLOPE)

    def verify_steps(self, n: int) -> float:
        points, ns = self._points, self._ns
        if len(points) < 2:
            return points.get(1, 1.0) * (1.0 + self.slope * (n - 1))
        if n in points:
            return points[n]
        i = bisect.bisect(ns, n)
        lo, hi = (ns[i - 1], ns[i]) if 0 < i < len(ns) else (ns[-2], ns[-1]) if i else (ns[0], ns[1])
        line = points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
        return max(line, points[ns[-1]]) if n > ns[-1] else line  # never cheaper than fewer tokens


class PolicyEstimates:
    """The acceptance and cost estimates a speculation policy keeps (policy.Policy decides with them): evidence of
    acceptance per position for the batch, per row and per draft class, timed costs per batch size, and what a step
    of K drafts is expected to yield and cost. observe() records a step."""

    def __init__(self, max_k: int, decay: float = DECAY, prior: CostPrior | None = None,
                 class_prior: Sequence[float] | None = None):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if class_prior is not None and (not class_prior or not all(0.0 < a < 1.0 for a in class_prior)):
            raise ValueError(f"class_prior needs an acceptance in (0, 1) per draft class, got {class_prior!r}")
        # per draft class, the acceptance assumed before its drafts were verified (Drafter.class_acceptance; a class
        # past the last takes the last's); None: the batch's pooled rate, which mixes every class's
        self.class_prior = None if class_prior is None else tuple(float(a) for a in class_prior)
        self.max_k = max_k
        self.decay = decay
        self.prior = prior or CostPrior()  # costs before any timing (in target steps), and the curve's shape
        self.accepted, self.seen = [0.0] * self.max_k, [0.0] * self.max_k  # the batch's evidence
        self._verify: dict[int, dict[int, Cost]] = {}  # batch size -> tokens -> seconds
        self._draft: dict[int, Cost] = {}  # batch size -> seconds per draft step
        self._catch_up = Cost()  # seconds per token a draft feeds when it catches up
        self._histogram: dict[int, int] = {}
        self._free_drafts = False  # the current decision's drafts run no model forward (Outlook.free)
        self._classes: dict[int, RowState] = {}  # draft class -> its acceptance evidence (Outlook.classes)
        self.fixed_costs = False  # the costs are the prior's, in target steps, not timings (Policy: fixed_costs)

    def _evidence(self, row: RowState) -> RowState:
        """Where a row's acceptance is counted: its draft class's evidence, or its own."""
        if not isinstance(row, RowState) or row.draft_class is None:
            return row
        return self._classes.setdefault(row.draft_class, RowState(self.max_k))

    # ------------------------------------------------------------------ after a step
    def observe(self, rows: list[RowState], k: int, accepted: list[int], batch_size: int,
                draft_seconds: float | None, verify_seconds: float | None, drafted: list[int] | None = None,
                free: bool | None = None) -> None:
        """Record a step: k drafts (0 = plain step), accepted[b] of row b's drafts kept, its timings.

        drafted[b] is how many drafts row b got; by default min(k, the cap choose() was given for it).
        draft_seconds None: the drafting time was not a clean sample (the draft first caught up on the tokens of
        plain steps, a one-off cost): the draft cost is not updated from it. free (by default the Outcome's that
        learn() is recording): no model forward drafted (suffix+MODEL copying every row), no draft cost to learn."""
        drafted = self._drafted(rows, k, accepted, batch_size, draft_seconds, verify_seconds, drafted)
        self._histogram[k] = self._histogram.get(k, 0) + 1
        if verify_seconds is not None:  # None: a cold forward (a graph captured), no sample of the step's cost
            self._verify.setdefault(batch_size, {}).setdefault(k + 1, Cost()).add(verify_seconds)
        if k == 0:
            return
        free = self._free_drafts if free is None else free
        if draft_seconds is not None and not free:
            self._draft.setdefault(batch_size, Cost()).add(draft_seconds / k)
        scale_evidence([self.accepted, self.seen], self.decay)  # the batch decays once per step, not once per row
        for row, n, kept in zip(rows, drafted, accepted):
            if n:
                evidence = self._evidence(row)
                scale_evidence([evidence.accepted, evidence.seen], self.decay)
                record_outcome(evidence, n, kept)
                record_outcome(self, n, kept)

    def _drafted(self, rows, k, accepted, batch_size, draft_seconds, verify_seconds, drafted) -> list[int]:
        """Checks an observation before anything is recorded; returns each row's number of drafts."""
        if not 0 <= k <= self.max_k or len(accepted) != len(rows) or len(drafted or rows) != len(rows):
            raise ValueError(f"observe() got k={k} (max_k={self.max_k}) and {len(rows)} rows, {len(accepted)} "
                             f"accepted counts: pass one count per row and a k in 0..max_k")
        if batch_size < 1 or (draft_seconds is not None and draft_seconds < 0) or \
                (verify_seconds is not None and verify_seconds < 0):
            raise ValueError("observe() needs batch_size >= 1 and non-negative timings")
        if drafted is None:
            drafted = [k if row.cap is None else min(k, row.cap) for row in rows]
        for n, kept in zip(drafted, accepted):
            if not 0 <= kept <= n <= k:
                raise ValueError(f"a row kept {kept} drafts out of {n} (k={k}): accepted[b] counts row b's kept "
                                 f"drafts")
        return drafted

    # ------------------------------------------------------------------ estimates
    def batch_acceptance(self) -> list[float]:
        """a_1..a_max_k for the batch as a whole."""
        pooled = shrunk(sum(self.accepted), sum(self.seen), PRIOR_ACCEPTANCE)
        return [shrunk(a, s, pooled) for a, s in zip(self.accepted, self.seen)]

    def expected_tokens(self, row: RowState, batch: list[float] | None = None) -> list[float]:
        """E(k) for k = 0..max_k: the new tokens row expects from a step with k drafts (from its draft class's
        evidence where it has one)."""
        evidence, priors = self._evidence(row), batch or self.batch_acceptance()
        if evidence is not row:  # a class: shrunk to its own pooled rate, which is shrunk to its prior
            pooled = shrunk(sum(evidence.accepted), sum(evidence.seen), self._class_prior(row.draft_class))
            priors = [pooled] * len(priors)
        gains, run = [1.0], 1.0
        for a, s, prior in zip(evidence.accepted, evidence.seen, priors):
            run *= shrunk(a, s, prior)
            gains.append(gains[-1] + run)
        return gains

    def _class_prior(self, draft_class: int) -> float:
        """What a class's acceptance is shrunk to: its prior where the drafter gave one, else the batch's pooled rate.
        (After a run of short matches' misses the batch's rate is low, and a class of long matches, never tried,
        would never be: its copies kept ~90 % of the time went undrafted on novel code.)"""
        if self.class_prior is not None:
            return self.class_prior[min(draft_class, len(self.class_prior) - 1)]
        return shrunk(sum(self.accepted), sum(self.seen), PRIOR_ACCEPTANCE)

    def verify_cost(self, n: int, batch_size: int, borrow: bool = True) -> float:
        """Seconds (or prior target steps, before any timing) of a target forward of n tokens."""
        points = self._verify.get(batch_size)
        shape = self._shape if borrow else lambda m, _: self.prior.verify_steps(m)
        if not points:
            return shape(n, batch_size)
        if n in points:
            return points[n].value
        lo = max((m for m in points if m < n), default=None)
        hi = min((m for m in points if m > n), default=None)
        if lo is not None and hi is not None:
            return points[lo].value + (points[hi].value - points[lo].value) * (n - lo) / (hi - lo)
        near = lo if lo is not None else hi
        return points[near].value * shape(n, batch_size) / shape(near, batch_size)

    def _shape(self, n: int, batch_size: int) -> float:
        """The curve to scale where this batch size has no timing: the nearest measured batch size's, or the prior."""
        others = [b for b in self._verify if b != batch_size]
        if not others:
            return self.prior.verify_steps(n)
        return self.verify_cost(n, min(others, key=lambda b: (abs(b - batch_size), b)), borrow=False)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft fed `tokens` tokens (over all rows) in `seconds` before drafting: the price of leaving it idle."""
        if tokens > 0 and seconds >= 0:
            self._catch_up.add(seconds / tokens)

    def catch_up_cost(self, tokens: int) -> float:
        per_token = self._catch_up.value if self._catch_up.count else PRIOR_CATCH_UP * self.draft_cost(1)
        return tokens * per_token

    def draft_cost(self, batch_size: int) -> float:
        if batch_size in self._draft:
            return self._draft[batch_size].value
        if self._draft:
            near = min(self._draft, key=lambda b: (abs(b - batch_size), b))
            ratio = self._draft[near].value / max(self.verify_cost(1, near), 1e-12)
        else:
            ratio = self.prior.draft_step
        return ratio * self.verify_cost(1, batch_size)

    def step_time(self, k: int, batch_size: int, free: bool | None = None) -> float:
        """Seconds of a step with k drafts; free (by default the current decision's Outlook.free): drafts cost 0."""
        free = self._free_drafts if free is None else free
        drafting = 0.0 if free else k * self.draft_cost(batch_size)
        return max(drafting + self.verify_cost(k + 1, batch_size), 1e-12)

    def figures(self) -> dict:
        """The numbers behind the choices, at the batch size timed most: costs in target steps (a plain step = 1),
        the recent acceptance, and the expected speedup of each K by Leviathan's formula at those numbers.

        draft_step_cost and verify_cost are estimates (the priors, scaled) where the flags say unmeasured;
        acceptance_rate is None before any draft was verified."""
        batch = self._main_batch()
        plain = self.verify_cost(1, batch)
        timed = self._verify.get(batch, {})
        verify = {n: self.verify_cost(n, batch) / plain for n in range(1, self.max_k + 2)}
        draft_step = self.draft_cost(batch) / plain
        acceptance = self.batch_acceptance()
        speedups = {k: expected_speedup(acceptance, k, draft_step, verify) for k in range(1, self.max_k + 1)}
        best = max(speedups, key=speedups.__getitem__, default=0)  # ties go to the smaller K
        seen = sum(self.seen)
        return {
            "batch_size": batch, "target_step_s": timed[1].value if 1 in timed and not self.fixed_costs else None,
            "draft_step_cost": draft_step, "draft_step_measured": batch in self._draft,
            "verify_cost": verify, "verify_measured": sorted(n for n in timed if n <= self.max_k + 1),
            "acceptance_rate": sum(self.accepted) / seen if seen else None, "acceptance_evidence": seen,
            "speedup_by_k": speedups, "best_k": best, "expected_speedup": speedups.get(best, 1.0),
        }

    def _main_batch(self) -> int:
        """The batch size with the most timed forwards (1 before any timing)."""
        counts = {b: sum(c.count for c in points.values()) for b, points in list(self._verify.items())}
        return max(counts, key=lambda b: (counts[b], -b), default=1)


def modelled_costs(prior: CostPrior, outcome) -> dict:
    """A step's costs as the prior models them, in target steps, for the timings of an Outcome (a policy with fixed
    costs): a forward of the step's tokens (B rows of k + 1) costs v(B (k + 1)), a draft step of B rows c v(B), a
    token a draft catches up on PRIOR_CATCH_UP c. None stays None (no sample). No clock is read."""
    batch, k = outcome.batch_size, outcome.k
    return {"verify_s": None if outcome.verify_s is None else prior.verify_steps(batch * (k + 1)),
            "draft_s": None if outcome.draft_s is None else k * prior.draft_step * prior.verify_steps(batch),
            "catch_up_s": outcome.catch_up_tokens * PRIOR_CATCH_UP * prior.draft_step if outcome.catch_up_s else 0.0}

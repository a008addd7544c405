"""How many tokens to draft before each step: K chosen online to maximise expected new tokens per second.

The model. A step with K drafts costs  time(K) = K * c(B) + v(K + 1, B)  seconds, where c(B) is one draft step (0 on a
step whose drafts run no model: Outlook.free) and v(n, B) one target forward of n tokens for a batch of B rows. Both
are learned from the loop's own timings (or modelled by the prior: fixed costs, below), per batch size (machine, backend, dtype and B all change them). A cost never
measured for this B is estimated: linearly between measured n; outside them (or with nothing measured) by the shape of
the nearest measured batch size, else of the prior (CostPrior: v(n) = 1 + 0.15 (n - 1) target steps, a GPU's shape,
this machine's curve where `--draft auto` recorded one for the target, or 1 + 0.5 (n - 1) for a real model on a CPU
without one), scaled to the nearest measured point; an unmeasured draft step is the prior's (0.3 target steps, or the
recorded one for this draft model). Row b drafting k tokens with conditional acceptances a_1..a_k (a_i = P(draft i
kept | drafts 1..i-1 kept)) yields  E_b(k) = 1 + sum_{j<=k} prod_{i<=j} a_i  tokens (the 1 is the resampled or bonus
token). The policy picks the K in 0..max_k maximising  sum_b E_b(min(K, cap_b)) / time(K); with a constant a this is
Leviathan et al.'s (1 - a^(K+1)) / ((1 - a)(K c + v(K+1))). K = 0 is a plain step.

Acceptance is counted per position, per row and for the whole batch, with exponential forgetting so the
estimate follows the text (code inside prose, a change of topic). A row that kept n of its k drafts shows
positions 1..n accepted and position n+1 rejected (when n < k); later positions were never tried and are not
counted. A position with little evidence leans on a coarser estimate (shrinkage): row -> batch at that position
-> batch pooled over positions -> a prior of 0.7, so a new row, or a deep position, is not clueless.

Draft classes. A copying drafter knows before each step how good its draft is likely to be (DraftOutlook.classes,
the match length bucketed): a copy after a 16-token match is kept nearly always, after a 1-token match rarely. A
classed draft's acceptance is learned per class (class at that position -> class pooled -> the drafter's prior for
the class, else the batch's), so the policy drafts after long matches and decodes plainly after short ones. A class
is a function of the context (drafts are deterministic), so K stays a function of what is known before the step.

Long copies. A step whose drafts all run no model (Outlook.free: every row copies) may verify up to max_copy_k tokens,
a model's at most max_k: a copy after a long match (a file re-emitted with a rename) is kept nearly whole, and a
65-token verification on a 2-core CPU costs far less than 65 steps (~34 on an AMD EPYC). Past max_k only COPY_GRID's
K are explored, costs between them interpolated; deep positions' acceptance leans on the class's pooled rate.

Plain steps and probes. When no K pays the policy decodes plainly (it stops speculating only when plain steps look
5 % faster, so a noisy dip in the estimates does not stop it; that margin holds only while the draft classes are the
last speculating step's: a short match after a long one is another bet, judged on its own) and probes, with the K
most likely to pay, after 8 plain steps; each failed probe doubles the wait (16, 32, ... 256). A probe that makes the draft catch up (a model that has not read the plain steps' tokens)
also waits until its cost, that catch-up plus what its step is expected to lose against plain steps, is at most 1 %
of the plain decoding time since the last trial and of the plain time the rows' remaining tokens will take, where
their lengths are known (a probe near the end has no tokens left to pay it back); an exploration from plain steps
waits the same way (its step priced at the lower bound that made it worth trying). A probe that beat a plain step is evidence the text has changed: the old evidence is cut to 30 % and the
probe is repeated at once, so a draft that agrees again gets speculation back within a few steps of the next probe;
as soon as the estimates say a K pays the wait is reset to 8.

Settling. Where even full acceptance cannot beat plain decoding at the measured costs (max over K of
(K + 1) / (K c + v(K + 1)) <= 1, v extrapolated along its measured slope beyond the timed n), no text can make a
draft pay: the policy settles (`settled`): choose() returns 0 at once and the loop asks the drafter nothing and
feeds it nothing. Every SETTLED_STEPS steps it re-checks: only where a plain step's cost moved by more than
RECHECK_DRIFT (the machine's load changed) does one probe re-time the draft and a verification. Only a policy whose
drafts all come from a model settles (`model_drafts`): suffix+MODEL's copies can pay where its model cannot.

Exploring costs. A K whose verification was never timed for this batch size is tried when, costed at a lower
bound (no cheaper than a shorter forward measured, nor than 1/m of a longer one of m tokens, nor than 85 % of what
a curve measured on this machine predicts), it could beat the best estimate; so a wrong prior cannot lock in a bad
K, and a recorded one spares a CPU the explorations that cannot pay there. Timings are robust to warm-up and stalls
(estimates.Cost; a K counts as untried until it has WARM_SAMPLES timings).

Losslessness. K (and each row's cap) is a function of what is known before the step's drafts are drawn: past
acceptance and past timings. Given the prefix, every token a step emits has the target's distribution whatever K
was fixed beforehand, so any such rule keeps the output distribution exact; the policy never sees the current
step's drafts or target output. Seeded sampled rows are drawn by Gumbel-max coupling (sampling.BatchSampling),
whose draw does not depend on K. Fixed costs (fixed_costs, the CLI's and server's default on a CPU): the prior's
costs stand for every timing (estimates.modelled_costs), so K, and with it each forward's size (which changes a
llama.cpp logit's rounding), is a function of the tokens: the same request gives the same text, run after run.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

from .estimates import DECAY, WARM_SAMPLES, CostPrior, modelled_costs, PolicyEstimates, RowState, scale_evidence
from .speculation import MAX_COPY_K, Speculation

PROBE_FORGET = 0.3         # evidence kept when a probe pays: the text has changed since it was gathered
MARGIN = 0.05              # speculation stops only when plain steps look 5 % faster: a noisy dip must not stop it
PROBE_FIRST, PROBE_MAX = 8, 256
CEILING_ACCEPTANCE = 0.95  # the best acceptance a probe could find; if even that cannot pay, probing is waste
PRIOR_TRUST = 0.85         # a recorded v(n) (CostPrior.verify) may be this far off today: untried K are explored
                           # only where they could pay at 85 % of it
TRIAL_BUDGET = 0.01        # a probe or an exploration from plain steps may cost (its draft's catch-up and its step's
                           # expected loss) up to 1 % of the plain decoding time since the last one, and of the plain
                           # time the rows' remaining tokens take
REFRESH_STEPS = 128        # speculating this long without a plain step: time plain steps afresh (only they can)
THIN_EVIDENCE = 10         # an explanation counts the drafts behind an acceptance measured on fewer than this
SETTLED_STEPS = 1024       # steps of plain decoding, with nothing drafted or probed, once no draft could ever pay
RECHECK_DRIFT = 0.25       # ... after which a probe re-times the draft if a plain step's cost moved this much
COPY_GRID = (12, 16, 24, 32, 48, 64)  # K past max_k whose verification is explored (timed); between them v(n) is
                           # interpolated, so a long copy does not cost an exploration for every K up to max_copy_k


@dataclass(slots=True)  # built every step: not frozen (a frozen dataclass costs ~3 us more to build)
class Outlook:
    """Everything the loop tells the policy before a step, in one value (known before any draft is drawn)."""

    rows: list  # [B] each row's state (Policy.new_row())
    caps: list[int]  # [B] drafts row b can use at most (0..max_k)
    free: bool = False  # the drafts will run no model forward (suffix+MODEL copying every row): priced at zero
    classes: list[int | None] | None = None  # [B] the class of row b's draft (DraftOutlook.classes); None: none
    behind: list[int] | None = None  # [B] tokens the draft feeds for row b before drafting; None: never behind
    probe_behind: list[int] | None = None  # [B] what a probe would feed (behind, bounded by the drafter's window)
    remaining: list[int] | None = None  # [B] tokens row b still wants


@dataclass(slots=True)
class Choice:
    """The policy's answer: one K for the batch (row b drafts min(k, caps[b])), and whether it is a trial."""

    k: int
    trial: bool = False  # a probe or an exploration: the drafter may bound the catch-up it feeds (still exact)


@dataclass(slots=True)
class Outcome:
    """What a step did, for the rows whose K the policy chose (rows with a fixed K or a forced run left out)."""

    rows: list  # [R] their states; empty: the step taught nothing the policy asked (catch-up timing aside)
    k: int  # the step's drafts (0: a plain step)
    accepted: list[int]  # [R] drafts row r kept
    drafted: list[int]  # [R] drafts row r was given
    batch_size: int  # rows in the step's forward
    draft_s: float | None  # seconds drafting took; None: not a draft step's cost (fed a backlog with its drafts)
    verify_s: float | None  # seconds of the target's forward and the verification; None: a cold forward (no sample)
    free: bool = False  # no model forward drafted (Proposal.free): no draft step's cost to learn
    catch_up_tokens: int = 0  # tokens the draft fed before drafting, timed apart (Proposal.catch_up_*)
    catch_up_s: float = 0.0


class Policy(PolicyEstimates, ABC):
    """What both policies share: the estimates, the loop's two calls and summary(). Subclasses choose."""

    name = "policy"
    adaptive = False  # whether K follows measurements (the loop then draws seeded sampled rows by coupling)
    settled = False  # whether it decodes plainly without looking (AdaptivePolicy: Settling): the drafter is not asked
    model_drafts = False  # every draft comes from a model (the loop reads Drafter.drafts_from_model): it may settle

    def __init__(self, max_k: int, decay: float = DECAY, prior: CostPrior | None = None, class_prior=None,
                 fixed_costs: bool = False):
        super().__init__(max_k, decay, prior, class_prior)
        self.fixed_costs = fixed_costs  # costs are the prior's, never timed (modelled_costs): same tokens, same K
        self.model_k = max_k  # the widest step of a model's drafts (AdaptivePolicy: copies may go further)
        self.probes = self.explorations = self.refreshes = 0
        self.trial = False  # whether the last choose() was a probe or an exploration (decide() reports it)

    def new_row(self) -> RowState:
        return RowState(self.max_k)

    # ------------------------------------------------------------------ the loop's two calls
    def decide(self, outlook: Outlook) -> Choice:
        """The one question before a step: the outlook in, a K out. The rows' states take the outlook's facts (a
        user's policy with other row states keeps its own), then choose() picks K from the estimates."""
        for b, row in enumerate(outlook.rows):
            if not isinstance(row, RowState):
                continue
            if outlook.classes is not None:  # a long match's copy is worth more than a short one's
                row.draft_class = outlook.classes[b]
            if outlook.behind is not None:  # what a draft's catch-up would cost
                row.behind, row.probe_behind = outlook.behind[b], outlook.probe_behind[b]
                row.remaining = outlook.remaining[b]
        self._free_drafts = outlook.free
        k = self.choose(outlook.rows, outlook.caps)
        return Choice(k, bool(k) and self.trial)

    def learn(self, outcome: Outcome) -> None:
        """The one observation after a step: its catch-up cost, then (if it served rows the policy chose for) the
        drafts kept and the step's timings (fixed_costs: the prior's costs of that step instead)."""
        if self.fixed_costs:
            outcome = replace(outcome, **modelled_costs(self.prior, outcome))
        if outcome.catch_up_s:
            self.observe_catch_up(outcome.catch_up_tokens, outcome.catch_up_s)
        if outcome.rows:
            self._free_drafts = outcome.free
            self.observe(outcome.rows, outcome.k, outcome.accepted, outcome.batch_size, outcome.draft_s,
                         outcome.verify_s, outcome.drafted)

    @abstractmethod
    def choose(self, rows: list[RowState], caps: list[int]) -> int:
        """One K for the batch, in 0..max_k; row b then drafts min(K, caps[b])."""

    def _remember(self, rows: list[RowState], caps: list[int]) -> int:
        """Stores each row's cap for observe(); returns the largest K any row can use."""
        if len(rows) != len(caps) or any(cap < 0 for cap in caps):
            raise ValueError(f"choose() got {len(rows)} rows and caps {caps}: pass one cap >= 0 per row")
        for row, cap in zip(rows, caps):
            row.cap = cap
        return min(self.max_k, max(caps, default=0))

    def summary(self) -> dict:
        """JSON-able: the K histogram, probes, and the current cost and acceptance estimates."""
        steps = sum(self._histogram.values())
        figures = self.figures()
        return {
            "policy": self.name, "max_k": self.max_k, "steps": steps,
            "k_histogram": dict(sorted(self._histogram.items())),
            "plain_steps": self._histogram.get(0, 0),
            "mean_k": sum(k * n for k, n in self._histogram.items()) / steps if steps else 0.0,
            "probes": self.probes, "explorations": self.explorations, "refreshes": self.refreshes,
            "acceptance": [round(a, 4) for a in self.batch_acceptance()],
            "class_acceptance": {c: round(sum(e.accepted) / sum(e.seen), 4) for c, e in sorted(self._classes.items())
                                 if sum(e.seen)},
            "costs": {b: {"draft_s": self._draft[b].value if b in self._draft else None,
                          "verify_s": {n: m.value for n, m in sorted(self._verify[b].items())}}
                      for b in sorted(self._verify)},
            **figures, "explanation": self._explain(figures),
        }

    def explain(self) -> str:
        """One line: what the policy decided, the costs and acceptance it measured, and what they predict."""
        return self._explain(self.figures())

    def _explain(self, figures: dict) -> str:
        steps = dict(self._histogram)
        total = sum(steps.values())
        if not total:
            return "no steps yet"
        return f"{self._decision(steps, total)}: {self._measured(figures)}"

    def _decision(self, steps: dict, total: int) -> str:
        plain = steps.get(0, 0)
        if plain * 2 >= total:
            probes = f" ({self.probes} probe{'s' * (self.probes != 1)})" if self.probes else ""
            return f"plain decoding on {plain} of {total} steps{probes}"
        mean_k = sum(k * n for k, n in steps.items()) / (total - plain)
        return f"speculating on {total - plain} of {total} steps (mean K {mean_k:.1f})"

    def _measured(self, figures: dict, k: int | None = None) -> str:
        """The costs at K (the best K by default) and the speedup the measured acceptance gives there."""
        k = figures["best_k"] if k is None else k
        n = k + 1
        draft = f"draft step {figures['draft_step_cost']:.2f} of a target step" + \
            ("" if _timed(figures, draft=True) else " (not yet timed)")
        verify = f"verifying {n} tokens {figures['verify_cost'][n]:.2f} steps" + \
            ("" if _timed(figures, n) else " (not yet timed)")
        rate = figures["acceptance_rate"]
        if rate is None:
            return f"{draft}, {verify}; no draft verified yet"
        speedup = figures["speedup_by_k"][k]
        verb = "gives" if speedup >= 1 else "would give"
        drafts = round(figures["acceptance_evidence"])
        thin = f" ({drafts} draft{'s' * (drafts != 1)} so far)" if drafts < THIN_EVIDENCE else ""
        return f"{draft}, {verify}; at the measured {100 * rate:.0f} % acceptance{thin} K={k} {verb} {speedup:.2f}×"


def _timed(figures: dict, n: int = 1, draft: bool = False) -> bool:
    """Whether a cost in target steps rests on timings: its own, and the plain step's it is divided by."""
    timed = set(figures["verify_measured"])
    return 1 in timed and (figures["draft_step_measured"] if draft else n in timed)


class FixedPolicy(Policy):
    """Always K (0 = plain decoding), as the caps allow. Measures costs and acceptance all the same, for summary()."""

    name = "fixed"

    def __init__(self, k: int, decay: float = DECAY, prior: CostPrior | None = None, fixed_costs: bool = False):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"FixedPolicy needs an integer K >= 0, got {k!r}")
        super().__init__(k, decay, prior, fixed_costs=fixed_costs)
        self.k = k

    def choose(self, rows: list[RowState], caps: list[int]) -> int:
        return self._remember(rows, caps)

    def figures(self) -> dict:
        figures = super().figures()
        figures["expected_speedup"] = figures["speedup_by_k"].get(self.k, 1.0)  # at the K it was told to use
        return figures

    def _explain(self, figures: dict) -> str:
        total = sum(self._histogram.values())
        if not total:
            return "no steps yet"
        if self.k == 0:
            return f"plain decoding (K fixed at 0) on {total} steps: nothing drafted"
        line = f"fixed K={self.k} on {total} steps: {self._measured(figures, self.k)}"
        best = figures["best_k"]
        if figures["acceptance_rate"] is not None and best != self.k:
            estimated = "" if _timed(figures, best + 1) else " at estimated costs"
            line += f" (K={best} would give {figures['speedup_by_k'][best]:.2f}×{estimated})"
        return line


class AdaptivePolicy(Policy):
    """K in 0..max_k maximising expected new tokens per second, from measured acceptance and costs."""

    name = "adaptive"
    adaptive = True

    def __init__(self, max_k: int = 8, decay: float = DECAY, probe_forget: float = PROBE_FORGET, margin: float = MARGIN,
                 prior: CostPrior | None = None, max_copy_k: int | None = None, class_prior=None,
                 fixed_costs: bool = False):
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"AdaptivePolicy needs max_k >= 1, got {max_k!r}")
        if max_copy_k is not None and (isinstance(max_copy_k, bool) or not isinstance(max_copy_k, int)
                                       or not max_k <= max_copy_k <= MAX_COPY_K):
            raise ValueError(f"AdaptivePolicy needs max_copy_k in max_k..{MAX_COPY_K} ({max_k}..{MAX_COPY_K}) or "
                             f"None, got {max_copy_k!r}")
        super().__init__(max_copy_k or max_k, decay, prior, class_prior, fixed_costs)
        self.model_k = max_k  # the widest step whose drafts run a model; free steps (copies) go up to self.max_k
        self.probe_forget = probe_forget
        self.margin = margin
        self._speculating = None  # the rows' draft classes when the last step chose to speculate (None: it did not)
        self._plain_run, self._wait, self._probing = 0, PROBE_FIRST, False
        self._plain_time = 0.0  # seconds of plain steps since the last trial (probe or exploration)
        self._since_plain = 0  # steps since the last plain one
        self.model_drafts = False  # the loop says so when every draft comes from a model (only then may it settle)
        self._settled = 0  # plain steps left before costs are re-timed, once no draft could ever pay (Settling)
        self._recheck = False  # a settled stretch just ended: the next plain step's choice is a probe
        self._settled_at = (1, 1.0)  # the batch size and plain step cost when the policy settled
        self.settles = 0

    @property
    def settled(self) -> bool:
        """Whether the policy decodes plainly without looking: no draft could pay at the measured costs."""
        return self._settled > 0

    def choose(self, rows: list[RowState], caps: list[int]) -> int:
        self.trial = False
        top = self._remember(rows, caps)
        if not self._free_drafts:  # a model drafts: its K stays within max_k; only free copies go further
            top = min(top, self.model_k)
        if top == 0 or self._settled:
            return 0
        batch = len(rows)
        prior = self.batch_acceptance()
        gains = [self.expected_tokens(row, prior) for row in rows]
        tokens = [sum(g[min(k, cap)] for g, cap in zip(gains, caps)) for k in range(top + 1)]
        rates = [tokens[k] / self.step_time(k, batch) for k in range(top + 1)]
        best = max(range(top + 1), key=rates.__getitem__)  # ties go to the smaller K
        classes = tuple(getattr(row, "draft_class", None) for row in rows)
        if best == 0 and self._speculating == classes and max(rates[1:]) * (1 + self.margin) > rates[0]:
            # hysteresis: a noisy dip must not stop it; only for the same classes (a short match after a long one is
            # a different bet, not a dip in the same one)
            best = max(range(1, top + 1), key=rates.__getitem__)
        if best > 0 and not self._repays_catch_up(rows, rates[0], rates[best]):
            best = 0
        self._speculating = classes if best > 0 else None
        if best == 0 and not self._recheck and self._never_pays(top, batch):  # before exploring: no K could pay
            self._settled, self._plain_run = SETTLED_STEPS, 0
            self._settled_at = (batch, self.verify_cost(1, batch))
            self.settles += 1
            return 0
        self._restart_stale_plain_cost(batch)
        measured = self._verify.get(batch, {})
        untried = {k: tokens[k] / self._optimistic_time(k, batch) for k in range(top + 1)
                   if (k <= self.model_k or k in COPY_GRID)
                   and (k + 1 not in measured or measured[k + 1].count < WARM_SAMPLES)}
        catch_up = self.catch_up_cost(sum(r.probe_behind for r in rows))
        if untried and max(untried.values()) > rates[best]:
            explore = max(untried, key=untried.__getitem__)
            if best > 0 or self._affordable(rows, batch, catch_up, tokens[explore], untried[explore], rates[0]):
                self.explorations += 1
                self.trial = best == 0
                return explore
        if best > 0:
            self._plain_run, self._wait = 0, PROBE_FIRST
            return best
        self._plain_run += 1
        recheck, self._recheck = self._recheck, False
        if recheck and self._affordable(rows, batch, catch_up, tokens[1], rates[1], rates[0]):
            self._plain_run, self._probing, self.trial = 0, True, True  # one probe re-times the draft and a verify
            self.probes += 1
            return 1
        probe = max(range(1, top + 1), key=rates.__getitem__)  # the K most likely to pay
        if self._plain_run < self._wait or not self._could_pay(caps, batch, rates[0]) or \
                not self._affordable(rows, batch, catch_up, tokens[probe], rates[probe], rates[0]):
            return 0  # not yet, or not worth it: where no text could make a draft pay, probes are pure loss
        self._plain_run, self._probing, self.trial = 0, True, True
        self.probes += 1
        return probe

    def summary(self) -> dict:
        return {**super().summary(), "settles": self.settles, "settled": self.settled}

    def _decision(self, steps: dict, total: int) -> str:
        decision = super()._decision(steps, total)
        if self.settled:
            decision += "; no draft can pay at these costs even if all were kept, so nothing is drafted or probed"
        return decision

    def _restart_stale_plain_cost(self, batch: int) -> None:
        """While it speculates only plain steps re-time a plain step, so its cost can date from other conditions
        (other prompts, another process's load) and keep a speculation that no longer pays: every REFRESH_STEPS
        steps it is forgotten, and exploration times WARM_SAMPLES plain steps afresh."""
        if self._since_plain >= REFRESH_STEPS and 1 in self._verify.get(batch, {}):
            self._verify[batch][1].restart()
            self._since_plain = 0
            self.refreshes += 1

    def _repays_catch_up(self, rows: list[RowState], plain_rate: float, rate: float) -> bool:
        """Whether speculating for the rest of the rows' tokens saves more time than the draft's catch-up costs
        (its backlog: new rows' prompts, or the tokens of plain steps). Short answers to long prompts (a few-shot
        prompt and 8 new tokens) never repay a draft prefill; a long generation does at once."""
        backlog = sum(r.behind for r in rows)
        if backlog <= 2 * len(rows) or any(r.remaining is None for r in rows):
            return True  # in step (or nothing known of the rows' lengths): nothing to repay
        saved = sum(r.remaining for r in rows) * (1 / plain_rate - 1 / rate)
        return saved > self.catch_up_cost(backlog)

    def _affordable(self, rows: list[RowState], batch_size: int, catch_up: float, tokens: float, rate: float,
                    plain_rate: float) -> bool:
        """Whether a trial from plain steps fits TRIAL_BUDGET. Its cost is the draft's catch-up plus what its step
        is expected to lose against plain steps: its tokens at its rate (an exploration's at the lower bound that
        made it worth trying, so a pessimistic prior does not also delay the timing that corrects it) against the
        same tokens at the plain rate. On a 2-core CPU a K = 1 probe of a 135M draft lost ~0.7 steps beside its
        ~2-step catch-up, and with the catch-up alone counted trials took 1.5 % of a 512-token answer. A draft in
        step (no catch-up) is not bounded here: its probes' doubling wait keeps them well under 1 %."""
        if not catch_up:
            return True
        cost = catch_up + tokens * max(0.0, 1 / rate - 1 / plain_rate)
        return cost <= TRIAL_BUDGET * self._plain_time and cost <= TRIAL_BUDGET * self._remaining_time(rows, batch_size)

    def _remaining_time(self, rows: list[RowState], batch_size: int) -> float:
        """Seconds of plain steps the rows' remaining tokens will take (infinite where a row's length is unknown)."""
        remaining = [r.remaining for r in rows]
        if not remaining or None in remaining:
            return math.inf
        return max(remaining) * self.verify_cost(1, batch_size)

    def _could_pay(self, caps: list[int], batch_size: int, plain_rate: float) -> bool:
        """Whether some K could beat plain steps if the draft agreed as well as drafts ever do (CEILING_ACCEPTANCE
        at every position), at the estimated costs. Where it could not, as with a draft nearly as slow as the target,
        probing only costs: each probe makes the draft catch up on every token since it last ran. (Untimed K are
        still explored above, at their lower-bound cost, so a pessimistic estimate here is corrected.)"""
        a = CEILING_ACCEPTANCE
        for k in range(1, max(caps, default=0) + 1):
            tokens = sum((1 - a ** (min(k, cap) + 1)) / (1 - a) for cap in caps)
            if tokens / self.step_time(k, batch_size) > plain_rate * (1 + self.margin):
                return True
        return False

    def _never_pays(self, top: int, batch_size: int) -> bool:
        """Whether a draft that is a model (not free) could not beat plain decoding even if every draft were kept,
        at costs timed for this batch size: a draft step, and at least two forward sizes, 1 token among them, each
        WARM_SAMPLES times. Beyond the largest timed n, v(n) follows the slope of the two largest (a forward does
        not get cheaper per token as it grows on the machines that settle; a flat curve, a GPU's, never settles)."""
        timed = {n: c.value for n, c in self._verify.get(batch_size, {}).items() if c.count >= WARM_SAMPLES}
        draft = self._draft.get(batch_size)
        if not self.model_drafts or self._free_drafts or draft is None or draft.count < WARM_SAMPLES \
                or 1 not in timed or len(timed) < 2:
            return False
        (lo, v_lo), (hi, v_hi) = sorted(timed.items())[-2:]
        slope = max(0.0, (v_hi - v_lo) / (hi - lo))
        for k in range(1, top + 1):
            n = k + 1
            verify = self.verify_cost(n, batch_size) if n <= hi else v_hi + slope * (n - hi)
            if (k + 1) * timed[1] > k * draft.value + verify:
                return False
        return True

    def _optimistic_time(self, k: int, batch_size: int) -> float:
        """A lower bound on a step whose forward of n = k+1 tokens is unmeasured: no cheaper than a shorter
        forward, nor than 1/m of a longer one of m tokens (m forwards of one token cost more than one of m), nor,
        where the prior is this machine's measured curve, than PRIOR_TRUST of what it predicts."""
        n, points = k + 1, self._verify.get(batch_size, {})
        bounds = [p.value for m, p in points.items() if m < n] + [p.value / m for m, p in points.items() if m > n]
        if self.prior.verify and 1 in points:  # a curve measured on this machine is evidence, within its error
            bounds.append(PRIOR_TRUST * self.verify_cost(n, batch_size))
        verify = max(bounds) if bounds else self.verify_cost(n, batch_size)
        drafting = 0.0 if self._free_drafts else k * self.draft_cost(batch_size)
        return max(drafting + verify, 1e-12)

    def observe(self, rows, k, accepted, batch_size, draft_seconds, verify_seconds, drafted=None,
                free: bool | None = None) -> None:
        self._drafted(rows, k, accepted, batch_size, draft_seconds, verify_seconds, drafted)
        probing, self._probing = self._probing, False
        # A probe's drafting often begins by catching up on the plain steps' tokens: judge it at the steady cost.
        drafting = k * self.draft_cost(batch_size) if draft_seconds is None else draft_seconds
        # None: a cold forward (a graph captured), judged and counted at the estimated cost, never learned
        verify = self.verify_cost(k + 1, batch_size) if verify_seconds is None else verify_seconds
        paid = probing and (len(rows) + sum(accepted)) / max(drafting + verify, 1e-12) > \
            len(rows) / self.verify_cost(1, batch_size)
        if paid:  # the text has changed since the evidence that stopped speculation: let the probe outweigh it
            scale_evidence([self.accepted, self.seen] + [c for r in rows for c in (r.accepted, r.seen)],
                           self.probe_forget)
        super().observe(rows, k, accepted, batch_size, draft_seconds, verify_seconds, drafted, free)
        if self._settled:
            self._settled -= 1
            if not self._settled:  # re-time the costs with a probe only if the machine's speed has changed
                batch, step = self._settled_at
                self._recheck = abs(self.verify_cost(1, batch) / step - 1) > RECHECK_DRIFT
                self._settled = 0 if self._recheck else SETTLED_STEPS
        self._plain_time = self._plain_time + verify if k == 0 else 0.0
        self._since_plain = 0 if k == 0 else self._since_plain + 1
        if paid:  # one row's probe is one noisy bit: confirm it at once
            self._plain_run = self._wait
        elif probing:
            self._wait = min(PROBE_MAX, 2 * self._wait)


def make_policy(spec, max_k: int = 8, prior: CostPrior | None = None, max_copy_k: int | None = None,
                class_prior=None, fixed_costs: bool = False) -> Policy:
    """'auto' -> AdaptivePolicy(max_k, max_copy_k); a fixed K (0 = plain) -> FixedPolicy(K) (Speculation.parse).
    prior: the costs it starts from (CostPrior: a GPU's shape by default). max_copy_k: how far a step of free copies
    may go (None: max_k). class_prior: the acceptance assumed per draft class (the drafter's class_acceptance).
    fixed_costs: the prior's costs stand for every timing (modelled_costs): K follows the tokens alone."""
    speculation = Speculation.parse(spec)
    if speculation.auto:
        return AdaptivePolicy(max_k, prior=prior, max_copy_k=max_copy_k, class_prior=class_prior,
                              fixed_costs=fixed_costs)
    return FixedPolicy(speculation.k, prior=prior, fixed_costs=fixed_costs)

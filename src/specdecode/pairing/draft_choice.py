"""`--draft auto`: whether a draft model can pay on this machine, decided from its measured costs.

A step that drafts K tokens with a draft model costs K c + v(K + 1) target steps (c: a draft step, v(n): a target
forward of n tokens, both in target steps) and yields (1 - a^(K+1)) / (1 - a) tokens on average when each draft is
kept with probability a (Leviathan et al.), K + 1 when every draft is kept. `auto` takes the model where

    max over K of E(K, a) / (K c + v(K + 1))  >  1 + MARGIN,   a = TYPICAL_ACCEPTANCE (0.9),

a good pair's acceptance (the default pair keeps 93 % of its drafts on code: docs/results/llamacpp-code.json), not
a perfect one's: a bound that only full acceptance reaches is a loss on real text.

Where it cannot (on a 2-core CPU the 0.5B draft of the default pair costs c = 0.57 and verifying 2 tokens 1.62, so
the best K reaches 0.9x even with every draft kept) no text makes it pay: `auto` then drafts with what costs nothing,
the suffix drafter (copies from the row's context and from earlier requests) and the tokens a grammar forces, and
the draft model is not loaded at all. Where it can (a GPU, many cores, a much larger target) it is suffix+MODEL:
the suffix's copies where its index is confident, the model's drafts elsewhere.

The costs are measured once per machine, thread count and pair (draft_timing.py: the target's own forwards first,
and the draft model's only where the least its step can cost leaves it a chance to pay) and kept in costs.json in
the cache directory, so later runs decide without loading the draft; `specdecode advise` measures them again and
updates the record. A measurement taken while other processes used more than BUSY of the machine's CPU time is
unsure (a busy machine reads verification cheaper than it is): it decides only that run, for the free draft, is not
recorded, and says so. On a GPU, where a small draft's step is a small fraction of the target's, the model is
chosen without measuring.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..models.machine import machine_name

MARGIN = 0.05  # a bound within 5 % of plain decoding is not worth a second model: real acceptance is below 1
FREE = "suffix"  # the draft that costs nothing: copies from the context and earlier requests
MEASURED_KS = (1, 2, 3, 4, 6, 8)  # the K whose verification is timed for the decision (each a forward of K + 1)
COPY_TOKENS = (17, 33, 65)  # forwards timed with them for long copies' verification (policy.choose.COPY_GRID's K + 1)
TYPICAL_ACCEPTANCE = 0.9  # what the model must pay at to be chosen (see the module's doc)
# ... and a draft of another tokenizer (drafters/cross_vocab.py), which keeps fewer: SmolLM2-135M drafting for
# Qwen2.5-Coder-1.5B kept 40-70 % on code (docs/BENCHMARKS.md, "Drafts of another tokenizer")
CROSS_TOKENIZER_ACCEPTANCE = 0.7
# Other processes' share of the machine's CPU time above which a measurement is unsure: a desktop's background stays
# well below; on 2 cores it is one other busy thread at half speed, enough to stall llama.cpp's threads at every
# operation (they wait for each other).
BUSY = 0.25
UNTIMED = "timed later"  # costs.json's entry of the keys a first run left to the next (leave_to_next_run)


@dataclass(frozen=True)
class DraftCosts:
    """A draft model's costs against its target on one machine: c and v(n), in target steps (v(1) = 1)."""

    draft_step: float
    verify: dict[int, float]
    target_step_ms: float | None = None
    measured: str = ""  # when (ISO date), for the explanation
    machine: str = ""
    draft_step_floor: bool = False  # draft_step is the least a step can cost (draft_timing.draft_step_floor), not timed
    others: float | None = None  # other processes' share of the CPU time while timing (None: not read)
    rounds: int = 0  # rounds timed (0: not said)
    agreeing: int = 0  # of them, those whose own costs lead to the same choice
    copies: dict[int, float] = field(default_factory=dict)  # v(n) of long copies' forwards (COPY_TOKENS), by n

    @property
    def sure(self) -> bool:
        """Sure enough to decide on and record: other processes used at most BUSY of the CPUs; where that could not
        be read (no /proc/stat), most rounds agree with the choice. On a quiet machine the least time of each shape
        rides out passing disturbances however the single rounds read; a machine busy all along slows every round,
        which the load reading tells, and without it rounds that mostly disagree still hint at it."""
        if self.others is not None:
            return self.others <= BUSY
        return not self.rounds or 2 * self.agreeing > self.rounds

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others > BUSY

    def best(self, max_k: int = 8, acceptance: float = 1.0) -> tuple[int, float]:
        """(K, speedup) of the best K when each draft is kept with probability `acceptance` (1: every draft):
        E(K) / (K c + v(K + 1)), over the K whose verification was measured (K <= max_k); (0, 1.0) when none was."""
        gains = {k: expected_tokens(k, acceptance) / (k * self.draft_step + self.verify[k + 1])
                 for k in range(1, max_k + 1) if k + 1 in self.verify}
        if not gains:
            return 0, 1.0
        k = max(gains, key=gains.__getitem__)
        return k, gains[k]

    def model_can_pay(self, max_k: int = 8, margin: float = MARGIN, acceptance: float = TYPICAL_ACCEPTANCE) -> bool:
        return self.best(max_k, acceptance)[1] > 1 + margin

    def to_dict(self) -> dict:
        return {**asdict(self), "verify": {str(n): v for n, v in self.verify.items()},
                "copies": {str(n): v for n, v in self.copies.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "DraftCosts":
        return cls(float(data["draft_step"]), {int(n): float(v) for n, v in data["verify"].items()},
                   data.get("target_step_ms"), data.get("measured", ""), data.get("machine", ""),
                   bool(data.get("draft_step_floor", False)), data.get("others"), int(data.get("rounds", 0)),
                   int(data.get("agreeing", 0)), {int(n): float(v) for n, v in data.get("copies", {}).items()})

    def how_sure(self) -> str:
        """When and how it was measured, for the explanation ("" when nothing is known)."""
        said = [f"measured {self.measured}"] if self.measured else []
        if self.rounds:
            said.append(f"{self.agreeing} of {self.rounds} rounds agree")
        if self.others is not None:
            said.append(f"other processes used {self.others:.0%} of the CPUs")
        return ", ".join(said)


@dataclass(frozen=True)
class DraftChoice:
    """What `--draft auto` resolved to: `draft` (as --draft would name it) and why."""

    draft: str  # FREE or "suffix+MODEL"
    model: str | None  # the draft model that was considered (None: none is known for this target)
    reason: str
    costs: DraftCosts | None = field(default=None, compare=False)

    @property
    def uses_model(self) -> bool:
        return self.draft != FREE

    def line(self) -> str:
        """One line for the first output and the policy line."""
        return f"{self.draft} (--draft auto: {self.reason})"


def choose_draft(model: str | None, costs: DraftCosts | None, on_gpu: bool = False, max_k: int = 8,
                 margin: float = MARGIN, acceptance: float = TYPICAL_ACCEPTANCE) -> DraftChoice:
    """The draft `auto` stands for, from the candidate draft model and its measured costs (pure arithmetic).

    model None: no draft model is known for the target, so the free draft. costs None: allowed only on a GPU
    (the model is assumed to pay there); on a CPU measure them first (measure_costs). acceptance: what the model
    must pay at (CROSS_TOKENIZER_ACCEPTANCE for a draft of another tokenizer)."""
    if model is None:
        return DraftChoice(FREE, None, "no draft model is known for this target; pass --draft MODEL to use one")
    if costs is None:
        if not on_gpu:
            raise ValueError("choose_draft needs the draft model's measured costs on a CPU")
        return DraftChoice(f"{FREE}+{model}", model, "on a GPU a small draft model's step costs a small fraction "
                                                     "of the target's", None)
    k, bound = costs.best(max_k, acceptance)
    full_k, full = costs.best(max_k)
    verify = f"verifying 2 tokens {costs.verify.get(2, float('nan')):.2f} steps"
    if not costs.sure:
        if costs.busy:
            why = f"other processes used {costs.others:.0%} of the CPUs " + (
                f"while it was timed, and a busy machine reads verification cheaper than it is ({verify})"
                if 2 in costs.verify else "so nothing was timed: a busy machine reads verification cheaper than it is")
        else:
            why = (f"only {costs.agreeing} of {costs.rounds} rounds of its timing agree (c = {costs.draft_step:.2f}, "
                   f"{verify} as read)")
        return DraftChoice(FREE, model, f"unsure: {why}; this run drafts only for free (the model is not used), "
                                        f"records nothing, and the next run looks again", costs)
    if costs.draft_step_floor:
        figures = (f"{verify} here, and the draft model {model} costs at least c = {costs.draft_step:.2f} of a "
                   f"target step (its share of the weights' bytes)")
    else:
        figures = f"the draft model {model} costs c = {costs.draft_step:.2f} of a target step and {verify}"
    when = f"; {costs.how_sure()}" if costs.how_sure() else ""
    if bound > 1 + margin:
        if costs.draft_step_floor:  # the least the draft can cost shows only that it cannot pay
            raise ValueError("choose_draft cannot choose a draft model from the floor of its cost: time it")
        return DraftChoice(f"{FREE}+{model}", model, f"{figures}, so at {acceptance:.0%} of drafts kept "
                                                     f"K={k} would give {bound:.2f}x: the model can pay here{when}",
                           costs)
    gives = "gives at most" if costs.draft_step_floor else "gives"
    return DraftChoice(FREE, model, f"{figures}: at {acceptance:.0%} of drafts kept the best K={k} {gives} "
                                    f"{bound:.2f}x (with every draft kept K={full_k}: {full:.2f}x), so only free "
                                    f"drafts pay here and the model is not loaded{when}", costs)


def untimed_choice(model: str) -> DraftChoice:
    """A first run's choice on a CPU where the model's costs are not recorded yet and the run does not wait to time
    them (leave_to_next_run marks them for the next run)."""
    return DraftChoice(FREE, model, f"not timed on this machine yet: a first run drafts for free rather than wait "
                                    f"for timing whether the draft model {model} can pay here; the next run times it "
                                    f"once (`specdecode advise` does it now)")


# ----------------------------------------------------------------------------------------------- the record
def cost_key(target: str, draft: str, backend: str, threads: int | None, draft_quantize: str | None) -> str:
    """What the costs depend on besides the machine: the pair, how it runs, and the threads."""
    return f"{machine_name()} | threads={threads or 'all'} | {backend} | {target} -> {draft} | draft {draft_quantize}"


def costs_path() -> Path:
    """$SPECDECODE_COSTS, else costs.json in the cache (a test suite keeps its own, apart from the user's)."""
    from ..models.catalog import cache_dir

    return Path(os.environ.get("SPECDECODE_COSTS") or cache_dir() / "costs.json")


def load_costs(key: str) -> DraftCosts | None:
    """The costs recorded under key, or None (none recorded, or an unreadable record: measured again)."""
    try:
        return DraftCosts.from_dict(_records()[key])
    except (ValueError, KeyError, TypeError):
        return None


def recorded_target_costs(target: str, draft: str | None, backend: str,
                          threads: int | None) -> tuple[DraftCosts, bool] | None:
    """The costs recorded on this machine for `target` run this way, whatever draft they were recorded with (v(n)
    is the target's own), and whether they are `draft`'s (only then is their c this draft's): its entry where
    there is one, else the latest sure one. None when none is recorded."""
    head = cost_key(target, "", backend, threads, None).split(" -> ")[0] + " -> "
    found = []
    for key, data in _records().items():
        if not key.startswith(head):
            continue
        try:
            costs = DraftCosts.from_dict(data)
        except (ValueError, KeyError, TypeError):
            continue
        if costs.sure and len(costs.verify) > 1:
            found.append((key[len(head):].split(" | draft ")[0] == draft, costs.measured, costs))
    if not found:
        return None
    same, _, costs = max(found, key=lambda entry: entry[:2])
    return costs, same


def leave_to_next_run(key: str) -> bool:
    """Whether a first run may leave the timing of key's costs to the next run: True once, marking it; False where
    a run before left it (this one times) or the mark cannot be written (no run would ever be the next)."""
    records = _records()
    later = records.get(UNTIMED, {})
    if not isinstance(later, dict) or key in later:
        return False
    records[UNTIMED] = {**later, key: datetime.date.today().isoformat()}
    return _write_records(records)


def _records() -> dict:
    try:
        records = json.loads(costs_path().read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _write_records(records: dict) -> bool:
    path = costs_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(records, indent=1))
        os.replace(temporary, path)
        return True
    except (OSError, ValueError):
        return False


def save_costs(key: str, costs: DraftCosts) -> None:
    """Record costs under key (other keys kept); a cache that cannot be written only means measuring again. Costs
    without long copies' (advise times none) keep those of the record they replace."""
    records = _records()
    try:
        kept = DraftCosts.from_dict(records[key]).copies if not costs.copies else {}
    except (ValueError, KeyError, TypeError, AttributeError):
        kept = {}
    records[key] = replace(costs, copies=kept).to_dict() if kept else costs.to_dict()  # advise times no copies
    later = records.get(UNTIMED)
    if isinstance(later, dict):
        later.pop(key, None)
    _write_records(records)


def costs_from_measurement(measured: dict, draft_step_floor: bool = False) -> DraftCosts:
    """DraftCosts from a measurement's dict (c, v by K, target_step_ms; draft_timing.run_rounds adds others,
    rounds and agreeing). draft_step_floor: c is the least a draft step can cost, not a timing."""
    verify, floor = {1: 1.0}, 1.0
    for k, v in sorted((int(k), float(v)) for k, v in measured["v"].items()):
        floor = max(floor, v)  # never cheaper than a forward of fewer tokens (a lower reading is noise)
        verify[k + 1] = floor
    c = float("nan") if measured["c"] is None else float(measured["c"])  # nothing timed: a busy machine
    copies = {}
    for n, v in sorted((int(n), float(v)) for n, v in measured.get("copies", {}).items()):
        floor = max(floor, v)
        copies[n] = floor
    return DraftCosts(c, verify, measured.get("target_step_ms"),
                      datetime.date.today().isoformat(), machine_name(), draft_step_floor, measured.get("others"),
                      int(measured.get("rounds", 0)), int(measured.get("agreeing", 0)), copies)


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a step of K drafts yields on average when each is kept with probability `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)

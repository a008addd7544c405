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

The costs are measured once per machine, thread count and pair (a few forwards of each model) and kept in
costs.json in the cache directory, so later runs decide without loading the draft; `specdecode advise` measures
them again and updates the record. On a GPU, where a small draft's step is a small fraction of the target's, the
model is chosen without measuring.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

MARGIN = 0.05  # a bound within 5 % of plain decoding is not worth a second model: real acceptance is below 1
FREE = "suffix"  # the draft that costs nothing: copies from the context and earlier requests
MEASURED_KS = (1, 2, 3, 4, 6, 8)
TYPICAL_ACCEPTANCE = 0.9  # what the model must pay at to be chosen (see the module's doc)  # the K whose verification is timed for the decision (each a forward of K + 1)


@dataclass(frozen=True)
class DraftCosts:
    """A draft model's costs against its target on one machine: c and v(n), in target steps (v(1) = 1)."""

    draft_step: float
    verify: dict[int, float]
    target_step_ms: float | None = None
    measured: str = ""  # when (ISO date), for the explanation
    machine: str = ""

    def best(self, max_k: int = 8, acceptance: float = 1.0) -> tuple[int, float]:
        """(K, speedup) of the best K when each draft is kept with probability `acceptance` (1: every draft):
        E(K) / (K c + v(K + 1)), over the K whose verification was measured (K <= max_k); (0, 1.0) when none was."""
        gains = {k: expected_tokens(k, acceptance) / (k * self.draft_step + self.verify[k + 1])
                 for k in range(1, max_k + 1) if k + 1 in self.verify}
        if not gains:
            return 0, 1.0
        k = max(gains, key=gains.__getitem__)
        return k, gains[k]

    def model_can_pay(self, max_k: int = 8, margin: float = MARGIN) -> bool:
        return self.best(max_k, TYPICAL_ACCEPTANCE)[1] > 1 + margin

    def to_dict(self) -> dict:
        return {**asdict(self), "verify": {str(n): v for n, v in self.verify.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "DraftCosts":
        return cls(float(data["draft_step"]), {int(n): float(v) for n, v in data["verify"].items()},
                   data.get("target_step_ms"), data.get("measured", ""), data.get("machine", ""))


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
                 margin: float = MARGIN) -> DraftChoice:
    """The draft `auto` stands for, from the candidate draft model and its measured costs (pure arithmetic).

    model None: no draft model is known for the target, so the free draft. costs None: allowed only on a GPU
    (the model is assumed to pay there); on a CPU measure them first (measure_costs)."""
    if model is None:
        return DraftChoice(FREE, None, "no draft model is known for this target; pass --draft MODEL to use one")
    if costs is None:
        if not on_gpu:
            raise ValueError("choose_draft needs the draft model's measured costs on a CPU")
        return DraftChoice(f"{FREE}+{model}", model, "on a GPU a small draft model's step costs a small fraction "
                                                     "of the target's", None)
    k, bound = costs.best(max_k, TYPICAL_ACCEPTANCE)
    full_k, full = costs.best(max_k)
    figures = (f"the draft model {model} costs c = {costs.draft_step:.2f} of a target step and verifying 2 tokens "
               f"{costs.verify.get(2, float('nan')):.2f} steps")
    when = f"; measured {costs.measured}" if costs.measured else ""
    if bound > 1 + margin:
        return DraftChoice(f"{FREE}+{model}", model, f"{figures}, so at {TYPICAL_ACCEPTANCE:.0%} of drafts kept "
                                                     f"K={k} would give {bound:.2f}x: the model can pay here{when}",
                           costs)
    return DraftChoice(FREE, model, f"{figures}: at {TYPICAL_ACCEPTANCE:.0%} of drafts kept the best K={k} gives "
                                    f"{bound:.2f}x (with every draft kept K={full_k}: {full:.2f}x), so only free "
                                    f"drafts pay here and the model is not loaded{when}", costs)


# ----------------------------------------------------------------------------------------------- the record
def machine_name() -> str:
    """The CPU's model name (as lscpu says it) and its core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def cost_key(target: str, draft: str, backend: str, threads: int | None, draft_quantize: str | None) -> str:
    """What the costs depend on besides the machine: the pair, how it runs, and the threads."""
    return f"{machine_name()} | threads={threads or 'all'} | {backend} | {target} -> {draft} | draft {draft_quantize}"


def costs_path() -> Path:
    from ..models.catalog import cache_dir

    return cache_dir() / "costs.json"


def load_costs(key: str) -> DraftCosts | None:
    """The costs recorded under key, or None (none recorded, or an unreadable record: measured again)."""
    try:
        return DraftCosts.from_dict(json.loads(costs_path().read_text())[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_costs(key: str, costs: DraftCosts) -> None:
    """Record costs under key (other keys kept); a cache that cannot be written only means measuring again."""
    path = costs_path()
    try:
        records = json.loads(path.read_text()) if path.exists() else {}
        records[key] = costs.to_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(records, indent=1))
        os.replace(temporary, path)
    except (OSError, ValueError):
        pass


def costs_from_measurement(measured: dict) -> DraftCosts:
    """DraftCosts from bench.costs.measure_costs' dict (c, v by K, target_step_ms)."""
    verify, floor = {1: 1.0}, 1.0
    for k, v in sorted((int(k), float(v)) for k, v in measured["v"].items()):
        floor = max(floor, v)  # never cheaper than a forward of fewer tokens (a lower reading is noise)
        verify[k + 1] = floor
    return DraftCosts(float(measured["c"]), verify, measured.get("target_step_ms"),
                      datetime.date.today().isoformat(), machine_name())


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a step of K drafts yields on average when each is kept with probability `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)

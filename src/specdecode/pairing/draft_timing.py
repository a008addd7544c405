"""Timing a draft model against its target for `--draft auto`, on a machine that other processes may share.

What one measurement has to survive: on a busy machine a forward waits for CPU time it does not get, and llama.cpp's
threads meet after every operation, so the wait is about the same whatever the forward's size. A busy machine then
reads a forward of 2 tokens as barely dearer than one of 1 (verification at 1.16 target steps where a quiet run
finds 1.70, issue 50) and a draft model as able to pay where it cannot. So:

- each shape's cost is the least of its rounds: load only ever adds time, so the least disturbed reading is the
  nearest to what the machine itself costs, and the ratios are taken between those minima;
- the share of the machine's CPU time that other processes used meanwhile is read from /proc/stat. Above BUSY the
  measurement is unsure: --draft auto then takes the free draft for this run and records nothing, and the next run
  measures again (draft_choice.choose_draft);
- every round's own figures go through the decision too, and the choice's line says how many rounds agree with
  it; when some disagree, more rounds are taken (up to MAX_ROUNDS);
- the draft model is not even loaded where the least its step can cost (draft_step_floor) already leaves it no
  chance to pay: the target's own forwards decide, about a second of a first run instead of loading a second model;
  where it is loaded, the target's verifications just timed are kept and the pair's rounds time one step of each
  model (on the default pair a round of every verification is ~16 target steps, one step of each model ~1.5).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from .draft_choice import BUSY, COPY_TOKENS, MEASURED_KS, costs_from_measurement

ROUNDS = 3  # rounds of every shape; enough for a minimum when they agree
LOOK_S = 0.2  # how long the machine's load is read before anything is timed
MAX_ROUNDS = 6  # when some round's own figures decide otherwise, this many in all
COPY_ROUNDS = 2  # rounds of the long copies' forwards (each round ~28 target steps on a 2-core CPU)
CONTEXT = 64  # tokens in the cache when a forward is timed, as a short prompt leaves it
# A CPU's decoding step streams every weight once, so a draft step costs at least about its share of the bytes;
# 0.9 of it leaves room for kernels that do better per byte. The default pair (a Q8_0 draft, the cheapest format
# per byte, for a Q4_K_M target): 0.9 x 491 / 1117 MB = 0.40, where its measured c was 0.57 on a 2-core EPYC and
# 0.49-0.61 on a 2-core Xeon (1.1-1.4 times the share). At 0.8 (0.35) a noisy reading of verification (1.57 steps
# for 2 tokens where a quiet one reads 1.7-1.8) left the 0.5B a chance on that Xeon, so a first run loaded and timed
# it (about 15 s) only to find c = 0.49 and not use it.
FLOOR_SHARE = 0.9


# ---------------------------------------------------------------------------------------------- the machine's load
def cpu_seconds() -> tuple[float, float, int] | None:
    """(CPU seconds the machine has spent busy, this process's CPU seconds, CPUs /proc/stat counts) now; None
    where there is no /proc/stat. Busy includes steal: a hypervisor running someone else on our CPUs."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(fields) - fields[3] - fields[4]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    times = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), times.user + times.system, max(cpus, 1)


class OthersLoad:
    """The share of the machine's CPU time other processes used since the block began (`share`, 0..1, updated by
    `busy()` and on leaving; None where it cannot be read). reading and clock replace cpu_seconds and
    time.perf_counter (tests)."""

    def __init__(self, reading: Callable[[], tuple[float, float, int] | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.reading, self.clock, self.share = reading or cpu_seconds, clock, None

    def __enter__(self) -> "OthersLoad":
        self._start, self._before = self.clock(), self.reading()
        return self

    def __exit__(self, *exc) -> None:
        self.busy()

    def busy(self) -> bool:
        """Whether other processes have used more than BUSY of the CPU time so far (share updated)."""
        after, wall = self.reading(), self.clock() - self._start
        if self._before is not None and after is not None and wall > 0:
            others = (after[0] - self._before[0]) - (after[1] - self._before[1])
            self.share = min(1.0, max(0.0, others / (after[2] * wall)))
        return self.share is not None and self.share > BUSY


# ---------------------------------------------------------------------------------------------- rounds
Timer = Callable[[str, int], float]  # (model, tokens) -> seconds of one forward of that many tokens


def shapes(with_draft: bool, verifications: bool = True) -> list[tuple[str, int]]:
    """What a round times: a target step, a draft step, and (verifications) a verification of K + 1 tokens for each
    measured K."""
    return [("target", 1)] + ([("draft", 1)] if with_draft else []) + (
        [("target", k + 1) for k in MEASURED_KS] if verifications else [])


def costs_of(rounds: list[dict], floor: float | None = None, verify: dict | None = None) -> dict:
    """c, v(n) by K and target_step_ms (measure_costs' form) from the least time of each shape over the rounds; c
    is `floor` where no draft was timed; v is `verify` where it was given (timed before: the rounds then hold no
    verification)."""
    least = {shape: min(r[shape] for r in rounds) for shape in rounds[0]}
    step = least[("target", 1)]
    c = least[("draft", 1)] / step if ("draft", 1) in least else floor
    v = dict(verify) if verify is not None else {str(k): least[("target", k + 1)] / step for k in MEASURED_KS}
    return {"c": c, "v": v, "target_step_ms": 1000 * step}


def run_rounds(make_timer: Callable[[], Timer], with_draft: bool, floor: float | None = None, rounds: int = ROUNDS,
               max_rounds: int = MAX_ROUNDS, load: OthersLoad | None = None,
               decide: Callable[[dict], bool] | None = None, look: Callable[[], None] | None = None,
               verify: dict | None = None) -> dict:
    """Times every shape once per round, back to back, and returns costs_of the rounds with how sure they are:
    "others" (load.share), "rounds", and "agreeing": the rounds whose own costs lead to the decision that the
    minima lead to. Rounds that disagree get more rounds, up to max_rounds. decide(costs) -> whether the draft
    model can pay (default: draft_choice's rule). The machine's load is looked at first (look: LOOK_S of sleep),
    before make_timer sets up the forwards, and after every round: once it is busy nothing more is timed, since
    the measurement could only be unsure (and a busy machine's forwards are slow to time); with nothing timed "v"
    is empty and "rounds" 0. verify: the target's v(n) (by K, as "v"), timed just before: the rounds time a step
    of each model only (on a 2-core CPU a sixth of a round with every verification), and "v" is verify."""
    decide = decide or (lambda measured: costs_from_measurement(measured).model_can_pay())
    timed, load = [], load or OthersLoad()
    with load:
        (look or (lambda: time.sleep(LOOK_S)))()
        timer = None if load.busy() else make_timer()
        order = shapes(with_draft, verify is None)
        for shape in order if timer else ():  # warm-up: the first call of a shape allocates
            timer(*shape)
        while timer and len(timed) < rounds and not load.busy():
            timed.append({shape: timer(*shape) for shape in order})
            if len(timed) == rounds and rounds < max_rounds and \
                    len(set(_decisions(timed, floor, decide, verify))) > 1:
                rounds = max_rounds
    if not timed:
        return {"c": floor, "v": {}, "target_step_ms": None, "others": load.share, "rounds": 0, "agreeing": 0}
    measured = costs_of(timed, floor, verify)
    verdict = decide(measured)
    return {**measured, "others": load.share, "rounds": len(timed),
            "agreeing": sum(d == verdict for d in _decisions(timed, floor, decide, verify))}


def _decisions(timed: list[dict], floor: float | None, decide, verify: dict | None = None) -> list[bool]:
    return [decide(costs_of([r], floor, verify)) for r in timed]


def copy_costs(timer: Timer, copies: tuple[int, ...], step_s: float, rounds: int = COPY_ROUNDS,
               load: OthersLoad | None = None) -> dict[str, float]:
    """v(n) of the target for each n in copies, in target steps of step_s: the least of `rounds` forwards of n
    tokens. A long copy's verification is priced from these (policy.estimates.CostPrior) where a run keeps its
    costs fixed; between the measured K's last point and them v(n) would otherwise be extended along a line, and a
    CPU's forward of 65 tokens costs far less per token than one of 9 (a 2-vCPU Xeon: v(9) = 3.9, v(65) = 14.6).
    {} when other processes took more than BUSY of the CPUs meanwhile (the extension is used then)."""
    least: dict[int, float] = {}
    with (load or OthersLoad()) as load:
        for _ in range(rounds):
            for n in copies:
                least[n] = min(least.get(n, float("inf")), timer("target", n))
            if load.busy():
                return {}
    return {} if load.busy() else {str(n): least[n] / step_s for n in copies}


# ---------------------------------------------------------------------------------------------- real forwards
def measure_costs(target, draft_model=None, floor: float | None = None, rounds: int = ROUNDS,
                  max_rounds: int = MAX_ROUNDS, acceptance: float | None = None, verify: dict | None = None,
                  copies: tuple[int, ...] = ()) -> dict:
    """run_rounds on real forwards on a warm 64-token context: the target's alone (c is then `floor`), or the
    target's and the draft model's. acceptance: what the model must pay at (default draft_choice's
    TYPICAL_ACCEPTANCE), for the rounds' own decisions. verify: the target's v(n) timed just before (run_rounds).
    copies: forwards of these many tokens timed after the rounds (copy_costs), as "copies" {n: v(n)}."""
    import torch

    from ..backends import huge_pages
    from ..backends.base import pad
    from ..engine.generators import AutoregressiveGenerator, SpeculativeGenerator

    backends, timers = {}, []

    def make_timer() -> Timer:
        gen = (SpeculativeGenerator(target, draft_model, num_speculative_tokens=1) if draft_model is not None
               else AutoregressiveGenerator(target))
        context = [(7 * i + 100) % min(gen.vocab_size, 5000)
                   for i in range(CONTEXT + max(MEASURED_KS + tuple(n - 1 for n in copies)) + 1)]
        backends.update(target=gen.target, **({"draft": gen.drafter.backend} if draft_model is not None else {}))
        for backend in backends.values():
            backend.reset(1)
            backend.forward(pad([context[:CONTEXT]], backend.device)[0], last_only=True)

        def timer(name: str, n: int) -> float:
            backend = backends[name]
            ids = torch.tensor([context[CONTEXT:CONTEXT + n]], dtype=torch.long, device=backend.device)
            start = time.perf_counter()
            backend.forward(ids)
            elapsed = time.perf_counter() - start
            backend.trim([CONTEXT])
            return elapsed

        timers.append(timer)
        return timer

    try:
        decide = None if acceptance is None else (
            lambda measured: costs_from_measurement(measured).model_can_pay(acceptance=acceptance))
        with huge_pages.paused(target, *([draft_model] if draft_model is not None else [])):
            measured = run_rounds(make_timer, draft_model is not None, floor, rounds, max_rounds, decide=decide,
                                  verify=verify)
            if copies and timers and measured["rounds"] and measured["target_step_ms"]:
                measured["copies"] = copy_costs(timers[0], copies, measured["target_step_ms"] / 1000)
            return measured
    finally:
        if "target" in backends:
            backends["target"].reset(0)


def measure_copy_costs(target) -> dict:
    """v(n) of the target's long copies' forwards here ({} on a busy machine): one round of its own forwards, for
    the step they are counted in, then the copies (copy_costs)."""
    return measure_costs(target, None, None, rounds=1, max_rounds=1, copies=COPY_TOKENS).get("copies", {})


def with_copies(costs, target, key: str | None = None):
    """costs (DraftCosts, sure ones only) with the long copies' v(n) timed on target (measure_copy_costs) and, where
    key is given and they were, recorded under it. Timing them is a bonus: where it cannot be done (a machine too
    busy, a target that is no model to time) the costs stay as they are and the policy extends the short forwards'
    line."""
    from dataclasses import replace

    from .draft_choice import costs_from_measurement, save_costs

    if not costs.sure:
        return costs
    try:
        copies = measure_copy_costs(target)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return costs
    if not copies:
        return costs
    floor = max(costs.verify.values(), default=1.0)
    timed = costs_from_measurement({"c": None, "v": {}, "copies": copies}).copies
    costs = replace(costs, copies={n: max(v, floor) for n, v in timed.items()})
    if key is not None:
        save_costs(key, costs)
    return costs


# ---------------------------------------------------------------------------------------------- the floor
def draft_step_floor(target, target_name: str, draft_name: str, lean: bool = False) -> float | None:
    """The least a step of the draft model can cost, in target steps, where llama.cpp runs both as GGUF files:
    FLOOR_SHARE x the draft's bytes / the target's; lean: the draft may run as its lean copy (models/lean_gguf.py),
    whose bytes count where its file is already prepared. None elsewhere: transformers runs a CPU draft in int8 and
    the target in fp32, so no file's size says what their steps read."""
    if getattr(target, "backend", None) != "llamacpp":
        return None
    target_bytes, draft_bytes = _gguf_bytes(target_name), _gguf_bytes(draft_name, lean)
    if not target_bytes or not draft_bytes:
        return None
    return FLOOR_SHARE * draft_bytes / target_bytes


def _gguf_bytes(name: str, lean: bool = False) -> int | None:
    from ..models import catalog
    from ..models.lean_gguf import lean_size

    path = os.path.expanduser(name)
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        if not catalog.is_registered(name):
            return None
        path = catalog.gguf_cache_path(catalog.lookup(name).name)
        if not path.is_file():
            return catalog.lookup(name).size
    size = os.path.getsize(path)
    return min(size, lean_size(Path(path)) or size) if lean else size

"""--draft auto's measurement on a machine other processes share (pairing/draft_timing.py): simulated forwards that
carry a busy machine's waits and simulated /proc/stat readings. The promises: passing load that spares each shape in
one round leaves the choice a quiet machine's; a busy machine's measurement is unsure, takes the free draft for that
run only and says so; the draft model is not loaded where the least its step can cost shows it cannot pay."""

from __future__ import annotations

import random

import pytest

from specdecode.pairing import draft_choice, draft_timing
from specdecode.pairing.draft_choice import BUSY, DraftCosts, choose_draft, costs_from_measurement
from specdecode.pairing.draft_timing import OthersLoad, run_rounds, shapes

STEP = 0.04  # seconds of a quiet target step
EPYC = (0.57, {1: 1.0, 2: 1.62, 3: 2.14, 4: 2.56, 5: 3.14, 7: 4.30, 9: 5.5})  # c, v(n): the default pair, 2-core EPYC
MANY_CORES = (0.3, {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08, 7: 1.12, 9: 1.16})  # where the model pays


class Machine:
    """A clock that forwards advance, and /proc/stat readings in which other processes use `share` of 2 CPUs
    (`share` may change as the forwards go)."""

    def __init__(self, share: float):
        self.now, self.busy_s, self.share = 0.0, 0.0, share

    def clock(self) -> float:
        return self.now

    def reading(self):
        return self.busy_s, 0.0, 2

    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.busy_s += self.share * 2 * seconds

    def load(self) -> OthersLoad:
        return OthersLoad(self.reading, self.clock)

    def timer(self, costs, delays=lambda name, n: 0.0):
        """Forwards of the quiet costs (c, v) plus delays(name, n) target steps of waiting for the CPU."""
        c, v = costs
        self.calls = 0

        def forward(name: str, n: int) -> float:
            self.calls += 1
            seconds = STEP * ((c if name == "draft" else v[n]) + delays(name, n))
            self.wait(seconds)
            return seconds

        return forward


def measure(machine, costs, with_draft=True, delays=lambda name, n: 0.0, floor=None):
    measured = run_rounds(lambda: machine.timer(costs, delays), with_draft, floor, load=machine.load(),
                          look=lambda: machine.wait(0.2))
    return costs_from_measurement(measured, draft_step_floor=not with_draft)


@pytest.mark.parametrize("costs, draft", [(EPYC, "suffix"), (MANY_CORES, "suffix+M")])
def test_passing_load_that_spares_each_shape_once_leaves_a_quiet_machines_choice(costs, draft):
    """Each round another process takes the CPU during two forwards (1-4 steps each), never the same shape in
    every round: the least reading of each shape is a quiet one, so the costs and the choice are exact."""
    quiet = choose_draft("M", measure(Machine(0.0), costs))
    assert quiet.draft == draft and quiet.costs.agreeing == quiet.costs.rounds == 3
    order = shapes(True)
    for seed in range(20):
        rng, machine, seen = random.Random(seed), Machine(0.1), []

        def delays(name, n):
            seen.append((name, n))
            rnd, at = divmod(len(seen) - 1 - len(order), len(order))  # the warm-up first, then the rounds
            return rng.uniform(1, 4) if rnd >= 0 and at in ((3 * rnd + seed) % 8, (3 * rnd + seed + 1) % 8) else 0.0

        costs_read = measure(machine, costs, delays=delays)
        choice = choose_draft("M", costs_read)
        assert choice.draft == draft and costs_read.sure
        assert costs_read.draft_step == pytest.approx(costs[0]) and costs_read.verify[2] == pytest.approx(costs[1][2])
        assert f"of {costs_read.rounds} rounds agree, other processes used 10% of the CPUs" in choice.reason


def test_random_passing_load_gives_the_quiet_choice_wherever_a_shape_has_a_quiet_reading():
    """One forward in five waits 1-4 steps: wherever every shape kept an undisturbed reading in some round, the
    choice is the quiet machine's (the promise); the seeds where one did not are counted, not hidden."""
    kept = 0
    for seed in range(50):
        rng, machine, clean = random.Random(seed), Machine(0.1), set()
        rounds_seen = {"n": 0}

        def delays(name, n):
            rounds_seen["n"] += 1
            wait = rng.uniform(1, 4) if rng.random() < 0.2 else 0.0
            if rounds_seen["n"] > len(shapes(True)) and not wait:  # past the warm-up
                clean.add((name, n))
            return wait

        choice = choose_draft("M", measure(machine, EPYC, delays=delays))
        if clean == set(shapes(True)):
            kept += 1
            assert choice.draft == "suffix", seed
    assert kept >= 45  # the promise was put to the test, not skipped


def test_a_busy_machine_is_unsure_takes_the_free_draft_and_times_nothing():
    """Other processes using 70 % of the CPUs: nothing is timed or set up at all (the look comes first), and the
    choice says why and that nothing is recorded."""
    machine, made = Machine(0.7), []
    run = run_rounds(lambda: made.append(1) or machine.timer(MANY_CORES), True, load=machine.load(),
                     look=lambda: machine.wait(0.2))
    costs = costs_from_measurement(run)  # a quiet machine would take the model here
    assert made == [] and not costs.sure and costs.rounds == 0  # no forward was even set up
    choice = choose_draft("M", costs)
    assert choice.draft == "suffix" and not choice.uses_model
    assert choice.reason == ("unsure: other processes used 70% of the CPUs so nothing was timed: a busy machine reads "
                             "verification cheaper than it is; this run drafts only for free (the model is not used), "
                             "records nothing, and the next run looks again")


def test_load_that_comes_midway_stops_the_timing_and_verification_that_looks_cheap_is_not_believed():
    """The machine turns busy after the warm-up, and every target forward then waits 2 steps whatever its size (a
    draft step half a step), so verification reads cheap (v(2) about 1.2, as a busy EPYC read 1.16) and the model
    would seem to pay: the measurement stops after the round in which the load came, is unsure, and the run takes
    the free draft."""
    machine = Machine(0.0)
    warm = len(shapes(True))

    def delays(name, n):
        if machine.calls > warm:
            machine.share = 0.9
            return 2.0 if name == "target" else 0.5
        return 0.0

    costs = measure(machine, EPYC, delays=delays)
    assert costs.rounds == 1 and machine.calls == 2 * warm and not costs.sure
    assert costs.verify[2] < 1.3 and DraftCosts(costs.draft_step, costs.verify).model_can_pay()  # what it read
    choice = choose_draft("M", costs)
    assert choice.draft == "suffix" and "unsure: other processes used" in choice.reason
    assert "verifying 2 tokens 1.2" in choice.reason  # the figures as read, for the curious


def test_rounds_that_disagree_get_more_rounds_and_the_line_says_how_many_agree():
    """A machine at the edge: the first round reads a cheap verification (a disturbed plain step), the next two do
    not; the three disagree, so three more rounds are timed and the choice says 5 of 6 agree."""
    machine = Machine(0.05)
    warm = len(shapes(True))

    def delays(name, n):
        return 1.5 if warm < machine.calls <= 2 * warm and (name, n) != ("target", 1) else 0.0

    costs = measure(machine, MANY_CORES, delays=delays)
    assert costs.rounds == draft_timing.MAX_ROUNDS and costs.agreeing == 5 and costs.sure
    assert "5 of 6 rounds agree" in choose_draft("M", costs).reason


def test_rounds_that_mostly_disagree_are_unsure_where_the_load_cannot_be_read():
    """/proc/stat unreadable (a container can see the host's): one clean round, then five in which the plain step
    waited 2 steps (every verification then reads cheap). The least times are the clean round's, so the figures
    say the model cannot pay, but 1 round of 6 agrees: unsure, nothing recorded. (Seen for real: a busy Xeon with
    the load reading off read v(2) 1.03, c 0.68, and 2 of 6 rounds agreed.)"""
    machine = Machine(0.9)
    machine.reading = lambda: None
    warm = len(shapes(True))

    def delays(name, n):
        return 2.0 if machine.calls > 2 * warm and (name, n) == ("target", 1) else 0.0

    costs = measure(machine, EPYC, delays=delays)
    assert costs.others is None and (costs.rounds, costs.agreeing) == (6, 1) and not costs.sure
    assert costs.verify[2] == pytest.approx(EPYC[1][2]) and not costs.model_can_pay()
    choice = choose_draft("M", costs)
    assert choice.draft == "suffix" and choice.reason.startswith("unsure: only 1 of 6 rounds of its timing agree")


def test_the_floor_decides_without_the_draft_model_where_it_cannot_pay():
    """Only the target's forwards are timed (c is the floor), and the line says so: 'at least', 'at most'."""
    machine = Machine(0.02)
    costs = measure(machine, EPYC, with_draft=False, floor=0.35)
    assert machine.calls == 4 * (len(draft_choice.MEASURED_KS) + 1)  # the warm-up and 3 rounds, no draft forward
    assert costs.draft_step_floor and costs.draft_step == 0.35 and not costs.model_can_pay()
    choice = choose_draft("M", costs)
    assert choice.draft == "suffix" and "costs at least c = 0.35" in choice.reason and "gives at most" in choice.reason
    cheap = measure(Machine(0.02), MANY_CORES, with_draft=False, floor=0.35)
    assert cheap.model_can_pay()
    with pytest.raises(ValueError, match="floor"):
        choose_draft("M", cheap)  # a floor can rule the model out, never in: it must be timed


def test_the_floor_of_the_default_pair_is_its_share_of_the_bytes():
    from specdecode.models import catalog
    from specdecode.pairing.pair import DEFAULT_DRAFT, DEFAULT_TARGET

    llamacpp = type("Loaded", (), {"backend": "llamacpp"})()
    floor = draft_timing.draft_step_floor(llamacpp, DEFAULT_TARGET, DEFAULT_DRAFT)
    share = catalog.lookup(DEFAULT_DRAFT).size / catalog.lookup(DEFAULT_TARGET).size
    assert floor == pytest.approx(draft_timing.FLOOR_SHARE * share) and 0.3 < floor < 0.57  # 0.57: c measured
    transformers = type("Loaded", (), {"backend": "transformers"})()  # a CPU draft in int8 against an fp32 target
    assert draft_timing.draft_step_floor(transformers, DEFAULT_TARGET, DEFAULT_DRAFT) is None
    assert draft_timing.draft_step_floor(llamacpp, "/no/such/model", DEFAULT_DRAFT) is None


def test_with_the_targets_verifications_timed_before_a_round_times_one_step_of_each_model():
    machine = Machine(0.0)
    verify = {str(n - 1): v for n, v in MANY_CORES[1].items() if n > 1}
    measured = run_rounds(lambda: machine.timer(MANY_CORES), True, load=machine.load(),
                          look=lambda: machine.wait(0.2), verify=verify)
    assert machine.calls == 2 * (1 + measured["rounds"])  # the warm-up and each round: a target and a draft step
    assert measured["v"] == verify and measured["c"] == pytest.approx(MANY_CORES[0])
    assert measured["rounds"] == measured["agreeing"] == 3
    assert choose_draft("M", costs_from_measurement(measured)).draft == "suffix+M"
    full = Machine(0.0)
    run_rounds(lambda: full.timer(MANY_CORES), True, load=full.load(), look=lambda: full.wait(0.2))
    assert full.now - 0.2 > 5 * (machine.now - 0.2)  # every verification in every round (after the 0.2 s look):
    # what a first run that loads the draft no longer waits for


def test_records_without_the_new_fields_still_decide():
    old = {"draft_step": 0.57, "verify": {"1": 1.0, "2": 1.62}, "target_step_ms": 40.0, "measured": "2026-01-01"}
    costs = DraftCosts.from_dict(old)
    assert costs.sure and not costs.draft_step_floor and costs.how_sure() == "measured 2026-01-01"
    assert DraftCosts.from_dict(costs.to_dict()) == costs


# ---------------------------------------------------------------------------------------------- resolve_auto_draft
class _LlamaCppTarget:
    backend = "llamacpp"
    device = type("device", (), {"type": "cpu"})()


@pytest.fixture
def auto(tmp_path, monkeypatch):
    from specdecode.pairing import pair

    path = tmp_path / "costs.json"
    monkeypatch.setattr(draft_choice, "costs_path", lambda: path)
    monkeypatch.setattr(pair, "auto_draft_model", lambda opts: pair.DEFAULT_DRAFT)
    loads, timings = [], []
    monkeypatch.setattr(pair, "load_draft_model", lambda o, *a, **k: loads.append(o.draft_model) or "MODEL")
    monkeypatch.setattr(pair, "measure_pair_costs", lambda *a, **k: timings.append("pair") or _measured(*MANY_CORES))
    return pair, path, loads, timings


def _measured(c, v, others=0.02):
    return {"c": c, "v": {str(n - 1): x for n, x in v.items() if n > 1}, "target_step_ms": 40.0, "others": others,
            "rounds": 3, "agreeing": 3}


def test_a_first_run_on_a_small_cpu_never_loads_the_draft_model(auto, monkeypatch):
    pair, path, loads, timings = auto
    monkeypatch.setattr(pair, "measure_target_costs", lambda target, floor, **k: _measured(floor, EPYC[1]))
    opts = pair.ModelOptions()
    choice, model = pair.resolve_auto_draft(opts, _LlamaCppTarget())
    assert (choice.draft, model, loads, timings) == ("suffix", None, [], [])
    recorded = draft_choice.load_costs(pair.auto_cost_key(pair.ModelOptions(), pair.DEFAULT_DRAFT))
    assert recorded is not None and recorded.draft_step_floor  # later runs decide from the record
    assert "3 of 3 rounds agree, other processes used 2% of the CPUs" in choice.line()


def test_where_the_floor_leaves_a_chance_the_draft_is_loaded_and_timed(auto, monkeypatch):
    pair, path, loads, timings = auto
    target_costs = _measured(0.35, MANY_CORES[1])
    monkeypatch.setattr(pair, "measure_target_costs", lambda target, floor, **k: {**target_costs, "c": floor})
    given = []
    monkeypatch.setattr(pair, "measure_pair_costs",
                        lambda *a, verify=None, **k: timings.append("pair") or given.append(verify) or
                        _measured(*MANY_CORES))
    choice, model = pair.resolve_auto_draft(pair.ModelOptions(), _LlamaCppTarget())
    assert choice.draft == f"suffix+{pair.DEFAULT_DRAFT}" and model == "MODEL"
    assert loads == [pair.DEFAULT_DRAFT] and timings == ["pair"]  # loaded once: timed, then used
    assert given == [target_costs["v"]]  # the target's verifications are not timed twice


def test_a_busy_first_run_loads_nothing_records_nothing_and_the_next_run_looks_again(auto, monkeypatch):
    pair, path, loads, timings = auto
    looks = []
    busy = _measured(0.35, MANY_CORES[1], others=BUSY + 0.5)
    monkeypatch.setattr(pair, "measure_target_costs", lambda target, floor, **k: looks.append(1) or busy)
    for _ in range(2):
        choice, model = pair.resolve_auto_draft(pair.ModelOptions(), _LlamaCppTarget())
        assert (choice.draft, model, loads, timings) == ("suffix", None, [], [])
        assert choice.reason.startswith("unsure: other processes used 75% of the CPUs")
    assert looks == [1, 1] and not path.exists()


def test_the_auto_draft_is_prepared_alongside_only_where_a_core_is_spare(monkeypatch, tmp_path):
    from specdecode.pairing import pair

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pair, "auto_draft_model", lambda opts: "smollm2-135m-instruct")  # a one-file built-in
    opts = pair.ModelOptions(target="qwen2.5-coder-1.5b-instruct", backend="llamacpp")
    monkeypatch.setattr(pair, "_cores", lambda: pair.SPARE_CORES - 1)
    assert pair._unprepared_draft(opts) is None  # its floor will likely rule it out: not prepared for nothing
    explicit = pair.ModelOptions(target=opts.target, draft="smollm2-135m-instruct", backend="llamacpp")
    assert pair._unprepared_draft(explicit).name == "smollm2-135m-instruct"  # a named draft is always needed
    monkeypatch.setattr(pair, "_cores", lambda: pair.SPARE_CORES)
    assert pair._unprepared_draft(opts).name == "smollm2-135m-instruct"


def test_specdecode_costs_names_the_file_the_costs_are_kept_in(tmp_path, monkeypatch):
    """docs/GETTING_STARTED.md: the costs are recorded in the cache's costs.json, or where SPECDECODE_COSTS says (the suite keeps its
    own there, so no test writes the user's record or reads it)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDECODE_COSTS")
    assert draft_choice.costs_path() == tmp_path / "cache" / "costs.json"
    monkeypatch.setenv("SPECDECODE_COSTS", str(tmp_path / "elsewhere.json"))
    draft_choice.save_costs("a key", DraftCosts(0.3, {1: 1.0, 2: 1.5}))
    assert draft_choice.load_costs("a key").verify == {1: 1.0, 2: 1.5}
    assert (tmp_path / "elsewhere.json").exists() and not (tmp_path / "cache").exists()

"""Long copies' verification costs: timed once per machine with the target's own forwards (draft_timing.copy_costs),
recorded with the draft's costs, and the points a CPU run's fixed costs price a long copy from (starting_costs)."""

from __future__ import annotations

import pytest

from specdecode.pairing import draft_choice, draft_timing
from specdecode.pairing.draft_choice import COPY_TOKENS, DraftCosts, costs_from_measurement
from specdecode.pairing.draft_timing import OthersLoad, copy_costs

XEON = {1: 1.0, 17: 5.19, 33: 8.37, 65: 14.57}  # v(n) a 2-vCPU Xeon measured for the 1.5B target (Q4_K_M, 2 threads)
STEP = 0.09


class _Clock:
    def __init__(self, share=0.0):
        self.now, self.busy_s, self.share = 0.0, 0.0, share

    def reading(self):
        return self.busy_s, 0.0, 2

    def timer(self, noise=lambda n, i: 0.0):
        calls = []

        def forward(name, n):
            assert name == "target"
            seconds = STEP * XEON[n] + noise(n, len(calls))
            calls.append(n)
            self.now += seconds
            self.busy_s += self.share * 2 * seconds
            return seconds

        forward.calls = calls
        return forward


def test_copy_costs_are_the_least_of_each_forward_in_target_steps():
    clock = _Clock()
    timer = clock.timer(noise=lambda n, i: 0.5 if i < 3 else 0.0)  # the first round disturbed: the second is kept
    measured = copy_costs(timer, COPY_TOKENS, STEP, load=OthersLoad(clock.reading, lambda: clock.now))
    assert measured == pytest.approx({str(n): XEON[n] for n in COPY_TOKENS})
    assert timer.calls == [17, 33, 65, 17, 33, 65]


def test_copy_costs_on_a_busy_machine_record_nothing():
    clock = _Clock(share=0.9)
    assert copy_costs(clock.timer(), COPY_TOKENS, STEP, load=OthersLoad(clock.reading, lambda: clock.now)) == {}


def _measured(copies):
    return {"c": 0.4, "v": {"1": 1.5, "8": 3.9}, "target_step_ms": 90.0, "others": 0.01, "rounds": 3, "agreeing": 3,
            "copies": copies}


def test_recorded_copies_never_cost_less_than_fewer_tokens_and_round_trip():
    costs = costs_from_measurement(_measured({"17": 3.5, "33": 8.4, "65": 8.0}))
    assert costs.copies == {17: 3.9, 33: 8.4, 65: 8.4}  # a lower reading than a smaller forward's is noise
    assert DraftCosts.from_dict(costs.to_dict()) == costs
    old = costs.to_dict()
    del old["copies"]
    assert DraftCosts.from_dict(old).copies == {}  # a record from before copies were timed still reads


def test_advise_recording_costs_without_copies_keeps_the_records_copies(tmp_path, monkeypatch):
    monkeypatch.setattr(draft_choice, "costs_path", lambda: tmp_path / "costs.json")
    draft_choice.save_costs("k", costs_from_measurement(_measured({"17": 5.0, "33": 8.0, "65": 14.0})))
    draft_choice.save_costs("k", costs_from_measurement(_measured({})))
    assert draft_choice.load_costs("k").copies == {17: 5.0, 33: 8.0, 65: 14.0}
    draft_choice.save_costs("k", costs_from_measurement(_measured({"17": 6.0, "33": 9.0, "65": 15.0})))
    assert draft_choice.load_costs("k").copies == {17: 6.0, 33: 9.0, 65: 15.0}


def test_a_cpu_runs_fixed_costs_price_a_long_copy_from_the_recorded_forwards(tmp_path, monkeypatch):
    from specdecode.pairing import pair, starting_costs
    from specdecode.policy.estimates import CostPrior

    monkeypatch.setattr(draft_choice, "costs_path", lambda: tmp_path / "costs.json")
    monkeypatch.setattr(starting_costs, "on_gpu", lambda opts, target: False)
    opts = pair.ModelOptions(draft="suffix")
    key = draft_choice.cost_key(opts.target, pair.DEFAULT_DRAFT, opts.backend, opts.threads, "auto")
    without = costs_from_measurement(_measured({}))
    draft_choice.save_costs(key, without)
    extended = starting_costs.recorded_cost_prior(opts, object())
    draft_choice.save_costs(key, costs_from_measurement(_measured({"17": 5.19, "33": 8.37, "65": 14.57})))
    prior = starting_costs.recorded_cost_prior(opts, object())
    assert prior.verify_steps(65) == pytest.approx(14.57) and prior.verify_steps(9) == pytest.approx(3.9)
    assert prior.verify_steps(49) == pytest.approx((8.37 + 14.57) / 2)  # interpolated between the timed forwards
    assert extended.verify_steps(65) == pytest.approx(CostPrior.measured(without.verify).verify_steps(65))
    assert extended.verify_steps(65) != pytest.approx(14.57)


def test_measure_costs_times_the_copies_on_a_real_model(tiny_pair, monkeypatch):
    monkeypatch.setattr(draft_timing, "cpu_seconds", lambda: None)  # the load unread: a busy CI still times
    monkeypatch.setattr(draft_timing, "LOOK_S", 0.0)
    measured = draft_timing.measure_costs(tiny_pair[0], None, floor=0.5, rounds=1, max_rounds=1, copies=(5, 9))
    assert measured["rounds"] == 1 and set(measured["copies"]) == {"5", "9"}
    assert all(v > 0 for v in measured["copies"].values())
    assert "copies" not in draft_timing.measure_costs(tiny_pair[0], None, floor=0.5, rounds=1, max_rounds=1)


def test_auto_records_the_copies_timed_with_the_targets_forwards_when_the_draft_model_is_timed_after(
        tmp_path, monkeypatch):
    from specdecode.pairing import pair

    monkeypatch.setattr(draft_choice, "costs_path", lambda: tmp_path / "costs.json")
    monkeypatch.setattr(pair, "auto_draft_model", lambda opts: pair.DEFAULT_DRAFT)
    monkeypatch.setattr(pair, "load_draft_model", lambda *a, **k: "MODEL")
    many_cores = {"c": 0.3, "v": {str(k): 1 + 0.02 * k for k in (1, 2, 3, 4, 6, 8)}, "target_step_ms": 40.0,
                  "others": 0.01, "rounds": 3, "agreeing": 3}
    asked = []
    monkeypatch.setattr(pair, "measure_target_costs", lambda target, floor, **k: {**many_cores, "c": floor})
    monkeypatch.setattr(draft_timing, "measure_copy_costs", lambda target: {"17": 1.4, "65": 2.5})
    monkeypatch.setattr(pair, "measure_pair_costs", lambda *a, verify=None, **k: asked.append(verify) or many_cores)
    target = type("T", (), {"backend": "llamacpp", "device": type("d", (), {"type": "cpu"})()})()
    choice, _ = pair.resolve_auto_draft(pair.ModelOptions(), target)
    assert choice.uses_model and asked == [many_cores["v"]]
    recorded = draft_choice.load_costs(pair.auto_cost_key(pair.ModelOptions(), pair.DEFAULT_DRAFT))
    assert recorded.copies == {17: 1.4, 65: 2.5} and recorded.draft_step == 0.3


def test_a_record_from_before_copies_were_timed_gets_them_once(tmp_path, monkeypatch):
    from specdecode.pairing import pair

    monkeypatch.setattr(draft_choice, "costs_path", lambda: tmp_path / "costs.json")
    monkeypatch.setattr(pair, "auto_draft_model", lambda opts: pair.DEFAULT_DRAFT)
    key = pair.auto_cost_key(pair.ModelOptions(), pair.DEFAULT_DRAFT)
    draft_choice.save_costs(key, costs_from_measurement(_measured({})))
    timings = []
    readings = iter([{}, {"17": 4.0, "33": 6.5, "65": 2.0}])  # a busy machine first: nothing recorded, tried again
    monkeypatch.setattr(draft_timing, "measure_copy_costs", lambda target: timings.append(1) or next(readings))
    target = type("T", (), {"backend": "llamacpp", "device": type("d", (), {"type": "cpu"})()})()
    for _ in range(3):
        choice, model = pair.resolve_auto_draft(pair.ModelOptions(), target)
        assert choice.draft == "suffix" and model is None  # the choice is the record's: c = 0.4 cannot pay here
    assert timings == [1, 1]
    assert draft_choice.load_costs(key).copies == {17: 4.0, 33: 6.5, 65: 6.5}  # never below a smaller forward

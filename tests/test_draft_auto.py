"""--draft auto (draft_choice.py, pair.resolve_auto_draft) and the policy settling where no draft can pay: the
decision is arithmetic on measured costs, the draft model is loaded only when chosen, an explicit --draft wins, and
a settled policy asks the drafter nothing."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specdecode.pairing import draft_choice
from specdecode.pairing.draft_choice import DraftCosts, choose_draft
from specdecode.policy.choose import SETTLED_STEPS, AdaptivePolicy

# The default pair on a 2-core AMD EPYC (shared/PERF_NOTES.md): c = 0.57, v(n) of the target's n-token forward.
EPYC = DraftCosts(0.57, {1: 1.0, 2: 1.62, 3: 2.14, 4: 2.56, 5: 3.14, 7: 4.30, 9: 5.5})
GPU_LIKE = DraftCosts(0.08, {1: 1.0, 2: 1.02, 3: 1.03, 4: 1.05, 5: 1.06, 7: 1.1, 9: 1.15})


@pytest.fixture
def costs_file(tmp_path, monkeypatch):
    path = tmp_path / "costs.json"
    monkeypatch.setattr(draft_choice, "costs_path", lambda: path)
    return path


# ---------------------------------------------------------------------------------------------- the arithmetic
def test_a_draft_that_cannot_pay_even_with_every_draft_kept_gives_the_free_draft():
    k, bound = EPYC.best()
    assert bound == pytest.approx(max((k + 1) / (k * 0.57 + EPYC.verify[k + 1]) for k in (1, 2, 3, 4, 6, 8)))
    assert bound < 1 and not EPYC.model_can_pay()
    choice = choose_draft("draft-model", EPYC)
    assert choice.draft == "suffix" and not choice.uses_model
    assert "c = 0.57" in choice.reason and "1.62" in choice.reason and "not loaded" in choice.reason


def test_a_draft_that_can_pay_gives_suffix_and_the_model():
    assert GPU_LIKE.model_can_pay()
    choice = choose_draft("draft-model", GPU_LIKE)
    assert choice.draft == "suffix+draft-model" and choice.uses_model and "can pay" in choice.reason
    # The model must pay at a typical acceptance (0.9), not only when every draft is kept.
    edge = DraftCosts(0.25, {1: 1.0, 2: 1.45})  # K=1: every draft kept 2 / 1.7 = 1.18; at 0.9: 1.9 / 1.7 = 1.12
    assert choose_draft("m", edge).draft == "suffix+m"
    assert choose_draft("m", edge, margin=0.15).draft == "suffix"  # the margin still applies on top
    marginal = DraftCosts(0.51, {1: 1.0, 2: 1.49, 3: 1.9, 4: 2.3, 5: 2.7, 7: 3.5, 9: 4.1})  # seen on a busy EPYC
    k, full = marginal.best()
    assert full > 1.05 and not marginal.model_can_pay()  # 1.11x only if every draft were kept: a loss on real text
    assert "with every draft kept" in choose_draft("m", marginal).reason
    assert draft_choice.expected_tokens(3, 0.9) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    # a reading where 3 tokens cost less than 2 (seen under load) is taken as at least v(2)
    noisy = draft_choice.costs_from_measurement({"c": 0.67, "v": {"1": 2.28, "2": 1.15, "3": 2.5}})
    assert noisy.verify == {1: 1.0, 2: 2.28, 3: 2.28, 4: 2.5} and not noisy.model_can_pay()


def test_without_costs_a_gpu_takes_the_model_and_a_cpu_must_measure():
    assert choose_draft("m", None, on_gpu=True).draft == "suffix+m"
    with pytest.raises(ValueError, match="measured costs"):
        choose_draft("m", None)
    assert choose_draft(None, None).draft == "suffix"  # no draft model known for the target


def test_costs_are_recorded_per_key(costs_file):
    assert draft_choice.load_costs("a") is None
    draft_choice.save_costs("a", EPYC)
    draft_choice.save_costs("b", GPU_LIKE)
    assert draft_choice.load_costs("a") == EPYC and draft_choice.load_costs("b") == GPU_LIKE


# ---------------------------------------------------------------------------------------------- loading
class _CpuTarget:
    device = type("device", (), {"type": "cpu"})()


def _auto(monkeypatch, model="tiny-draft"):
    from specdecode.pairing import pair

    monkeypatch.setattr(pair, "auto_draft_model", lambda opts: model)
    return pair, pair.ModelOptions()


def test_a_draft_that_cannot_pay_is_not_loaded(costs_file, monkeypatch):
    pair, opts = _auto(monkeypatch)
    draft_choice.save_costs(pair.auto_cost_key(opts, "tiny-draft"), EPYC)
    monkeypatch.setattr(pair, "load_draft_model", lambda *a, **k: pytest.fail("the draft model was loaded"))
    assert opts.draft_is_auto
    choice, model = pair.resolve_auto_draft(opts, _CpuTarget())
    assert model is None and choice.draft == "suffix" and opts.draft == "suffix" and opts.draft_choice is choice
    assert type(pair.load_draft(opts)).__name__ == "SuffixDrafter"


def test_a_draft_that_can_pay_is_loaded_once(costs_file, monkeypatch):
    pair, opts = _auto(monkeypatch)
    draft_choice.save_costs(pair.auto_cost_key(opts, "tiny-draft"), GPU_LIKE)
    loads = []
    monkeypatch.setattr(pair, "load_draft_model", lambda o, *a, **k: loads.append(o.draft_model) or "MODEL")
    choice, model = pair.resolve_auto_draft(opts, _CpuTarget())
    assert (choice.draft, model, loads) == ("suffix+tiny-draft", "MODEL", ["tiny-draft"])
    assert opts.draft_with_suffix and opts.draft_model == "tiny-draft"


def test_an_explicit_draft_wins(costs_file, monkeypatch):
    pair, _ = _auto(monkeypatch)
    for draft in ("suffix", "none", "tiny-draft", "suffix+tiny-draft", "prompt-lookup"):
        opts = pair.ModelOptions(draft=draft)
        assert pair.resolve_auto_draft(opts, _CpuTarget()) == (None, None) and opts.draft == draft
    assert not costs_file.exists()  # nothing was measured either


def test_first_use_measures_records_and_releases_an_unused_draft(costs_file, monkeypatch, tiny_model_dirs):
    from specdecode import load_model
    from specdecode.pairing import draft_timing

    pair, opts = _auto(monkeypatch, tiny_model_dirs["draft"])
    opts.target = tiny_model_dirs["target"]
    target = load_model(tiny_model_dirs["target"], threads=1)
    measure = pair.measure_pair_costs
    measured = []
    # the real measurement, with the machine's load unread (whatever other processes do here: see the next test)
    monkeypatch.setattr(draft_timing, "cpu_seconds", lambda: None)
    monkeypatch.setattr(pair, "measure_pair_costs", lambda *a, **k: measured.append(1) or measure(*a, **k))
    choice, model = pair.resolve_auto_draft(opts, target)
    assert measured == [1]
    costs = draft_choice.load_costs(pair.auto_cost_key(opts, tiny_model_dirs["draft"]))
    assert costs is not None and costs.draft_step > 0 and set(costs.verify) == {1, 3, 4, 5, 7, 9, 2}
    assert choice.draft == ("suffix+" + tiny_model_dirs["draft"] if costs.model_can_pay() else "suffix")
    assert (model is None) == (not costs.model_can_pay())
    monkeypatch.setattr(pair, "measure_pair_costs", lambda *a, **k: pytest.fail("measured twice"))
    again = pair.ModelOptions(target=tiny_model_dirs["target"])
    assert pair.resolve_auto_draft(again, target)[0].draft == choice.draft  # the record decides now


def test_a_measurement_on_a_busy_machine_decides_this_run_only(costs_file, monkeypatch, tiny_model_dirs):
    """Costs measured while other processes used more than BUSY of the CPUs are not recorded, and the run takes the
    free draft whatever they say (here that the model would pay): the next run measures again."""
    from specdecode import load_model

    pair, opts = _auto(monkeypatch, tiny_model_dirs["draft"])
    opts.target = tiny_model_dirs["target"]
    target = load_model(tiny_model_dirs["target"], threads=1)
    busy = {"c": 0.02, "v": {str(k): 1.0 for k in draft_choice.MEASURED_KS}, "target_step_ms": 4000.0,
            "others": draft_choice.BUSY + 0.1, "rounds": 3, "agreeing": 3}
    calls = []
    monkeypatch.setattr(pair, "measure_pair_costs", lambda *a, **k: calls.append(1) or busy)
    for _ in range(2):
        choice, model = pair.resolve_auto_draft(pair.ModelOptions(target=tiny_model_dirs["target"]), target)
        assert choice.draft == "suffix" and model is None and choice.reason.startswith("unsure: other processes")
        assert "records nothing" in choice.line()
    assert calls == [1, 1] and not costs_file.exists()


def test_the_measurement_reports_how_sure_it_is(tiny_model_dirs):
    from specdecode import load_model
    from specdecode.pairing.pair import measure_pair_costs

    target = load_model(tiny_model_dirs["target"], threads=1)
    draft = load_model(tiny_model_dirs["draft"], threads=1)
    measured = measure_pair_costs(target, draft, rounds=3)
    assert set(measured) == {"c", "v", "target_step_ms", "others", "rounds", "agreeing"}
    if measured["rounds"]:  # this machine was quiet enough to time it
        assert measured["c"] > 0 and measured["target_step_ms"] > 0 and 0 <= measured["agreeing"] <= measured["rounds"]
        assert set(measured["v"]) == {str(k) for k in draft_choice.MEASURED_KS}
    assert measured["others"] is None or 0 <= measured["others"] <= 1


def test_other_targets_have_no_auto_draft_model():
    from specdecode.pairing.pair import ModelOptions, auto_draft_model

    assert auto_draft_model(ModelOptions(target="/some/dir")) is None


def test_the_first_output_and_the_policy_line_name_the_choice(costs_file, tiny_model_dirs, monkeypatch):
    from specdecode.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["generate", "def f(x):\n    return f(x)", "-n", "12", "--ignore-eos", "-v",
                                 "--target", tiny_model_dirs["target"]])
    assert result.exit_code == 0, result.output
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "draft: suffix (--draft auto: no draft model is known for this target" in text
    assert "policy: draft suffix (--draft auto:" in text
    pair, _ = _auto(monkeypatch, tiny_model_dirs["draft"])
    key = pair.auto_cost_key(pair.ModelOptions(target=tiny_model_dirs["target"], threads=1), tiny_model_dirs["draft"])
    draft_choice.save_costs(key, EPYC)
    result = runner.invoke(app, ["generate", "def f(x):", "-n", "4", "--target", tiny_model_dirs["target"],
                                 "--threads", "1"])
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 0 and "draft: suffix (--draft auto: the draft model" in text and "c = 0.57" in text


def test_a_first_generate_does_not_wait_for_the_timing_and_the_next_run_times(costs_file, monkeypatch):
    """A one-off run (first_run_waits=False, as `generate` asks) with nothing recorded drafts for free at once and
    leaves the timing to the next run, which times and records it; a GPU never waits; the record clears the mark."""
    pair, _ = _auto(monkeypatch)
    timings = []
    monkeypatch.setattr(pair, "measure_auto_costs", lambda *a, **k: timings.append(1) or (EPYC, None))
    opts = pair.ModelOptions()
    choice, model = pair.resolve_auto_draft(opts, _CpuTarget(), first_run_waits=False)
    assert (choice.draft, model, timings, opts.draft) == ("suffix", None, [], "suffix")
    assert "not timed on this machine yet" in choice.line() and "the next run times it" in choice.line()
    key = pair.auto_cost_key(opts, "tiny-draft")
    assert draft_choice.load_costs(key) is None and key in draft_choice._records()[draft_choice.UNTIMED]
    choice, _ = pair.resolve_auto_draft(pair.ModelOptions(), _CpuTarget(), first_run_waits=False)
    assert timings == [1] and "c = 0.57" in choice.reason  # the second run timed it, and recorded it
    assert draft_choice.load_costs(key) == EPYC and key not in draft_choice._records()[draft_choice.UNTIMED]
    pair.resolve_auto_draft(pair.ModelOptions(), _CpuTarget(), first_run_waits=False)
    assert timings == [1]  # the record decides from now on
    gpu = type("target", (), {"device": type("device", (), {"type": "cuda"})()})()
    monkeypatch.setattr(pair, "load_draft_model", lambda *a, **k: "MODEL")
    costs_file.unlink()
    assert pair.resolve_auto_draft(pair.ModelOptions(), gpu, first_run_waits=False)[0].draft == "suffix+tiny-draft"


def test_a_first_run_that_cannot_mark_times_at_once(costs_file, monkeypatch):
    """Where the cache cannot be written no later run would ever time: every run times (as before)."""
    pair, _ = _auto(monkeypatch)
    monkeypatch.setattr(pair, "measure_auto_costs", lambda *a, **k: (EPYC, None))
    monkeypatch.setattr(draft_choice, "_write_records", lambda records: False)
    choice, _ = pair.resolve_auto_draft(pair.ModelOptions(), _CpuTarget(), first_run_waits=False)
    assert "c = 0.57" in choice.reason


def test_generate_leaves_the_timing_to_the_next_run_and_serve_times_at_once(costs_file, tiny_model_dirs,
                                                                            monkeypatch):
    from specdecode.cli import common

    pair, _ = _auto(monkeypatch, tiny_model_dirs["draft"])
    waits = []
    real = pair.resolve_auto_draft
    monkeypatch.setattr(pair, "resolve_auto_draft",
                        lambda *a, first_run_waits=True, **k: waits.append(first_run_waits) or real(
                            *a, first_run_waits=first_run_waits, **k))
    monkeypatch.setattr(pair, "measure_auto_costs", lambda *a, **k: (EPYC, None))
    from specdecode.cli.app import app

    result = CliRunner().invoke(app, ["generate", "def f(x):", "-n", "4", "--target", tiny_model_dirs["target"],
                                      "--threads", "1"])
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 0, text
    assert waits == [False] and "draft: suffix (--draft auto: not timed on this machine yet" in text
    common.load_pair(pair.ModelOptions(target=tiny_model_dirs["target"], threads=1), quiet=True)  # serve's call
    assert waits == [False, True]


# ---------------------------------------------------------------------------------------------- settling
def _observe_costs(policy, c=0.57, verify=None, model=True):
    """Two timed plain steps and two timed K=1 and K=2 steps at these costs (seconds = target steps), from a draft
    model."""
    policy.model_drafts = model
    verify = verify or {1: 1.0, 2: 1.62, 3: 2.14}
    rows = [policy.new_row()]
    for _ in range(2):
        policy.choose(rows, [8])
        policy.observe(rows, 0, [0], 1, None, verify[1])
        for k in (1, 2):
            policy.choose(rows, [8])
            policy.observe(rows, k, [k], 1, k * c, verify[k + 1])
    return rows


def _run(policy, rows, steps, plain_s=1.0):
    choices = []
    for _ in range(steps):
        k = policy.choose(rows, [8])
        choices.append(k)
        policy.observe(rows, k, [0], 1, k * 0.57 * plain_s if k else None, plain_s * (1.0 if k == 0 else 1.62))
    return choices


def test_the_policy_settles_where_no_draft_can_pay_and_rechecks_rarely():
    policy = AdaptivePolicy(8)
    rows = _observe_costs(policy)
    explored = policy.explorations  # while the costs were being timed
    assert policy.choose(rows, [8]) == 0 and policy.settled  # nothing explored: no K could pay
    assert "nothing is drafted or probed" in policy.explain()
    assert not any(_run(policy, rows, 2 * SETTLED_STEPS + 10))  # steady costs: the re-checks cost no draft
    assert policy.summary()["settles"] == 1 and policy.probes == 0 and policy.explorations == explored
    # The machine got twice as fast (another process's load went away): the next re-check probes, once.
    choices = _run(policy, rows, SETTLED_STEPS + 10, plain_s=0.5)
    drafted = [i for i, k in enumerate(choices) if k]
    assert len(drafted) == 1 and policy.probes == 1 and policy.settled  # the probe lost: settled again


def test_free_drafts_cheap_drafts_and_copying_drafters_never_settle():
    cheap = AdaptivePolicy(8)
    rows = _observe_costs(cheap, c=0.05, verify={1: 1.0, 2: 1.02, 3: 1.04})
    cheap.choose(rows, [8])
    assert not cheap.settled
    free = AdaptivePolicy(8)
    free._free_drafts = True  # every choice prices free drafts (what decide() takes from Outlook.free)
    rows = _observe_costs(free)
    free.choose(rows, [8])
    assert not free.settled
    copies = AdaptivePolicy(8)
    rows = _observe_costs(copies, model=False)  # a suffix drafter's cost (or suffix+MODEL's copies): not per K
    copies.choose(rows, [8])
    assert not copies.settled


def test_a_settled_session_never_asks_the_draft(tiny_pair, tokenizer):
    from specdecode import SpeculativeGenerator

    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto", tokenizer=tokenizer)
    _observe_costs(gen.policy)
    gen.policy.choose([gen.policy.new_row()], [8])
    assert gen.policy.settled
    calls = []
    for name in ("outlook", "propose"):  # the drafter's verbs that a step asks (drafters/base.py)
        original = getattr(gen.drafter, name)
        setattr(gen.drafter, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    result = gen.generate([[5, 17, 42, 99]], max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = SpeculativeGenerator(target, draft, num_speculative_tokens=0, tokenizer=tokenizer)
    assert result.token_ids == plain.generate([[5, 17, 42, 99]], max_new_tokens=24, temperature=0,
                                              ignore_eos=True).token_ids
    assert calls == [] and result.stats.draft_forward_calls == 0 and result.stats.proposed_tokens == 0


def test_advise_agrees_with_auto_and_records_its_costs(costs_file, tiny_model_dirs, monkeypatch):
    import json

    from specdecode.bench.advise import DraftCost, draft_auto
    from specdecode.cli.app import app

    assert draft_auto({"cost": DraftCost(0.57)}, EPYC.verify, 36.0)["draft"] == choose_draft("MODEL", EPYC).draft
    assert draft_auto({"cost": DraftCost(0.08)}, GPU_LIKE.verify, 36.0)["draft"] == "suffix+MODEL"
    target, draft = tiny_model_dirs["target"], tiny_model_dirs["draft"]
    result = CliRunner().invoke(app, ["advise", "--target", target, "--draft", draft, "--threads", "1",
                                      "--nb-prompts", "1", "-n", "4", "-k", "2", "--measure", "none", "--json"])
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)["draft_auto"]
    pair, _ = _auto(monkeypatch, draft)
    opts = pair.ModelOptions(target=target, threads=1)
    recorded = draft_choice.load_costs(pair.auto_cost_key(opts, draft))
    assert recorded is not None and recorded.draft_step == pytest.approx(auto["costs"]["draft_step"])
    monkeypatch.setattr(pair, "load_draft_model", lambda *a, **k: "MODEL")
    choice, _ = pair.resolve_auto_draft(opts, _CpuTarget())
    assert choice.draft == auto["draft"]  # generate would choose what advise said


def test_a_pair_the_catalog_does_not_know_pays_at_advises_acceptance(costs_file, monkeypatch):
    """advise takes a draft whose tokenizer matches at a good pair's acceptance; generate must read its record the
    same way, or costs between the two bounds (these: 1.19x at 90 % kept, 1.00x at 70 %) flip the choice."""
    from specdecode.bench.advise import DraftCost, draft_auto
    from specdecode.pairing.draft_choice import CROSS_TOKENIZER_ACCEPTANCE, TYPICAL_ACCEPTANCE

    between = {1: 1.0, 2: 1.5, 3: 1.9, 4: 2.3, 5: 2.7, 7: 3.5, 9: 4.3}
    costs = DraftCosts(0.2, between)
    assert costs.model_can_pay(acceptance=TYPICAL_ACCEPTANCE)
    assert not costs.model_can_pay(acceptance=CROSS_TOKENIZER_ACCEPTANCE)
    auto = draft_auto({"cost": DraftCost(0.2)}, between, 30.0)
    pair, _ = _auto(monkeypatch, "/models/draft")
    opts = pair.ModelOptions(target="/models/target", threads=1)
    assert pair.auto_acceptance(opts, "/models/draft") == TYPICAL_ACCEPTANCE
    draft_choice.save_costs(pair.auto_cost_key(opts, "/models/draft"), DraftCosts.from_dict(auto["costs"]))
    monkeypatch.setattr(pair, "load_draft_model", lambda *a, **k: "MODEL")
    choice, _ = pair.resolve_auto_draft(opts, _CpuTarget())
    assert auto["draft"] == "suffix+MODEL" and choice.draft == "suffix+/models/draft"

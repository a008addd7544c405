"""The costs the speculation policy starts from (policy.estimates.CostPrior): a GPU's shape by default, this
machine's recorded costs of the target where `--draft auto` or `advise` measured them (pairing/pair.py,
recorded_cost_prior), else, for a real model on a CPU, a CPU's shape (CostPrior.cpu). On a 2-core CPU the default
takes verifying 2 tokens for 1.15 steps where it costs 1.7, so a short run's first steps draft where nothing can pay;
started from the machine's curve, or a CPU's shape, the policy decodes plainly from the first step and only probes."""

from __future__ import annotations

import json
import random
import statistics
import types

import pytest
import torch

from specdecode.pairing import draft_choice
from specdecode.pairing.pair import ModelOptions, recorded_cost_prior
from specdecode.policy.choose import AdaptivePolicy, FixedPolicy, Outcome, Outlook, make_policy
from specdecode.policy.estimates import CostPrior
from test_policy import curve, simulate

# A 2-core Xeon's measured v(n) of Qwen2.5-Coder-1.5B on llama.cpp (2026-11-29), and a cross-tokenizer draft's
# cost and acceptance there (SmolLM2-135M: c about 0.3 with its text bridged, 40-60 % of drafts kept)
XEON = {1: 1.0, 2: 1.72, 3: 1.98, 4: 2.24, 5: 2.5, 7: 3.1, 9: 3.7}
C, ALPHA = 0.3, 0.5


def test_the_default_prior_is_a_gpus_shape_and_a_measured_one_follows_its_points():
    default = CostPrior()
    assert default.verify_steps(1) == 1.0 and default.verify_steps(5) == pytest.approx(1.6)
    assert default.draft_step == pytest.approx(0.3)
    measured = CostPrior.measured({2: 1.72, 4: 2.24, 9: 3.7}, draft_step=0.21)
    assert measured.verify_steps(1) == 1.0 and measured.verify_steps(2) == pytest.approx(1.72)
    assert measured.verify_steps(3) == pytest.approx(1.98)  # between two points: on the line
    assert measured.verify_steps(11) == pytest.approx(3.7 + 2 * (3.7 - 2.24) / 5)  # past the last: the last slope
    assert measured.draft_step == pytest.approx(0.21)
    assert CostPrior.measured({2: 1.5}).draft_step == pytest.approx(0.3)  # no timed draft: the default step
    with pytest.raises(ValueError, match="v\\(n\\) > 0"):
        CostPrior.measured({2: -1.0})


def test_a_policy_reads_its_untimed_costs_from_its_prior():
    prior = CostPrior.measured(XEON, draft_step=0.25)
    policy = AdaptivePolicy(8, prior=prior)
    assert policy.verify_cost(2, 1) == pytest.approx(1.72) and policy.draft_cost(1) == pytest.approx(0.25)
    rows = [policy.new_row()]
    policy.observe(rows, 0, [0], 1, 0.0, 0.120)  # a plain step timed: 120 ms
    assert policy.verify_cost(3, 1) == pytest.approx(0.120 * 1.98)  # the prior's shape, scaled to the timing
    assert policy.draft_cost(1) == pytest.approx(0.120 * 0.25)
    assert make_policy("auto", 8, prior).prior is prior and make_policy(2, 8, prior).prior is prior
    assert FixedPolicy(2).prior == CostPrior()


def test_on_a_steep_machine_a_measured_prior_decodes_plainly_from_the_first_step():
    v, prior = curve(XEON), CostPrior.measured(XEON, C)
    default, measured = [], []
    for seed in range(5):  # 128 steps: a short answer, where the first steps weigh most
        default_rate, default_ks = simulate(AdaptivePolicy(8), 128, v, C, ALPHA, seed=seed)
        prior_rate, prior_ks = simulate(AdaptivePolicy(8, prior=prior), 128, v, C, ALPHA, seed=seed)
        assert default_ks[0] > 0  # the GPU's shape drafts (explores) at once
        assert prior_ks[:8] == [0] * 8  # nothing drafted before the first probe
        default.append(default_rate)
        measured.append(prior_rate)
    # rates relative to plain decoding's (v(1) = 1): what is left is the probes', which find out whether the text
    # has become one the draft knows
    assert statistics.median(measured) >= 0.975
    assert statistics.median(measured) > statistics.median(default) + 0.01


def _run_with_catch_up(policy, v, c: float, alpha: float, tokens: int, prompt: int = 40, per_token: float = 0.1,
                       window: int = 32, seed: int = 0):
    """One answer of `tokens` tokens as the loop drives the policy with a model draft: the draft has read nothing of
    the prompt, falls a token behind on each plain step, and catches up before drafting (all of it, or at most its
    window on a probe or an exploration), at per_token target steps a token fed (a 135M draft on 2 cores: 31 tokens
    ~3 steps). Returns (tokens per target step, the Ks)."""
    rng = random.Random(seed)
    rows = [policy.new_row()]
    behind, made, seconds, ks = prompt, 0, 0.0, []
    while made < tokens:
        row = rows[0]
        row.behind, row.probe_behind, row.remaining = behind, min(behind, window), tokens - made
        choice = policy.decide(Outlook(rows, [min(8, tokens - made - 1)]))
        k, fed = choice.k, 0
        if k:
            fed = min(behind, window) if choice.trial else behind
            seconds += fed * per_token
            policy.learn(Outcome([], 0, [], [], 1, None, None, catch_up_tokens=fed, catch_up_s=fed * per_token))
        kept = 0
        while kept < k and rng.random() < alpha:
            kept += 1
        step = k * c + v(k + 1)
        seconds += step
        jitter = 1 + 0.04 * (rng.random() - 0.5)
        policy.learn(Outcome(rows, k, [kept], [k], 1, k * c * jitter if k else 0.0, v(k + 1) * jitter))
        made += kept + 1
        behind = behind + 1 if k == 0 else 1
        ks.append(k)
    return made / seconds, ks


def test_a_cpus_shape_decodes_plainly_and_still_finds_a_draft_that_pays():
    """CostPrior.cpu(): v(n) = 1 + 0.5 (n - 1), what the CLI starts a real model on a CPU from where nothing is
    recorded. On the 2-core Xeon's curve with a 135M draft of another tokenizer and a 40-token prompt, a 128-token
    answer from the GPU's shape drafts at once and pays the draft's reading of the prompt for nothing; from the CPU's
    shape it decodes plainly throughout (an exploration's catch-up would be more than 1 % of the answer), and in
    answers of 512 and 1,000 tokens its trials cost under 1.2 % (counting only their catch-ups against the budget,
    at 2 %, they cost 1.4-2 %). Where drafts do pay (a flat many-core curve and a good draft) the CPU's shape only
    delays them: its explorations time the curve and it speculates for most of a long answer."""
    steep, v = CostPrior.cpu(), curve(XEON)
    assert steep == CostPrior(slope=0.5)
    assert steep.verify_steps(3) == pytest.approx(2.0) and steep.draft_step == CostPrior().draft_step
    with pytest.raises(ValueError, match="slope >= 0"):
        CostPrior(slope=-0.1)
    for seed in range(3):
        default_rate, default_ks = _run_with_catch_up(AdaptivePolicy(8), v, C, ALPHA, 128, seed=seed)
        steep_rate, steep_ks = _run_with_catch_up(AdaptivePolicy(8, prior=steep), v, C, ALPHA, 128, seed=seed)
        assert default_ks[0] > 0 and default_rate < 0.97
        assert set(steep_ks) == {0} and steep_rate == pytest.approx(1.0)
        for tokens in (512, 1000):
            rate, _ = _run_with_catch_up(AdaptivePolicy(8, prior=steep), v, C, ALPHA, tokens, seed=seed)
            assert rate > 0.988
    flat = curve({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})
    rate, ks = _run_with_catch_up(AdaptivePolicy(8, prior=steep), flat, 0.1, 0.8, 1000, per_token=0.03)
    first = next(t for t, k in enumerate(ks) if k)
    assert 0 < first < 200 and rate > 1.7  # its first exploration waits for its catch-up at the prior's price


def test_the_cli_starts_a_real_model_on_a_cpu_without_a_record_from_a_cpus_shape(tmp_path, monkeypatch):
    """recorded_cost_prior with nothing recorded: a target of 100 MB or more of weights (its GGUF file, or its
    directory's safetensors) starts from CostPrior.cpu(); a smaller one (a forward of a few MB is fixed costs: flat)
    and a model the caller built (no path) from the default; a GPU from the default whatever the size."""
    from specdecode.models.sources import LoadedModel

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # nothing recorded
    opts = ModelOptions(target="qwen2.5-coder-1.5b-instruct", draft="smollm2-135m-instruct")

    def loaded(path, size: int, device: str = "cpu") -> LoadedModel:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)  # sparse: the size without the bytes
        model = types.SimpleNamespace(device=torch.device(device))
        return LoadedModel(model=model, tokenizer=None, name="m", path=str(path if path.suffix == ".gguf" else
                                                                             path.parent))

    assert recorded_cost_prior(opts, loaded(tmp_path / "big.gguf", 900 * 2**20)) == CostPrior.cpu()
    assert recorded_cost_prior(opts, loaded(tmp_path / "hf" / "model.safetensors", 300 * 2**20)) == CostPrior.cpu()
    assert recorded_cost_prior(opts, loaded(tmp_path / "tiny" / "model.safetensors", 2 * 2**20)) is None
    assert recorded_cost_prior(opts, object()) is None
    gpu = ModelOptions(target=opts.target, draft=opts.draft, device_map="auto")
    assert recorded_cost_prior(gpu, loaded(tmp_path / "big.gguf", 900 * 2**20)) is None
    assert recorded_cost_prior(opts, loaded(tmp_path / "big.gguf", 900 * 2**20, device="cuda")) is None


def _record(path, entries: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))


def _costs(verify: dict, c: float, floor: bool = False, others: float | None = 0.01, measured="2026-11-29") -> dict:
    return {"draft_step": c, "verify": {str(n): v for n, v in verify.items()}, "measured": measured,
            "draft_step_floor": floor, "others": others}


def test_the_recorded_costs_of_the_target_become_the_cli_policys_prior(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    key = lambda target, draft, threads=None: draft_choice.cost_key(target, draft, "auto", threads, "auto")  # noqa
    opts = ModelOptions(target="qwen2.5-coder-1.5b-instruct", draft="smollm2-135m-instruct")
    assert recorded_cost_prior(opts, object()) is None  # nothing recorded: the default
    _record(draft_choice.costs_path(), {
        key("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"): _costs({2: 1.72, 4: 2.24}, 0.35, True),
        key("qwen2.5-coder-1.5b-instruct", "other", threads=1): _costs({2: 9.0}, 0.1),  # other threads: not ours
        key("another-target", "smollm2-135m-instruct"): _costs({2: 5.0}, 0.1),  # another target: not ours
        key("qwen2.5-coder-1.5b-instruct", "busy"): _costs({2: 1.1}, 0.2, others=0.9, measured="2026-12-01"),
    })
    prior = recorded_cost_prior(opts, object())
    assert prior.verify_steps(2) == pytest.approx(1.72) and prior.verify_steps(4) == pytest.approx(2.24)
    assert prior.draft_step == pytest.approx(0.3)  # the record's c is another draft's floor: the default step
    _record(draft_choice.costs_path(), {
        key("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"): _costs({2: 1.72, 4: 2.24}, 0.35, True),
        key("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"): _costs({2: 1.6, 3: 1.9}, 0.21),
    })
    prior = recorded_cost_prior(opts, object())
    assert prior.verify_steps(2) == pytest.approx(1.6) and prior.draft_step == pytest.approx(0.21)  # its own c
    assert recorded_cost_prior(ModelOptions(target=opts.target, draft="none"), object()) is None  # no draft
    assert recorded_cost_prior(ModelOptions(target=opts.target, draft=opts.draft, device_map="auto"),
                               object()) is None  # a GPU: its own shape


def test_the_generator_keeps_its_prior_for_every_call(tiny_pair, tokenizer):
    from specdecode import SpeculativeGenerator

    prior = CostPrior.measured(XEON)
    gen = SpeculativeGenerator(*tiny_pair, num_speculative_tokens="auto", tokenizer=tokenizer,
                               cost_prior=prior)
    assert gen.policy.prior is prior
    seen = []
    original = make_policy

    def spy(spec, max_k=8, prior=None):
        seen.append(prior)
        return original(spec, max_k, prior)

    import specdecode.engine.generators as generators
    generators.make_policy, restore = spy, generators.make_policy
    try:
        gen.generate(["ab"], max_new_tokens=2, temperature=0, num_speculative_tokens=2)
    finally:
        generators.make_policy = restore
    assert seen == [prior]


def test_bench_starts_its_policies_from_the_costs_it_is_given(tiny_pair):
    """`bench` passes generate's starting costs (recorded_cost_prior) to every speculative generator it times, so
    `bench -k auto` measures the policy `generate` runs."""
    from specdecode.bench.runner import Bench, BenchSettings

    prior = CostPrior.measured(XEON)
    runner = Bench(*tiny_pair, [[1, 2, 3]], BenchSettings(ks=["auto", 2], methods=("specdecode",)), cost_prior=prior)
    assert len(runner.ctx.spec) == 2 and all(gen.policy.prior is prior for gen in runner.ctx.spec.values())

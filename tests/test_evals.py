"""`specdecode eval multiplication` and `specdecode verify`: parsing, problems, the exact reference distribution,
the verdicts (PASS for exact samplers, FAIL for a wrong one), and both commands end to end on the tiny models."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specdecode.backends.hf import HFBackend
from specdecode.evals import multiplication as mul
from specdecode.evals.verify import (REST, check_samples, exact_distribution, sample_exact, sample_speculative,
                                     verify_pair)
from specdecode.exact.sampling import SamplingParams, logits_to_probs


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cli(args):
    from specdecode.cli import app

    return CliRunner().invoke(app, args, catch_exceptions=False)


def _models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--draft-quantize", "none", "--threads", "1"]


# ------------------------------------------------------------------------------------------ multiplication
@pytest.mark.parametrize("text, expected", [
    (" 1035\n", 1035), ("1,035", 1035), (" = 408 because", 408), ("answer: -12", -12), ("  42.", 42),
    ("no number", None), ("", None), (" 12,", 12), ("7 * 86 = 602", 7),
])
def test_parse_answer(text, expected):
    assert mul.parse_answer(text) == expected


def test_problems_are_seeded_and_pooled():
    a = mul.make_problems(20, [0])
    assert a == mul.make_problems(20, [0])
    assert a != mul.make_problems(20, [1])
    pooled = mul.make_problems(20, [0, 1])
    assert len(pooled) == 40 and pooled[:20] == a and {p.seed for p in pooled} == {0, 1}
    assert all(1 <= p.a <= 99 and 1 <= p.b <= 99 and p.answer == p.a * p.b for p in pooled)
    prompt = mul.make_prompt(23, 47)
    assert prompt.endswith("23 * 47 =") and "12 * 34 = 408\n" in prompt
    with pytest.raises(ValueError):
        mul.make_problems(0, [0])


def test_eval_multiplication_cli(tiny_model_dirs, tmp_path, one_thread):
    path = tmp_path / "mul.json"
    result = _cli(["eval", "multiplication", *_models(tiny_model_dirs), "--nb-prompts", "6", "--seed", "0,1",
                   "--max-new-tokens", "3", "-k", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "Wilson" in result.stdout and "p =" in result.stdout
    report = json.loads(path.read_text())
    assert report["n"] == 12 and report["seeds"] == [0, 1]
    for name in ("plain", "speculative"):
        m = report["methods"][name]
        low, high = m["ci95"]
        assert 0.0 <= low <= m["accuracy"] <= high <= 1.0 and m["n"] == 12
    assert 0.0 <= report["comparison"]["p_value"] <= 1.0
    assert len(report["problems"]) == 12 and report["sampling"]["temperature"] == 0.7


# ------------------------------------------------------------------------------------------ verify: the core
PARAMS = SamplingParams(temperature=1.0, top_k=3)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer("def quicksort(arr):\n")["input_ids"]


@pytest.fixture(scope="module")
def exact_target(tiny_pair, tokenizer, prompt_ids):
    backend = HFBackend(tiny_pair[0], len(tokenizer))
    return exact_distribution(backend, prompt_ids, PARAMS, positions=3, n_samples=3000)


def test_exact_distribution_is_the_targets(tiny_pair, tokenizer, prompt_ids, exact_target):
    exact = exact_target
    assert sum(exact.joint.values()) == pytest.approx(1.0, abs=1e-6)  # top-3, 3 positions: fully enumerated
    assert len(exact.joint) <= 27 and exact.joint_rest < 1e-6
    with torch.no_grad():
        logits = tiny_pair[0](torch.tensor([prompt_ids])).logits[0, -1, : len(tokenizer)]
    first = logits_to_probs(logits, PARAMS)
    for token, p in exact.marginals[0].items():
        assert p == pytest.approx(float(first[token]), abs=1e-5)
    # each marginal is the sum of the joint over the other positions
    for j in range(3):
        summed = {}
        for seq, p in exact.joint.items():
            summed[seq[j]] = summed.get(seq[j], 0.0) + p
        for token, p in summed.items():
            assert exact.marginals[j][token] == pytest.approx(p, abs=1e-6)


def test_exact_samples_pass_and_draft_samples_fail(tiny_pair, tokenizer, prompt_ids, exact_target):
    n = 3000
    ok = check_samples(exact_target, sample_exact(exact_target, n, seed=1))
    assert ok["pass"], [t for t in ok["tests"] if not t["pass"]]
    # A wrong sampler: sequences drawn from the DRAFT's distribution instead of the target's.
    draft = HFBackend(tiny_pair[1], len(tokenizer))
    exact_draft = exact_distribution(draft, prompt_ids, PARAMS, positions=3, n_samples=n)
    wrong = check_samples(exact_target, sample_exact(exact_draft, n, seed=2))
    assert not wrong["pass"]
    assert any(t["p_value"] < wrong["level"] for t in wrong["tests"])
    # A subtler wrong sampler: the target's first token, then the draft's continuation (only later positions differ)
    mixed = [target_seq[:1] + draft_seq[1:] for target_seq, draft_seq in
             zip(sample_exact(exact_target, n, seed=3), sample_exact(exact_draft, n, seed=4))]
    report = check_samples(exact_target, mixed)
    assert not report["pass"] and report["tests"][0]["pass"]


def test_impossible_sample_fails(exact_target):
    samples = sample_exact(exact_target, 500, seed=5)
    outside = next(t for t in range(300) if t not in exact_target.marginals[0])  # outside the top-3
    samples[0] = (outside,) + samples[0][1:]
    report = check_samples(exact_target, samples)
    assert not report["pass"]
    assert exact_target.marginal_cell(samples[0], 0) == REST
    assert report["tests"][0]["reasons"] and "no probability" in report["tests"][0]["reasons"][0]


def test_speculative_sampler_passes(tiny_pair, tokenizer, prompt_ids, one_thread):
    from specdecode.engine.generators import SpeculativeGenerator

    gen = SpeculativeGenerator(tiny_pair[0], tiny_pair[1], num_speculative_tokens=2, tokenizer=tokenizer)
    report = verify_pair(gen, [prompt_ids], PARAMS, positions=4, samples=1500, batch_size=250, seed=11)
    assert report["pass"], [t for t in report["prompts"][0]["tests"] if not t["pass"]]
    assert report["speculative_path_exercised"] and report["max_drafts_per_step_exercised"] == 2
    drawn = report["prompts"][0]["provenance"]
    assert drawn.get("accepted", 0) > 0 and drawn.get("resampled", 0) > 0  # both branches of the sampler ran


def test_every_sample_has_its_own_seed(tiny_pair, tokenizer, prompt_ids, one_thread):
    """The engine seeds row j of a call with seed + j, so the samples must not depend on how they are batched
    (batches seeded seed, seed + 1, ... would repeat each other's draws)."""
    from specdecode.engine.generators import SpeculativeGenerator

    gen = SpeculativeGenerator(tiny_pair[0], tiny_pair[1], num_speculative_tokens=2, tokenizer=tokenizer)
    in_fours = sample_speculative(gen, prompt_ids, PARAMS, 3, 12, batch_size=4, seed=5).sequences
    at_once = sample_speculative(gen, prompt_ids, PARAMS, 3, 12, batch_size=12, seed=5).sequences
    assert in_fours == at_once
    assert len(set(in_fours)) > 1


def _resample_from_p(draft_tokens, q, p, u, method="leviathan", num_drafts=None):
    """The classic bug: after a rejection, draw from p instead of normalize(max(0, p − q)).

    rejection.verify's signature; u [B, K+1]: u[:, i] decides draft i, u[:, K] draws the next token.
    """
    from specdecode.exact.sampling import sample_with_uniforms

    batch, k = draft_tokens.shape
    rows = torch.arange(batch)
    if k == 0:
        return draft_tokens.new_zeros(batch), sample_with_uniforms(p[:, 0], u[:, -1])
    proposed = torch.full((batch,), k) if num_drafts is None else torch.as_tensor(num_drafts)
    p_x = p[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    accepted = (u[:, :k] < (p_x / q_x).clamp(max=1.0)) & (torch.arange(k) < proposed.unsqueeze(1))
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, sample_with_uniforms(p[rows, num_accepted], u[:, -1])


def test_verify_catches_the_resample_from_p_bug(tiny_pair, tokenizer, prompt_ids, monkeypatch, one_thread):
    """A plausible engine bug, patched into the loop: verify must FAIL it (the draft is never sampled directly)."""
    import specdecode.engine.generators as engine
    import specdecode.exact.verification as verification

    monkeypatch.setattr(verification, "verify", _resample_from_p)
    gen = engine.SpeculativeGenerator(tiny_pair[0], tiny_pair[1], num_speculative_tokens=2, tokenizer=tokenizer)
    report = verify_pair(gen, [prompt_ids], PARAMS, positions=4, samples=1500, batch_size=250, seed=11)
    assert not report["pass"]
    tests = report["prompts"][0]["tests"]
    assert tests[0]["pass"]  # the first token comes from the target's prefill: the bug cannot touch it


def test_greedy_reference_is_the_greedy_continuation(tiny_pair, tokenizer, prompt_ids, one_thread):
    from specdecode.engine.generators import SpeculativeGenerator

    params = SamplingParams(temperature=0.0)
    exact = exact_distribution(HFBackend(tiny_pair[0], len(tokenizer)), prompt_ids, params, positions=3,
                               n_samples=50)
    assert list(exact.joint.values()) == [1.0]
    gen = SpeculativeGenerator(tiny_pair[0], tiny_pair[1], num_speculative_tokens=2, tokenizer=tokenizer)
    drawn = sample_speculative(gen, prompt_ids, params, 3, 20, batch_size=10)
    assert check_samples(exact, drawn.sequences)["pass"]
    assert set(drawn.sequences) == set(exact.joint)
    bad = list(drawn.sequences)
    seq = bad[0]
    bad[0] = seq[:2] + ((seq[2] + 1) % len(tokenizer),)
    assert not check_samples(exact, bad)["pass"]


# ------------------------------------------------------------------------------------------ verify: the command
def test_verify_cli_passes(tiny_model_dirs, tmp_path, one_thread):
    path = tmp_path / "verify.json"
    result = _cli(["verify", *_models(tiny_model_dirs), "-k", "2", "--samples", "600", "--positions", "3",
                   "--batch-size", "200", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout and "What this checks" in result.stdout
    report = json.loads(path.read_text())
    assert report["pass"] and len(report["prompts"]) == 2 and report["num_tests"] == 2 * 4
    for r in report["prompts"]:
        assert [t["name"] for t in r["tests"]] == ["position 1", "position 2", "position 3", "joint 1..3"]
        assert all(0.0 <= t["p_value"] <= 1.0 and t["tv"] >= 0 for t in r["tests"])


def test_verify_cli_rejects_bad_arguments(tiny_model_dirs, one_thread):
    result = _cli(["verify", *_models(tiny_model_dirs), "--samples", "0"])
    assert result.exit_code == 1 and "--samples" in result.stderr
    result = _cli(["verify", "--target", tiny_model_dirs["target"], "--draft", "none"])
    assert result.exit_code == 1 and "--draft" in result.stderr

"""The step's phases hand values, not side channels: BatchSampling never changes, a drafter gets its step context
as an argument, the policy is asked once and told once per step, and a row batch's select/extend make new batches."""

from __future__ import annotations

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from specdecode import SpeculativeGenerator
from specdecode.drafters import DraftContext, ModelDrafter, as_drafter
from specdecode.policy.choose import FixedPolicy
from specdecode.exact.sampling import BatchSampling, SamplingParams

PROMPT = [11, 42, 7, 99, 5]


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(128, seed=3, eos_token_id=127)
    return target, perturbed_copy(target, 0.3, seed=4)


def test_batch_sampling_is_immutable():
    sampling = BatchSampling([SamplingParams(0.7), SamplingParams(0.0)], coupled=[True, False])
    with pytest.raises(AttributeError, match="immutable"):
        sampling.noise = torch.zeros(1)
    picked = sampling.select([1])
    assert picked is not sampling and len(sampling) == 2 and picked.greedy_rows == [True]


def test_the_drafter_gets_its_step_context_and_the_policy_one_question_and_one_answer(models, monkeypatch):
    target, draft = models
    contexts, calls = [], []
    real_propose = ModelDrafter.propose

    def propose(self, choice, context):
        contexts.append(context)
        return real_propose(self, choice, context)

    monkeypatch.setattr(ModelDrafter, "propose", propose)
    policy = FixedPolicy(3)
    monkeypatch.setattr(policy, "decide", lambda outlook, real=policy.decide: calls.append("decide") or real(outlook))
    monkeypatch.setattr(policy, "learn", lambda outcome, real=policy.learn: calls.append("learn") or real(outcome))
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    session = gen.session(policy=policy)
    rows = [session.add(gen.request(PROMPT, 20, temperature=0.8, seed=5, ignore_eos=True)),
            session.add(gen.request(PROMPT[:3], 9, temperature=0.8, seed=6, ignore_eos=True))]
    steps = 0
    while not session.idle:
        session.admit()
        if session.active:
            sampling, state = session.sampling, dict(vars(session.sampling))
            session.decode()
            assert vars(sampling) == state  # nothing was set on it for the step
            steps += 1
    assert contexts and all(isinstance(c, DraftContext) and c.grammars is None for c in contexts)
    assert all(c.noise is None for c in contexts)  # a fixed K: no coupled row, no noise
    assert calls.count("learn") == steps  # told once per step ...
    assert "decide" in calls and ("decide", "decide") not in zip(calls, calls[1:])  # ... asked at most once
    assert [len(t) for t in session.result(rows).token_ids] == [20, 9]


def test_row_batch_select_and_extend_make_new_batches(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    session = gen.session()
    for prompt in (PROMPT, PROMPT[:4], PROMPT[:2]):
        session.add(gen.request(prompt, 8, temperature=0.0, ignore_eos=True))
    session.admit()
    batch = session.batch
    assert len(batch) == 3
    picked = batch.select([2, 0])
    assert [r.index for r in picked.rows] == [2, 0] and len(batch) == 3
    assert len(picked.sampling) == len(picked.generators) == len(picked.grammars) == 2
    both = picked.extend(batch.select([1]))
    assert [r.index for r in both.rows] == [2, 0, 1] and len(picked) == 2


def test_an_object_that_proposes_but_is_no_drafter_is_refused_with_the_fix():
    class OldStyle:
        def propose(self, choice, context):
            return None

    with pytest.raises(TypeError, match="subclass Drafter"):
        as_drafter(OldStyle())

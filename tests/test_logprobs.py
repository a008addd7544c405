"""Logprobs under speculation: every emitted token's log-probability (accepted, resampled, bonus and forced alike)
is the target's, after the row's temperature/top-k/top-p, exactly what plain decoding reports for the same tokens."""

import pytest
import torch

from reference import hf_warp
from specdecode import AutoregressiveGenerator, SpeculativeGenerator


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("The quick brown fox")["input_ids"]


@torch.no_grad()
def teacher_forced_logprobs(target, prompt, tokens, temperature, top_k, top_p):
    logits = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    scores = logits.float() if temperature == 0 else hf_warp(logits, temperature, top_k, top_p)
    return torch.log_softmax(scores, -1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 20, 0.9)])
def test_logprobs_are_the_targets_at_every_emitted_position(models, prompt, temperature, top_k, top_p):
    target, draft = models
    for k in (0, 3):
        gen = SpeculativeGenerator(target, draft, num_speculative_tokens=k)
        result = gen.generate([prompt], max_new_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=4, ignore_eos=True, return_logprobs=3)
        tokens = result.token_ids[0]
        reference = teacher_forced_logprobs(target, prompt, tokens, temperature, top_k, top_p)
        expected = reference.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(result.logprobs[0]), expected, atol=1e-4)
        for row, top in zip(reference, result.top_logprobs[0]):
            ids, values = zip(*top)
            assert list(values) == sorted(values, reverse=True) and len(ids) == 3
            assert torch.allclose(torch.tensor(values, dtype=torch.float32), row.topk(3).values, atol=1e-4)
        if k == 3 and temperature > 0:
            assert {"accepted", "resampled", "bonus"} & set(result.provenance[0])


def test_greedy_logprobs_with_speculation_equal_plain_decoding(models, prompt):
    target, draft = models
    plain = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=30, temperature=0.0, ignore_eos=True,
                                                    return_logprobs=2)
    spec = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        [prompt], max_new_tokens=30, temperature=0.0, ignore_eos=True, return_logprobs=2)
    assert spec.token_ids == plain.token_ids
    assert torch.allclose(torch.tensor(spec.logprobs[0]), torch.tensor(plain.logprobs[0]), atol=1e-5)


def test_logprobs_are_off_unless_asked_and_checked(models, prompt):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    result = gen.generate([prompt], max_new_tokens=4, temperature=0.0)
    assert result.logprobs is None and result.top_logprobs is None
    events = list(gen.stream([prompt], max_new_tokens=4, temperature=0.0, return_logprobs=0))
    assert all(e.logprob is not None and e.top_logprobs == () for e in events)
    with pytest.raises(ValueError, match="logprobs"):
        gen.generate([prompt], return_logprobs=21)

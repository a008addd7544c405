"""Temperature, top-k and top-p must match transformers' logits warpers exactly, for p and q alike."""

import math

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from specdecode.exact.sampling import SamplingParams, greedy, logits_to_probs, sample, warp_logits


def hf_warp(logits, temperature, top_k, top_p):
    scores = logits.clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k, min_tokens_to_keep=1)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p, min_tokens_to_keep=1)(None, scores)
    return scores


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 3, 50])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5, 0.01])
def test_warping_matches_transformers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen) * 3
    logits[0, :5] = 2.0  # ties at the top-k boundary are kept, as in TopKLogitsWarper
    ours = warp_logits(logits, SamplingParams(temperature, top_k, top_p))
    theirs = hf_warp(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])
    probs = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p))
    torch.testing.assert_close(probs, torch.softmax(theirs, dim=-1))


def test_warping_works_on_any_leading_shape():
    logits = torch.randn(2, 3, 17)
    params = SamplingParams(0.8, 5, 0.9)
    flat = logits_to_probs(logits.reshape(6, 17), params).reshape(2, 3, 17)
    torch.testing.assert_close(logits_to_probs(logits, params), flat)


def test_top_k_and_top_p_keep_at_least_one_token():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    probs = logits_to_probs(logits, SamplingParams(1.0, 0, 1e-9))
    assert probs[0, 0] == 1.0 and probs[0, 1:].sum() == 0


def test_greedy_is_argmax_and_has_no_division():
    logits = torch.tensor([[0.0, 3.0, -1.0], [9.0, 1.0, 9.5]])
    assert greedy(logits).tolist() == [1, 2]
    assert SamplingParams(0.0).greedy
    with pytest.raises(ValueError, match="greedy"):
        warp_logits(logits, SamplingParams(0.0))



def test_greedy_takes_the_same_index_as_torch_argmax():
    """greedy() reads the argmax through numpy on the CPU: the same index as torch.argmax, ties to the first maximum,
    a NaN counted as the maximum, rows of -inf (a grammar forbidding all), float64 scores, strided views, 1-d rows."""
    nan, inf = float("nan"), float("inf")
    torch.manual_seed(0)
    wide = torch.randn(2, 5, 1000)
    wide[0, 1, 7] = wide[0, 1, 900] = wide[0, 1].max() + 1  # a tie far apart
    cases = [torch.tensor([[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf, -inf], [1.0, nan, 5.0, nan], [inf, nan, 0, 0],
                           [-0.0, 0.0, -1.0, -2.0]]),
             wide, wide[:, 1:4], wide.transpose(1, 2), wide.double() + torch.rand(2, 5, 1000, dtype=torch.float64),
             wide[0, 1], torch.tensor([[2, 7, 7]], dtype=torch.int64), wide.half()]
    for case in cases:
        out = greedy(case)
        assert out.dtype == torch.long and out.shape == case.shape[:-1]
        assert out.tolist() == torch.argmax(case, dim=-1).tolist()
    out = greedy(wide)
    out[0, 0] = -1  # a tensor of its own, not a view of the scores
    assert torch.argmax(wide, dim=-1)[0, 0] != -1

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_p": -0.5}, "top_p"),
])
def test_invalid_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sample_never_draws_zero_probability_tokens_and_token_zero_is_valid():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0]]).expand(20000, 4)
    draws = sample(probs, gen)
    counts = torch.bincount(draws, minlength=4)
    assert counts[1] == 0 and counts[3] == 0
    assert counts[0] > 9000 and counts[2] > 9000  # token id 0 is drawn like any other

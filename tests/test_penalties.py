"""logit_bias, repetition / frequency / presence penalties and min_p: the arithmetic against the formulas written by
hand, per position along chains, token trees and a drafter's path (penalties.py, sampling.py), then end to end
(test_penalties_exact.py: speculative samples against distributions enumerated from the formulas)."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.exact.penalties import RowPenalties
from specdecode.exact.sampling import BatchSampling, SamplingParams
from specdecode.exact.token_tree import ancestors_mask

V = 12


def by_hand(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The documented formulas, in float64, one token at a time: logit_bias, then the repetition penalty over the
    prompt + output, then the frequency and presence penalties over the output."""
    out = [float(x) for x in logits]
    for token, value in params.logit_bias:
        out[token] += value
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


ROWS = [  # one neutral row, each option alone, all of them together
    SamplingParams(0.8),
    SamplingParams(1.0, logit_bias={3: 2.5, 7: -100}),
    SamplingParams(1.0, repetition_penalty=1.7),
    SamplingParams(1.0, repetition_penalty=0.6),
    SamplingParams(1.0, frequency_penalty=0.9),
    SamplingParams(1.0, presence_penalty=-1.3),
    SamplingParams(0.0, logit_bias={0: 1.0}, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=1.5),
]


def _state(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 6))] for _ in ROWS]
    kept = [[rng.randrange(4) for _ in range(rng.randint(0, 5))] for _ in ROWS]  # small ids: repeats
    state = RowPenalties(ROWS, prompts, V)
    state.advance([k[:2] for k in kept])  # two steps, as the loop records them
    state.advance([k[2:] for k in kept])
    return rng, prompts, kept, state


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_position_sees_the_kept_text_and_the_drafts_before_it(seed):
    rng, prompts, kept, state = _state(seed)
    k = 4
    drafts = torch.tensor([[rng.randrange(4) for _ in range(k)] for _ in ROWS])  # repeats within the chain too
    logits = torch.randn(len(ROWS), k + 1, V, generator=torch.Generator().manual_seed(seed)) * 3
    got = state.along_chain(drafts).apply(logits)
    for b, params in enumerate(ROWS):
        for j in range(k + 1):
            want = by_hand(logits[b, j].tolist(), params, prompts[b], kept[b] + drafts[b, :j].tolist())
            assert got[b, j].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), (b, j)


@pytest.mark.parametrize("seed", range(4))
def test_a_tree_node_sees_its_ancestors_and_never_its_siblings(seed):
    rng, prompts, kept, state = _state(seed)
    n = 6
    parents = [[-1] + [rng.randrange(-1, i) for i in range(1, n)] for _ in ROWS]
    tokens = torch.tensor([[rng.randrange(4) for _ in range(n)] for _ in ROWS])
    logits = torch.randn(len(ROWS), n + 1, V, generator=torch.Generator().manual_seed(seed)) * 3
    got = state.along_tree(tokens, parents).apply(logits)
    for b, params in enumerate(ROWS):
        mask = ancestors_mask(parents[b])
        for j in range(n + 1):
            path = [tokens[b, i].item() for i in range(n) if mask[j, i + 1]]  # root first: ancestors come first
            want = by_hand(logits[b, j].tolist(), params, prompts[b], kept[b] + path)
            assert got[b, j].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), (b, j)


def test_a_drafter_position_equals_the_chain_position_bit_for_bit():
    """q at draft position i and p at chain position i see the same text: the same numbers, to the bit."""
    rng, _, _, state = _state(7)
    drafts = torch.tensor([[rng.randrange(4) for _ in range(3)] for _ in ROWS])
    logits = torch.randn(len(ROWS), 4, V, generator=torch.Generator().manual_seed(3))
    chain = state.along_chain(drafts).apply(logits)
    for i in range(4):
        drafter = state.at_draft([drafts[:, j] for j in range(i)]).apply(logits[:, i])
        assert torch.equal(drafter, chain[:, i])


def test_rows_without_options_keep_their_logits_bit_for_bit():
    """A neutral row in a batch where others have options: its scores are what they would be alone."""
    _, _, _, state = _state(1)
    logits = torch.randn(len(ROWS), 3, V)
    got = state.along_chain(torch.tensor([[1, 1]] * len(ROWS))).apply(logits)
    assert torch.equal(got[0], logits[0])
    assert RowPenalties([SamplingParams(0.7)] * 2, [[1], [2]], V).along_chain(torch.zeros(2, 3)) is None


def test_select_and_extend_keep_each_rows_state():
    _, prompts, kept, state = _state(2)
    plain = RowPenalties([SamplingParams(), SamplingParams(0.0)], [[1], [2]], V)
    assert not plain.active
    joined = plain.extend(state).select([1, 3, 2, 5, 8])  # rows 0..1 neutral, then ROWS
    logits = torch.randn(5, 1, V)
    got = joined.along_chain(torch.zeros(5, 0, dtype=torch.long)).apply(logits)
    for i, b in enumerate([None, 1, 0, 3, 6]):
        if b is None:
            assert torch.equal(got[i], logits[i])
        else:
            assert got[i, 0].tolist() == pytest.approx(by_hand(logits[i, 0].tolist(), ROWS[b], prompts[b], kept[b]),
                                                       rel=1e-6, abs=1e-5)


def test_min_p_drops_tokens_below_its_share_of_the_top_probability_after_top_p():
    """min_p after temperature, top-k and top-p, as transformers' MinPLogitsWarper (its own code as the reference)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    from reference import hf_warp

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 2
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.1), (0.7, 6, 0.9, 0.3), (1.5, 0, 1.0, 1.0)]:
        params = SamplingParams(temperature, top_k, top_p, min_p=min_p)
        want = MinPLogitsWarper(min_p)(None, hf_warp(logits, temperature, top_k, top_p))
        got = BatchSampling([params] * 3).warp(logits)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got.softmax(-1), want.softmax(-1), atol=1e-6)


def test_repetition_penalty_matches_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([[1, 4, 4, 9], [2, 3, 0, 0]])
    logits = torch.randn(2, V) * 3
    for r in (0.5, 1.3):
        state = RowPenalties([SamplingParams(repetition_penalty=r)] * 2, [[1, 4], [2, 3, 0]], V)
        state.advance([[4, 9], [0]])
        want = RepetitionPenaltyLogitsProcessor(r)(ids, logits.clone())
        assert torch.equal(state.at_draft([]).apply(logits), want)


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be"),
    ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
    ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in \\[-100, 100\\]"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 1}}, "logit_bias keys must be token ids"),
])
def test_bad_values_are_refused_with_their_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_stay_hashable_and_normalise_the_bias():
    params = SamplingParams(logit_bias={5: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (5, 1.0)) and hash(params) == hash(SamplingParams(logit_bias=[(5, 1),
                                                                                                         (2, -3.5)]))
    assert params.adjusts_logits and not SamplingParams(min_p=0.3).adjusts_logits

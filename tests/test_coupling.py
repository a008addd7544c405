"""Seeded sampled rows under K = "auto" are drawn by Gumbel-max coupling: their text depends on the seed alone.

The policy picks K from timings, which no seed reproduces; with coupling a seeded row's tokens are the same
whatever K each step used, whichever drafter proposed, and whatever shares the batch, and they still follow the
target's distribution exactly (checked in test_distribution.py). Rows with a fixed K keep the rejection sampler.
"""

import random

import numpy as np
import pytest
import torch

from specdecode.exact.sampling import stream_seed

from conftest import perturbed_copy, tiny_qwen
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator
from specdecode.policy.choose import AdaptivePolicy
from specdecode.exact.sampling import BatchSampling, RowGenerators, SamplingParams, coupled_choice

PROMPT = [11, 42, 7, 99, 5, 11, 42]


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(128, seed=3, eos_token_id=127)
    return target, perturbed_copy(target, 0.3, seed=4)


@pytest.fixture
def random_k(monkeypatch):
    """The policy picks a random K (0..cap) before each step: what any timing-driven choice could be."""
    def use(seed):
        rng = random.Random(seed)
        monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: rng.randint(0, max(caps)))
    return use


SETTINGS = [dict(temperature=0.9), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=12)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["T0.9", "T0.7-topp0.9", "T1.3-topk12"])
def test_a_seeded_row_is_the_same_whatever_k_each_step_took(models, random_k, settings):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    outputs = set()
    for choice_seed in range(5):
        random_k(choice_seed)
        result = gen.generate([PROMPT], max_new_tokens=40, seed=17, ignore_eos=True, **settings)
        outputs.add(tuple(result.token_ids[0]))
        assert result.stats.k_histogram.get(0, 0) < sum(result.stats.k_histogram.values())  # it did speculate
    assert len(outputs) == 1
    other_seed = gen.generate([PROMPT], max_new_tokens=40, seed=18, ignore_eos=True, **settings).token_ids[0]
    assert tuple(other_seed) not in outputs  # the seed, not a constant, decides the text


def test_a_seeded_row_is_the_same_whichever_drafter_proposed(models):
    target, draft = models
    drafters = [draft, perturbed_copy(target, 2.0, seed=9), PromptLookupDrafter(max_ngram=2)]
    outputs = {tuple(SpeculativeGenerator(target, d, num_speculative_tokens="auto")
                     .generate([PROMPT], max_new_tokens=30, temperature=0.8, seed=5, ignore_eos=True).token_ids[0])
               for d in drafters}
    assert len(outputs) == 1


def test_a_seeded_row_is_the_same_in_any_batch_whatever_k(models, random_k):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    random_k(0)
    solo = gen.generate([PROMPT], max_new_tokens=24, temperature=0.8, seed=[40], ignore_eos=True).token_ids[0]
    random_k(1)
    batch = gen.generate([[3, 4], PROMPT, [9] * 12], max_new_tokens=24, temperature=[1.0, 0.8, 0.0],
                         seed=[None, 40, None], ignore_eos=True)
    assert batch.token_ids[1] == solo


def test_coupled_drafts_are_accepted_where_the_models_agree(models, random_k):
    """The draft draws with the same noise as the target: a draft equal to the target is always kept."""
    target, draft = models
    random_k(2)
    same = SpeculativeGenerator(target, target, num_speculative_tokens="auto")
    result = same.generate([PROMPT], max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    assert result.stats.proposed_tokens > 0 and result.stats.accepted_tokens == result.stats.proposed_tokens
    other = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    rate = other.generate([PROMPT], max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True).stats.acceptance_rate
    assert 0.05 < rate < 1.0  # a different draft: both outcomes happen


def test_a_fixed_k_keeps_the_rejection_sampler(models):
    """Coupling is only for rows whose K the policy picks: a fixed K uses the uniforms of the rejection sampler."""
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    session = gen.session()
    seeded = session.add(gen.request(PROMPT, 10, 0.8, seed=1))
    session.step()
    assert not session.rows[seeded].coupled and not session.sampling.any_coupled
    auto = SpeculativeGenerator(target, draft, num_speculative_tokens="auto").session()
    rows = [auto.add(gen.request(PROMPT, 10, 0.8, seed=1)), auto.add(gen.request(PROMPT, 10, 0.8)),
            auto.add(gen.request(PROMPT, 10, 0.0, seed=1)), auto.add(gen.request(PROMPT, 10, 0.8, seed=1,
                                                                                  num_speculative_tokens=2))]
    assert [auto.rows[r].coupled for r in rows] == [True, False, False, False]


def test_plain_decoding_of_a_coupled_row_matches_its_noise(models, random_k):
    """K = 0 on every step: each token is argmax(log p + its position's noise), computed here by hand."""
    target, draft = models
    random_k(0)
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    got = gen.generate([PROMPT], max_new_tokens=6, temperature=0.9, seed=8, ignore_eos=True).token_ids[0]
    stream = np.random.Generator(np.random.PCG64(stream_seed(8, 0)))  # the row's noise stream, from its seed
    ids, expected = list(PROMPT), []
    plain = AutoregressiveGenerator(target)
    for _ in range(6):
        logits = plain.target_model(torch.tensor([ids])).logits[0, -1, :128].float()
        noise = torch.from_numpy(-np.log(-np.log(stream.random(128))))
        token = int(coupled_choice(torch.log_softmax(logits / 0.9, -1), noise))
        expected.append(token)
        ids.append(token)
    # random_k(0) drew Ks for the speculative run; the tokens still equal the position-by-position draws
    assert got == expected


def test_noise_belongs_to_positions_not_to_steps():
    a = RowGenerators([7], coupled=[True])
    b = RowGenerators([7], coupled=[True])
    first = a.noise(5, 32)[0]
    b.noise(2, 32)
    b.advance([1])
    later = b.noise(4, 32)[0]  # positions 1..4
    assert torch.equal(later, first[1:5])
    b.advance([3])
    assert torch.equal(b.noise(1, 32)[0, 0], first[4])


def test_coupled_choice_samples_the_distribution():
    """argmax(log p + Gumbel) is a draw from p: frequencies over 40k draws match p (chi-square)."""
    from reference import assert_matches

    p = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.0625, 0.0625])
    gens = RowGenerators([123], coupled=[True])
    noise = gens.noise(40_000, len(p))[0]
    tokens = coupled_choice(torch.log(p).expand(40_000, -1), noise)
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[3] == 0
    assert_matches(counts, p.double(), min_p=1e-4)


def test_batch_sampling_keeps_coupling_through_select_and_extend():
    params = [SamplingParams(0.0), SamplingParams(0.8), SamplingParams(1.0), SamplingParams(0.7)]
    s = BatchSampling(params, coupled=[True, True, False, True])  # a greedy row is never coupled
    assert s.coupled == [False, True, False, True]
    assert s.coupled_pos.tolist() == [0, 2] and s.rejection_pos.tolist() == [1]
    t = s.select([2, 3]).extend(s.select([1]))
    assert t.coupled == [False, True, True] and t.coupled_pos.tolist() == [1, 2]

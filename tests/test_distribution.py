"""End to end: speculative samples follow the target model's exact distribution.

A tiny target and a different tiny draft over a 16-token vocabulary. For each configuration we draw >= 20k
sequences of several new tokens and compare them with distributions computed from the target alone (full
forwards without any cache, transformers' own warpers):
- the joint distribution of the first three tokens, enumerated exactly (16^3 outcomes), by chi-square;
- every position's conditional distribution, by the probability integral transform of each sampled token
  under its exact conditional (uniform iff the token follows the target given its prefix), by chi-square.
"""

import functools
import itertools
import random

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from reference import assert_matches, assert_uniform, exact_joint, hf_warp, pit_values, target_conditionals
from specdecode import SpeculativeGenerator
from specdecode.exact import rejection
from specdecode.engine.results import Stats

VOCAB = 16
PROMPTS = [[1, 2, 3, 4, 5], [7, 0]]  # ragged, and token id 0 is a real token
SAMPLES = 10_000  # the injected bugs below fail at p << 1e-10 with these; real ones are as gross
BATCH = 500  # rows per generate call (a multiple of the rows that interleave: prompts, settings)
MIN_P = 1e-4  # ~250 checks in this file: keep the family-wise false alarm rate low; real bugs give p << 1e-10


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = tiny_qwen(VOCAB, seed=10, layers=2, hidden=32)
    draft = perturbed_copy(target, 0.5, seed=11)  # a different model: acceptance well between 0 and 1
    return target, draft


def check_against_target(target, prompt, tokens: torch.Tensor, temperature, top_k, top_p, seed=0):
    warp = functools.partial(hf_warp, temperature=temperature, top_k=top_k, top_p=top_p)
    joint = exact_joint(target, prompt, 3, warp)
    index = {s: i for i, s in enumerate(joint)}
    observed = torch.zeros(len(joint) + 1)
    for row in tokens[:, :3].tolist():
        observed[index.get(tuple(row), len(joint))] += 1
    probs = torch.tensor(list(joint.values()) + [0.0], dtype=torch.float64)
    assert_matches(observed, probs, min_p=MIN_P)
    conditionals = target_conditionals(target, prompt, tokens, warp)
    u = pit_values(conditionals, tokens, torch.Generator().manual_seed(seed))
    for position in range(tokens.shape[1]):
        assert_uniform(u[:, position], min_p=MIN_P)


def sample_batched(generator, new_tokens, temperature, top_k, top_p, prompts=PROMPTS[:1], seed=1234):
    """SAMPLES sequences per prompt in batches; several prompts are interleaved (ragged batches)."""
    batch = [p for _ in range(SAMPLES) for p in prompts]
    tokens, stats = generate_in_batches(generator, batch, new_tokens, seed, temperature=temperature, top_k=top_k,
                                        top_p=top_p)
    return [tokens[i::len(prompts)] for i in range(len(prompts))], stats


def generate_in_batches(generator, batch, new_tokens, seed, **settings):
    """One request cut into calls of BATCH rows; row i keeps its stream (the (seed, i) pair: the same stream as
    row i of one call of every row). The engine's host bookkeeping costs more than linearly in the rows (~4x for
    20k rows in one call), and the distribution of a row does not depend on its batch. Settings given per row
    (lists) are cut with the rows. Returns the tokens [rows, new_tokens] and the calls' summed acceptance counts."""
    tokens, total = [], Stats()
    for start in range(0, len(batch), BATCH):
        rows = slice(start, start + BATCH)
        seeds = None if seed is None else [(seed, i) for i in range(start, start + len(batch[rows]))]
        result = generator.generate(batch[rows], max_new_tokens=new_tokens, seed=seeds, ignore_eos=True,
                                    **{k: v[rows] if isinstance(v, list) else v for k, v in settings.items()})
        tokens.append(torch.tensor(result.token_ids))
        _add_acceptance(total, result.stats)
    tokens = torch.cat(tokens)
    assert tokens.shape == (len(batch), new_tokens)
    return tokens, total


def _add_acceptance(total: Stats, stats: Stats) -> None:
    total.proposed_tokens += stats.proposed_tokens
    total.accepted_tokens += stats.accepted_tokens
    for name in ("proposed_per_position", "accepted_per_position"):
        mine, theirs = getattr(total, name), getattr(stats, name)
        mine.extend([0] * (len(theirs) - len(mine)))
        for i, n in enumerate(theirs):
            mine[i] += n


CONFIGS = [
    # (K, temperature, top_k, top_p, new tokens)
    pytest.param(3, 1.0, 0, 1.0, 5, id="T1-K3"),
    pytest.param(2, 0.6, 6, 0.8, 5, id="T0.6-topk6-topp0.8-K2"),
    pytest.param(4, 1.8, 0, 1.0, 5, id="T1.8-K4"),
    pytest.param(1, 1.0, 0, 1.0, 4, id="T1-K1"),
    pytest.param(8, 1.0, 0, 1.0, 12, id="T1-K8"),
    pytest.param(5, 0.9, 0, 0.7, 7, id="T0.9-topp0.7-K5"),
]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["leviathan", "chen"])
@pytest.mark.parametrize("k, temperature, top_k, top_p, new_tokens", CONFIGS)
def test_batched_samples_follow_target(pair, method, k, temperature, top_k, top_p, new_tokens):
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method)
    per_prompt, stats = sample_batched(generator, new_tokens, temperature, top_k, top_p)
    assert 0.05 < stats.acceptance_rate < 0.98  # both the accept and the reject paths were exercised
    if new_tokens > k + 1:
        assert stats.accepted_per_position[-1] > 0  # full acceptance (and so the bonus token) happened
    check_against_target(target, PROMPTS[0], per_prompt[0], temperature, top_k, top_p)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["leviathan", "chen"])
def test_ragged_batch_rows_each_follow_their_own_target(pair, method):
    """Prompts of different lengths share a batch (left padding, per-row acceptance, holes in the cache)."""
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3, method=method)
    per_prompt, _ = sample_batched(generator, 5, 1.0, 0, 1.0, prompts=PROMPTS)
    for prompt, tokens in zip(PROMPTS, per_prompt):
        check_against_target(target, prompt, tokens, 1.0, 0, 1.0)


@pytest.mark.slow
def test_batch_of_one_samples_follow_target(pair):
    """The unbatched path (no slot mask at all) with one seeded call per sample. One call per sample costs ~13 ms,
    so this draws fewer samples than the batched tests, with one method (both share this path; the batched tests
    cover each method's own verification)."""
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    prompt = PROMPTS[0]
    rows = [generator.generate([prompt], max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True).token_ids[0]
            for seed in range(SAMPLES // 4)]
    check_against_target(target, prompt, torch.tensor(rows), 1.0, 0, 1.0)


def test_the_check_catches_a_sampler_that_resamples_from_p(pair, monkeypatch):
    """Power: the classic bug (after a rejection, sample from p rather than from max(0, p - q)) fails the check."""
    target, draft = pair
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    per_prompt, _ = sample_batched(generator, 4, 1.0, 0, 1.0)
    with pytest.raises(AssertionError, match="chi-square"):
        check_against_target(target, PROMPTS[0], per_prompt[0], 1.0, 0, 1.0)


def test_the_check_catches_a_draft_warped_differently(pair, monkeypatch):
    """Power: the draft samples after top-k but hands the sampler its q from before top-k (a warping mismatch)."""
    from specdecode.drafters import model as drafter_module

    real_propose, real_sample = drafter_module.ModelDrafter.propose, drafter_module.sample_with_uniforms
    unwarped = {}

    class RemembersUnwarped:
        def __init__(self, sampling):
            self.sampling = sampling

        def __getattr__(self, name):
            return getattr(self.sampling, name)

        def probs(self, logits):
            temperature = self.sampling.sampling.temperature  # the step's DraftContext holds the rows' settings
            unwarped["q"] = torch.softmax(logits[self.sampled_index].float() / temperature.view(-1, 1), -1)
            return self.sampling.probs(logits)

    def propose(self, choice, context):
        return real_propose(self, choice, RemembersUnwarped(context))

    def sample_then_hand_over_unwarped(q, u):
        token = real_sample(q, u)
        q.copy_(unwarped["q"])
        return token

    monkeypatch.setattr(drafter_module.ModelDrafter, "propose", propose)
    monkeypatch.setattr(drafter_module, "sample_with_uniforms", sample_then_hand_over_unwarped)
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=3)
    per_prompt, _ = sample_batched(generator, 4, 0.6, 3, 1.0)
    with pytest.raises(AssertionError, match="chi-square|probability 0"):
        check_against_target(target, PROMPTS[0], per_prompt[0], 0.6, 3, 1.0)


MIXED = [  # (temperature, top_k, top_p) of each row of one batch
    (0.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 0, 1.0), (0.6, 4, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("k", [3, "auto"])
def test_rows_with_different_settings_in_one_batch_each_follow_their_own_target(pair, k, monkeypatch):
    """Per-row sampling: a greedy row, top-p, a hot row and top-k share every step; each follows its own law.

    With "auto" the K of each step is random: 80k rows of 5 tokens after 2-5-token prompts would never repay the
    draft's prefill, and the real policy would rightly decode them plainly."""
    if k == "auto":
        _random_k(monkeypatch, 3)
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=k)
    n_rows, prompts = len(MIXED), [PROMPTS[i % 2] for i in range(len(MIXED))]
    batch = [prompts[i % n_rows] for i in range(12_000 * n_rows)]  # 12k per setting: 4 settings share a batch
    settings = [MIXED[i % n_rows] for i in range(len(batch))]
    tokens, stats = generate_in_batches(generator, batch, 5, 2024, temperature=[t for t, _, _ in settings],
                                        top_k=[k_ for _, k_, _ in settings], top_p=[p for _, _, p in settings])
    greedy_rows = tokens[0::n_rows]
    assert (greedy_rows == greedy_rows[0]).all()
    assert greedy_rows[0].tolist() == target.generate(torch.tensor([prompts[0]]), max_new_tokens=5, do_sample=False,
                                                      min_new_tokens=5, pad_token_id=0)[0, len(prompts[0]):].tolist()
    for i in range(1, n_rows):
        check_against_target(target, prompts[i], tokens[i::n_rows], *MIXED[i])
    assert 0.05 < stats.acceptance_rate < 0.98


@pytest.mark.slow
@pytest.mark.parametrize("method", ["leviathan", "chen"])
def test_adaptive_k_keeps_the_target_distribution(pair, method, monkeypatch):
    """K chosen by the policy before each step (from past acceptance and timings) keeps the output exact.

    Unseeded rows: these go through the rejection sampler (seeded ones are coupled, tested below). K is random per
    step (the real policy would decode 40k 6-token rows plainly: they cannot repay the draft's prefill)."""
    _random_k(monkeypatch, 4)
    _reproducible_unseeded_rows(monkeypatch)
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens="auto", method=method)
    per_prompt, stats = sample_batched(generator, 6, 0.9, 0, 1.0, prompts=PROMPTS, seed=None)
    assert 0.05 < stats.acceptance_rate < 0.98
    for prompt, tokens in zip(PROMPTS, per_prompt):
        check_against_target(target, prompt, tokens, 0.9, 0, 1.0)


def _reproducible_unseeded_rows(monkeypatch, first: int = 10_000):
    """Unseeded rows stay unseeded for the engine (not coupled: the rejection sampler), but their generators get
    fixed seeds instead of fresh entropy: 28 chi-square checks at p > 1e-4 on fresh draws would fail ~0.3 % of runs."""
    from specdecode.exact.sampling import RowGenerators

    real, seeds = RowGenerators.__init__, itertools.count(first)

    def init(self, row_seeds, *args, **kwargs):
        real(self, [next(seeds) if s is None else s for s in row_seeds], *args, **kwargs)

    monkeypatch.setattr(RowGenerators, "__init__", init)


def _random_k(monkeypatch, seed):
    from specdecode.policy.choose import AdaptivePolicy

    rng = random.Random(seed)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: rng.randint(0, max(caps)))


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.85)])
def test_seeded_rows_under_auto_follow_target_whatever_k(pair, monkeypatch, temperature, top_k, top_p):
    """Seeded rows under "auto" are drawn by Gumbel-max coupling; any K per step (here random) keeps them exact."""
    _random_k(monkeypatch, 0)
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    per_prompt, stats = sample_batched(generator, 6, temperature, top_k, top_p, prompts=PROMPTS)
    assert 0.05 < stats.acceptance_rate < 0.98 and stats.accepted_per_position[2] > 0
    for prompt, tokens in zip(PROMPTS, per_prompt):
        check_against_target(target, prompt, tokens, temperature, top_k, top_p)


@pytest.mark.slow
def test_the_check_catches_coupling_that_reuses_its_noise(pair, monkeypatch):
    """Power: noise drawn per step and reused (the reseed-per-step bug) instead of one vector per position."""
    from specdecode.exact.sampling import RowGenerators

    _random_k(monkeypatch, 1)
    monkeypatch.setattr(RowGenerators, "advance", lambda self, emitted: None)
    target, draft = pair
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    per_prompt, _ = sample_batched(generator, 4, 1.0, 0, 1.0)
    with pytest.raises(AssertionError, match="chi-square"):
        check_against_target(target, PROMPTS[0], per_prompt[0], 1.0, 0, 1.0)


@pytest.mark.slow
def test_prompt_lookup_drafter_is_lossless(pair):
    """A deterministic drafter (one-hot q): acceptance is p(x), a rejection resamples p without x."""
    from specdecode import PromptLookupDrafter

    target, _ = pair
    generator = SpeculativeGenerator(target, PromptLookupDrafter(max_ngram=2), num_speculative_tokens=3)
    per_prompt, stats = sample_batched(generator, 6, 0.8, 0, 1.0, prompts=[[1, 2, 3, 1, 2, 3, 1, 2]])
    assert 0.05 < stats.acceptance_rate < 0.98
    check_against_target(target, [1, 2, 3, 1, 2, 3, 1, 2], per_prompt[0], 0.8, 0, 1.0)

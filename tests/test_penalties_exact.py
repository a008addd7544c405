"""End to end: with logit_bias, repetition / frequency / presence penalties and min_p, speculative samples follow the
distribution computed by hand from the documented formulas on the target alone (full forwards, no cache), for every
way a step is built: model drafts at K = 1..4 (Leviathan and Chen), token trees, Gumbel-coupled rows under a random
K, deterministic drafts (prompt lookup: q = None), and a grammar.

One generate call per configuration holds every setting below side by side (a batch of mixed rows). Its check is
one chi-square: per setting, the joint of the first three tokens (enumerated: 16^3 outcomes) plus the randomised
PIT of each later position under its exact conditional; these pieces are independent, so their statistics add up
(degrees of freedom too). The reference restates the formulas in float64 and never calls penalties.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chi2

from conftest import perturbed_copy, tiny_qwen
from reference import hf_warp, pit_values
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator
from specdecode.drafters.base import Drafter, DraftOutlook, Proposal
from specdecode.exact.penalties import RowPenalties

VOCAB = 16
PROMPT = [1, 2, 3, 4, 1, 2]  # repeats: the repetition penalty sees the prompt
NEW = 6
JOINT = 3
ROWS = 1000  # per setting
CHUNK = 3500  # rows per generate call (the loop's bookkeeping of joining and leaving rows grows with the batch)
LEVEL = 1e-3  # per configuration (~12 of them); a real bug gives p << 1e-10 (the power tests below)

SETTINGS = [  # (temperature, top_k, top_p, options)
    (1.0, 0, 1.0, dict(presence_penalty=2.0)),
    (1.0, 0, 1.0, dict(frequency_penalty=2.0)),
    (1.0, 0, 1.0, dict(repetition_penalty=2.0)),
    (1.0, 0, 1.0, dict(repetition_penalty=0.5)),
    (1.3, 0, 1.0, dict(min_p=0.15)),
    (1.0, 0, 1.0, dict(logit_bias={3: 3.0, 5: -100.0, 9: 1.5})),
    (0.9, 8, 0.95, dict(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.3, min_p=0.05,
                        logit_bias={2: 2.0})),
]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return tiny_qwen(VOCAB, seed=10, layers=2, hidden=32)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, 0.5, seed=11)


# ---------------------------------------------------------------------------------------------- the reference
def by_formula(logits: torch.Tensor, prompt: list[int], counts: torch.Tensor, setting) -> torch.Tensor:
    """The next-token distribution [M, V] of logits [M, V] whose output so far has counts [M, V]: logit_bias, the
    repetition penalty (prompt + output), frequency and presence (output), then temperature, top-k, top-p, min_p."""
    temperature, top_k, top_p, options = setting
    x = logits.double().clone()
    for token, value in options.get("logit_bias", {}).items():
        x[:, token] += value
    seen = counts > 0
    seen[:, prompt] = True
    r = options.get("repetition_penalty", 1.0)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - options.get("frequency_penalty", 0.0) * counts - options.get("presence_penalty", 0.0) * (counts > 0)
    x = hf_warp(x, temperature, top_k, top_p)
    if options.get("min_p"):
        from transformers.generation.logits_process import MinPLogitsWarper

        x = MinPLogitsWarper(options["min_p"])(None, x)
    return torch.softmax(x, dim=-1)


@torch.no_grad()
def joint(model, prompt: list[int], setting, length: int = JOINT) -> dict[tuple, float]:
    probs = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        logits = model(torch.tensor([prompt + list(s) for s in prefixes])).logits[:, -1]
        counts = torch.zeros(len(prefixes), VOCAB, dtype=torch.float64)
        for i, s in enumerate(prefixes):
            for t in s:
                counts[i, t] += 1
        cond = by_formula(logits, prompt, counts, setting)
        probs = {s + (t,): probs[s] * c[t].item() for s, c in zip(prefixes, cond)
                 for t in c.nonzero().flatten().tolist()}
    return probs


@torch.no_grad()
def conditionals(model, prompt: list[int], tokens: torch.Tensor, setting) -> torch.Tensor:
    """[N, n, V]: position j's exact distribution given prompt + tokens[:, :j]."""
    n = tokens.shape[1]
    ids = torch.cat([torch.tensor(prompt).expand(len(tokens), -1), tokens], dim=1)
    logits = model(ids).logits[:, len(prompt) - 1: len(prompt) - 1 + n]
    hot = torch.nn.functional.one_hot(tokens, VOCAB).double()
    counts = hot.cumsum(1) - hot  # the output before each position
    return by_formula(logits.reshape(-1, VOCAB), prompt, counts.reshape(-1, VOCAB), setting).view(len(tokens), n, -1)


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) with cells expected below 5 pooled; a sample of probability 0 makes the
    statistic infinite (p = 0)."""
    if observed[probs == 0].sum():
        return float("inf"), 1
    expected = probs / probs.sum() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs, exp = (obs[:-1], exp[:-1]) if exp[-1] == 0 else (obs, exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def setting_statistic(model, prompt, tokens: torch.Tensor, setting, seed: int) -> tuple[float, int]:
    """The joint of the first JOINT tokens, the PIT of each later position, and at each position after the first
    how often the token repeats one of the output's (what the penalties move most: a sharp check of them)."""
    law = joint(model, prompt, setting)
    index = {s: i for i, s in enumerate(law)}
    observed = torch.zeros(len(law) + 1, dtype=torch.float64)
    for row in tokens[:, :JOINT].tolist():
        observed[index.get(tuple(row), len(law))] += 1
    stat, dof = chi_square(observed, torch.tensor([*law.values(), 0.0], dtype=torch.float64))
    cond = conditionals(model, prompt, tokens, setting)
    if (cond.gather(-1, tokens.unsqueeze(-1)) == 0).any():
        return float("inf"), dof  # a token of probability 0 was emitted
    u = pit_values(cond[:, JOINT:], tokens[:, JOINT:], torch.Generator().manual_seed(seed))
    for j in range(u.shape[1]):
        s, d = chi_square(torch.histc(u[:, j].float().clamp(0, 1 - 1e-7), bins=20, min=0, max=1).double(),
                          torch.full((20,), 0.05, dtype=torch.float64))
        stat, dof = stat + s, dof + d
    s, d = repeats(cond, tokens)
    return stat + s, dof + d


def repeats(cond: torch.Tensor, tokens: torch.Tensor) -> tuple[float, int]:
    """Per position j >= 1, (observed - expected repeats)^2 / variance: a repeat is a token the output already
    holds, expected with probability sum of p_j over those tokens (a sum of Bernoullis: one chi-square dof each)."""
    hot = torch.nn.functional.one_hot(tokens, VOCAB).double()
    held = (hot.cumsum(1) - hot) > 0
    q = (cond * held).sum(-1)
    hit = held.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()
    stat, dof = 0.0, 0
    for j in range(1, tokens.shape[1]):
        variance = float((q[:, j] * (1 - q[:, j])).sum())
        if variance > 0:
            stat, dof = stat + float((hit[:, j] - q[:, j]).sum()) ** 2 / variance, dof + 1
    return stat, dof


def sample(generator, settings=SETTINGS, rows=ROWS, seed=1234, prompt=PROMPT, **kwargs):
    """rows per setting, the settings interleaved, in batches of CHUNK rows (row r draws the stream (seed, r));
    [setting][row, token] and the batches' stats summed."""
    from specdecode.bench.stats import merge_stats

    batch = [s for _ in range(rows) for s in settings]
    keys = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    tokens, stats = [], []
    for start in range(0, len(batch), CHUNK):
        part = batch[start:start + CHUNK]
        options = {key: [s[3].get(key, 0.0 if key != "repetition_penalty" else 1.0) for s in part] for key in keys}
        result = generator.generate([prompt] * len(part), max_new_tokens=NEW, temperature=[s[0] for s in part],
                                    top_k=[s[1] for s in part], top_p=[s[2] for s in part],
                                    logit_bias=[s[3].get("logit_bias") for s in part],
                                    seed=[(seed, start + j) for j in range(len(part))], ignore_eos=True,
                                    **options, **kwargs)
        tokens += result.token_ids
        stats.append(result.stats)
    tokens = torch.tensor(tokens)
    return [tokens[i::len(settings)] for i in range(len(settings))], merge_stats(stats)


def p_value(model, per_setting, settings=SETTINGS, prompt=PROMPT) -> float:
    stat, dof = 0.0, 0
    for i, (tokens, setting) in enumerate(zip(per_setting, settings)):
        s, d = setting_statistic(model, prompt, tokens, setting, seed=i)
        stat, dof = stat + s, dof + d
    return float(chi2.sf(stat, dof))


def assert_exact(model, per_setting, settings=SETTINGS, prompt=PROMPT) -> float:
    p = p_value(model, per_setting, settings, prompt)
    assert p > LEVEL, f"chi-square p = {p:.2e} over {len(settings)} settings"
    return p


def _random_k(monkeypatch, seed):
    from specdecode.policy.choose import AdaptivePolicy

    rng = random.Random(seed)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: rng.randint(0, max(caps)))


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("k, method", [(1, "leviathan"), (2, "chen"), (3, "leviathan"), (4, "chen")])
def test_model_drafts_follow_the_formulas(target, draft, k, method):
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=k, method=method)
    per_setting, stats = sample(generator, seed=100 + k)
    assert 0.05 < stats.acceptance_rate < 0.98 and stats.accepted_per_position[k - 1] > 0
    assert_exact(target, per_setting)


def test_token_trees_follow_the_formulas(target, draft):
    """A draft model's chain with siblings of its first token: each node's distribution sees its own ancestors."""
    from specdecode.backends import as_backend
    from specdecode.drafters import ModelDrafter

    generator = SpeculativeGenerator(target, ModelDrafter(as_backend(draft), tree_width=3), num_speculative_tokens=4)
    per_setting, stats = sample(generator, seed=7)
    assert stats.proposed_tokens > 0
    assert_exact(target, per_setting)


def test_coupled_rows_under_a_random_k_follow_the_formulas(target, draft, monkeypatch):
    """Seeded rows under auto are drawn by Gumbel-max coupling; K random per step."""
    _random_k(monkeypatch, 3)
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    per_setting, stats = sample(generator, seed=11)
    assert stats.accepted_per_position[2] > 0
    assert_exact(target, per_setting)


def test_deterministic_drafts_follow_the_formulas(target):
    """Prompt lookup (q = None): a draft is kept with p(x) under the path's penalties, a rejection draws p - x."""
    generator = SpeculativeGenerator(target, PromptLookupDrafter(max_ngram=2), num_speculative_tokens=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    per_setting, stats = sample(generator, seed=5, prompt=prompt)
    assert 0.05 < stats.acceptance_rate < 0.98
    assert_exact(target, per_setting, prompt=prompt)


def test_plain_decoding_follows_the_formulas(target):
    per_setting, _ = sample(AutoregressiveGenerator(target), seed=9)
    assert_exact(target, per_setting)


# ---------------------------------------------------------------------------------------------- power
class OneToken(Drafter):
    """Drafts one fixed token everywhere: deterministic drafts that the target mostly rejects, so a sampler that
    counted rejected drafts, or a position blind to the drafts before it, would move that token's probability."""

    def __init__(self, token: int):
        self.token = token

    def outlook(self, rows):
        return DraftOutlook([rows.widest] * len(rows.texts))

    def propose(self, choice, context):
        return Proposal(torch.full((len(context.texts), choice.k), self.token, dtype=torch.long))


SHARP = [(1.0, 0, 1.0, dict(presence_penalty=-2.0)), (1.0, 0, 1.0, dict(presence_penalty=2.0, frequency_penalty=2.0)),
         (1.0, 0, 1.0, dict(repetition_penalty=0.5))]
FREQUENT = 14  # a token the target draws ~20 % of the time: often drafted in vain, often emitted


def rejected_drafts(target):
    return sample(SpeculativeGenerator(target, OneToken(FREQUENT), num_speculative_tokens=3), SHARP, seed=77)


def test_drafts_the_target_mostly_rejects_follow_the_formulas(target):
    per_setting, stats = rejected_drafts(target)
    assert 0.05 < stats.acceptance_rate < 0.3
    assert_exact(target, per_setting, SHARP)


def test_the_check_catches_rejected_drafts_that_count(target, monkeypatch):
    """Broken on purpose: every draft of a step is recorded, kept or not (a sampler that counts while drafting)."""
    along, advance = RowPenalties.along_chain, RowPenalties.advance

    def remember(self, tokens):
        self.drafted = tokens.tolist()
        return along(self, tokens)

    def count_all(self, emitted):
        drafted = self.__dict__.pop("drafted", None) or [[] for _ in emitted]
        advance(self, [d + e[-1:] for d, e in zip(drafted, emitted)])

    monkeypatch.setattr(RowPenalties, "along_chain", remember)
    monkeypatch.setattr(RowPenalties, "advance", count_all)
    assert p_value(target, rejected_drafts(target)[0], SHARP) < 1e-10


def test_the_check_catches_positions_blind_to_the_drafts_before_them(target, monkeypatch):
    """Broken on purpose: p at position j sees the kept text only, not the drafts between it and the last token."""
    along = RowPenalties.along_chain

    def blind(self, tokens):
        path = along(self, tokens)
        path.before = torch.zeros_like(path.before)
        return path

    monkeypatch.setattr(RowPenalties, "along_chain", blind)
    assert p_value(target, rejected_drafts(target)[0], SHARP) < 1e-10


def test_q_sees_what_p_sees(target, monkeypatch):
    """A draft identical to the target proposes from q = p under every option, so (almost) every draft is kept;
    a drafter whose q missed the penalties (still exact: its q is what it drew from) would lose that."""
    from specdecode.drafters import DraftContext

    def acceptance():
        generator = SpeculativeGenerator(target, perturbed_copy(target, 0.0, seed=1), num_speculative_tokens=4)
        return sample(generator, SETTINGS, rows=200, seed=3)[1].acceptance_rate

    assert acceptance() > 0.97
    monkeypatch.setattr(DraftContext, "penalized", lambda self, logits, drafted: logits)
    assert acceptance() < 0.9

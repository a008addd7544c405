"""Structured outputs and logprobs under speculation, on tiny models with the tiny real tokenizer.

A constrained row draws from normalise(p * mask) at every position, where mask is what its grammar allows after the
tokens before it. The reference here enumerates that joint distribution from the target alone (full forwards, a
fresh matcher per prefix), and the engine's samples must follow it for every way a step can be built: model drafts
(both rejection methods), the adaptive policy with Gumbel coupling, deterministic drafts (prompt lookup) and plain
steps, with forced runs riding as certain drafts.
"""

import json

import pytest
import torch

from reference import assert_matches, hf_warp
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator
from specdecode.structured.constraints import ConstraintError, ConstraintSpec, GrammarCompiler
from specdecode.drafters.base import Drafter, DraftOutlook, Proposal
from specdecode.policy.choose import AdaptivePolicy

SAMPLES = 3000
MIN_P = 1e-4
REGEX = "(ab|cd)e(f|gh)ij"  # choices between forced stretches: forced runs and real choices in three tokens
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("The quick brown fox")["input_ids"]


@torch.no_grad()
def constrained_joint(target, tokenizer, prompt, spec, length, temperature):
    """P(first `length` new tokens = s) under the grammar, from the target alone."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    grammar = GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer), eos_token_ids=[eos]).compile(spec)
    probs = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in probs.items():
            matcher = grammar.matcher()
            assert matcher.advance(list(prefix)) == len(prefix)
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = torch.softmax(hf_warp(logits[None], temperature, 0, 1.0)[0], -1).double() * matcher.mask()
            p = p / p.sum()
            grown.update({prefix + (t,): mass * p[t].item() for t in p.nonzero().flatten().tolist()})
        probs = grown
    return probs


def generators(target, draft):
    return {
        "leviathan-k2": SpeculativeGenerator(target, draft, num_speculative_tokens=2, method="leviathan"),
        "chen-k3": SpeculativeGenerator(target, draft, num_speculative_tokens=3, method="chen"),
        "auto-coupled": SpeculativeGenerator(target, draft, num_speculative_tokens="auto"),
        "prompt-lookup": SpeculativeGenerator(target, PromptLookupDrafter(), num_speculative_tokens=2),
        "plain": AutoregressiveGenerator(target),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["leviathan-k2", "chen-k3", "auto-coupled", "prompt-lookup", "plain"])
def test_constrained_samples_follow_the_exact_constrained_joint(models, tokenizer, prompt, name):
    target, draft = models
    gen = generators(target, draft)[name]
    gen.tokenizer = tokenizer
    joint = constrained_joint(target, tokenizer, prompt, ConstraintSpec.of(regex=REGEX), 3, 1.0)
    result = gen.generate([prompt] * SAMPLES, max_new_tokens=3, temperature=1.0, seed=5, regex=REGEX,
                          ignore_eos=True)
    index = {s: i for i, s in enumerate(joint)}
    observed = torch.zeros(len(joint) + 1)
    for row in result.token_ids:
        observed[index.get(tuple(row), len(joint))] += 1
    assert_matches(observed, list(joint.values()) + [0.0], min_p=MIN_P)
    assert result.stats.forced_tokens > 0 or name != "plain"  # plain decoding still verifies forced runs


def test_forced_tokens_ride_as_certain_drafts(models, tokenizer, prompt):
    """The regex forces 'e' after the first choice and 'ij' at the end: those tokens need no model draft, and each
    forced position is one-hot under the mask, so greedy and sampled rows keep them all."""
    target, _ = models
    gen = AutoregressiveGenerator(target, tokenizer=tokenizer)
    result = gen.generate([prompt] * 4, max_new_tokens=12, temperature=[0.0, 1.0, 1.0, 0.7], seed=3, regex=REGEX)
    for text, reason in zip(result.texts, result.finish_reasons):
        assert text in {"abefij", "abeghij", "cdefij", "cdeghij"} and reason == "stop"
    assert result.stats.forced_tokens >= 4
    assert "forced" in result.provenance[0]
    plain_steps = result.stats.target_forward_calls
    assert plain_steps < 1 + sum(len(t) for t in result.token_ids)  # fewer forwards than tokens


def test_greedy_under_a_schema_is_the_same_with_speculation_on_and_off(models, tokenizer, prompt):
    target, draft = models
    plain = AutoregressiveGenerator(target, tokenizer=tokenizer).generate(
        [prompt], max_new_tokens=60, temperature=0.0, json_schema=SCHEMA)
    for k in (3, "auto"):
        spec = SpeculativeGenerator(target, draft, num_speculative_tokens=k, tokenizer=tokenizer).generate(
            [prompt], max_new_tokens=60, temperature=0.0, json_schema=SCHEMA)
        assert spec.token_ids == plain.token_ids
    assert json.loads(plain.texts[0])["color"] in {"red", "green", "blue"}


def test_seeded_sampled_answers_are_valid_under_their_schema(models, tokenizer, prompt):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=3, tokenizer=tokenizer)
    result = gen.generate([prompt] * 200, max_new_tokens=60, temperature=1.0, seed=11, json_schema=SCHEMA)
    assert set(result.finish_reasons) == {"stop"}
    for text in result.texts:
        value = json.loads(text)
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool)
        assert value["color"] in {"red", "green", "blue"}
    assert len(set(result.texts)) > 1


def test_hitting_max_tokens_mid_json_is_length_not_stop(models, tokenizer, prompt):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=3, tokenizer=tokenizer)
    result = gen.generate([prompt], max_new_tokens=3, temperature=0.0, json_schema=SCHEMA)
    assert result.finish_reasons == ["length"]


def test_constrained_and_free_rows_share_a_batch_and_equal_their_solo_answers(models, tokenizer, prompt):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2, tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=30, temperature=0.8)
    batch = gen.generate([prompt, prompt, prompt], seed=[1, 2, 3], json_schema=[SCHEMA, None, None],
                         regex=[None, None, REGEX], **kwargs)
    assert batch.token_ids[0] == gen.generate([prompt], seed=1, json_schema=SCHEMA, **kwargs).token_ids[0]
    assert batch.token_ids[1] == gen.generate([prompt], seed=2, **kwargs).token_ids[0]
    assert batch.token_ids[2] == gen.generate([prompt], seed=3, regex=REGEX, **kwargs).token_ids[0]


def test_bad_constraints_are_clear_errors_before_any_work(models, tokenizer, prompt):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2, tokenizer=tokenizer)
    with pytest.raises(ConstraintError):
        gen.generate([prompt], json_schema={"type": "no-such-type"})
    with pytest.raises(ConstraintError):
        gen.generate([prompt], regex="(unclosed")
    with pytest.raises(ConstraintError):
        gen.generate([prompt], regex="a", json_schema=SCHEMA)
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeGenerator(target, draft, num_speculative_tokens=2).generate([prompt], regex="a")


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.5)])
def test_the_additive_mask_warps_exactly_like_masked_fill(top_k, top_p):
    """BatchSampling applies a grammar's mask by adding its additive form (branch-free): the scores must be those of
    masked_fill bit for bit, for a bool mask, its additive form and the drafter's mask alike, with greedy rows in
    the batch, and rows where top-k/top-p cut every allowed token fall back to warping the masked logits."""
    from specdecode.exact.sampling import BatchSampling, SamplingParams

    torch.manual_seed(0)
    params = [SamplingParams(0.7, top_k, top_p), SamplingParams(0.0), SamplingParams(1.3, top_k, top_p)]
    sampling = BatchSampling(params)
    logits = torch.randn(3, 4, 50)
    mask = torch.rand(3, 4, 50) < 0.3
    mask[0, 1] = False
    mask[0, 1, logits[0, 1].argmin()] = True  # a lone allowed token that top-k / top-p cut: the fallback
    mask[2, 2] = True
    additive = sampling.additive(mask)
    assert additive.dtype == torch.float32 and torch.equal(sampling.additive(additive), additive)
    ninf = float("-inf")
    scores = sampling._warp(logits)
    masked = scores.masked_fill(~mask[[0, 2]], ninf)
    empty = torch.isneginf(masked).all(dim=-1)
    expected = torch.where(empty.unsqueeze(-1), sampling._warp(logits.masked_fill(~mask, ninf)), masked)
    for form in (mask, additive):
        assert torch.equal(sampling.warp(logits, form), expected)
        full = sampling.scores(logits, form)
        assert torch.equal(full[1], logits[1].masked_fill(~mask[1], ninf)) and torch.equal(full[[0, 2]], expected)
    assert bool(empty.any()) == (top_k > 0 or top_p < 1)


class ForbiddenDrafter(Drafter):
    """Drafts one fixed token everywhere (after `first`, if given): under a digits-only regex every draft from the
    fixed token on is cut before the verification."""

    def __init__(self, token: int, first: int | None = None):
        self.token, self.first = token, first

    def outlook(self, rows):
        return DraftOutlook([rows.widest] * len(rows.texts))

    def propose(self, choice, context):
        tokens = torch.full((len(context.texts), choice.k), self.token, dtype=torch.long)
        if self.first is not None:
            tokens[:, 0] = self.first
        return Proposal(tokens)


def test_drafts_a_grammar_forbids_are_not_run_through_the_target(models, tokenizer, prompt, monkeypatch):
    """A draft the row's grammar forbids cannot be kept, so the step's forward stops before it: with every draft
    forbidden each decode step is a one-token forward (it was K + 1 tokens wide, at K + 1 tokens' cost), and the
    answers are the plain decoder's (greedy) and valid (sampled)."""
    target, _ = models
    widths = []
    forward = target.forward

    def recorded(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(ids.shape[1])
        return forward(*args, **kwargs)

    regex = "[0-9]{12}"
    plain = AutoregressiveGenerator(target, tokenizer=tokenizer).generate([prompt], max_new_tokens=12,
                                                                          temperature=0.0, regex=regex)
    letter = tokenizer("z", add_special_tokens=False)["input_ids"][0]
    gen = SpeculativeGenerator(target, ForbiddenDrafter(letter), num_speculative_tokens=3, tokenizer=tokenizer)
    monkeypatch.setattr(target, "forward", recorded)
    greedy = gen.generate([prompt], max_new_tokens=12, temperature=0.0, regex=regex)
    assert greedy.token_ids == plain.token_ids and greedy.stats.accepted_tokens == 0
    assert len(widths) > 5 and widths[1:] == [1] * (len(widths) - 1), widths  # after the prompt's forward
    widths.clear()
    sampled = gen.generate([prompt] * 3, max_new_tokens=12, temperature=1.0, seed=4, regex=regex)
    assert all(text.isdigit() and len(text) == 12 for text in sampled.texts), sampled.texts
    assert widths[1:] == [1] * (len(widths) - 1), widths


class AlwaysThree(AdaptivePolicy):
    """An adaptive policy (so seeded sampled rows are coupled) that always asks for 3 drafts."""

    def choose(self, rows, caps):
        self.trial = False
        return min(3, self._remember(rows, caps))


def test_cut_drafts_leave_coupled_rows_a_function_of_their_seed(models, tokenizer, prompt):
    """Under an adaptive policy seeded sampled rows draw by Gumbel coupling: their text depends on the seed alone,
    whatever K. Drafts the grammar cuts (a narrower forward, so fewer positions of noise read) keep it so: the same
    seeds give the same answers with a draft model whose drafts the grammar masks, and with 3 drafts cut after 0 or
    1 of them."""
    target, draft = models
    regex = "[0-9]{12}"
    letter = tokenizer("z", add_special_tokens=False)["input_ids"][0]
    digit = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    kwargs = dict(max_new_tokens=12, temperature=1.0, seed=[7, 8, 9], regex=regex)
    masked = SpeculativeGenerator(target, draft, num_speculative_tokens="auto", tokenizer=tokenizer)
    expected = masked.generate([prompt] * 3, **kwargs).token_ids
    for first in (None, digit):
        cut = SpeculativeGenerator(target, ForbiddenDrafter(letter, first), num_speculative_tokens="auto",
                                   tokenizer=tokenizer)
        cut.policy = AlwaysThree(8)
        assert cut.generate([prompt] * 3, **kwargs).token_ids == expected
        verified = cut.policy.summary()["k_histogram"]  # the widths the grammar left of the 3 drafts
        assert max(verified) == (0 if first is None else 1) and sum(verified.values()) >= 10, verified

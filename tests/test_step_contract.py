"""The step contract: per-row sampling and seeds, deterministic drafts without dense q, backends and drafters
behind adapters (a backend with no transformers behind it runs the same loop), hidden states on request."""

import pytest
import torch

from conftest import perturbed_copy, tiny_qwen
from drafting import Driver
from lookup_backend import LookupBackend
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator
from specdecode.drafters import ModelDrafter, as_drafter

PROMPT = [11, 42, 7, 99, 5]


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen(128, seed=3, eos_token_id=127)
    return target, perturbed_copy(target, 0.3, seed=4)


@pytest.mark.parametrize("k", [3, "auto"])
def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch(models, k):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=k)
    kwargs = dict(temperature=0.9, top_p=0.95, ignore_eos=True)
    alone = gen.generate([PROMPT], max_new_tokens=24, seed=[1234], **kwargs).token_ids[0]
    batch = gen.generate([[3, 4], PROMPT, [9, 9, 9, 1], PROMPT], max_new_tokens=[5, 24, 40, 13],
                         temperature=[1.4, 0.9, 0.0, 0.5], top_p=[1.0, 0.95, 1.0, 0.8], top_k=[0, 0, 0, 5],
                         seed=[7, 1234, None, 1234], ignore_eos=True)
    assert batch.token_ids[1] == alone
    # an int seed S is one request: its row 0 is the solo call with seed S, row 1 a stream of its own (under the
    # old S + i rule, row 1 of seed 1233 was the solo call with seed 1234)
    pair = gen.generate([PROMPT, PROMPT], max_new_tokens=24, seed=1234, **kwargs).token_ids
    assert pair[0] == alone and pair[1] != alone
    assert gen.generate([[3, 4], PROMPT], max_new_tokens=24, seed=1233, **kwargs).token_ids[1] != alone
    assert gen.generate([PROMPT], max_new_tokens=24, seed=[1235], **kwargs).token_ids[0] != alone


def test_greedy_rows_are_the_target_greedy_in_a_batch_of_sampled_rows(models):
    target, draft = models
    expected = target.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=4).generate(
        [PROMPT, PROMPT, [5, 6]], max_new_tokens=16, temperature=[1.0, 0.0, 0.7], seed=0, ignore_eos=True)
    assert result.token_ids[1] == expected


def test_per_row_settings_are_checked_and_counted(models):
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="temperature has 3 entries for 2 prompts"):
        gen.generate([PROMPT, PROMPT], temperature=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="top_p"):
        gen.generate([PROMPT, PROMPT], top_p=[0.5, 0.0])
    with pytest.raises(ValueError, match="seed"):
        gen.generate([PROMPT], seed="abc")


def test_prompt_lookup_builds_no_dense_q_even_with_a_huge_vocabulary(monkeypatch):
    """Deterministic drafts: nothing of shape [B, K, V] is allocated (a 200k vocabulary, 8 rows, K = 6)."""
    vocab, rows, k = 200_000, 8, 6

    class Cycling(LookupBackend):  # mostly continues 5 6 7 8 5 6 ..., so the lookup finds matches
        def _logits(self, before, last):
            logits = super()._logits(before, last)
            logits[5 + (last - 4) % 4] += 14.0
            return logits

    backend = Cycling(vocab_size=vocab, seed=1, sharpness=0.5)
    largest = {"numel": 0}
    real_zeros, real_zeros_like = torch.zeros, torch.zeros_like

    def spy(real):
        def make(*args, **kwargs):
            t = real(*args, **kwargs)
            largest["numel"] = max(largest["numel"], t.numel())
            return t
        return make

    monkeypatch.setattr(torch, "zeros", spy(real_zeros))
    monkeypatch.setattr(torch, "zeros_like", spy(real_zeros_like))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    drafter = PromptLookupDrafter()
    result = SpeculativeGenerator(backend, drafter, num_speculative_tokens=k).generate(
        [prompt] * rows, max_new_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    assert all(len(t) == 8 for t in result.token_ids)
    assert result.stats.proposed_tokens > 0
    assert largest["numel"] < rows * k * vocab  # [B, V] rows exist (one residual per row), never [B, K, V]
    batch = Driver(drafter)
    batch.join([prompt] * rows)
    assert batch.propose(k).q is None


def test_a_backend_without_transformers_runs_the_same_loop():
    """The engine imports only protocols: a pure-torch lookup-table backend is a target and a draft."""
    target, draft = LookupBackend(32, seed=0), LookupBackend(32, seed=0)
    prompt = [1, 2, 3]
    result = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        prompt, max_new_tokens=12, temperature=0.0)
    tokens = list(prompt)
    for _ in range(12):  # the backend's own greedy decoding, computed directly
        tokens.append(int(target.exact_next(tokens).argmax()))
    assert result.token_ids[0] == tokens[len(prompt):]
    assert result.stats.acceptance_rate == 1.0  # the draft is the same table
    plain = AutoregressiveGenerator(LookupBackend(32, seed=0)).generate(prompt, max_new_tokens=12, temperature=0.0)
    assert plain.token_ids == result.token_ids


def test_adapters_wrap_what_the_user_passes(models):
    target, _ = models
    assert as_drafter(None) is None
    drafter = PromptLookupDrafter()
    assert as_drafter(drafter) is drafter
    assert isinstance(as_drafter(LookupBackend(16)), ModelDrafter)
    assert isinstance(as_drafter(target), ModelDrafter)
    with pytest.raises(TypeError, match="ModelBackend"):
        as_drafter(object())


def test_hidden_states_are_handed_to_a_drafter_that_asks_and_cost_nothing_otherwise(models):
    target, _ = models
    seen = []

    class FeatureDrafter(PromptLookupDrafter):
        needs_hidden_states = True

        def relayout(self, change):
            if change.appended:
                seen.append(("prefill", tuple(change.hidden.shape)))
            super().relayout(change)

        def observe(self, outcome):
            seen.append(("update", None if outcome.hidden is None else tuple(outcome.hidden.shape)))
            super().observe(outcome)

    calls = []
    real_forward = type(target).forward

    def recording_forward(self, *args, **kwargs):
        calls.append(kwargs.get("output_hidden_states", False))
        return real_forward(self, *args, **kwargs)

    gen = SpeculativeGenerator(target, FeatureDrafter(), num_speculative_tokens=2)
    result = gen.generate([PROMPT], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert seen[0] == ("prefill", (1, len(PROMPT), 64))
    assert all(shape is not None and shape[-1] == 64 for kind, shape in seen[2:] if kind == "update")
    type(target).forward = recording_forward
    try:
        SpeculativeGenerator(target, PromptLookupDrafter(), num_speculative_tokens=2).generate(
            [PROMPT], max_new_tokens=4, temperature=0.0)
    finally:
        type(target).forward = real_forward
    assert calls and not any(calls)  # no drafter asked: hidden states were never requested
    assert len(result.token_ids[0]) == 6


def test_stats_record_the_k_chosen(models):
    target, draft = models
    stats = SpeculativeGenerator(target, draft, num_speculative_tokens="auto").generate(
        [PROMPT], max_new_tokens=30, temperature=0.0, ignore_eos=True).stats
    assert stats.policy == "auto" and sum(stats.k_histogram.values()) == stats.target_forward_calls - 1
    assert 0 <= stats.mean_k <= 8
    assert "k_histogram" in stats.policy_summary or stats.policy_summary
    fixed = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        [PROMPT], max_new_tokens=30, temperature=0.0, ignore_eos=True).stats
    assert fixed.policy == "fixed" and set(fixed.k_histogram) <= {1, 2, 3}


@pytest.mark.parametrize("joins_late", [False, True])
def test_a_probe_bounds_the_catch_up_of_a_draft_far_behind(models, monkeypatch, joins_late):
    """A probe after many plain steps does not make the draft read every token it missed: rows further behind than
    `catch_up_window` restart from their last `catch_up_window` tokens. Greedy output is still the target's own."""
    from specdecode.policy.choose import AdaptivePolicy

    target, draft = models
    prompt = [5, 9, 2, 7, 1, 8, 3, 3, 4] * 3
    plan = ([2] * 3 if not joins_late else []) + [0] * 20 + [3]  # speculate, 20 plain steps, then a probe

    def choose(self, rows, caps):
        self.trial = len(plan) == 1
        return min(plan.pop(0) if plan else 3, max(caps))

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
    gen.drafter.catch_up_window = 8
    fed = []
    real = ModelDrafter.propose

    def spy(self, choice, context):
        out = real(self, choice, context)
        fed.append((self.catch_up, self.backend.lengths[0]))
        return out

    monkeypatch.setattr(ModelDrafter, "propose", spy)
    result = gen.generate([prompt], max_new_tokens=40, temperature=0.0, ignore_eos=True)
    plain = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=40, temperature=0.0, ignore_eos=True)
    assert result.token_ids == plain.token_ids
    probe = fed[3] if not joins_late else fed[0]
    assert probe[0] == 8  # the window, not the 20 missed tokens (nor the 27-token prompt)
    assert probe[1] < 8 + 4  # the cache restarted: the window and this step's drafts
    assert fed[-1][0] <= 2  # steady drafting afterwards
    assert result.stats.k_histogram.get(0, 0) >= 20


def test_an_exploited_k_feeds_the_whole_backlog(models):
    """Outside probes nothing is cut: a row's first proposal feeds its whole prompt (the draft's full context)."""
    target, draft = models
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    gen.drafter.catch_up_window = 4
    gen.generate([[5, 9, 2, 7, 1, 8, 3, 3, 4] * 3], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert gen.drafter.catch_up_tokens == 27  # prompt + first token, all but the last fed apart

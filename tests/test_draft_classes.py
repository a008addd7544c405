"""Draft classes: a copying drafter tells the policy, before each step, how long a match its draft was copied after
(DraftOutlook.classes), and the policy learns acceptance per class, so it drafts after long matches and decodes
plainly after short ones. The classes are a function of the context, so outputs stay exactly the target's."""

from __future__ import annotations

import random

import pytest

from conftest import tiny_qwen
from drafting import Driver
from reference import assert_first_tokens_follow_target
from specdecode import AutoregressiveGenerator, PromptLookupDrafter, SpeculativeGenerator, SuffixDrafter
from specdecode.drafters.base import match_class
from specdecode.policy.choose import AdaptivePolicy, Outcome, Outlook

# This project's 2-core CPU on llama.cpp: a forward of n tokens costs v(n) single-token steps (BENCHMARKS.md).
V = {1: 1.0, 2: 1.61, 3: 2.18, 4: 2.70, 5: 3.35, 6: 4.02, 7: 4.56, 8: 5.1, 9: 5.6}
LONG, SHORT = match_class(20), match_class(1)


def test_match_classes_bucket_match_lengths():
    assert [match_class(m) for m in (1, 2, 3, 4, 5, 6, 8, 9, 15, 16, 31, 32, 500)] == \
        [0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]


def run(policy, steps: int, classes: bool, seed: int = 0):
    """One row whose drafts are free (no model): half the steps copy after a long match (kept 97 % of the time),
    half after a one-token match (kept 20 %). Returns (expected tokens per unit of time, K chosen per class)."""
    rng = random.Random(seed)
    row = policy.new_row()
    tokens = seconds = 0.0
    chosen = {LONG: [], SHORT: []}
    for _ in range(steps):
        draft_class = LONG if rng.random() < 0.5 else SHORT
        a = 0.97 if draft_class == LONG else 0.2
        k = policy.decide(Outlook([row], [8], free=True, classes=[draft_class if classes else None])).k
        kept = next((m for m in range(k) if rng.random() >= a), k)
        tokens += sum(a ** j for j in range(k + 1))
        seconds += V[k + 1]
        policy.learn(Outcome([row], k, [kept], [k], 1, 0.0, V[k + 1] * (1 + 0.04 * (rng.random() - 0.5)), free=True))
        chosen[draft_class].append(k)
    return tokens / seconds, chosen


def test_the_policy_drafts_after_long_matches_and_decodes_plainly_after_short_ones():
    with_classes, chosen = run(AdaptivePolicy(8), 3000, classes=True)
    without, _ = run(AdaptivePolicy(8), 3000, classes=False)
    # After long matches K = 3 (3.8 tokens for 2.7 steps) or 8 (8.1 for 5.6); after short ones a plain step.
    late_long, late_short = chosen[LONG][500:], chosen[SHORT][500:]
    assert sum(k >= 3 for k in late_long) > 0.9 * len(late_long)
    assert sum(k == 0 for k in late_short) > 0.9 * len(late_short)
    # The row's average (0.58 acceptance) pays for no K at these costs: without classes it is about plain decoding.
    assert with_classes > 1.2 * without and with_classes > 1.25


def test_class_evidence_is_kept_apart_from_the_rows_and_reported():
    policy = AdaptivePolicy(4)
    row = policy.new_row()
    for draft_class, kept in [(LONG, 4), (LONG, 4), (SHORT, 0), (None, 1)]:
        policy.decide(Outlook([row], [4], classes=[draft_class]))
        policy.learn(Outcome([row], 4, [kept], [4], 1, 0.0, 1.0))
    assert row.seen == [1, 1, 0, 0] and row.accepted == [1, 0, 0, 0]  # only the unclassed step is the row's
    summary = policy.summary()
    assert summary["class_acceptance"] == {SHORT: 0.0, LONG: 1.0}
    assert policy.seen[0] == pytest.approx(sum(0.97 ** j for j in range(4)))  # the batch's pools every step
    row.draft_class = LONG
    long_gain = policy.expected_tokens(row)[4]
    row.draft_class = SHORT
    assert long_gain > policy.expected_tokens(row)[4] + 1.5


def test_copying_drafters_classify_their_drafts_by_match_length():
    suffix = Driver(SuffixDrafter(history_tokens=0))
    context = list(range(10, 50)) + list(range(10, 30))  # the tail repeats a 20-token run
    suffix.join([context, [1, 2, 3]])
    outlook = suffix.outlook(4)
    assert outlook.drafts == [4, 0]
    assert outlook.classes == [match_class(20), None]
    lookup = Driver(PromptLookupDrafter(max_ngram=3))
    lookup.join([[5, 6, 7, 9, 6, 7], [5, 6, 7, 8, 9, 1]])
    outlook = lookup.outlook(2)
    assert outlook.drafts == [2, 0]
    assert outlook.classes == [match_class(2), None]  # "6 7" matched; the 3-gram "9 6 7" did not


@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


def test_greedy_output_with_classes_is_the_targets_own_and_the_policy_learns_them(target, tokenizer):
    prompt = tokenizer("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n")["input_ids"]
    plain = AutoregressiveGenerator(target).generate([prompt] * 2, max_new_tokens=48, temperature=0.0,
                                                     ignore_eos=True)
    gen = SpeculativeGenerator(target, SuffixDrafter(), num_speculative_tokens="auto")
    for _ in range(3):  # later requests copy earlier answers from the history: long matches
        result = gen.generate([prompt] * 2, max_new_tokens=48, temperature=0.0, ignore_eos=True)
        assert result.token_ids == plain.token_ids
    assert gen.policy.summary()["class_acceptance"]  # the classes reached the policy
    assert result.stats.proposed_tokens > 0


VOCAB = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


class ClassDriven(AdaptivePolicy):
    """K from this step's draft classes alone (the longest match's class + 1): K changes with the context at every
    step, which the exactness test needs and which timings on a tiny model would not reliably give."""

    adaptive = False  # seeded rows are then not coupled: they take the rejection sampler, as with a fixed K

    def choose(self, rows, caps):
        top = self._remember(rows, caps)
        return min(top, max((r.draft_class + 1 for r in rows if r.draft_class is not None), default=0))


@pytest.mark.parametrize("method", ["leviathan", "chen"])
def test_sampled_output_with_a_k_that_follows_the_classes_is_the_targets(method):
    """K set by each step's match classes (copies from the row and from a history of earlier samples): the first
    three tokens' joint is still the target's (chi-square against the enumerated joint)."""
    model = tiny_qwen(VOCAB, seed=11, layers=2, hidden=32)
    earlier = AutoregressiveGenerator(model).generate([PROMPT] * 20, max_new_tokens=6, temperature=0.8, seed=1,
                                                      ignore_eos=True)
    drafter = SuffixDrafter()
    for tokens in earlier.token_ids:
        drafter.history.add(PROMPT + tokens)
    gen = SpeculativeGenerator(model, drafter, method=method)
    session = gen.session(policy=ClassDriven(8))
    for i in range(4000):  # seeded (each row its own stream): the chi-square below is then not a fresh draw per run
        session.add(gen.request(PROMPT, 4, temperature=0.8, seed=i, ignore_eos=True))
    while not session.idle:
        session.step()
    result = session.result()
    assert len(set(result.stats.k_histogram)) >= 3  # K really varied with the classes
    assert 0.05 < result.stats.acceptance_rate < 0.98
    assert_first_tokens_follow_target(model, PROMPT, result.token_ids, temperature=0.8)


def test_an_untried_long_match_class_is_drafted_after_short_matches_missed():
    """With the copying drafters' class prior, a class never verified is judged by what such matches are measured to
    keep, not by the batch's rate: after a run of one-token matches that all missed, the first copy after a 20-token
    match is drafted (without the prior it was not: the batch's misses priced it out, and it was never tried)."""
    for class_prior, drafts_long in [(SuffixDrafter.class_acceptance, True), (None, False)]:
        policy = AdaptivePolicy(8, class_prior=class_prior)
        row = policy.new_row()
        for _ in range(12):
            k = policy.decide(Outlook([row], [8], free=True, classes=[SHORT])).k
            policy.learn(Outcome([row], k or 1, [0], [k or 1], 1, 0.0, V[(k or 1) + 1], free=True))
        for k in range(9):  # the costs timed, as a run's explorations would have
            policy.learn(Outcome([row], k, [0], [k], 1, 0.0, V[k + 1], free=True))
        assert (policy.decide(Outlook([row], [8], free=True, classes=[LONG])).k > 0) is drafts_long
        assert policy.decide(Outlook([row], [8], free=True, classes=[SHORT])).k == 0


def test_copying_drafters_declare_a_prior_per_class_and_the_generator_passes_it():
    from specdecode.drafters.base import MATCH_CLASS_ACCEPTANCE, MATCH_CLASSES

    assert len(MATCH_CLASS_ACCEPTANCE) == len(MATCH_CLASSES) + 1
    assert list(MATCH_CLASS_ACCEPTANCE) == sorted(MATCH_CLASS_ACCEPTANCE)  # a longer match is kept at least as often
    assert PromptLookupDrafter.class_acceptance == SuffixDrafter.class_acceptance == MATCH_CLASS_ACCEPTANCE
    generator = SpeculativeGenerator(tiny_qwen(64, 0), SuffixDrafter(history_tokens=0), "auto")
    assert generator.policy.class_prior == MATCH_CLASS_ACCEPTANCE
    with pytest.raises(ValueError, match="class_prior"):
        AdaptivePolicy(8, class_prior=(0.5, 1.5))

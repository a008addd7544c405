"""The suffix drafter (SuffixDecoding without token trees): its index, its shared history, and that decoding with it
is exactly the target's (greedy token for token; sampled by chi-square against the enumerated joint).

The drafts are deterministic (q=None), so exactness holds for any history; what these tests add over prompt
lookup's is that the history changes between requests, and the keys that keep histories apart.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import tiny_qwen
from drafting import Driver
from reference import assert_first_tokens_follow_target
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, SuffixDrafter, SuffixHistory
from specdecode.drafters.suffix_drafts import speculate
from specdecode.drafters.suffix_index import TokenLog


def draft_of(log: TokenLog, tail, k=8, min_prob=0.1, factor=1.0):
    return speculate(log, list(tail), k, min_prob, factor)


def history_of(*docs, max_tokens=10_000, key=None) -> SuffixHistory:
    history = SuffixHistory(max_tokens)
    for doc in docs:
        history.add(doc, key)
    return history


# ---------------------------------------------------------------------------------------------- the index
def test_match_finds_every_occurrence_of_the_longest_suffix_with_its_true_length():
    log = TokenLog()
    log.extend([1, 2, 3, 4, 5, 8, 9, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5])
    ends, lengths = log.match([1, 2, 3, 4, 5])  # found on the 4-gram "2 3 4 5", extended token by token
    assert ends.tolist() == [10, 4]  # newest first; the context's own tail (position 16) has nothing after it
    assert lengths.tolist() == [4, 5]  # "9 2 3 4 5" differs at its first token; "1 2 3 4 5" matches whole
    draft = draft_of(log, [1, 2, 3, 4, 5])
    assert draft.tokens == [8, 9, 2, 3, 4] and draft.match == 5  # the deepest match: certain, 5 tokens long
    assert draft_of(log, [7, 7]).tokens == []  # nothing matches


def test_the_most_frequent_continuation_wins_and_its_frequency_is_the_confidence():
    history = history_of([5, 1, 2, 3, 10, 11], [6, 1, 2, 3, 10, 12], [7, 1, 2, 3, 20, 21])
    draft = history.speculate([1, 2, 3], None, 8, 0.1)
    assert draft.tokens[0] == 10 and draft.match == 3
    assert draft.score == pytest.approx(2 / 3 + 1 / 3)  # 10 (2 of 3), then 12 or 11 (1 of 3 in all)
    assert draft.tokens == [10, 12]  # the tie between 11 and 12 goes to the most recent document
    # The estimated acceptance cuts the draft: below 2/3 nothing is proposed, below 1/3 only the first token.
    assert history.speculate([1, 2, 3], None, 8, 0.7).tokens == []
    assert history.speculate([1, 2, 3], None, 8, 0.5).tokens == [10]


def test_documents_that_end_count_against_a_continuation():
    history = history_of([1, 2, 3], [1, 2, 3], [1, 2, 3, 4])  # two of three stopped after "1 2 3"
    assert history.speculate([1, 2, 3], None, 4, 0.3).tokens == [4]
    assert history.speculate([1, 2, 3], None, 4, 0.4).tokens == []


def test_a_draft_is_no_longer_than_its_match_times_the_factor():
    log = TokenLog()
    log.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3])
    assert draft_of(log, [0, 3]).tokens == [4]  # a match of one token ("3") drafts one token
    assert draft_of(log, [0, 3], factor=4.0).tokens == [4, 5, 6, 7]
    assert draft_of(log, [0, 3], k=2, factor=4.0).tokens == [4, 5]  # and never more than k


def test_nothing_matches_or_continues_across_documents():
    history = history_of([1, 2, 3], [4, 5, 6])
    assert history.speculate([2, 3], None, 4, 0.1).tokens == []  # "2 3" ends a document: nothing follows
    assert history.speculate([3, 4], None, 4, 0.1).tokens == [5]  # only "4" matches, not "3 4"
    assert history.speculate([3, 4], None, 4, 0.1).match == 1


def test_a_log_indexed_at_once_and_token_by_token_has_the_same_chains():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, 5000).tolist()
    whole, pieces = TokenLog(), TokenLog()
    whole.extend(tokens)
    for i in range(0, len(tokens), 3):
        pieces.extend(tokens[i:i + 3])
    assert whole._bits == pieces._bits
    assert np.array_equal(whole._head, pieces._head)
    assert np.array_equal(whole._prev[:, :whole.size], pieces._prev[:, :pieces.size])
    for start in (100, 2000, 4990):
        tail = tokens[start - 6:start]
        assert draft_of(whole, tail) == draft_of(pieces, tail)


def test_the_history_evicts_the_least_recently_used_documents_first():
    history = SuffixHistory(max_tokens=12)
    history.add([1, 2, 3, 4])
    history.add([5, 6, 7, 8])
    history.used(history.speculate([1, 2], None, 4, 0.1))  # a proposed draft came from it: it is recent
    history.add([9, 10, 11, 12, 13])  # 13 tokens: the least recently used, [5..8], goes
    assert history.tokens == 9 and history.documents == 2
    assert history.speculate([5, 6], None, 4, 0.1).tokens == []
    assert history.speculate([1, 2], None, 4, 0.1).tokens == [3, 4]
    history.add(list(range(100, 130)))  # longer than the history: its last 12 tokens stay, alone
    assert history.tokens == 12 and history.documents == 1
    assert history.speculate([118, 119], None, 2, 0.1).tokens == [120, 121]
    assert history.speculate([110, 111], None, 2, 0.1).tokens == []
    assert SuffixHistory(0).speculate([1], None, 4, 0.1).tokens == []


def test_the_history_stays_within_its_token_budget_and_its_memory():
    rng = np.random.default_rng(1)
    history = SuffixHistory(max_tokens=20_000)
    sizes = []
    for i in range(200):  # 20x the budget goes through it
        doc = rng.integers(0, 500, 2000).tolist()
        history.add(doc, key=f"k{i % 3}")
        assert history.tokens <= 20_000
        sizes.append(history.nbytes)
    assert history.speculate(doc[1000:1008], "k1", 4, 0.1).tokens == doc[1008:1012]  # compacted logs still match
    assert history.speculate(doc[1000:1008], "k0", 4, 0.1).match < 4  # another key: chance matches only
    logs = history._logs.values()
    assert sum(log.size - log.dead for log in logs) == history.tokens + history.documents  # + one SEP each
    assert all(log.dead <= max(log.size - log.dead, 4096) for log in logs)  # removed tokens are compacted away
    assert max(sizes[100:]) <= 1.5 * max(sizes[50:100])  # no growth once full
    assert max(sizes) < 300 * 20_000  # 36 bytes per slot; slots <= 2x (live + dead), dead <= live (or 4096)


# ---------------------------------------------------------------------------------------------- keys
def finished_rows(drafter: SuffixDrafter, prompts: list[list[int]], keys=None) -> None:
    """Rows join (keys queued in join order, as a server would), then leave: their text enters the history."""
    if keys is not None:
        drafter.queue_keys(keys)
    rows = Driver(drafter)
    rows.join(prompts)
    rows.keep([])


def test_rows_draft_only_from_their_own_keys_history():
    secret = [40, 41, 42, 43, 44, 45, 46, 47]
    history = SuffixHistory(1000)
    drafter = SuffixDrafter(history)
    finished_rows(drafter, [secret, [1, 2, 3, 4, 5, 6, 7, 8]], keys=["alice", "bob"])
    assert set(history.keys) == {"alice", "bob"}
    # Rows asking for alice's text: alice's row gets it, bob's and an unkeyed row get nothing.
    drafter.queue_keys(["alice", "bob"])
    rows = Driver(drafter)
    rows.join([secret[:4]] * 3)
    assert drafter.keys == ["alice", "bob", None]
    assert rows.max_drafts(4) == [4, 0, 0]
    assert rows.propose(4, [4, 0, 0]).tokens[0].tolist() == secret[4:8]
    drafter.keys = ["bob", "bob", "alice"]  # the caller may also set the running rows' keys
    assert rows.max_drafts(4) == [0, 0, 4]
    with pytest.raises(ValueError, match="one key per row"):
        drafter.keys = ["alice"]


def test_a_drafters_default_key_goes_to_its_forks_and_into_the_history():
    history = SuffixHistory(1000)
    tenant = SuffixDrafter(history, key="tenant")
    finished_rows(tenant, [[7, 8, 9, 10, 11]])
    assert history.keys == ["tenant"]
    other = Driver(SuffixDrafter(history))
    other.join([[7, 8, 9]])
    assert other.max_drafts(3) == [0]
    rows = Driver(tenant)
    rows.join([[7, 8, 9]])
    assert rows.max_drafts(3) == [2]  # 10 11, then the document ends


# ---------------------------------------------------------------------------------------------- decoding
@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr", "The quick brown fox"]
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_output_is_the_targets_own_with_and_without_history(target, prompts, k):
    plain = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=40, temperature=0.0, ignore_eos=True)
    drafter = SuffixDrafter()
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=k)
    for _ in range(2):  # the second time the history holds both answers
        result = gen.generate(prompts, max_new_tokens=40, temperature=0.0, ignore_eos=True)
        assert result.token_ids == plain.token_ids
        assert result.stats.draft_forward_calls == 0
    assert drafter.history.documents == 4
    if k != "auto":  # the policy may decode plainly when drafts do not pay; a fixed K drafts whenever it can
        assert result.stats.proposed_tokens > 0


def test_a_repeated_request_drafts_its_answer_from_the_history(target, prompts):
    history = SuffixHistory()
    first = SpeculativeGenerator(target, SuffixDrafter(history), num_speculative_tokens=4)
    cold = first.generate(prompts[0], max_new_tokens=48, temperature=0.0, ignore_eos=True)
    # A second generator sharing the history (a server's replicas, or the next request to the same one).
    second = SpeculativeGenerator(target, SuffixDrafter(history), num_speculative_tokens=4)
    warm = second.generate(prompts[0], max_new_tokens=48, temperature=0.0, ignore_eos=True)
    assert warm.token_ids == cold.token_ids
    assert warm.stats.acceptance_rate > 0.5 and warm.stats.acceptance_rate > cold.stats.acceptance_rate
    assert warm.stats.target_forward_calls < cold.stats.target_forward_calls
    isolated = SpeculativeGenerator(target, SuffixDrafter(history, key="someone else"), num_speculative_tokens=4)
    assert isolated.generate(prompts[0], max_new_tokens=48, temperature=0.0,
                             ignore_eos=True).stats.target_forward_calls > warm.stats.target_forward_calls


def test_keys_queued_for_a_session_reach_the_rows_that_join_and_their_histories(target, prompts):
    """Continuous batching: rows join between steps, in the order added; each finished row's text goes to its key."""
    drafter = SuffixDrafter(SuffixHistory())
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=3)
    session = gen.session(max_batch=1)  # one row at a time: the second joins after the first has left
    for key, prompt in zip(["alice", "bob"], prompts):
        drafter.queue_keys([key])
        session.add(gen.request(prompt, 12, temperature=0.0, ignore_eos=True))
    while not session.idle:
        session.step()
    answers = session.result().token_ids
    for key, prompt, answer in zip(["alice", "bob"], prompts, answers):
        assert drafter.history.speculate(prompt, key, 4, 0.1).tokens == answer[:4]
    assert drafter.history.speculate(prompts[0], "bob", 4, 0.1).match < 8


VOCAB = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
SAMPLES = 4000


@pytest.fixture(scope="module")
def small_target():
    return tiny_qwen(VOCAB, seed=10, layers=2, hidden=32)


@pytest.mark.parametrize("k, method, seed", [(3, "leviathan", 3), (2, "chen", 5), ("auto", "leviathan", 7)])
def test_sampled_output_follows_the_target_exactly(small_target, k, method, seed):
    """Drafts from the row's context and from a history of earlier samples (and one unlikely continuation); the
    first three tokens' joint against the target's, enumerated (seeded + auto: Gumbel-coupled rows)."""
    earlier = AutoregressiveGenerator(small_target).generate([PROMPT] * 20, max_new_tokens=6, temperature=0.8,
                                                             seed=1, ignore_eos=True)
    history = history_of(*[PROMPT + t for t in earlier.token_ids], PROMPT + [5, 9, 5, 9])
    gen = SpeculativeGenerator(small_target, SuffixDrafter(history), num_speculative_tokens=k, method=method)
    result = gen.generate([PROMPT] * SAMPLES, max_new_tokens=4, temperature=0.8, seed=seed, ignore_eos=True)
    if k != "auto":
        assert 0.05 < result.stats.acceptance_rate < 0.98  # both the accept and the reject paths ran
    assert_first_tokens_follow_target(small_target, PROMPT, result.token_ids, temperature=0.8)


# ------------------------------------------------------------------------------- rows independent of their batch
OWN = [5, 6, 7, 10, 11, 99, 5, 6, 7]  # the context's own match is 3 tokens long: it drafts at most 10 11 99
SHARED = OWN + [20, 21, 22, 23, 24, 25, 26, 27]  # the history matches the whole context: 8 tokens follow


@pytest.mark.parametrize("width", [1, 2])
def test_a_rows_drafts_are_those_of_its_own_k_whatever_the_other_rows_k(width):
    """At K = 2 the context's draft (10 11) ties the history's (20 21) and wins; at the batch's widest K (8) the
    history's scores 8 against 3. A row of K = 2 beside a row of K = 8 drafts what it drafts alone."""
    alone = Driver(SuffixDrafter(history_of(SHARED), tree_width=width))
    alone.join([OWN])
    assert alone.max_drafts(2, ks=[2], trees=True) == [2]
    mine = alone.propose(2, [2])
    batch = Driver(SuffixDrafter(history_of(SHARED), tree_width=width))
    batch.join([[3, 4] + OWN, OWN])
    assert batch.max_drafts(8, ks=[8, 2], trees=True) == [8, 2]
    theirs = batch.propose(8, [8, 2])
    assert mine.tokens[0].tolist() == theirs.tokens[1, :2].tolist() == [10, 11]
    assert theirs.tokens[0].tolist() == SHARED[9:]
    if width > 1:
        assert mine.parents[0] == theirs.parents[1][:2]


@pytest.mark.parametrize("method, others", [("leviathan", "outlive"), ("chen", "outlive"),
                                            ("leviathan", "finish first")])
def test_a_rows_seeded_text_does_not_depend_on_the_other_rows_of_its_batch(small_target, method, others,
                                                                           monkeypatch):
    """A row of fixed K = 2, alone and beside rows of K = 8, on a 16-token vocabulary where the row's context and a
    history of earlier samples compete at every step: the same drafts, so the same sampled text. The other rows
    have other prompts and outlive it, or hold the row's answer and finish first: what they leave in the history is
    not for the row (it drafts from the documents there when it joined)."""
    earlier = AutoregressiveGenerator(small_target).generate([PROMPT] * 12, max_new_tokens=8, temperature=1.0,
                                                             seed=1, ignore_eos=True).token_ids
    from specdecode.engine.session import DecodingSession

    proposed = []  # per run, per session row index: its drafts, step by step
    real = DecodingSession._ask_drafter  # the step's call to the drafter (session.py: the propose phase)

    def recording(self, plan):
        proposal = real(self, plan)
        for b, (row, n) in enumerate(zip(self.active, plan.k_rows)):
            proposed[-1].setdefault(row.index, []).append(proposal.tokens[b, :n].tolist())
        return proposal

    monkeypatch.setattr(DecodingSession, "_ask_drafter", recording)

    def run(rows):
        proposed.append({})
        history = history_of(*[PROMPT + t for t in earlier])
        gen = SpeculativeGenerator(small_target, SuffixDrafter(history), num_speculative_tokens=2, method=method)
        session = gen.session()
        for prompt, k, limit in rows:  # the others need >= 12 steps of 9 tokens: the row (<= 10 steps) ends first
            session.add(gen.request(prompt, limit, temperature=1.0, seed=11, num_speculative_tokens=k,
                                    ignore_eos=True))
        while not session.idle:
            session.step()
        return session.result()

    alone = run([(PROMPT, 2, 10)])
    if others == "outlive":
        batch = run([([4, 5, 6, 4, 5, 6], 8, 100), (PROMPT, 2, 10), ([1, 2, 3, 9, 9], 8, 100)])
    else:  # rows that end at their first token, whose prompts hold the row's own answer: in the history at once
        answer = alone.token_ids[0]
        batch = run([(PROMPT + answer + [0, 1], 8, 1), (PROMPT, 2, 10), (PROMPT + answer[:6], 8, 1)])
    assert proposed[1][1] == proposed[0][0]
    assert batch.token_ids[1] == alone.token_ids[0]
    assert alone.stats.proposed_tokens > 4


# ---------------------------------------------------------------------------------------------- the CLI
def test_the_cli_drafts_with_suffix_and_equals_plain_decoding(tiny_model_dirs):
    from specdecode.cli.app import app

    def run(*args):
        result = CliRunner().invoke(app, ["generate", "def quicksort(arr):\n    return quicksort(arr)", "-n", "16",
                                          "--ignore-eos", "--json", "--target", tiny_model_dirs["target"], *args])
        assert result.exit_code == 0 and result.exception is None, result.output
        return result

    import json

    suffix = json.loads(run("--draft", "suffix", "-k", "3", "--suffix-history-tokens", "1000").stdout)
    plain = json.loads(run("--draft", "none").stdout)
    assert suffix["token_ids"] == plain["token_ids"]
    assert suffix["stats"]["draft_forward_calls"] == 0 and suffix["stats"]["proposed_tokens"] > 0
    bad = CliRunner().invoke(app, ["generate", "x", "--target", tiny_model_dirs["target"], "--draft", "suffix",
                                   "--suffix-history-tokens", "-1"])
    assert bad.exit_code != 0 and "--suffix-history-tokens" in bad.output


def test_the_pair_options_build_a_suffix_drafter_with_its_history_budget():
    from specdecode.pairing.pair import ModelOptions, load_draft

    drafter = load_draft(ModelOptions(draft="suffix", suffix_history_tokens=123))
    assert isinstance(drafter, SuffixDrafter) and drafter.history.max_tokens == 123
    assert ModelOptions(draft="Suffix").draft_is_lookup  # no draft model to load


# ---------------------------------------------------------------------------------------------- cost
def test_proposing_costs_well_under_a_millisecond_per_row_at_a_million_history_tokens():
    """The module docstring's number: a history of 1M code-like tokens (Zipf-distributed tokens and copies of
    earlier spans, so chains are long and matches deep), tails from it and novel ones."""
    rng = np.random.default_rng(0)
    history, docs = SuffixHistory(1_000_000), []
    while history.tokens < 1_000_000 - 2000:
        docs.append(code_like(rng, 2000, docs[-50:]))
        history.add(docs[-1])
    drafter = Driver(SuffixDrafter(history))
    drafter.join([docs[-1][:1000]] * 4)
    times = []
    for i in range(100):
        doc = docs[int(rng.integers(len(docs)))]
        start = int(rng.integers(32, len(doc)))
        drafter.observe([doc[start - 8:start], code_like(rng, 8, [])] * 2)  # seen text, and novel
        t0 = time.perf_counter()
        drafter.propose(8, drafter.max_drafts(8))
        times.append((time.perf_counter() - t0) / 4)
    assert statistics.median(times) < 1e-3, f"median {statistics.median(times) * 1e3:.3f} ms per row"


def code_like(rng, n: int, earlier: list[list[int]]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        if earlier and rng.random() < 0.5:
            src = earlier[int(rng.integers(len(earlier)))]
            s = int(rng.integers(max(1, len(src) - 64)))
            out += src[s:s + int(rng.integers(8, 64))]
        else:
            out += (rng.zipf(1.3, size=int(rng.integers(4, 32))) % 20_000).tolist()
    return out[:n]

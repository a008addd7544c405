"""The copy cursor of SuffixDrafter (drafters/suffix_cursor.py): where a row's copy of its prompt stands, and the
drafts it makes there. Exact cases on token lists, a drafter driven by hand, and greedy decoding with it against the
target's own (sampled exactness: test_suffix_drafter's chi-square, which runs with the cursor too)."""

from __future__ import annotations

import pytest

from drafting import Driver
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, SuffixDrafter
from specdecode.drafters.suffix_cursor import CONFIRM, COPY_FACTOR, COPY_OFFSET, WINDOW, CopyCursor
from specdecode.drafters.suffix_drafts import speculate
from specdecode.drafters.suffix_index import TokenLog

# A file that repeats a sentence (1 2 3 4) with a different continuation each time: 20 21 ... first, 30 31 ... later.
PROMPT = [10, 1, 2, 3, 4, 20, 21, 22, 23, 5, 1, 2, 3, 4, 30, 31, 32, 33]


def log_of(*parts) -> TokenLog:
    log = TokenLog()
    for part in parts:
        log.extend(part)
    return log


def drafts(log: TokenLog, cursor: CopyCursor, k: int = 8, factor: float = 1.0, offset: float = 0.0):
    tail = log.tail(64)
    own = speculate(log, tail, k, 0.1, factor, offset)
    return own, cursor.draft(log, tail, k, own, factor, offset)


def test_the_copy_resumes_at_the_nearest_repeat_after_the_cursor_not_the_latest():
    """The answer copied "10", inserted 9, then wrote the sentence again: the search follows the latest occurrence
    (30 31 ...), the cursor the one its copy reached first (20 21 ...)."""
    log = log_of(PROMPT, [10, 9, 1, 2, 3, 4])
    cursor = CopyCursor(len(PROMPT), at=1)
    own, draft = drafts(log, cursor, k=64)
    assert own.tokens == [30, 31, 32, 33]  # the search's rule: at most m * factor tokens
    assert draft.match == own.match == 4 and cursor.offered == (5, True)
    assert draft.tokens == log.tokens()[5:5 + int(4 * COPY_FACTOR + COPY_OFFSET)]  # the copy goes on past it
    assert draft.tokens[:4] == [20, 21, 22, 23]


def test_a_cursor_copy_is_at_most_k_tokens_and_at_least_the_searchs_rule():
    log = log_of(PROMPT, [10, 9, 1, 2, 3, 4])
    assert drafts(log, CopyCursor(len(PROMPT), at=1), k=3)[1].tokens == [20, 21, 22]
    own, draft = drafts(log, CopyCursor(len(PROMPT), at=1), k=64, factor=8.0)  # a longer rule asked for wins
    assert draft.tokens == log.tokens()[5:] and len(draft.tokens) > 4 * COPY_FACTOR + COPY_OFFSET  # to the log's end


def test_the_cursor_never_goes_back_nor_past_its_window():
    log = log_of(PROMPT, [10, 9, 1, 2, 3, 4])
    cursor = CopyCursor(len(PROMPT), at=6)  # the copy is past the first sentence: only the second is ahead
    assert drafts(log, cursor)[1].tokens[:4] == [30, 31, 32, 33]
    far = [7] * WINDOW + PROMPT  # both sentences more than WINDOW tokens from a cursor at 0
    log = log_of(far, [10, 9, 1, 2, 3, 4])
    cursor = CopyCursor(len(far), at=0)
    own, draft = drafts(log, cursor)
    assert draft is own and cursor.offered == (own.ends[0] + 1, False)


def test_the_longest_match_ahead_beats_the_nearest():
    log = log_of(PROMPT, [5, 1, 2, 3, 4])  # "5 1 2 3 4" occurs only before the second continuation
    cursor = CopyCursor(len(PROMPT), at=1)
    own, draft = drafts(log, cursor)
    assert draft.tokens[:5] == own.tokens == [30, 31, 32, 33, 5] and draft.match == 5  # (k = 8 tokens of it)
    assert cursor.offered == (14, True)


def test_the_cursor_follows_its_own_copy_on_any_kept_token_and_a_copy_from_elsewhere_on_confirm():
    log = log_of(PROMPT)
    cursor = CopyCursor(len(PROMPT), at=1)
    cursor.offered = (5, True)
    cursor.observe(log, [20, 21, 99])  # two of its tokens kept, then the answer changed
    assert cursor.at == 7
    cursor.offered = (14, False)  # the search's draft, from the second sentence
    cursor.observe(log, [30, 99])
    assert CONFIRM == 2 and cursor.at == 7  # one token of a copy from elsewhere is as often chance
    cursor.offered = (14, False)
    cursor.observe(log, [30, 31])
    assert cursor.at == 16
    cursor.observe(log, [32, 99])  # nothing offered: it follows its own position
    assert cursor.at == 17 and cursor.offered is None


def test_a_copy_from_the_answer_itself_does_not_move_the_cursor():
    log = log_of(PROMPT, [40, 41, 42])
    cursor = CopyCursor(len(PROMPT), at=3)
    cursor.offered = (len(PROMPT) + 1, False)  # a draft from the answer's own text
    cursor.observe(log, [41, 42])
    assert cursor.at == 3


def test_the_drafter_proposes_the_cursors_copy_and_is_deterministic():
    """Driven as a session drives it: the row copies the prompt's start, inserts a token, writes the sentence again;
    its draft is the first continuation, the same from a fresh drafter given the same steps."""
    def run():
        driver = Driver(SuffixDrafter(tree_width=1))
        driver.join([PROMPT])
        steps = [([10], None), ([1, 2], 1), ([9], 0), ([1, 2, 3, 4], None)]
        for emitted, _ in steps:
            driver.propose(2)
            driver.observe([emitted])
        return driver.propose(4).tokens[0].tolist()

    first = run()
    assert first == [20, 21, 22, 23]
    assert run() == first


@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_output_with_the_cursor_is_the_targets_own(tiny_pair, tokenizer, monkeypatch, k):
    """A prompt that holds the target's own greedy answer twice, so that answering copies it: the text is plain
    greedy decoding's, token for token, and the cursor took part (it reached a position in the prompt)."""
    target = tiny_pair[0]
    start = tokenizer("def area(w, h):\n    return w * h\n")["input_ids"]
    answer = AutoregressiveGenerator(target).generate([start], max_new_tokens=40, temperature=0.0,
                                                      ignore_eos=True).token_ids[0]
    prompt = start + answer + start + answer[:20] + start
    plain = AutoregressiveGenerator(target).generate([prompt], max_new_tokens=48, temperature=0.0, ignore_eos=True)
    reached = []
    real = CopyCursor.observe

    def observe(self, log, emitted):
        real(self, log, emitted)
        reached.append(self.at)

    monkeypatch.setattr(CopyCursor, "observe", observe)
    result = SpeculativeGenerator(target, SuffixDrafter(tree_width=1), num_speculative_tokens=k).generate(
        [prompt], max_new_tokens=48, temperature=0.0, ignore_eos=True)
    assert result.token_ids == plain.token_ids
    assert any(at is not None for at in reached)

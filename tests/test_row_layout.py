"""One owner of the rows: a join, a leave or a reorder is one RowChange, which the target's cache, the drafter and
the row batch apply alike (engine/layout.py); a row's text is read where the session keeps it (RowText)."""

from __future__ import annotations

from lookup_backend import LookupBackend
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, SuffixModelDrafter
from specdecode.drafters import RowChange, RowText

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 6, 7], [8, 9, 8, 9, 8], [10, 11, 12]]


def test_a_row_text_reads_the_sessions_lists_in_place():
    prompt, output = [1, 2, 3], [4]
    text = RowText(7, prompt, output)
    output.append(5)  # the session appends after each step: the text sees it
    assert len(text) == 5 and text.tokens() == [1, 2, 3, 4, 5]
    assert text.since(1) == [2, 3, 4, 5] and text.since(3) == [4, 5] and text.since(5) == []
    assert text.tail(1) == [5] and text.tail(3) == [3, 4, 5] and text.tail(9) == [1, 2, 3, 4, 5]
    change = RowChange((2, 0), (RowText(8, [6], [7]),))
    assert change.split(2) == ([0], [0]) and change.leaving(2) == [1]


def test_rows_moved_mid_answer_keep_their_caches_and_their_answers():
    """Rows swapped and dropped between steps by one change: every holder moves alike, so each row's greedy answer
    is still its own (a holder left behind would draft or verify another row's text)."""
    target, draft = LookupBackend(32, seed=0), LookupBackend(32, seed=1)
    drafter = SuffixModelDrafter(draft)
    gen = SpeculativeGenerator(target, drafter, num_speculative_tokens=2)
    session = gen.session()
    rows = [session.add(gen.request(p, 24, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):
        session.step()
    session.layout.apply(RowChange((3, 1, 0)))  # row 2 leaves; the others run on in another order
    assert [r.index for r in session.active] == [rows[3], rows[1], rows[0]]
    assert [t.id for t in session.batch.texts] == [rows[3], rows[1], rows[0]]
    assert list(drafter.model_drafter._rows) == [rows[3], rows[1], rows[0]]
    while not session.idle:
        session.step()
    result = session.result([rows[0], rows[1], rows[3]])
    plain = AutoregressiveGenerator(LookupBackend(32, seed=0)).generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                                                                         max_new_tokens=24, temperature=0.0,
                                                                         ignore_eos=True)
    assert result.token_ids == plain.token_ids
    assert result.stats.proposed_tokens > 0

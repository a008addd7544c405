"""text/token_bridge.py: a row's text between two tokenizers, on the fixture's byte-level BPE, a SentencePiece-style
tokenizer built here (cross_tokenizers.py) and, where installed, the real Qwen2.5, SmolLM2 and Gemma 3 tokenizers.

What is checked is what decides how often cross-vocabulary drafts are kept (never whether the output is exact: any
proposal is verified exactly): the draft reads the row's text in its usual tokenization however it was cut, the
draft's new text comes back as the target tokens that spell it, a token that straddles the row's end is handled,
and text that may still grow into a longer token is not proposed."""

from __future__ import annotations

import pytest
import torch

from cross_tokenizers import build_metaspace_tokenizer, real_tokenizer
from specdecode.text.token_bridge import (BridgedRow, DraftKV, DraftText, TokenText, complete_length, decodable,
                                          shared_vocabulary, spelled_tokens, target_tokens)
from specdecode.text.vocab import VocabularyMismatchError

TEXTS = ["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
         "The quick brown fox jumps over the lazy dog. café 😀 naïve\n\tx = [1, 2]  # ok",
         "    left = [x for x in arr if x < mid]\n    return quicksort(left) + middle"]
# (not " pivot", "//" or "10": the fixture's tokenizer gives their BPE ids to its special tokens as well)


@pytest.fixture(scope="module")
def target(tokenizer):
    return TokenText(tokenizer, "target")


@pytest.fixture(scope="module")
def draft():
    return TokenText(build_metaspace_tokenizer())


def chunks(text: str, sizes=(1, 3, 2, 7, 5)) -> list[str]:
    out, at, i = [], 0, 0
    while at < len(text):
        out.append(text[at:at + sizes[i % len(sizes)]])
        at += sizes[i % len(sizes)]
        i += 1
    return out


# ---------------------------------------------------------------------------------------------- reading tokenizers
def test_pieces_spell_the_text_on_both_kinds_of_tokenizer(target, draft):
    for codec in (target, draft):
        for text in TEXTS:
            assert codec.spell(codec.encode(text)) == text.encode()
    assert draft.prefix == [2] and target.prefix == []  # the SentencePiece-style one puts <bos> before a text
    assert draft.pieces[2] == b"" and draft.pieces[draft.encode("é")[0]] == b"\xc3"  # a byte-fallback piece
    im_end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert target.pieces[im_end] == b"<|im_end|>" and target.encode("a<|im_end|>")[-1] == im_end


def test_a_tokenizer_that_does_not_give_back_its_text_is_refused_by_name(tokenizer):
    class Lowercasing:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __len__(self):
            return len(self.inner)

        def __call__(self, text, **kwargs):
            return self.inner(text.lower(), **kwargs)

        def encode(self, text, **kwargs):
            return self.inner.encode(text.lower(), **kwargs)

    wrapped = Lowercasing(tokenizer)
    wrapped.backend_tokenizer = None
    with pytest.raises(VocabularyMismatchError, match="does not give back the text.*shares the target's tokenizer"):
        TokenText(wrapped)


def test_utf8_helpers_hold_back_an_incomplete_character():
    emoji = "😀".encode()
    assert complete_length(b"ab" + emoji[:2]) == 2 and complete_length(b"ab" + emoji) == 6
    assert complete_length(b"a\xc3") == 1 and complete_length(b"") == 0
    assert decodable(b"ok" + emoji[:3]) == "ok" and decodable(b"a\xffb") == "a"


def test_the_shared_vocabulary_pairs_tokens_of_the_same_bytes(target, draft):
    shared = shared_vocabulary(draft, target)
    pairs = list(zip(shared.draft_ids.tolist(), shared.target_ids.tolist()))
    assert len(pairs) == len(set(d for d, _ in pairs)) == len(set(t for _, t in pairs)) == len(shared)
    assert all(draft.pieces[d] == target.pieces[t] and draft.pieces[d] for d, t in pairs)
    assert any(d != t for d, t in pairs)  # the ids differ: the map is not the identity
    # where a vocabulary has a text piece and a byte-fallback piece of the same bytes, the text piece is paired
    a = draft.encode("a")[0]
    assert draft.kinds[a] == 0 and shared.target_to_draft[target.encode("a")[0]] == a
    logits = torch.randn(2, draft.size)
    projected = shared.project(logits, target.size)
    assert projected.shape == (2, target.size)
    assert torch.equal(projected[:, shared.target_ids], logits[:, shared.draft_ids])
    unshared = [t for t in range(target.size) if t not in shared.target_to_draft]
    assert (projected[:, unshared] == -1e9).all()
    assert torch.softmax(projected, -1)[:, unshared].sum() == 0  # such tokens are never drawn beside shared ones


# ---------------------------------------------------------------------------------------------- target -> draft
@pytest.mark.parametrize("text", TEXTS)
def test_text_added_in_pieces_reads_as_the_whole_texts_tokenization(draft, text):
    """However the row's text arrives (the target's tokens cut it anywhere), the draft reads its usual tokens."""
    mirror = DraftText(draft)
    for piece in chunks(text):
        before = list(mirror.ids)
        changed = mirror.add(piece)
        assert mirror.ids[:changed] == before[:changed]  # the ids before `changed` did not move
    assert mirror.ids == draft.prefix + draft.encode(text)
    assert bytes(mirror.text) == text.encode() and mirror.ends[-1] == len(text.encode())


def test_without_looking_back_a_token_split_at_the_boundary_stays_split(draft):
    """The lookback is what merges "▁a" + "rr" read so far with what follows: without it the draft reads a split."""
    text = " arr rra arr"
    ids = DraftText(draft, lookback=0)
    for piece in chunks(text, (2, 1)):
        ids.add(piece)
    assert bytes(ids.text) == text.encode() and ids.ids != draft.prefix + draft.encode(text)


def split_character(target) -> tuple[list[int], list[int]]:
    """The fixture tokenizer's tokens of "ok 😀", cut inside the emoji (byte-level pieces: its bytes over several
    tokens)."""
    ids = target.encode("ok 😀")
    cut = next(i for i in range(1, len(ids)) if complete_length(target.spell(ids[:i])) < len(target.spell(ids[:i])))
    return ids[:cut], ids[cut:]


def test_a_character_split_between_target_tokens_reaches_the_draft_whole(target, draft):
    row = BridgedRow(target, draft)
    first, rest = split_character(target)
    row.commit(first)
    assert row.lag and bytes(row.draft.text) == b"ok "  # the incomplete character waits
    row.commit(rest)
    assert row.lag == b"" and bytes(row.draft.text) == "ok 😀".encode()


# ---------------------------------------------------------------------------------------------- draft -> target
def test_new_text_comes_back_as_the_targets_tokens_without_the_growing_last_one(target):
    new = b" return arr + 1"
    tokens = target_tokens(target, b"    ", new)
    assert tokens == target.encode(" return arr + 1")[:-1]  # "1" may still grow ("12"): not proposed
    assert target_tokens(target, b"    ", new, whole=True) == target.encode(" return arr + 1")
    assert target_tokens(target, b"x", b"") == [] and target_tokens(target, b"x", b"a") == []
    # a word cut short is not proposed, however many tokens it already takes (" qu" + "ic": " quicksort" later)
    assert target.spell(target_tokens(target, b"x =", b" quicksort(arr) + quic")) == b" quicksort(arr) +"
    assert len(target.encode(" quic")) > 1


def test_a_token_straddling_the_rows_end_is_handled(target):
    """The row ends in "ar" and the draft goes on "r + 1": the target's tokenizer reads "arr" there, across the
    boundary. The row's "ar" is fixed, so the proposal is the continuation's own tokens from the boundary on."""
    tail = target.spell([target.encode(" ar")[-1]])
    assert target.encode((tail + b"r + 1").decode())[0] != target.encode(" ar")[0]  # it does straddle
    tokens, _, whole = spelled_tokens(target, tail, b"r + 1")
    assert whole and target.spell(tokens) == b"r + 1" and tokens[0] == target.encode("r")[0]


def test_where_the_window_ends_on_a_token_boundary_its_tokenization_is_kept(target):
    """After "    " the draft's "return" is read with the spaces, as the target's tokenizer would: " return"."""
    tokens, _, _ = spelled_tokens(target, b"\n    ", b"return arr")
    assert target.spell(tokens) == b"return arr"
    alone = target.encode("return arr")
    assert tokens == alone  # here both agree; the window matters where the pre-tokenizer looks across


def test_the_proposal_of_a_drafted_end_of_text(target, draft):
    shared = shared_vocabulary(draft, target)
    row = BridgedRow(target, draft, shared)
    row.commit(target.encode("def f(x):\n    return"))
    tail = target.encode("def f(x):\n    return")
    drafted = draft.encode(" x + 1") + [min(draft.eos)]
    assert target.spell(row.proposal(drafted, tail)) == b" x + 1"  # its text ended: "1" is whole
    assert target.spell(row.proposal(drafted[:-1], tail)) == b" x + "
    assert target.spell(row.proposal(drafted[:-1], tail, growing=True)) == b" x + 1"


def test_a_draft_text_that_does_not_continue_an_incomplete_character_proposes_nothing(target, draft):
    row = BridgedRow(target, draft)
    first, _ = split_character(target)
    row.commit(first)
    assert row.proposal(draft.encode(" and more"), first) == []


# ---------------------------------------------------------------------------------------------- the draft's KV
def test_the_kv_keeps_the_common_prefix_and_feeds_the_rest():
    kv = DraftKV()
    keep, feed = kv.plan([5, 6, 7], changed=0)
    assert (keep, feed) == (0, [5, 6, 7])
    kv.fed(keep, feed)
    kv.drafted(8)
    kv.drafted(9)  # the KV holds 5 6 7 8 9; the text then went on 8, 4
    assert kv.behind([5, 6, 7, 8, 4], changed=3) == 1
    assert kv.plan([5, 6, 7, 8, 4], changed=3) == (4, [4])
    kv.fed(4, [4])
    assert kv.plan([5, 6, 7, 8, 4], changed=5) == (4, [4])  # nothing new: the last id is fed again for its logits
    kv.restart([5, 6, 7, 8, 4, 3], window=2)
    assert kv.plan([5, 6, 7, 8, 4, 3], changed=6) == (0, [4, 3])
    kv.fed(0, [4, 3])
    assert kv.plan([5, 6, 1, 8, 4, 3], changed=2) == (0, [5, 6, 1, 8, 4, 3])  # a change before the window: restart


# ---------------------------------------------------------------------------------------------- the real tokenizers
@pytest.mark.parametrize("draft_name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_real_tokenizers_round_trip(draft_name):
    qwen = TokenText(real_tokenizer("qwen2.5-coder-1.5b-instruct"), "target")
    other = TokenText(real_tokenizer(draft_name))
    shared = shared_vocabulary(other, qwen)
    assert len(shared) > 0.3 * other.size
    row = BridgedRow(qwen, other, shared)
    prompt = "def quicksort(arr):\n    pivot = arr[le"
    row.commit(qwen.encode(prompt))
    assert bytes(row.draft.text) == prompt.encode()
    drafted = other.encode("n(arr) // 2]\n    left = [x for x in arr")
    proposal = row.proposal(drafted, qwen.encode(prompt))
    assert qwen.spell(proposal) == b"n(arr) // 2]\n    left = [x for x in"  # "le" + "n": straddling, handled

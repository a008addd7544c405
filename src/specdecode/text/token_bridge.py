"""Between two tokenizers: a row's text as a draft of another vocabulary reads it, and the draft's new text as the
target's tokens. Pure functions and classes over token ids and bytes (no model, no tensor but the shared-vocabulary
index), so that the drafter around them (drafters/cross_vocab.py) stays thin.

Text is handled as bytes: a byte-level BPE token may hold part of a UTF-8 character (an emoji split in two), and the
bytes of the target's tokens are what the row really says. A tokenizer is read as `TokenText`: each id's bytes, the
ids its encoder gives for a text, and the ids it puts before any text (Gemma's <bos>).

Two directions (Timor et al., ICML 2025, "Lossless speculative decoding algorithms for heterogeneous vocabularies"):
- target -> draft (`DraftText`, `BridgedRow.commit`): the row's new text is appended to the draft's tokens; the last
  LOOKBACK draft tokens are tokenized again with it, because a draft token that ended the old text may be the first
  half of a longer token now ("qu" + "ick" is "quick"): the draft reads its usual tokenization, not a split one.
- draft -> target (`target_tokens`, SLEM): the draft's new text is tokenized by the target's tokenizer together
  with the row's last WINDOW target tokens (their text), and the tokens after the ones that spell exactly that
  window are the proposal. Where no tokenization of the window ends at the row's end (a target token straddles
  the boundary, as "(" + ")" is one token "()"), the row's tokens are fixed, so the new text is tokenized on its own
  from the boundary. The tokens of the text's last word (as the target's pre-tokenizer splits words; where it does
  not, the last token) are not proposed unless the draft's text ended (its end-of-text token): more text may still
  tokenize that word otherwise (" r" + "et" becomes " return").
Neither direction affects exactness: the verifier accepts any proposal by a rule that keeps the target's
distribution. They decide only how often the proposals are kept.

The shared vocabulary (`shared_vocabulary`, TLI) pairs the draft and target tokens that are the same bytes; the
draft's distribution over those, renormalised, is a distribution over target tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .vocab import VocabularyMismatchError

LOOKBACK = 4  # draft tokens tokenized again with new text (a token ending the old text may merge with the new)
WINDOW = 4  # target tokens of the row's end tokenized with the draft's text (see target_tokens)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte pieces
_SPACE_MARK = "\u2581"  # SentencePiece's word-boundary mark: a space
_PROBES = ("def f(x):\n    return x  # café 😀\n", " The quick brown fox,  jumps.\t1+2=3\r\n", "naïve 日本語 ok")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others are shifted
    to U+0100 and up (transformers' bytes_to_unicode, inverted). Shared with the server's logprobs."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def complete_length(data: bytes | bytearray) -> int:
    """len(data) without an incomplete UTF-8 character at its end (the bytes a later token completes)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte < 0x80:
            return n
        if byte >= 0xC0:  # the character's first byte: complete when all of its bytes are there
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return n if back >= need else n - back
    return n  # continuation bytes only: not a character we could complete; left as it is


def decodable(data: bytes) -> str:
    """The longest prefix of data that is whole UTF-8 characters, as text (invalid bytes end it too)."""
    data = data[:complete_length(data)]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[:e.start].decode("utf-8")


class TokenText:
    """One tokenizer as bytes: `pieces[id]` (b"" for ids with no text), `encode(text)`, `prefix` (ids put before
    any text), `eos` (its end-of-text ids). Raises VocabularyMismatchError when its tokens cannot be read as bytes
    (its encoding does not give back the text), the one case where a draft of another vocabulary cannot work."""

    def __init__(self, tokenizer, role: str = "draft"):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = backend if backend is not None and hasattr(backend, "encode") else None
        self.size = len(tokenizer)
        with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = self.encode("a")
        self.prefix = with_specials[: len(with_specials) - len(plain)] if with_specials[-len(plain):] == plain else []
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.pieces, self.kinds = self._read_pieces(tokenizer, str(getattr(backend, "decoder", "")))
        self._words = getattr(backend, "pre_tokenizer", None)  # splits text into the words its tokens stay within
        self._normalizer = getattr(backend, "normalizer", None)
        if self._words is not None and len(self._words.pre_tokenize_str("a b")) < 2:
            self._words = None  # one piece for any text (Gemma's): no word boundary to go by
        for probe in _PROBES:
            ids = self.encode(probe)
            if self.spell(ids) != probe.encode():
                raise VocabularyMismatchError(
                    f"the {role} tokenizer ({type(tokenizer).__name__}) does not give back the text it encodes "
                    f"({probe!r} reads back as {self.spell(ids)!r}), so its tokens cannot be matched with the "
                    f"other model's text: use a draft that shares the target's tokenizer")

    def encode(self, text: str) -> list[int]:
        """The ids of text, no special tokens added (special tokens written in the text are read as such)."""
        if not text:
            return []
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def last_word(self, text: str) -> int | None:
        """Where the last word of text starts, in bytes, as the tokenizer's pre-tokenizer splits it (its tokens never
        cross a word's boundary, so only the last word's tokens may change as text is added); None where it does not
        say (no such pre-tokenizer, or a normaliser that changes this text)."""
        if self._words is None or (self._normalizer is not None and self._normalizer.normalize_str(text) != text):
            return None
        words = self._words.pre_tokenize_str(text)
        return len(text[:words[-1][1][0]].encode()) if words else None

    def spell(self, ids) -> bytes:
        pieces = self.pieces
        return b"".join(pieces[i] for i in ids)

    def _read_pieces(self, tokenizer, decoder: str) -> tuple[list[bytes], list[int]]:
        """Each id's bytes and kind (0 a piece of text, 1 a byte-fallback piece, 2 an added token)."""
        byte_level = "ByteLevel" in decoder
        sentencepiece = "ByteFallback" in decoder or "Metaspace" in decoder or _SPACE_MARK in decoder
        alphabet = byte_level_alphabet()
        added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        pieces, kinds = [b""] * self.size, [0] * self.size
        prefix = set(self.prefix)
        for token, i in tokenizer.get_vocab().items():
            if i >= self.size or i in added:
                continue
            if byte_level and all(c in alphabet for c in token):
                pieces[i] = bytes(alphabet[c] for c in token)
            elif sentencepiece and _BYTE_FALLBACK.fullmatch(token):
                pieces[i], kinds[i] = bytes([int(token[3:5], 16)]), 1
            elif sentencepiece:
                pieces[i] = token.replace(_SPACE_MARK, " ").encode("utf-8")
            else:
                pieces[i] = tokenizer.decode([i], clean_up_tokenization_spaces=False).encode("utf-8")
        for i, content in added.items():
            if i < self.size:  # a special token's text (<|im_end|>); the prefix (<bos>) spells nothing
                pieces[i], kinds[i] = (b"" if i in prefix else content.encode("utf-8")), 2
        return pieces, kinds


@dataclass(frozen=True)
class SharedVocabulary:
    """The tokens that are the same bytes in both vocabularies, as index pairs (draft_ids[j] <-> target_ids[j]),
    one pair per byte string (where a vocabulary has several ids for one string, the one its encoder uses:
    a text piece before a byte-fallback piece before an added token, then the lowest id), and target -> draft."""

    draft_ids: torch.Tensor  # [N] long
    target_ids: torch.Tensor  # [N] long
    target_to_draft: dict[int, int]
    draft_to_target: dict[int, int]

    def __len__(self) -> int:
        return len(self.target_to_draft)

    def project(self, draft_logits: torch.Tensor, target_size: int, fill: float = -1e9) -> torch.Tensor:
        """[B, Vd] draft logits -> [B, Vt] target logits: the shared tokens' values, `fill` elsewhere.

        fill is finite and far below any logit: such a token gets probability 0 after a softmax (exp underflows),
        yet a row whose grammar allows only unshared tokens still has a distribution (uniform over them), never
        NaNs."""
        out = torch.full((draft_logits.shape[0], target_size), fill, dtype=torch.float32, device=draft_logits.device)
        out[:, self.target_ids.to(out.device)] = draft_logits[:, self.draft_ids.to(out.device)].float()
        return out


def shared_vocabulary(draft: TokenText, target: TokenText) -> SharedVocabulary:
    def preferred(text: TokenText) -> dict[bytes, int]:
        best: dict[bytes, int] = {}
        for i, piece in enumerate(text.pieces):
            if piece and (piece not in best or text.kinds[i] < text.kinds[best[piece]]):
                best[piece] = i
        return best

    mine, theirs = preferred(draft), preferred(target)
    pairs = sorted((mine[p], t) for p, t in theirs.items() if p in mine)
    return SharedVocabulary(torch.tensor([d for d, _ in pairs], dtype=torch.long),
                            torch.tensor([t for _, t in pairs], dtype=torch.long), {t: d for d, t in pairs},
                            dict(pairs))


def target_tokens(target: TokenText, tail_text: bytes, new: bytes, whole: bool = False) -> list[int]:
    """The target tokens that spell the start of `new`, the text that follows a row whose last tokens spell
    tail_text (starting at a character boundary): those that are whole, or with `whole` (the text ends there) all of
    them when they spell all of new.

    The window tokenized is tail_text + new; the proposal starts after the first tokens that spell tail_text
    exactly. If none do (a token straddles the row's end), new is tokenized on its own: the row's tokens are fixed,
    so a token boundary is there whatever the tokenizer would have merged. A token is whole when it ends before the
    window's last word (its tokenizer's pre-tokenizer says where words start: more text may tokenize the last word
    otherwise, " r" + "et" becoming " return"); where the tokenizer does not say, all but the last token."""
    tokens, stable, spelled_all = spelled_tokens(target, tail_text, new)
    return tokens if whole and spelled_all else tokens[:stable]


def spelled_tokens(target: TokenText, tail_text: bytes, new: bytes) -> tuple[list[int], int, bool]:
    """target_tokens' tokens, all of them, how many of them are whole, and whether they spell all of new."""
    if not new:
        return [], 0, True
    window = decodable(tail_text + new)
    ids, base = target.encode(window), tail_text
    start, at = 0, 0
    while at < len(tail_text) and start < len(ids):
        at += len(target.pieces[ids[start]])
        start += 1
    if at != len(tail_text) or target.spell(ids[:start]) != tail_text:
        if complete_length(tail_text) != len(tail_text):
            return [], 0, False  # the row ends inside a character: new alone is not text
        window = decodable(new)
        ids, base, start = target.encode(window), b"", 0
    word = target.last_word(window)
    stable_end = None if word is None else word - len(base)  # in new: where its last word starts
    out, at, stable = [], 0, 0
    for token in ids[start:]:
        piece = target.pieces[token]
        if not piece or new[at:at + len(piece)] != piece:
            break  # the tokenizer normalised the text here: what follows does not spell the draft's text
        out.append(token)
        at += len(piece)
        if stable_end is not None and at <= stable_end:
            stable = len(out)
    if stable_end is None:
        stable = max(0, len(out) - 1)
    return out, stable, at == len(new)


class DraftText:
    """A text as the draft's tokenizer spells it, growing at its end: `ids` (after the tokenizer's prefix) and
    `ends[j]`, the end of token j's bytes in the text (what the ids spell), of which `text` keeps the end (from
    byte `origin` on: all that a later tokenization looks back at)."""

    def __init__(self, draft: TokenText, lookback: int = LOOKBACK):
        self.codec, self.lookback = draft, lookback
        self.ids: list[int] = list(draft.prefix)
        self.ends: list[int] = [0] * len(self.ids)
        self.text = bytearray()
        self.origin = 0
        self.fixed = len(self.ids)  # ids before this index never change (the prefix)

    def add(self, new: str) -> int:
        """Append text; the last `lookback` tokens are tokenized again with it. Returns the index of the first id
        that changed (len(ids) before the call when none did)."""
        before = len(self.ids)
        if not new:
            return before
        j = max(self.fixed, len(self.ids) - self.lookback)
        while j > self.fixed and not _starts_character(self.text, self.ends[j - 1] - self.origin):
            j -= 1  # a token boundary inside a character (byte-level pieces): start at a whole character
        start = (self.ends[j - 1] if j > self.fixed else 0) - self.origin
        window = bytes(self.text[start:]) + new.encode("utf-8")
        # what the ids spell is the draft's text from here on (the same bytes unless its tokenizer normalises)
        ids = self.codec.encode(window.decode("utf-8", errors="replace"))
        changed = j + _common(self.ids[j:], ids)
        del self.ids[j:], self.ends[j:]
        del self.text[start:]
        for token in ids:
            self.text += self.codec.pieces[token]
            self.ids.append(token)
            self.ends.append(self.origin + len(self.text))
        self._forget_old_text()
        return min(changed, before)

    def _forget_old_text(self, keep: int = 4096) -> None:
        """Drop the text no later window can reach (ids before the last 2 * lookback + 4), in chunks of `keep`."""
        j = len(self.ids) - 2 * self.lookback - 4
        if j > self.fixed and self.ends[j - 1] - self.origin > keep:
            cut = self.ends[j - 1] - self.origin
            del self.text[:cut]
            self.origin += cut


class BridgedRow:
    """One row's text on the draft's side: the draft's tokens of it (`draft`), and `lag`, the bytes of an incomplete
    character at the row's end that the draft has not been given yet. The row's target tokens stay where the
    caller keeps them: commit() is given the new ones, proposal() the row's last ones."""

    def __init__(self, target: TokenText, draft: TokenText, shared: SharedVocabulary | None = None,
                 window: int = WINDOW, lookback: int = LOOKBACK):
        self.target, self.codec, self.shared, self.window = target, draft, shared, window
        self.draft = DraftText(draft, lookback)
        self.lag = b""

    def commit(self, ids: list[int]) -> int:
        """The row's new target tokens; returns the first draft id that changed (see DraftText.add)."""
        data = self.lag + self.target.spell(ids)
        end = complete_length(data)
        self.lag = data[end:]
        return self.draft.add(data[:end].decode("utf-8", errors="replace"))

    def tail_text(self, tail_ids: list[int]) -> bytes:
        """The text of the row's last target tokens (tail_ids: up to 2 * window of them): at least `window` tokens'
        (or all), from the first that starts a character."""
        texts = [self.target.pieces[t] for t in tail_ids]
        n = min(self.window, len(texts))
        while n < len(texts) and not _starts_character(b"".join(texts[-n:]), 0):
            n += 1
        data = b"".join(texts[len(texts) - n:])
        start = 0
        while start < len(data) and not _starts_character(data, start):
            start += 1  # a character begun before the tokens at hand: not text to tokenize
        return data[start:]

    def proposal(self, drafted: list[int], tail_ids: list[int], growing: bool = False) -> list[int]:
        """SLEM: the target tokens for the draft's tokens `drafted` (drawn after the draft's text), the row's last
        target tokens being tail_ids. A draft that drew its end-of-text token ended its text there: the tokens
        before it are whole, and the end itself is proposed where the target has a token of the same bytes
        (<|im_end|> in both). growing: include the last token even where more text may still extend it."""
        end = next((i for i, d in enumerate(drafted) if d in self.codec.eos), None)
        text = self.codec.spell(drafted if end is None else drafted[:end])
        if not text.startswith(self.lag):
            return []
        tokens, stable, spelled_all = spelled_tokens(self.target, self.tail_text(tail_ids), text[len(self.lag):])
        if end is None or not spelled_all:
            return tokens if growing else tokens[:stable]
        mapped = None if self.shared is None else self.shared.draft_to_target.get(drafted[end])
        return tokens + ([mapped] if mapped is not None else [])


@dataclass
class DraftKV:
    """What one row's draft KV holds (`held`, token ids in order, from index `base` of the row's draft ids) and
    what the next forward must feed to bring it to the row's draft ids: their longest common prefix is kept, and
    at least the last id is fed again (its logits draft the next token)."""

    held: list[int] = field(default_factory=list)
    base: int = 0  # the row's draft ids before this index are not in the KV (a probe restarted it mid-text)
    known: int = 0  # held[:known] equals the row's ids from base on, as of the last sync

    def plan(self, ids: list[int], changed: int) -> tuple[int, list[int]]:
        """(tokens to keep, ids to feed) for the row's draft ids `ids`, of which ids[changed:] may differ from the
        last sync's. A change before base restarts the KV from base = 0."""
        if changed < self.base:
            self.held, self.base, self.known = [], 0, 0
        keep = self._keep(ids, changed)
        return keep, ids[self.base + keep:]

    def behind(self, ids: list[int], changed: int) -> int:
        """Ids the next plan() would feed."""
        return len(ids) if changed < self.base else len(ids) - self.base - self._keep(ids, changed)

    def fed(self, keep: int, tokens: list[int]) -> None:
        """The KV was trimmed to `keep` and then took `tokens`, the rest of the row's ids (as plan() said)."""
        del self.held[keep:]
        self.held += tokens
        self.known = len(self.held)

    def drafted(self, token: int) -> None:
        """The KV took a token the draft drew (after the row's ids: the next sync keeps it if the row's text
        goes on as the draft said)."""
        self.held.append(token)

    def restart(self, ids: list[int], window: int) -> None:
        """Forget the KV; it will hold only the row's last `window` ids (a probe that must not feed a long backlog;
        only the draft's view changes)."""
        self.held, self.base, self.known = [], max(0, len(ids) - window), 0

    def _keep(self, ids: list[int], changed: int) -> int:
        start = max(0, min(self.known, changed - self.base, len(self.held)))
        keep = start + _common(self.held[start:], ids[self.base + start:])
        return min(keep, len(ids) - self.base - 1)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _starts_character(text: bytes | bytearray, at: int) -> bool:
    return at <= 0 or at >= len(text) or (text[at] & 0xC0) != 0x80

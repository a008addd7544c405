"""No call identical to one already made in the answer: a matcher around a grammar's that refuses the tokens after
which every way to finish the current call repeats an earlier one.

A tool grammar that allows several calls starts with the line DISTINCT_CALLS, which sets its ConstraintSpec's
distinct_calls flag (ConstraintSpec.of); that flag makes its matchers DistinctCallsMatchers.
A call's text is read from its name to the end of its arguments (what `"name": "` opens, in every dialect), less
the whitespace outside strings (a start form's layout is free) and with "parameters" read as "arguments"; two calls
are identical when these texts are. The refusal is part of the mask (a function of the answer so far, the same
on p and q), so speculative decoding stays exact under it, and it never leaves a dead end: a token is refused only
when no completion of its call differs from every earlier call, which a walk through the grammar decides along the
earlier calls' texts (where the grammar allows any token that leaves them, the call can differ, and the walk
stops). If every call the grammar still allows would repeat one (every tool's arguments used up), nothing is
refused: a grammar cannot end in the middle of a call.
"""

from __future__ import annotations

import bisect
import re
import threading

import numpy as np

DISTINCT_CALLS = "// specdecode: distinct-calls"
_HEAD = re.compile(rb'"name"\s*:\s*"')
# a string (closed: its closing quote came) or a bracket
_JSON_PIECE = re.compile(rb'"(?:[^"\\]|\\.)*(?P<closed>")?|[{}\[\]]', re.S)
WALK_BUDGET = 2000  # grammar states one refusal may look at; past it a call is taken to be able to differ
# Past this many allowed tokens a state is not enumerated: so wide a choice (inside a free string) always holds a
# token that leaves the earlier calls, beside the few that follow them and the whitespace tokens.
WIDE = 8192
_SPACE = frozenset(b" \t\n\r")
_ARGUMENTS, _PARAMETERS = b'","arguments":', b'","parameters":'  # the same call under either key


class TokenTable:
    """Each token's bytes, and the tokens whose bytes run along a given text (built once per grammar compiler)."""

    _lock = threading.Lock()

    def __init__(self, ll_tokenizer, n_tokens: int):
        self.bytes = [ll_tokenizer.decode_bytes([i]) for i in range(n_tokens)]
        self.by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.bytes):
            self.by_bytes.setdefault(b, []).append(i)
        self.longest = max(map(len, self.bytes))
        ordered = sorted((b, i) for i, b in enumerate(self.bytes) if b)
        self._keys, self._ids = [b for b, _ in ordered], [i for _, i in ordered]
        self.quote = np.array([b'"' in b for b in self.bytes], dtype=bool)  # tokens that may open a call's name

    @classmethod
    def of(cls, compiler) -> "TokenTable":
        with cls._lock:
            if getattr(compiler, "_token_table", None) is None:
                compiler._token_table = cls(compiler.ll_tokenizer, compiler.n_tokens)
            return compiler._token_table

    def along(self, texts: list[bytes]) -> set[int]:
        """Tokens whose bytes begin one of the texts, or begin with one."""
        ids: set[int] = set()
        for text in texts:
            for k in range(1, min(len(text), self.longest) + 1):
                ids.update(self.by_bytes.get(text[:k], ()))
            at = bisect.bisect_left(self._keys, text)
            while at < len(self._keys) and self._keys[at].startswith(text):
                ids.add(self._ids[at])
                at += 1
        return ids


def compact(piece: bytes, state: tuple = (True, False)) -> tuple[bytes, tuple]:
    """`piece` less its whitespace outside strings, read from `state` (in a string, after a backslash; a call's
    text starts inside its name's string); and the state after it."""
    in_string, escaped = state
    out = bytearray()
    for byte in piece:
        if in_string:
            in_string, escaped = (True, False) if escaped else (byte != 0x22, byte == 0x5C)
        elif byte in _SPACE:
            continue
        elif byte == 0x22:
            in_string = True
        out.append(byte)
    return bytes(out), (in_string, escaped)


def calls_in(data: bytes, start: int = 0) -> tuple[list[bytes], int | None, int]:
    """The complete calls' texts from `start` on (each from its name to the end of its arguments, compacted),
    where the unfinished one starts (None: none is), and where the last complete one ends."""
    done, end = [], start
    while (head := _HEAD.search(data, end)) is not None:
        close = _arguments_end(data, head.end())
        if close is None:
            return done, head.end(), end
        done.append(compact(data[head.end():close])[0].replace(_PARAMETERS, _ARGUMENTS, 1))
        end = close
    return done, None, end


def _arguments_end(data: bytes, name: int) -> int | None:
    """Just past the arguments that follow the name starting at `name` (None: not finished)."""
    quote = data.find(b'"', name)
    brace = data.find(b"{", quote) if quote >= 0 else -1
    if brace < 0:
        return None
    depth = 0
    for piece in _JSON_PIECE.finditer(data, brace):
        token = piece.group()
        if token[:1] == b'"':
            if piece.group("closed") is None:
                return None  # a string still open
        elif token in (b"{", b"["):
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return piece.end()
    return None


class DistinctCallsMatcher:
    """A constraints.Matcher whose mask also refuses repeats of the answer's earlier calls (same interface)."""

    def __init__(self, inner, table: TokenTable):
        self._inner, self._table = inner, table
        self.vocab_size = inner.vocab_size
        self._tokens: list[int] = []
        self._data = b""
        self._refused: dict[int, set[int]] = {}  # by answer length: the tokens refused there
        self._budget = WALK_BUDGET

    # ------------------------------------------------------------------ the Matcher interface
    def allowed(self):
        refused = self._refusals()
        mask = self._inner.allowed()
        return mask.without(refused) if refused else mask

    def mask(self):
        return self.allowed().as_bool()

    def forced(self, limit: int) -> list[int]:
        return self._inner.forced(limit)  # a forced token is never refused: its state has a call that differs

    def advance(self, tokens) -> int:
        count = 0
        for token in tokens:
            token = int(token)
            if token in self._refusals() or self._inner.advance([token]) != 1:
                break
            self._tokens.append(token)
            self._data += self._table.bytes[token] if token < len(self._table.bytes) else b""
            count += 1
        return count

    def rollback(self, n: int) -> None:
        self._inner.rollback(n)
        if n:
            del self._tokens[-n:]
            self._data = b"".join(self._table.bytes[t] if t < len(self._table.bytes) else b"" for t in self._tokens)
            self._refused = {k: v for k, v in self._refused.items() if k <= len(self._tokens)}

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @property
    def accepting(self) -> bool:
        return self._inner.accepting

    @property
    def error(self) -> str | None:
        return self._inner.error

    def copy(self) -> "DistinctCallsMatcher":
        twin = DistinctCallsMatcher(self._inner.copy(), self._table)
        twin._tokens, twin._data = list(self._tokens), self._data
        return twin

    # ------------------------------------------------------------------ the refusals
    def _refusals(self) -> set[int]:
        n = len(self._tokens)
        if n not in self._refused:
            self._refused[n] = self._refuse() if b'"name"' in self._data else set()
        return self._refused[n]

    def _refuse(self) -> set[int]:
        done, open_at, last_end = calls_in(self._data)
        if not done:
            return set()
        mask = self._inner.allowed()
        if open_at is not None:  # in a call: the tokens that run along an earlier call
            current, state = compact(self._data[open_at:])
            rests = _rests(done, current)
            candidates = [t for t, _, _ in self._along(mask, rests, state, every=True)] if rests else []
        else:  # between calls: the tokens that may open one (the quote before a name)
            n = min(mask.known, len(self._table.quote))
            candidates = np.flatnonzero(_allowed(mask, n) & self._table.quote[:n]).tolist()
        self._budget = WALK_BUDGET
        refused = {t for t in candidates if self._repeats(t, done, last_end)}
        return refused if len(refused) < mask.count() else set()

    def _repeats(self, token: int, done: list[bytes], last_end: int) -> bool:
        """Whether every completion of the call the token leaves the answer in repeats an earlier call."""
        data = self._data + self._table.bytes[token]
        finished, open_at, _ = calls_in(data, last_end)
        if any(call in done for call in finished):
            return True
        if open_at is None:
            return False
        current, state = compact(data[open_at:])
        rests = _rests(done, current)
        if not rests:
            return False
        self._inner.advance([token])
        try:
            return not self._can_differ(rests, state)
        finally:
            self._inner.rollback(1)

    def _can_differ(self, rests: list[bytes], state: tuple) -> bool:
        """From the inner matcher's state, whether some completion of the call leaves every one of `rests` (the
        rest of an earlier call's text, compacted)."""
        self._budget -= 1
        mask = self._inner.allowed()
        along = self._along(mask, rests, state)
        if along is None or self._budget <= 0:
            return True  # a token that leaves them all (or a walk too long to finish: taken to differ)
        for token, piece, after in along:
            if any(piece.startswith(rest) for rest in rests):
                continue  # it finishes a repeat
            self._inner.advance([token])
            try:
                if self._can_differ([r[len(piece):] for r in rests if r.startswith(piece)], after):
                    return True
            finally:
                self._inner.rollback(1)
        return False

    def _along(self, mask, rests: list[bytes], state: tuple, every: bool = False):
        """The allowed tokens that run along the rests, each with its compacted text and the state after it
        (whitespace, which changes nothing, left out unless it is all there is); None when some allowed token
        leaves them all (unless `every`: then all that run along)."""
        count = mask.count()
        if count > WIDE:  # inside a free string: only the tokens that spell a rest can follow one
            ids = [t for t in self._table.along(rests) if mask.allows(t)]
            if count > len(ids) and not every:
                return None
            return [(t, *compact(self._table.bytes[t], state)) for t in ids]
        along, spaces = [], []
        for token in np.flatnonzero(_allowed(mask, min(mask.known, len(self._table.bytes)))).tolist():
            piece, after = compact(self._table.bytes[token], state)
            if not piece:
                spaces.append((token, piece, after))
            elif any(rest.startswith(piece) or piece.startswith(rest) for rest in rests):
                along.append((token, piece, after))
            elif not every:
                return None
        # Whitespace changes no call, and where other tokens may come, JSON lets them come without it; where it is
        # all the layout allows (a fixed layout's space), one of it is walked through.
        return along or ([] if every else spaces[:1])


def _allowed(mask, n: int) -> np.ndarray:
    """The mask's first n ids as a bool array."""
    if mask.bits is None:
        return np.ones(n, bool)
    return np.unpackbits(mask.bits, count=n, bitorder="little").view(bool)


def _rests(done: list[bytes], current: bytes) -> list[bytes]:
    """What is left of each earlier call (under either key) that the current call's text so far begins."""
    spelled = done + [call.replace(_ARGUMENTS, _PARAMETERS, 1) for call in done]
    return [call[len(current):] for call in spelled if call.startswith(current) and len(call) > len(current)]

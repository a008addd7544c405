"""A model backend that writes a known text in one tokenizer's tokens, for timing what a drafter does around its
model (the cross_vocab section: the bridge's host cost, device_cross_vocab.py): its greedy next token is the next
token of the text (as the tokenizer spells what follows the row's bytes), at no model cost. A draft may be made to
err: at a rate, per text position (a function of the position and the seed), it names another token.

Each row's history is its token ids; the text position is found once the row spells PLACE bytes (the first place
in the text that holds them), and the row stays on the text while every token it took spells the text's next
bytes. Off the text (a rejected draft, an error) its logits name token 0 until a trim brings it back. Forwards are
counted and timed (forward_s), with the token count of each (widths), so that the caller can subtract them and
price them with a real model's measured forward costs."""

from __future__ import annotations

import copy
import time
from collections import Counter

import torch

LOOKAHEAD = 48  # bytes of text tokenized to find the next token
PLACE = 64  # bytes a row spells before it is placed in the text (fewer may be found at an earlier place)


class TextOracle:
    def __init__(self, text: str, codec=None, error_rate: float = 0.0, seed: int = 0, device="cpu"):
        """text: what every row writes; codec: the tokenizer read as bytes (text.token_bridge.TokenText), here or
        later by use() (a drafter that reads its tokenizer itself: the same object, not read twice); device: where
        its logits are handed over (what the drafter then does with them runs there, as with a model there)."""
        self.text = text.encode("utf-8")
        self.device = torch.device(device)
        self.error_rate, self.seed = error_rate, seed
        self.name = "text-oracle"
        self.max_positions = 1 << 16
        self._next: dict[int, int] = {}  # text position -> the token there (shared by forks)
        self.stats = self.new_stats()
        self.codec, self.vocab_size, self.eos_token_ids = None, None, set()
        if codec is not None:
            self.use(codec)
        self.reset(1)

    def use(self, codec) -> None:
        self.codec, self.vocab_size, self.eos_token_ids = codec, codec.size, set(codec.eos)
        self._next.clear()

    @staticmethod
    def new_stats() -> dict:
        return {"forward_calls": 0, "forward_s": 0.0, "widths": Counter(), "off_text": 0}

    # ------------------------------------------------------------------ the backend
    def reset(self, batch_size: int) -> None:
        self.rows = [_Row() for _ in range(batch_size)]

    @property
    def lengths(self) -> list[int]:
        return [len(r.ids) for r in self.rows]

    def forward(self, input_ids, valid=None, last_only=False, output_hidden=False):
        start = time.perf_counter()
        ids = input_ids.tolist()
        mask = valid.tolist() if valid is not None else None
        batch, n = len(ids), len(ids[0])
        out = torch.zeros(batch, 1 if last_only else n, self.vocab_size)
        for b, row in enumerate(self.rows[:batch]):
            columns = [j for j in range(n) if mask is None or mask[b][j]]
            for j in columns:
                self._take(row, ids[b][j])
                if not last_only or j == columns[-1]:
                    out[b, -1 if last_only else j, self._predict(row)] = 30.0
        if self.device.type != "cpu":
            out = out.to(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copy is the oracle's, not the drafter's
        self.stats["forward_calls"] += 1
        self.stats["widths"][n] += 1
        self.stats["forward_s"] += time.perf_counter() - start
        return (out, out.clone()) if output_hidden else out

    def trim(self, lengths: list[int]) -> None:
        for row, n in zip(self.rows, lengths):
            row.trim(n)

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def fork(self, batch_size: int) -> "TextOracle":
        other = copy.copy(self)  # shares the text, its token cache and the counters
        other.reset(batch_size)
        return other

    def merge(self, other: "TextOracle") -> None:
        self.rows += other.rows

    # ------------------------------------------------------------------ the text
    def _take(self, row: "_Row", token: int) -> None:
        piece = self.codec.pieces[token] if token < len(self.codec.pieces) else b""
        on_before = row.on == len(row.ids)
        at = len(row.spelled)
        row.ids.append(token)
        row.spelled += piece
        row.ends.append(len(row.spelled))
        if not on_before:
            return
        if row.start is None:  # not placed yet: placed once it spells enough bytes to be found once
            if len(row.spelled) < PLACE:
                row.on = len(row.ids)
                return
            found = self.text.find(bytes(row.spelled))
            row.start = found if found >= 0 else None
            row.on = len(row.ids) if found >= 0 else 0
            return
        if self.text[row.start + at:row.start + at + len(piece)] == piece:
            row.on = len(row.ids)

    def _predict(self, row: "_Row") -> int:
        if row.start is None or row.on != len(row.ids):
            self.stats["off_text"] += 1
            return 0
        at = row.start + len(row.spelled)
        token = self._next.get(at)
        if token is None:
            from specdecode.text.token_bridge import decodable

            ahead = self.codec.encode(decodable(self.text[at:at + LOOKAHEAD]))
            token = self._next[at] = ahead[0] if ahead else min(self.eos_token_ids, default=0)
        if self.error_rate and _uniform(at, self.seed) < self.error_rate:
            return (token * 7919 + at) % self.vocab_size  # another token, the same at every visit of this position
        return token


class _Row:
    __slots__ = ("ids", "spelled", "ends", "start", "on")

    def __init__(self):
        self.ids: list[int] = []
        self.spelled = bytearray()  # the bytes its ids spell
        self.ends: list[int] = []  # after each id, len(spelled)
        self.start: int | None = None  # where in the text the row begins
        self.on = 0  # its first `on` ids spell the text from there

    def trim(self, n: int) -> None:
        if n >= len(self.ids):
            return
        del self.spelled[self.ends[n - 1] if n else 0:]
        del self.ids[n:], self.ends[n:]
        self.on = min(self.on, n)
        if not self.spelled:
            self.start, self.on = None, 0


def _uniform(position: int, seed: int) -> float:
    x = (position * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    return x / 2.0**64

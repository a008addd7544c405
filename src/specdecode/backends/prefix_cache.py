"""Prompt prefixes whose KV a model already holds, reused instead of prefilled again.

A chat re-sends its whole history every turn, and many requests share a system prompt. When a row finishes, its
KV (prompt and answer) is parked in the cache instead of forgotten; a new row whose prompt starts with the same
tokens (a parked row's, or a running row's) starts from a copy of that KV and prefills only the rest
(llama.cpp: llama_memory_seq_cp from the parked sequence; transformers: a copy of the cache slices).

The output is the same as a cold prefill's, bit for bit: the backend says how long a reused prefix may be so
that what is left runs through exactly the forwards a cold prefill would (`reusable_prefix`; on llama.cpp the
size of a forward changes its numbers). For the same reason a match never reaches past the tokens that were
prefilled (an entry's `exact`: its prompt): the KV of generated tokens came from decode steps of 1..K+1 tokens,
which a cold prefill of a later prompt computes in larger forwards, with other numbers (llama.cpp's kernels, and
torch's for one-token forwards on the CPU). Entries are evicted least recently used, under a token budget and the
backend's spare rows (llama.cpp sequences).

An agent's next turn re-sends the last answer, so what an answer's KV is worth is a setting (`answers`, ANSWER_KV):
"off" lends prompts only; "prefill" also prefills a parked answer again while the server is idle (an agent runs its
tools between turns: `prefill_answer`, a chunk at a time), in a cold prefill's forwards, and lends it from then on,
bit for bit what a cold prefill gives; "lend" lends the decode-computed KV as it is (as llama-server and
llama-cpp-python do): equal to a cold prefill's up to float rounding, and then on any length, not the backend's
reusable_prefix. A chat's answer often comes back otherwise than it was generated (the template writes tool calls
in its own form, which small models do not always use): `resend` says how, and the idle prefill prefills that
(both modes; "lend" lends the decode KV as far as the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .base import Interrupted, caches_prefixes, prefill_parked, reusable_prefix

MIN_REUSE = 16  # shorter matches are not worth a copy
ANSWER_KV = ("prefill", "lend", "off")  # what a parked answer's KV is worth: see the module's doc
IDLE_CHUNK = 512  # tokens of an answer's idle prefill per call without a prefill budget (llama.cpp's n_batch)
FAR = 1 << 30  # the length of "a later prompt that goes on well past this entry" for reusable_prefix
MAX_BYTES = 1 << 30  # KV copies held in memory of their own (transformers) at most; llama.cpp's live in its cache


@dataclass(eq=False)  # entries are compared by identity (their tokens are arrays)
class _Entry:
    tokens: np.ndarray  # what the parked KV holds, in order
    handle: object  # the backend's handle to it (dropping the handle frees the KV)
    used: int  # clock of the last hit or insertion
    exact: int  # leading tokens whose KV was prefilled (a cold prefill computes them the same way): a match's cap
    goal: int  # what exact becomes once the answer is prefilled again (prefill_answer); exact when it is not to be
    started: bool = False  # its idle prefill has begun (its KV from `exact` on is gone)
    render: Callable[[], list[int] | None] | None = None  # the tokens a later prompt re-sends instead (resend)


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens taken from the cache instead of prefilled
    prompt_tokens: int = 0  # prompt tokens looked up
    evictions: int = 0
    inserted: int = 0
    idle_prefilled_tokens: int = 0  # answers' tokens prefilled again while idle (prefill_answer), to be lent exactly

    def to_dict(self) -> dict:
        return dict(self.__dict__, hit_rate=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0)


@dataclass
class PrefixCache:
    """Parked KV of finished rows for one backend, LRU under max_tokens (tokens held), max_bytes (memory of their
    own, for backends whose handles are copies) and the backend's free rows."""

    max_tokens: int = 1 << 16
    max_bytes: int = MAX_BYTES
    answers: str = "off"  # what a parked answer's KV is worth (ANSWER_KV, the module's doc)
    entries: list[_Entry] = field(default_factory=list)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _clock: int = 0

    def __post_init__(self):
        if self.answers not in ANSWER_KV:
            raise ValueError(f"answers must be one of {', '.join(ANSWER_KV)}, got {self.answers!r}")

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    @property
    def bytes(self) -> int:
        return sum(getattr(e.handle, "nbytes", 0) for e in self.entries)

    def usable(self, backend) -> bool:
        return self.max_tokens > 0 and caches_prefixes(backend)

    def admit(self, backend, prompts: list[list[int]], running: list[tuple[list[int], int]], budget: int | None,
              extra_rows: int = 0) -> list:
        """Per prompt of rows about to be forked (with extra_rows more beside them), the cached prefix it starts from:
        (handle, n) or None. Room is made for the fork first; where that cost a hit's entry, no prompt takes a hit.
        running: the running rows' tokens and how many of them the backend holds (their KV can be copied too)."""
        hits = [self.lookup(backend, p, running, budget) for p in prompts]
        if not self.make_room(backend, len(prompts) + extra_rows, [h[0] for h in hits if h]):
            hits = [None] * len(prompts)
        for prompt, hit in zip(prompts, hits):
            self.record(len(prompt), hit[1] if hit else 0)
        return hits

    def park(self, backend, rows: list[int], tokens: list[list[int] | None], exact: list[int]) -> None:
        """These rows leave the backend's batch (as select_rows of the others would) and their KV stays, as entries:
        tokens[i] is what row rows[i] holds, in order (None: nothing worth keeping, its KV is freed), of which the
        first exact[i] were prefilled (its prompt: all a later prompt may reuse, see insert; all it holds when
        answers are lent)."""
        held = backend.lengths
        for b, seq, n, handle in zip(rows, tokens, exact, backend.park(rows)):
            if seq is not None:
                self.insert(seq[: held[b]], handle, exact=held[b] if self.answers == "lend" else n)

    def make_room(self, backend, rows: int, keep: list) -> bool:
        """Evict until the backend can fork `rows` new rows (parked entries hold its spare rows), entries whose
        handle is in `keep` last; False if those had to go too (their hits are then void)."""
        kept = [e for e in self.entries if any(e.handle is h for h in keep)]
        others = [e for e in self.entries if not any(e.handle is h for h in keep)]
        while others and backend.free_rows() < rows:
            self._evict(others)
        if backend.free_rows() >= rows:
            return True
        while kept and backend.free_rows() < rows:
            self._evict(kept)
        return False

    def lookup(self, backend, prompt: list[int], running: list[tuple[list[int], int]], budget: int | None):
        """(handle, n): the longest reusable prefix of prompt among the entries and the running rows (their
        prefilled tokens and how many of them the backend holds), or None. Called just before the copy: a running
        row's handle is valid only until it changes."""
        want = np.asarray(prompt, dtype=np.int64)
        best, best_n = None, 0
        for entry in self.entries:
            n = min(common_prefix(entry.tokens, want), entry.exact)
            if n > best_n:
                best, best_n = entry, n
        best_row = None
        for b, (tokens, held) in enumerate(running):
            n = common_prefix(np.asarray(tokens[:held], dtype=np.int64), want)
            if n > best_n:
                best, best_n, best_row = None, n, b
        if self.answers == "lend":  # decode-computed KV is lent: no forward shapes to keep, any length will do
            n = max(0, min(best_n, len(prompt) - 1))
        else:
            n = reusable_prefix(backend, len(prompt), best_n, budget)
        if n < MIN_REUSE:
            return None
        self._clock += 1
        if best is not None:
            best.used = self._clock
            return best.handle, n
        return backend.kv_ref(best_row), n

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_tokens
        self.stats.hits += hit_tokens > 0
        self.stats.hit_tokens += hit_tokens

    def insert(self, tokens: list[int], handle, exact: int | None = None) -> None:
        """Park a finished row's KV (tokens: what it holds; exact: how many of them were prefilled, its prompt, the
        only part a later prompt may reuse until prefill_answer has prefilled the rest; None: all). An entry that
        the new one extends (what it will lend) is dropped."""
        exact = len(tokens) if exact is None else min(exact, len(tokens))
        goal = len(tokens) if self.answers == "prefill" else exact
        if goal < MIN_REUSE or len(tokens) > self.max_tokens:
            return
        new = np.asarray(tokens, dtype=np.int64)
        self.entries = [e for e in self.entries if min(common_prefix(e.tokens, new), goal) < e.goal]
        # room first, then the entry: the metrics thread reads tokens and bytes at any moment, never over the bounds
        size = getattr(handle, "nbytes", 0)
        if size > self.max_bytes:
            return
        while self.entries and (self.tokens + len(new) > self.max_tokens or self.bytes + size > self.max_bytes):
            self._evict()
        self._clock += 1
        self.entries.append(_Entry(new, handle, self._clock, exact, goal))
        self.stats.inserted += 1

    def prefill_answer(self, backend, budget: int | None, abort_when: Callable[[], bool] | None = None) -> int:
        """Idle work, one chunk per call (so that a request arriving meanwhile waits for one chunk at most, and for
        none where the backend stops a forward once abort_when() is true: Interrupted, the entry as it was): the
        oldest parked answer whose KV came from decode steps is prefilled again, in place, from the longest prefix
        of its entry after which that prefill computes what a cold prefill of a later prompt re-sending it would
        (reusable_prefix), in a cold prefill's chunks (cuts at multiples of `budget`, the prefill tokens per step,
        or of IDLE_CHUNK); each chunk done is lent from then on. The tokens prefilled; 0: nothing left to do."""
        entry = next((e for e in self.entries if e.exact < e.goal or e.render is not None), None)
        if entry is None:
            return 0
        if entry.render is not None:
            self._retarget(entry)
            return self.prefill_answer(backend, budget, abort_when)
        length = len(entry.tokens)
        if not entry.started:
            start = self._refill_start(backend, entry, budget)
            if start is None:
                entry.goal = entry.exact
                return self.prefill_answer(backend, budget, abort_when)
            entry.exact, entry.started = start, True
        start, step = entry.exact, budget or IDLE_CHUNK
        end = min(length, start + step - start % step)
        try:
            entry.handle = prefill_parked(backend, entry.handle, start, entry.tokens[start:end].tolist(), abort_when)
        except Interrupted:  # stopped cleanly: its KV holds its first `start` tokens, the chunk is done again later
            raise
        except BaseException:  # its KV may be half written: it goes
            self.entries.remove(entry)
            raise
        entry.exact = end
        self.stats.idle_prefilled_tokens += end - start
        return end - start

    def _refill_start(self, backend, entry: _Entry, budget: int | None) -> int | None:
        """Where an entry's idle prefill starts: after the longest prefix from which it computes what a cold prefill
        of a later prompt re-sending the entry would (reusable_prefix; lent answers: where its prefix stops); None
        where such a prompt, which goes on past the entry, would take no more from the cache than it can now."""
        if self.answers == "lend":  # decode KV is lent: no forward shapes to keep
            return entry.exact if entry.exact < len(entry.tokens) else None
        start = reusable_prefix(backend, FAR, entry.exact, budget)
        return start if reusable_prefix(backend, FAR, len(entry.tokens), budget) > start else None

    def resend(self, tokens: list[int], prompt: int, render: Callable[[], list[int] | None]) -> None:
        """The row that parked `tokens` (its prompt's first `prompt` of them, then its answer) will come back as
        render() gives it (a chat template's rendering of the answer, say, with its tool calls in the template's
        own form where the model wrote them otherwise): its entry holds that instead, and prefill_answer prefills
        it, calling render in idle time. Nothing where answers are off."""
        if self.answers == "off":
            return
        want = np.asarray(tokens, dtype=np.int64)
        for entry in reversed(self.entries):  # the newest first: the row's own, just parked
            if prompt <= len(entry.tokens) <= len(want) and common_prefix(entry.tokens, want) == len(entry.tokens):
                entry.render = render
                return

    def _retarget(self, entry: _Entry) -> None:
        """The entry takes the tokens its render gives: its KV stays valid as far as they agree with what it held."""
        render, entry.render = entry.render, None
        try:
            new = render()
        except Exception:  # a conversation the template cannot render again: the entry stays as it was parked
            return
        if not new or len(new) > self.max_tokens:
            return
        new = np.asarray(new, dtype=np.int64)
        others = [e for e in self.entries if e is not entry]
        while others and self.tokens - len(entry.tokens) + len(new) > self.max_tokens:  # room first, as in insert
            self._evict(others)
        entry.exact = min(entry.exact, common_prefix(entry.tokens, new))
        entry.tokens, entry.goal, entry.started = new, len(new), False

    def clear(self) -> None:
        self.entries = []

    def _evict(self, among: list[_Entry] | None = None) -> None:
        among = self.entries if among is None else among
        oldest = min(among, key=lambda e: e.used)
        among.remove(oldest)
        if among is not self.entries:
            self.entries.remove(oldest)
        self.stats.evictions += 1  # the handle went with the entry: the backend frees that KV


def common_prefix(a, b) -> int:
    """How many leading tokens a and b share: token lists, or int64 arrays (one vector comparison, for the long
    prompts the cache compares)."""
    n = min(len(a), len(b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if len(diff) else n
    return next((i for i in range(n) if a[i] != b[i]), n)

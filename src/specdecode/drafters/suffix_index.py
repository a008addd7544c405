"""The index behind SuffixDrafter: token logs searched like a suffix tree (TokenLog; drafting from one is
suffix_drafts.py, the shared history of requests suffix_history.py).

SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications")
keeps suffix trees over the current request and over previous prompts and outputs. To draft, it finds the node of
a suffix of the context (match length m), then walks down to the most frequent child, token by token, multiplying
the estimated acceptance by count(child) / count(node), and stops when that product falls below a threshold or the
draft is m * factor long; of the drafts of every match length it keeps the one with the highest score (the sum of
those products: the expected number of accepted drafts).

Arctic Inference's suffix tree (the authors' own, Apache-2.0) ships on PyPI as a source package only: building it
needs torch, cmake, nanobind and the gRPC toolchain, and the package is a vLLM plugin. So the same questions are
answered here in a few numpy arrays, without building a tree:

- `TokenLog`: documents in one int32 array, each ended by SEP, and for n in NGRAMS a hash chain (LZ77-style):
  head[n][bucket] is the last position where an n-gram of that bucket ends, prev[n][p] the one before p. The
  occurrences of the longest indexed n-gram ending the context are the chain's entries (the most recent WALK,
  verified), each extended backwards to its true match length (up to MAX_MATCH). The positions that follow them
  are the children of the suffix-tree nodes on that path; counting their tokens gives the node counts (of the WALK
  most recent occurrences: recent text predicts best, and it bounds the work).
- `SuffixHistory` (suffix_history.py): one TokenLog per key (API key; None for unkeyed rows), at most max_tokens
  tokens in all; the least recently used documents go first (a document is used when it is added or a proposed
  draft came from it).

Memory: 20 bytes per log slot (token, 4 chain links) plus 16 per hash-head slot (4 heads, as many slots as log
slots, rounded up to a power of two); a log holds at most as many dead tokens as live ones (else it is compacted)
and grows by doubling. Measured: 37 MB for a full history of 1M tokens.

Lookups run in Python over memoryviews of the arrays (numpy's cost per call exceeds the work on the few entries
a lookup reads) and read only what the answer needs: a chain read to its end bounds shorter n-grams' match lengths,
the winning draft's rows alone are read, and (chains) the history's search stops where it cannot beat the row's
own draft. They draft exactly what the vectorised version did: tests/test_suffix_index_equivalence.py compares
every draft with a brute-force reference.

Time, measured on this project's 2-core CPU (AMD EPYC, Python 3.11, numpy 2.4), one row, K = 8, interleaved with
the vectorised version (commit 996dd7a): decoding novel text token by token (scripts/suffix_step_cost.py: the
README after 2k tokens of it, the docs' first 4k tokens in the history), observe + outlook cost 24 us per step
(median; mean 29), against 79 (mean 84); decoding code (session.py, 100k tokens of docs and sources in the
history) 30 us (mean 35) against 91 (mean 97). With a history of 1M code-like tokens (Zipf tokens and copied
spans: long chains, deep matches) and rows of 1k context tokens, a proposal (outlook + propose: the row's own
context and the history) costs 0.05 ms of CPU per row (median; p99 0.09 ms) against 0.10 (p99 0.14), and observe
(8 tokens) 0.017 ms per row against 0.031; tests/test_suffix_drafter.py checks the median at 1M tokens stays
well under 1 ms.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from operator import itemgetter

import numpy as np

SEP = -1  # ends every document in a log: no n-gram, match or continuation crosses it
NGRAMS = (1, 2, 4, 8)  # n-gram lengths with a hash chain; a match found on one is extended to MAX_MATCH
MAX_MATCH = 32  # the longest suffix matched (the tree depth)
WALK = 64  # chain entries read per lookup: the most recent occurrences
_BASE, _MIX = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F  # odd 64-bit constants: polynomial base, multiplicative hash
_BASE64, _MIX64 = np.uint64(_BASE), np.uint64(_MIX)
_MASK = (1 << 64) - 1
_SMALL = 16  # appends up to this many tokens are indexed in Python (numpy's per-call cost would dominate)
_POWERS = [pow(_BASE, d, 1 << 64) for d in range(NGRAMS[-1])]  # _BASE ** d: the weight of the token d back
_LEVEL = {n: i for i, n in enumerate(NGRAMS)}
_count = itemgetter(1)


def _suffix_hashes(tokens: list[int]) -> list[int]:
    """The hash of tokens[-n:] for n = 1 .. min(len(tokens), longest n-gram), exactly as `_hashes` computes it in
    uint64 arithmetic (a polynomial: sum(t[-1 - d] * _BASE ** d) mod 2 ** 64), in one pass from the end: each longer
    suffix adds one term."""
    hashes, h = [], 0
    for d in range(min(len(tokens), NGRAMS[-1])):
        h = (h + tokens[-1 - d] * _POWERS[d]) & _MASK
        hashes.append(h)
    return hashes


class TokenLog:
    """Token documents in one array with hash chains over their n-grams (see the module docstring)."""

    def __init__(self, capacity: int = 256):
        self._tok = np.full(capacity, SEP, np.int32)
        self._prev = np.full((len(NGRAMS), capacity), -1, np.int32)
        self._bits = max(8, (capacity - 1).bit_length())
        self._head = np.full((len(NGRAMS), 1 << self._bits), -1, np.int32)
        self.size = 0  # tokens in the log, SEPs and dead documents included
        self.dead = 0  # tokens of removed documents (overwritten with SEP until the log is compacted)
        self._starts: list[int] = []  # start position of each document, in log order
        self._ids: list = []  # its id
        self._spans: dict = {}  # live document id -> (start, length)
        self._views()

    def _views(self) -> None:
        """Memoryviews of the arrays (reading one element from Python is several times cheaper than numpy's)."""
        self._tokv = memoryview(self._tok)
        self._headv = [memoryview(row) for row in self._head]
        self._prevv = [memoryview(row) for row in self._prev]

    # ------------------------------------------------------------------ adding and removing
    def extend(self, tokens) -> None:
        """Append tokens to the open end of the log (a row's context grows this way)."""
        tokens = list(tokens)
        if not tokens:
            return
        lo = self.size
        self._reserve(lo + len(tokens))
        if len(tokens) <= _SMALL:
            self._tokv[lo:lo + len(tokens)] = array(self._tokv.format, tokens)
            self.size += len(tokens)
            self._index_small(lo, self.size)
        else:
            self._tok[lo:lo + len(tokens)] = tokens
            self.size += len(tokens)
            self._index(lo, self.size)

    def add(self, tokens, doc_id) -> None:
        """Append a finished document (it ends with SEP: nothing matches across it)."""
        tokens = list(tokens)
        self._starts.append(self.size)
        self._ids.append(doc_id)
        self._spans[doc_id] = (self.size, len(tokens))
        self.extend(tokens + [SEP])

    def remove(self, doc_id) -> None:
        """Forget a document: its tokens become SEP (they never match again); compacted once half is dead."""
        start, n = self._spans.pop(doc_id)
        self._tok[start:start + n] = SEP
        self.dead += n + 1
        if self.dead > max(self.size - self.dead, 4096):
            self._compact()

    @property
    def empty(self) -> bool:
        return not self._spans

    @property
    def nbytes(self) -> int:
        return self._tok.nbytes + self._prev.nbytes + self._head.nbytes

    def tokens(self) -> list[int]:
        return self._tok[:self.size].tolist()

    def tail(self, n: int) -> list[int]:
        """The last n tokens (fewer in a shorter log)."""
        return self._tokv[max(0, self.size - n):self.size].tolist()

    def doc_at(self, position: int):
        """The id of the document holding this position (None past the documents, e.g. in an open row)."""
        i = bisect_right(self._starts, position) - 1
        return self._ids[i] if i >= 0 else None

    def docs_at(self, positions) -> set:
        """{doc_at(p) for p in positions}, one search per run of positions in one document (a match's ends are
        newest first: mostly runs)."""
        docs, lo, hi = set(), 0, -1  # the span [lo, hi) of the document found last
        for p in positions:
            if not lo <= p < hi:
                i = bisect_right(self._starts, p) - 1
                lo = self._starts[i] if i >= 0 else -1
                hi = self._starts[i + 1] if i + 1 < len(self._starts) else self.size + 1
                docs.add(self._ids[i] if i >= 0 else None)
        return docs

    def _reserve(self, size: int) -> None:
        capacity = len(self._tok)
        if size <= capacity:
            return
        capacity = max(2 * capacity, size)
        self._tok = np.concatenate([self._tok, np.full(capacity - len(self._tok), SEP, np.int32)])
        self._prev = np.concatenate([self._prev, np.full((len(NGRAMS), capacity - self._prev.shape[1]), -1,
                                                         np.int32)], axis=1)
        if capacity > 1 << self._bits:  # one head slot per position at most: rebuild the chains wider
            self._bits = (capacity - 1).bit_length()
            self._head = np.full((len(NGRAMS), 1 << self._bits), -1, np.int32)
            self._index(0, self.size)
        self._views()

    def _compact(self) -> None:
        """Rebuild the log from its live documents, in order (positions change; ids stay)."""
        live = [(doc_id, self._tok[s:s + n].tolist()) for doc_id, (s, n) in self._spans.items()]
        fresh = TokenLog(max(256, sum(len(t) + 1 for _, t in live)))
        for doc_id, tokens in live:
            fresh._place(tokens, doc_id)
        fresh._index(0, fresh.size)
        self.__dict__.update(fresh.__dict__)

    def _place(self, tokens: list[int], doc_id) -> None:
        """Like add, without indexing: the caller indexes the whole range once (a compaction)."""
        lo = self.size
        self._starts.append(lo)
        self._ids.append(doc_id)
        self._spans[doc_id] = (lo, len(tokens))
        self._tok[lo:lo + len(tokens)] = tokens
        self._tok[lo + len(tokens)] = SEP
        self.size += len(tokens) + 1

    # ------------------------------------------------------------------ the hash chains
    def _index(self, lo: int, hi: int) -> None:
        """Link positions lo..hi-1 into the chain of every n-gram ending there (vectorised)."""
        pos = np.arange(lo, hi)
        for i, n in enumerate(NGRAMS):
            h, ok = self._hashes(pos, n)
            self._link(i, pos[ok], self._buckets(h[ok]))

    def _hashes(self, pos: np.ndarray, n: int):
        """(hash, valid) of the n-gram ending at each position; invalid where it starts before 0 or holds SEP."""
        ok = pos >= n - 1
        h = np.zeros(len(pos), np.uint64)
        for j in range(n):
            t = self._tok[np.maximum(pos - (n - 1) + j, 0)]
            ok &= t != SEP
            h = h * _BASE64 + t.astype(np.int64).astype(np.uint64)
        return h, ok

    def _buckets(self, h: np.ndarray) -> np.ndarray:
        return ((h * _MIX64) >> np.uint64(64 - self._bits)).astype(np.int64)

    def _link(self, i: int, pos: np.ndarray, buckets: np.ndarray) -> None:
        """prev[p] = the previous position of p's bucket (within pos, else the old head); heads move to the last."""
        if not len(pos):
            return
        order = np.argsort(buckets, kind="stable")  # stable: positions stay increasing within a bucket
        b, p = buckets[order], pos[order]
        first = np.ones(len(b), bool)
        first[1:] = b[1:] != b[:-1]
        prev = np.empty_like(p)
        prev[1:] = p[:-1]
        prev[first] = self._head[i, b[first]]
        self._prev[i, p] = prev
        last = np.ones(len(b), bool)
        last[:-1] = first[1:]
        self._head[i, b[last]] = p[last]

    def _index_small(self, lo: int, hi: int) -> None:
        """The same as _index for a few positions, in Python (a decode step appends one to nine tokens): the hashes of
        the n-grams ending at p are _suffix_hashes' (the same as _hashes'), cut at the first SEP."""
        tok, heads, prevs, shift = self._tokv, self._headv, self._prevv, 64 - self._bits
        for p in range(lo, hi):
            h = 0
            for d in range(min(p + 1, NGRAMS[-1])):
                t = tok[p - d]
                if t == SEP:  # no n-gram holds it: nor any longer one ending here
                    break
                h = (h + t * _POWERS[d]) & _MASK
                i = _LEVEL.get(d + 1)
                if i is not None:
                    b = ((h * _MIX) & _MASK) >> shift
                    prevs[i][p] = heads[i][b]
                    heads[i][b] = p

    # ------------------------------------------------------------------ lookups
    def match(self, tail: list[int], walk: int = WALK, before: int | None = None):
        """(ends, lengths): the most recent occurrences (newest first) of the longest indexed n-gram that ends
        `tail`, as the positions where they end and their true match lengths (<= len(tail)). Occurrences with
        nothing after them in the log (the context's own tail) are left out, and so are those in documents of id
        `before` or later (added after a row joined)."""
        ends, lengths = self.match_lists(list(tail), walk, self.start_of(before))
        return np.array(ends, np.int64), np.array(lengths, np.int64)

    def start_of(self, doc_id) -> int:
        """Where the first document of id doc_id or later starts (ids grow along the log); the log's end if none."""
        if doc_id is None:
            return self.size
        i = bisect_left(self._ids, doc_id)
        return self._starts[i] if i < len(self._ids) else self.size

    def match_lists(self, tail: list[int], walk: int, stop: int, need: int = 1) -> tuple[list[int], list[int]]:
        """match's (ends, lengths) as lists. For each n, longest first: the chain's `walk` most recent entries
        before min(stop, the last position) (a chain holds decreasing positions, so those at or past it are its
        first ones), each read backwards to its true match length; the first n with one of length >= n answers
        (the others are hash collisions and removed documents). A chain read to its end without one shows that no
        position before the stop matches n tokens: shorter n-grams' matches are then measured up to n - 1 only.
        need: the answer's matches shorter than this are left out (nothing where none or no longer one can be)."""
        if not tail:
            return [], []
        tok, prevs, heads, shift = self._tokv, self._prevv, self._headv, 64 - self._bits
        hashes, last = _suffix_hashes(tail), min(self.size - 1, stop)
        back, first, longest = tail[::-1], tail[-1], len(tail)  # back[m]: the token m before the end
        for i in reversed(range(len(NGRAMS))):
            n = NGRAMS[i]
            if n > len(tail):
                continue
            if longest < need:
                return [], []
            prev = prevs[i]
            p = heads[i][((hashes[n - 1] * _MIX) & _MASK) >> shift]
            while p >= last and p >= 0:  # the context's own end, and documents from `before` on
                p = prev[p]
            ends, lengths, read = [], [], 0
            if longest == 1:  # n == 1, and every occurrence matches exactly one token
                while p >= 0 and read < walk:
                    read += 1
                    if tok[p] == first:
                        ends.append(p)
                    p = prev[p]
                lengths = [1] * len(ends)
            else:
                while p >= 0 and read < walk:
                    read += 1
                    if tok[p] == first:
                        m = 1
                        while m < longest and m <= p and tok[p - m] == back[m]:
                            m += 1
                        if m >= n:
                            ends.append(p)
                            lengths.append(m)
                    p = prev[p]
            if ends:
                if need > 1:
                    ends, lengths = [e for e, m in zip(ends, lengths) if m >= need], [m for m in lengths if m >= need]
                return ends, lengths
            if p < 0:
                longest = min(longest, n - 1)
        return [], []

    def frequent_path(self, ends: list[int], limit: int, min_prob: float) -> tuple[list[int], float, list[int]]:
        """(tokens, score, the ends whose continuation starts with the first token) of the continuations after
        these match ends: follow the most frequent next token (ties: the most recent occurrence, ends being newest
        first) while the product of count / support stays >= min_prob. Continuations that end (SEP, or the log's
        end) stay in the support: they are evidence that the text stopped there."""
        tok, size = self._tokv, self.size
        tokens, prob, score, at, firsts = [], 1.0, 0.0, ends, ends
        for j in range(limit):
            if len(at) == 1:  # one row left: each next token has count / support 1
                q = at[0] + 1
                for _ in range(j, limit):
                    token = tok[q] if q < size else SEP
                    if token == SEP or prob < min_prob:
                        break
                    tokens.append(token)
                    score += prob
                    q += 1
                break
            nxt = [tok[p + 1] for p in at] if j == 0 else [tok[p + 1] if p + 1 < size else SEP for p in at]
            counts = Counter(nxt)  # ends lie before the log's last position: the first tokens are in it
            counts.pop(SEP, None)
            if not counts:
                break
            token, count = max(counts.items(), key=_count)
            prob *= count / len(at)
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            kept = [p for p, t in zip(at, nxt) if t == token]
            firsts, at = kept if j == 0 else firsts, [p + 1 for p in kept]
        return tokens, score, firsts if tokens else []

    def following(self, ends: list[int], k: int) -> list[list[int]]:
        """The k tokens after each end position (SEP past the log)."""
        tok, size, rows = self._tokv, self.size, []
        for e in ends:
            if e + 1 + k <= size:
                rows.append(tok[e + 1:e + 1 + k].tolist())
            else:
                row = tok[e + 1:size].tolist()
                rows.append(row + [SEP] * (k - len(row)))
        return rows

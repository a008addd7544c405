"""The suffix index's drafts, pinned: a brute-force reference of what TokenLog, speculate, SuffixHistory and
SuffixDrafter draft (written from their definitions, without hash chains), compared draft for draft (tokens, score,
match, ends, docs, rows, limit, trees) on random and repetitive token streams, with documents, SEP boundaries,
evictions and compactions, `before` marks and keys. The index is optimised for speed; this keeps what it drafts.

The reference's only shared idea with the index is the hash that chooses a bucket: a lookup reads the WALK most
recent entries of the bucket of the n-gram ending the context, and an entry of another n-gram in that bucket (a
collision), or of a removed document (its tokens were overwritten with SEP but stay linked until the chains are
rebuilt), takes one of those WALK places. So the reference keeps, per position and n, the bucket it was linked into,
and rebuilds them when TokenLog does (its head table widens, or it is compacted).
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections import Counter, OrderedDict

import heapq
import pytest

from drafting import Driver
from specdecode import SuffixDrafter, SuffixHistory
from specdecode.drafters.base import match_class
from specdecode.drafters.suffix_drafts import Draft, speculate
from specdecode.drafters.suffix_index import TokenLog

SEP = -1
NGRAMS = (1, 2, 4, 8)
MAX_MATCH = 32
WALK = 64
BASE, MIX, MASK = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, (1 << 64) - 1


def bucket_of(gram: list[int], bits: int) -> int:
    h = 0
    for t in gram:
        h = (h * BASE + t) & MASK
    return ((h * MIX) & MASK) >> (64 - bits)


# ---------------------------------------------------------------------------------------------- the reference
class RefLog:
    """A TokenLog as plain lists: tokens (SEP once removed) and, per n, the bucket each position is linked into."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.bits = max(8, (capacity - 1).bit_length())
        self.tok: list[int] = []
        self.linked = {n: [] for n in NGRAMS}
        self.starts, self.ids, self.spans, self.dead = [], [], {}, 0

    def _bucket(self, p: int, n: int):
        gram = self.tok[p - n + 1:p + 1] if p >= n - 1 else []
        return bucket_of(gram, self.bits) if len(gram) == n and SEP not in gram else None

    def _relink(self) -> None:
        self.linked = {n: [self._bucket(p, n) for p in range(len(self.tok))] for n in NGRAMS}

    def extend(self, tokens) -> None:
        tokens = list(tokens)
        if not tokens:
            return
        size = len(self.tok) + len(tokens)
        if size > self.capacity:
            self.capacity = max(2 * self.capacity, size)
            if self.capacity > 1 << self.bits:  # a wider head table: every chain is rebuilt from the live tokens
                self.bits = (self.capacity - 1).bit_length()
                self._relink()
        for t in tokens:
            self.tok.append(t)
            for n in NGRAMS:
                self.linked[n].append(self._bucket(len(self.tok) - 1, n))

    def add(self, tokens, doc_id) -> None:
        tokens = list(tokens)
        self.starts.append(len(self.tok))
        self.ids.append(doc_id)
        self.spans[doc_id] = (len(self.tok), len(tokens))
        self.extend(tokens + [SEP])

    def remove(self, doc_id) -> None:
        start, n = self.spans.pop(doc_id)
        self.tok[start:start + n] = [SEP] * n  # still linked: it takes its place in a walk, and never matches
        self.dead += n + 1
        if self.dead > max(len(self.tok) - self.dead, 4096):
            live = [(d, self.tok[s:s + n]) for d, (s, n) in self.spans.items()]
            self.__init__(max(256, sum(len(t) + 1 for _, t in live)))
            for d, tokens in live:
                self.starts.append(len(self.tok))
                self.ids.append(d)
                self.spans[d] = (len(self.tok), len(tokens))
                self.tok += tokens + [SEP]
            self._relink()

    def tail(self, n: int) -> list[int]:
        return self.tok[max(0, len(self.tok) - n):]

    def start_of(self, doc_id) -> int:
        if doc_id is None:
            return len(self.tok)
        i = bisect_left(self.ids, doc_id)
        return self.starts[i] if i < len(self.ids) else len(self.tok)

    def doc_at(self, position: int):
        i = bisect_right(self.starts, position) - 1
        return self.ids[i] if i >= 0 else None

    def length_at(self, end: int, tail: list[int]) -> int:
        m = 0
        while m < len(tail) and end - m >= 0 and self.tok[end - m] == tail[-1 - m]:
            m += 1
        return m

    def match(self, tail: list[int], before=None) -> list[tuple[int, int]]:
        """(end, length) of the WALK most recent bucket entries of the longest n-gram ending tail that has a true
        occurrence among them, newest first; entries end before the context's own last position and `before`."""
        last = min(len(self.tok) - 1, self.start_of(before))
        for n in reversed(NGRAMS):
            if n > len(tail):
                continue
            b = bucket_of(tail[-n:], self.bits)
            walked = [p for p in range(last - 1, -1, -1) if self.linked[n][p] == b][:WALK]
            kept = [(e, self.length_at(e, tail)) for e in walked if self.length_at(e, tail) >= n]
            if kept:
                return kept
        return []

    def following(self, end: int, k: int) -> list[int]:
        return [self.tok[q] if q < len(self.tok) else SEP for q in range(end + 1, end + 1 + k)]


def ref_path(rows, limit, min_prob):
    tokens, prob, score = [], 1.0, 0.0
    for j in range(limit):
        counts = Counter(r[j] for r in rows if r[j] != SEP)
        if not counts:
            break
        token = max(counts, key=lambda t: counts[t])  # ties: the first seen, rows being newest first
        prob *= counts[token] / len(rows)
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        rows = [r for r in rows if r[j] == token]
    return tokens, score


def ref_speculate(log: RefLog, tail, max_tokens, min_prob, factor=1.0, offset=0.0, before=None) -> Draft:
    if max_tokens <= 0 or not tail:
        return Draft()
    found = log.match(list(tail), before)
    best = Draft()
    for m in sorted({length for _, length in found}, reverse=True):
        # a match as deep as the index reaches may be longer than it can see: it drafts all max_tokens
        limit = max_tokens if m >= MAX_MATCH else min(max_tokens, int(m * factor + offset + 1e-6))
        if limit <= best.score:
            break
        rows = [(e, log.following(e, max_tokens)) for e, length in found if length >= m]
        tokens, score = ref_path([r for _, r in rows], limit, min_prob)
        if score > best.score:
            best = Draft(tokens, score, m, [e for e, r in rows if r[0] == tokens[0]], rows=[r for _, r in rows],
                         limit=limit)
    return best


def ref_tree(draft: Draft, budget, min_prob, width, max_leaves=None):
    tokens, parents, heap, expansions = [], [], [], {}
    order, score = [0], 0.0

    def expand(node, rows, depth, prob):
        if depth >= draft.limit:
            return
        counts = Counter(r[depth] for r in rows if r[depth] != SEP)
        for token, count in counts.most_common(width):
            child = prob * count / len(rows)
            if child >= min_prob:
                heapq.heappush(heap, (-child, order[0], node, token, depth))
                order[0] += 1
        expansions[node] = rows

    expand(-1, draft.rows, 0, 1.0)
    leaves, taken = 0, set()
    while heap and len(tokens) < budget:
        neg, _, parent, token, depth = heapq.heappop(heap)
        grows = parent < 0 or parent in taken
        if grows and max_leaves is not None and leaves >= max_leaves:
            continue
        leaves += grows
        taken.add(parent)
        tokens.append(token)
        parents.append(parent)
        score -= neg
        expand(len(tokens) - 1, [r for r in expansions[parent] if r[depth] == token], depth + 1, -neg)
    return tokens, parents, score


class RefHistory:
    def __init__(self, max_tokens):
        self.max_tokens, self.tokens, self.logs, self.docs, self.next_id = max_tokens, 0, {}, OrderedDict(), 0

    def add(self, tokens, key=None):
        tokens = list(tokens)[-self.max_tokens:] if self.max_tokens else []
        if not tokens:
            return None
        doc_id, self.next_id = self.next_id, self.next_id + 1
        self.logs.setdefault(key, RefLog()).add(tokens, doc_id)
        self.docs[doc_id] = (key, len(tokens))
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            old, (k, n) = self.docs.popitem(last=False)
            self.logs[k].remove(old)
            self.tokens -= n
            if not self.logs[k].spans:
                del self.logs[k]
        return doc_id

    def speculate(self, tail, key, max_tokens, min_prob, factor=1.0, offset=0.0, before=None) -> Draft:
        log = self.logs.get(key)
        if log is None:
            return Draft()
        draft = ref_speculate(log, tail, max_tokens, min_prob, factor, offset, before)
        draft.docs = {log.doc_at(e) for e in draft.ends}
        return draft

    def used(self, draft: Draft) -> None:
        for doc_id in draft.docs:
            if doc_id in self.docs:
                self.docs.move_to_end(doc_id)


class RefCursor:
    """A row's copy cursor (drafters/suffix_cursor.py) from its definition: the prompt position the copy reached;
    the longest match of the tail ending before a start among the WINDOW prompt positions from it (the nearest of
    equals, of the first CANDIDATES whose previous token is the tail's last) drafts where it is as long as own's; it
    moves along the copy offered (1 token kept of its own, CONFIRM of the search's), or along itself."""

    WINDOW, CANDIDATES, CONFIRM, FACTOR, OFFSET = 256, 64, 2, 2.0, 8.0

    def __init__(self, prompt: int):
        self.prompt, self.at, self.offered = prompt, None, None

    def draft(self, log: RefLog, tail, k, own: Draft, factor, offset) -> Draft:
        self.offered = (own.ends[0] + 1, False) if own.tokens and own.ends else None
        if self.at is None or k <= 0 or not tail:
            return own
        tok = log.tok
        starts = [q for q in range(max(self.at, 1), min(self.at + self.WINDOW, self.prompt, len(tok) - 1))
                  if tok[q - 1] == tail[-1]][:self.CANDIDATES]
        best, best_m = 0, 0
        for q in starts:
            m = 0
            while m < min(len(tail), q, MAX_MATCH) and tok[q - 1 - m] == tail[-1 - m]:
                m += 1
            if m > best_m:
                best, best_m = q, m
        if not best_m or best_m < own.match:
            return own
        def rule(factor, offset):
            return k if best_m >= MAX_MATCH else min(k, int(best_m * factor + offset + 1e-6))
        limit = rule(max(factor, self.FACTOR), max(offset, self.OFFSET))
        tokens = tok[best:best + limit]
        tokens = tokens[:tokens.index(SEP)] if SEP in tokens else tokens
        if not tokens:
            return own
        self.offered = (best, True)
        return Draft(tokens, float(min(len(tokens), rule(factor, offset))), best_m, [best - 1], limit=len(tokens))

    def observe(self, log: RefLog, emitted) -> None:
        offered, self.offered = self.offered, None
        start, own = offered if offered is not None else (self.at, True)
        if start is None or start >= self.prompt:
            return
        n = 0
        while n < len(emitted) and start + n < len(log.tok) and log.tok[start + n] == emitted[n]:
            n += 1
        if n >= (1 if own else self.CONFIRM):
            self.at = start + n


class RefDrafter:
    """SuffixDrafter's choice per row: its own context's draft (its cursor's, with chains) or its key's history's
    (a tie: its own)."""

    def __init__(self, history: RefHistory, min_prob=0.1, factor=1.0, offset=0.0, max_match=MAX_MATCH, width=1):
        self.history, self.min_prob, self.factor, self.offset = history, min_prob, factor, offset
        self.max_match, self.width, self.trees, self.max_leaves = max_match, width, False, None
        self.rows, self.keys, self.marks, self.cursors = [], [], [], []

    def prefill(self, prompts, keys) -> None:
        for prompt in prompts:
            log = RefLog(max(256, 2 * len(prompt)))
            log.extend(prompt)
            self.rows.append(log)
            self.cursors.append(RefCursor(len(prompt)))
        self.keys += keys
        self.marks += [self.history.next_id] * len(prompts)

    def leave(self, kept: list[int]) -> None:
        for i in range(len(self.rows)):
            if i not in kept:
                self.history.add(self.rows[i].tok, self.keys[i])
        self.rows = [self.rows[i] for i in kept]
        self.keys = [self.keys[i] for i in kept]
        self.marks = [self.marks[i] for i in kept]
        self.cursors = [self.cursors[i] for i in kept]

    def observe(self, b: int, emitted) -> None:
        self.cursors[b].observe(self.rows[b], emitted)
        self.rows[b].extend(emitted)

    def with_tree(self, draft: Draft, k: int) -> Draft:
        if self.trees:
            draft.tree = ref_tree(draft, k, self.min_prob, self.width, self.max_leaves)
        return draft

    def draft(self, b: int, k: int) -> Draft:
        log, cursor = self.rows[b], self.cursors[b]
        tail = log.tail(self.max_match)
        own = ref_speculate(log, tail, k, self.min_prob, self.factor, self.offset)
        if self.trees:
            cursor.offered = None
        else:
            own = cursor.draft(log, tail, k, own, self.factor, self.offset)
        if not self.history.max_tokens:
            return self.with_tree(own, k)
        shared = self.history.speculate(tail, self.keys[b], k, self.min_prob, self.factor, self.offset,
                                        self.marks[b])
        own, shared = self.with_tree(own, k), self.with_tree(shared, k)
        if (shared.tree[2] <= own.tree[2]) if self.trees else (shared.score <= own.score):
            return own
        cursor.offered = None
        self.history.used(shared)
        return shared


# ---------------------------------------------------------------------------------------------- token streams
def stream(rng: random.Random, n: int, vocab: int, earlier: list[list[int]], copy: float = 0.5) -> list[int]:
    """Random tokens with copied spans of earlier streams and of itself (repetition at every match length)."""
    out: list[int] = []
    while len(out) < n:
        sources = [s for s in earlier + [out] if len(s) > 4]
        if sources and rng.random() < copy:
            src = rng.choice(sources)
            s = rng.randrange(len(src) - 2)
            out += src[s:s + rng.randint(2, 40)]
        else:
            out += [min(int(rng.paretovariate(1.1)) - 1, vocab - 1) if rng.random() < 0.7 else rng.randrange(vocab)
                    for _ in range(rng.randint(1, 12))]
    return out[:n]


def tails_of(rng: random.Random, tokens: list[int], vocab: int, count: int) -> list[list[int]]:
    """Context tails: the log's own end, spans of it (seen text), spans with a novel last token, random ones."""
    tails = [tokens[-MAX_MATCH:]] if tokens else []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.6 and len(tokens) > 2:
            e = rng.randrange(1, len(tokens))
            tails.append(tokens[max(0, e - rng.randint(1, MAX_MATCH)):e])
        elif kind < 0.8 and len(tokens) > 2:
            e = rng.randrange(1, len(tokens))
            tails.append(tokens[max(0, e - rng.randint(1, MAX_MATCH)):e] + [rng.randrange(vocab)])
        else:
            tails.append([rng.randrange(vocab) for _ in range(rng.randint(1, MAX_MATCH))])
    return tails


SETTINGS = [(8, 0.1, 1.0, 0.0), (3, 0.1, 1.0, 0.0), (16, 0.05, 2.0, 1.0), (8, 0.4, 0.5, 0.0), (1, 0.1, 1.0, 0.0),
            (8, 1.0, 1.0, 0.0), (5, 0.2, 1.5, 2.0)]


def assert_same(got: Draft, want: Draft, what) -> None:
    assert (got.tokens, got.score, got.match, got.ends, got.docs, got.rows, got.limit, got.tree) == \
        (want.tokens, want.score, want.match, want.ends, want.docs, want.rows, want.limit, want.tree), what


# ---------------------------------------------------------------------------------------------- the comparisons
@pytest.mark.parametrize("seed, vocab", [(0, 3), (1, 12), (2, 60), (3, 1000), (4, 50_000)])
def test_a_growing_logs_matches_and_drafts_are_the_references(seed, vocab):
    """A row's log grows by decode steps (1-9 tokens) and long appends; small vocabularies give chains longer
    than WALK and deep matches, large ones collisions in the 256-slot head table of a small log."""
    rng = random.Random(seed)
    log, ref = TokenLog(), RefLog()
    tokens = stream(rng, 3000, vocab, [])
    at, walk_cut = 0, 0
    while at < len(tokens):
        n = rng.choice([1, 1, 1, 2, 5, 9, 17, 40, 300])
        log.extend(tokens[at:at + n])
        ref.extend(tokens[at:at + n])
        at += n
        assert log._bits == ref.bits
        for tail in tails_of(rng, tokens[:at], vocab, 4):
            ends, lengths = log.match(tail)
            assert list(zip(ends.tolist(), lengths.tolist())) == ref.match(tail), tail
            walk_cut += len(ends) > 0 and len(ends) == WALK
            k, min_prob, factor, offset = rng.choice(SETTINGS)
            want = ref_speculate(ref, tail, k, min_prob, factor, offset)
            assert_same(speculate(log, tail, k, min_prob, factor, offset), want, tail)
            # beat: the draft when it scores above beat, else none (how a row's own draft prunes the history's)
            for beat in (rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 7.5]), want.score):
                assert_same(speculate(log, tail, k, min_prob, factor, offset, beat=beat),
                            want if want.score > beat else Draft(), (tail, beat))
    if vocab <= 12:
        assert walk_cut > 0  # the WALK most recent rule was exercised


@pytest.mark.parametrize("seed, vocab, budget", [(5, 6, 3000), (6, 40, 5000), (7, 2000, 2500), (8, 50_000, 4000)])
def test_a_historys_drafts_are_the_references_through_evictions_and_compactions(seed, vocab, budget):
    """Documents under three keys through a budget a few times over (evictions leave SEP-filled documents linked;
    then the log is compacted), with drafts that touch documents (LRU) and `before` marks."""
    rng = random.Random(seed)
    history, ref = SuffixHistory(budget), RefHistory(budget)
    docs: list[list[int]] = []
    compactions, dead_walked = 0, 0
    for step in range(80):
        doc = stream(rng, rng.choice([1, 5, 60, 400, 1200]), vocab, docs[-8:], copy=0.6)
        key = rng.choice(["a", "a", "a", "b", None])
        docs.append(doc)
        dead = {k: log.dead for k, log in ref.logs.items()}
        assert history.add(doc, key) == ref.add(doc, key)
        assert history.tokens == ref.tokens and list(history._docs) == list(ref.docs)
        compactions += any(log.dead < dead.get(k, 0) for k, log in ref.logs.items())
        for tail in tails_of(rng, rng.choice(docs[-6:]), vocab, 5):
            key = rng.choice(["a", "b", None])
            before = rng.choice([None, history.next_id, rng.randrange(history.next_id + 1)])
            k, min_prob, factor, offset = rng.choice(SETTINGS)
            got = history.speculate(tail, key, k, min_prob, factor, offset, before)
            assert_same(got, ref.speculate(tail, key, k, min_prob, factor, offset, before), (tail, key, before))
            dead_walked += key in ref.logs and ref.logs[key].dead > 0 and got.match > 0
            if got.tokens and rng.random() < 0.5:
                history.used(got)
                ref.used(got)
    assert dead_walked > 0 and compactions > 0


def test_tokens_that_end_a_log_or_meet_sep_are_drafted_as_the_reference_drafts():
    """Continuations cut by the end of the log and by document ends, matches that stop at SEP and at position 0."""
    ref, log = RefLog(), TokenLog()
    for doc_id, doc in enumerate([[1, 2, 3], [1, 2], [2, 3, 1, 2, 3, 4], [3]]):
        log.add(doc, doc_id)
        ref.add(doc, doc_id)
    log.extend([1, 2, 3])
    ref.extend([1, 2, 3])
    for tail in ([1, 2, 3], [2, 3], [3], [1, 2], [9, 1, 2], [2, 3, 1, 2, 3]):
        for before in (None, 0, 1, 2, 3, 4):
            for k in (1, 2, 4, 8):
                for min_prob in (0.05, 0.34, 0.5, 0.67, 1.0):
                    assert_same(speculate(log, tail, k, min_prob, before=before),
                                ref_speculate(ref, tail, k, min_prob, before=before), (tail, before, k, min_prob))


@pytest.mark.parametrize("seed, width, vocab, settings", [
    (10, 1, 8, {}), (11, 3, 8, {}), (12, 1, 300, {}), (13, 2, 40, {}),
    (14, 1, 8, dict(min_prob=0.05, factor=2.0, offset=1.0)), (15, 2, 20, dict(min_prob=0.3, factor=0.5, offset=2.0))])
def test_a_drafters_drafts_step_by_step_are_the_references(seed, width, vocab, settings):
    """Rows join (with keys and marks), decode (emitting 1-4 tokens a step, text copied from the history or
    novel), leave into the history, at their own K, with chains and with token trees: every row's draft each step,
    and what the outlook (drafts, expected, classes) and propose return from it."""
    rng = random.Random(seed)
    budget = rng.choice([800, 3000])
    history, ref_history = SuffixHistory(budget), RefHistory(budget)
    drafter = SuffixDrafter(history, tree_width=width, min_prob=settings.get("min_prob", 0.1),
                            max_spec_factor=settings.get("factor", 1.0), max_spec_offset=settings.get("offset", 0.0))
    ref = RefDrafter(ref_history, width=width, **settings)
    texts = [stream(rng, 300, vocab, [], copy=0.3) for _ in range(4)]
    shared = 0
    rows = Driver(drafter)
    for step in range(160):
        if not ref.rows or (len(ref.rows) < 3 and rng.random() < 0.1):
            prompts = [rng.choice(texts)[:rng.randint(1, 200)] for _ in range(rng.randint(1, 2))]
            keys = [rng.choice(["x", "y"]) for _ in prompts]
            drafter.queue_keys(keys)
            rows.join(prompts)  # rows of different lengths, no padding
            ref.prefill(prompts, keys)
        trees = width > 1 and rng.random() < 0.7
        ref.trees = trees
        leaves = rng.choice([None, 2])
        ref.max_leaves = leaves
        ks = [rng.choice([1, 3, 8]) for _ in ref.rows]
        widest = max(ks)
        outlook = rows.outlook(widest, ks=ks, trees=trees, leaves=leaves)
        got = outlook.drafts
        want = [ref.draft(b, k) for b, k in enumerate(ks)]
        for b, (d, w) in enumerate(zip(outlook.plan[1], want)):
            assert_same(d, w, (step, b))
        shared += sum(bool(w.docs) for w in want)
        assert got == [len((w.tree[0] if trees else w.tokens)[:widest]) for w in want]
        assert outlook.expected == [w.score for w in want]
        assert outlook.classes == [match_class(w.match) if w.tokens else None for w in want]
        proposal = rows.propose(widest, got)
        for b, w in enumerate(want):
            drafted = (w.tree[0] if trees else w.tokens)[:widest]
            assert proposal.tokens[b, :len(drafted)].tolist() == drafted
        emitted = []
        for b in range(len(ref.rows)):
            source = rng.choice(texts)
            s = rng.randrange(len(source) - 4)
            emitted.append(source[s:s + rng.randint(1, 4)] if rng.random() < 0.6 else
                           [rng.randrange(vocab) for _ in range(rng.randint(1, 4))])
            ref.observe(b, emitted[-1])
        rows.observe(emitted)
        if rng.random() < 0.08:
            kept = [b for b in range(len(ref.rows)) if rng.random() < 0.5]
            rows.keep(kept)
            ref.leave(kept)
            texts.append(rng.choice(texts)[:50] + stream(rng, 100, vocab, texts, copy=0.5))
        assert list(history._docs) == list(ref_history.docs)
    assert shared > 0  # drafts from the history won too (and moved their documents in the LRU order)


def test_a_walk_cut_by_collisions_does_not_shorten_the_matches_found_below_it():
    """WALK entries of other 8-grams in the bucket of the context's 8-gram (all newer than its one true occurrence):
    the 8-gram's walk ends without an answer, but not at its chain's end, so the 4-gram's walk still finds that
    occurrence and measures all 8 of its tokens."""
    pattern = [1, 2, 3, 4, 5, 6, 7, 8]
    log, ref = TokenLog(), RefLog()  # 256 slots: 8-bit buckets while the log stays that short
    target = bucket_of(pattern, 8)
    tokens = pattern + [50, 51, SEP] + [1000 + i for i in range(7)]
    while sum(bucket_of(tokens[p - 7:p + 1], 8) == target for p in range(18, len(tokens))) < WALK + 2:
        t = 1000
        while bucket_of(tokens[-7:] + [t], 8) != target:
            t += 1
        tokens.append(t)
    assert len(tokens) < 256
    log.extend(tokens)
    ref.extend(tokens)
    assert log._bits == 8
    ends, lengths = log.match(pattern)
    assert ends.tolist() == [7] and lengths.tolist() == [8]
    assert list(zip(ends.tolist(), lengths.tolist())) == ref.match(pattern)
    assert_same(speculate(log, pattern, 8, 0.1), ref_speculate(ref, pattern, 8, 0.1), pattern)
    assert speculate(log, pattern, 8, 0.1).tokens == [50, 51] and speculate(log, pattern, 8, 0.1).match == 8

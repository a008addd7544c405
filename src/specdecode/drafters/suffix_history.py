"""The shared history of requests behind SuffixDrafter: previous prompts and outputs, one TokenLog
(suffix_index.py) per key, least recently used documents evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .suffix_drafts import Draft, speculate
from .suffix_index import TokenLog


class SuffixHistory:
    """Previous prompts and outputs, one TokenLog per key, LRU by tokens: at most max_tokens in all (a document
    longer than that keeps its last max_tokens). Rows of one key draft only from that key's documents. Share one
    object between drafters (a server's) to share what they have seen; it is safe to use from several threads."""

    def __init__(self, max_tokens: int = 1_000_000):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0  # live tokens, all keys
        self._logs: dict = {}
        self._docs: OrderedDict = OrderedDict()  # document id -> (key, tokens), least recently used first
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def keys(self) -> list:
        return list(self._logs)

    @property
    def documents(self) -> int:
        return len(self._docs)

    @property
    def nbytes(self) -> int:
        return sum(log.nbytes for log in self._logs.values())

    def add(self, tokens, key=None) -> int | None:
        """Remember a finished prompt + output under key; the least recently used documents make room. The new
        document's id (None when nothing was added: no tokens, or no history)."""
        tokens = list(tokens)[-self.max_tokens:] if self.max_tokens else []
        if not tokens:
            return None
        with self._lock:
            doc_id, self._next_id = self._next_id, self._next_id + 1
            self._logs.setdefault(key, TokenLog()).add(tokens, doc_id)
            self._docs[doc_id] = (key, len(tokens))
            self.tokens += len(tokens)
            self._evict()
            return doc_id

    def touch(self, doc_id) -> bool:
        """Whether the document is still held; if so it becomes the most recently used (it was seen again)."""
        with self._lock:
            if doc_id not in self._docs:
                return False
            self._docs.move_to_end(doc_id)
            return True

    def _evict(self) -> None:
        while self.tokens > self.max_tokens:
            doc_id, (key, n) = self._docs.popitem(last=False)
            log = self._logs[key]
            log.remove(doc_id)
            self.tokens -= n
            if log.empty:
                del self._logs[key]

    @property
    def next_id(self) -> int:
        """The id the next document gets: a row that joins now drafts from the documents before it (before=)."""
        return self._next_id

    def speculate(self, tail: list[int], key, max_tokens: int, min_prob: float, factor: float = 1.0,
                  offset: float = 0.0, before: int | None = None, beat: float | None = None) -> Draft:
        """The best draft from key's documents (see `speculate`), with the documents it came from; only those of
        ids below `before` when given."""
        with self._lock:
            log = self._logs.get(key)
            if log is None:
                return Draft()
            draft = speculate(log, tail, max_tokens, min_prob, factor, offset, before, beat)
            draft.docs = log.docs_at(draft.ends)
            return draft

    def used(self, draft: Draft) -> None:
        """The documents a draft that was proposed came from become the most recently used."""
        with self._lock:
            for doc_id in draft.docs:
                if doc_id in self._docs:
                    self._docs.move_to_end(doc_id)

    def clear(self) -> None:
        with self._lock:
            self._logs.clear()
            self._docs.clear()
            self.tokens = 0

"""Suffix drafting: copy what followed the longest match of the context, in this request and in earlier ones.

SuffixDecoding (Oliaro et al. 2024) drafts without a model from suffix trees over the current request and over the
prompts and outputs of previous requests; among the continuations of the longest match it follows the most
frequent, token by token, and stops where the estimated acceptance (the product of count / support along the path)
falls below a threshold. It pays on workloads that repeat: the previous turn's answer, the same file edited again,
the same tool output, boilerplate shared across users. `suffix_index.py` has the index and the search.

Each row has its own index (prompt + emitted tokens); a `SuffixHistory` holds finished rows' prompts and outputs,
per key, least recently used first out, at most max_tokens. A row joins the history when it leaves the batch
(select_rows: the session drops finished rows), so the next request of the same text drafts its whole answer. A row
drafts only from the documents that were there when it joined, never from the rows of its own batch that finished
before it: what it drafts does not depend on them.
The draft of the row's own context and the history's compete: the higher score (expected accepted tokens) wins,
scored at the row's own K (own_k), never the batch's widest, so a row drafts what it would draft alone.

Keys: a row drafts only from its own key's history and adds to it. `key` is the key of rows that join next;
`queue_keys` gives the joining rows one each, in the order they are added (the order a session admits them);
`keys` reads or sets the running rows'. Drafts are deterministic (q=None), like prompt lookup's, so the output
keeps exactly the target's distribution whatever the history holds.

Token trees (tree_width > 1, where the session can verify them: token_tree.py): instead of the one most frequent
path, the best `num_drafts` nodes of a tree grown best first over the match's continuations, up to tree_width
children per node. The forward is as wide as the chain's would be; where the chain's next token is uncertain, a
second guess replaces the chain's least likely deep tokens.
"""

from __future__ import annotations

from collections import deque

import torch

from .base import Drafter, Proposal, match_class
from ..exact.token_tree import padded
from .suffix_drafts import Draft, speculate, speculate_tree
from .suffix_history import SuffixHistory
from .suffix_index import MAX_MATCH, TokenLog

__all__ = ["SuffixDrafter", "SuffixHistory"]


class SuffixDrafter(Drafter):
    """Drafts from a suffix index of each row's context and a shared history of earlier requests.

    history: a SuffixHistory to share (a server's); a new one of history_tokens tokens otherwise (0: no history).
    key: the history key of rows that join (None: the unkeyed history). min_prob: the estimated acceptance below
    which a draft stops. max_spec_factor / max_spec_offset: a match of m tokens drafts at most m * factor + offset.
    """

    def __init__(self, history: SuffixHistory | None = None, key: str | None = None, min_prob: float = 0.1,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, max_match: int = MAX_MATCH,
                 history_tokens: int = 1_000_000, tree_width: int = 1):
        if not 0.0 < min_prob <= 1.0:
            raise ValueError(f"min_prob must be in (0, 1], got {min_prob}")
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or not 1 <= tree_width <= 16:
            raise ValueError(f"tree_width must be an integer 1..16 (1: chains), got {tree_width!r}")
        if not 1 <= max_match <= MAX_MATCH:
            raise ValueError(f"max_match must be in 1..{MAX_MATCH}, got {max_match}")
        self.history = history if history is not None else SuffixHistory(history_tokens)
        self.key = key
        self.min_prob, self.max_match = min_prob, max_match
        self.factor, self.offset = max_spec_factor, max_spec_offset
        self.tree_width = tree_width
        self._trees = False  # whether the session can verify trees now (use_trees)
        self.max_leaves: int | None = None  # leaves a row's tree may have (limit_tree_leaves)
        self._rows: list[TokenLog] = []
        self._keys: list = []
        self._marks: list[int] = []  # per row, the history's next_id when it joined: it drafts from what came before
        self._pending: deque = deque()  # keys of rows not joined yet: shared with forks, where rows join
        self._drafts: tuple[int, list[Draft]] | None = None  # (k, drafts) that max_drafts found this step
        self._own_k: list[int] | None = None  # each row's own K this step (own_k), None: the k asked

    # ------------------------------------------------------------------ keys
    @property
    def keys(self) -> list:
        """The history key of each running row."""
        return list(self._keys)

    @keys.setter
    def keys(self, keys) -> None:
        keys = list(keys)
        if len(keys) != len(self._rows):
            raise ValueError(f"need one key per row ({len(self._rows)}), got {len(keys)}")
        self._keys = keys
        self._drafts = self._own_k = None

    def queue_keys(self, keys) -> None:
        """Keys for the next rows to join, in the order they join; rows past these take `key`."""
        self._pending.extend(keys)

    def _next_key(self):
        return self._pending.popleft() if self._pending else self.key

    @property
    def next_key(self):
        """The key the next row to join takes (queue_keys' first, else key): documents meant for that row go
        there."""
        return self._pending[0] if self._pending else self.key

    # ------------------------------------------------------------------ rows
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, hidden=None) -> None:
        rows = input_ids.tolist()
        masks = valid.tolist() if valid is not None else [[True] * len(r) for r in rows]
        self._leave(range(len(self._rows)))
        self._rows = [self._new_row([t for t, v in zip(r, m) if v]) for r, m in zip(rows, masks)]
        self._keys = [self._next_key() for _ in rows]
        self._marks = [self.history.next_id] * len(rows)
        self._drafts = self._own_k = None

    @staticmethod
    def _new_row(tokens: list[int]) -> TokenLog:
        log = TokenLog(max(256, 2 * len(tokens)))
        log.extend(tokens)
        return log

    def fork(self, batch_size: int) -> "SuffixDrafter":
        other = SuffixDrafter(self.history, self.key, self.min_prob, self.factor, self.offset, self.max_match,
                              tree_width=self.tree_width)
        other._pending, other.max_leaves = self._pending, self.max_leaves
        return other

    def merge(self, other: "SuffixDrafter") -> None:
        self._rows += other._rows
        self._keys += other._keys
        self._marks += other._marks
        other._rows, other._keys, other._marks = [], [], []
        self._drafts = self._own_k = None

    def select_rows(self, rows: list[int]) -> None:
        """Keep these rows; the others are done (finished or cancelled): their text joins the history."""
        kept = set(rows)
        self._leave(i for i in range(len(self._rows)) if i not in kept)
        self._rows = [self._rows[r] for r in rows]
        self._keys = [self._keys[r] for r in rows]
        self._marks = [self._marks[r] for r in rows]
        self._drafts = self._own_k = None

    def _leave(self, indices) -> None:
        for i in indices:
            self.history.add(self._rows[i].tokens(), self._keys[i])

    def update(self, emitted: list[list[int]], kept: list[int], hidden=None) -> None:
        for log, tokens in zip(self._rows, emitted):
            log.extend(tokens)
        self._drafts = self._own_k = None

    # ------------------------------------------------------------------ drafting
    def _draft(self, b: int, k: int) -> Draft:
        """Row b's best draft: its own context's or its key's history's, whichever expects more accepted tokens
        (a tie goes to the row's own text, the more recent). With trees, the one whose tree expects more."""
        log = self._rows[b]
        tail = log.tail(self.max_match)
        own = speculate(log, tail, k, self.min_prob, self.factor, self.offset)
        if not self.history.max_tokens:
            return self._with_tree(own, k)
        # With chains only a draft scoring above own's is used: the history's search stops where none can.
        shared = self.history.speculate(tail, self._keys[b], k, self.min_prob, self.factor, self.offset,
                                        self._marks[b], None if self._trees else own.score)
        if self._trees:
            own, shared = self._with_tree(own, k), self._with_tree(shared, k)
        if (shared.tree[2] <= own.tree[2]) if self._trees else (shared.score <= own.score):
            return own
        self.history.used(shared)  # keeps documents that keep proposing in the history (LRU)
        return shared

    def _with_tree(self, draft: Draft, k: int) -> Draft:
        if self._trees:
            draft.tree = speculate_tree(draft, k, self.min_prob, self.tree_width, self.max_leaves)
        return draft

    def own_k(self, ks: list[int]) -> None:
        """Draft each row at its own K this step: a draft's score, which picks the row's context or the history,
        depends on K, and at the batch's widest a row could copy what it would not copy alone."""
        if len(ks) != len(self._rows):
            raise ValueError(f"need one K per row ({len(self._rows)}), got {len(ks)}")
        self._own_k, self._drafts = list(ks), None

    def _drafts_for(self, k: int) -> list[Draft]:
        if self._own_k is not None:  # rows at their own K (the step's k only pads them)
            if self._drafts is None:
                self._drafts = (k, [self._draft(b, n) for b, n in enumerate(self._own_k)])
        elif self._drafts is None or self._drafts[0] < k:
            self._drafts = (k, [self._draft(b, k) for b in range(len(self._rows))])
        return self._drafts[1]

    def limit_tree_leaves(self, leaves: int | None) -> None:
        if leaves != self.max_leaves:
            self.max_leaves, self._drafts = leaves, None

    def use_trees(self, allowed: bool) -> None:
        trees = allowed and self.tree_width > 1
        if trees != self._trees:
            self._trees, self._drafts = trees, None

    def max_drafts(self, k: int) -> list[int]:
        """How many drafts each row can really propose (0 where nothing matches): a bound for the loop's K. With
        trees, the nodes of its tree."""
        if self._trees:
            return [len(d.tree[0][:k]) for d in self._drafts_for(k)]
        return [len(d.tokens[:k]) for d in self._drafts_for(k)]

    def draft_classes(self) -> list[int | None]:
        """Per row, the class of the draft max_drafts found (its match length's), None where it found none."""
        if self._drafts is None:
            return [None] * len(self._rows)
        return [match_class(d.match) if d.tokens else None for d in self._drafts[1]]

    def scores(self, k: int) -> list[float]:
        """Per row, the index's confidence in the draft it found this step (at most k tokens, or the more asked
        first): the expected number of its tokens kept."""
        return [d.score for d in self._drafts_for(k)]

    def propose(self, k: int, context, uniforms, num_drafts):
        if self._trees:  # the first n nodes of a best-first tree are the best tree of n nodes
            trees = [d.tree for d in self._drafts_for(k)]
            rows = [(t[:n] + log.tail(1) * (k - len(t[:n])), padded(p[:n], k))
                    for (t, p, _), n, log in zip(trees, num_drafts, self._rows)]
            return Proposal(torch.tensor([r for r, _ in rows], dtype=torch.long).reshape(len(rows), k),
                            parents=[p for _, p in rows])
        drafts = self._drafts_for(k)
        # Past a row's draft (or with none) its positions are not verified (num_drafts stops there): pad.
        rows = [d.tokens[:k] + log.tail(1) * (k - len(d.tokens[:k])) for d, log in zip(drafts, self._rows)]
        return Proposal(torch.tensor(rows, dtype=torch.long).reshape(len(rows), k))

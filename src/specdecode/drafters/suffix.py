"""Suffix drafting: copy what followed the longest match of the context, in this request and in earlier ones.

SuffixDecoding (Oliaro et al. 2024) drafts without a model from suffix trees over the current request and over the
prompts and outputs of previous requests; among the continuations of the longest match it follows the most
frequent, token by token, and stops where the estimated acceptance (the product of count / support along the path)
falls below a threshold. It pays on workloads that repeat: the previous turn's answer, the same file edited again,
the same tool output, boilerplate shared across users. `suffix_index.py` has the index and the search.

Each row has its own index of its text (prompt + emitted tokens: the drafter's cache of it, keyed by the row's id,
built when the row joins and extended by what each step emitted); a `SuffixHistory` holds finished rows' prompts and
outputs, per key, least recently used first out, at most max_tokens. A row joins the history when it leaves the
batch (relayout: the session drops finished rows), so the next request of the same text drafts its whole answer. A
row drafts only from the documents that were there when it joined, never from the rows of its own batch that
finished before it: what it drafts does not depend on them.
The draft of the row's own context and the history's compete: the higher score (expected accepted tokens) wins,
scored at the row's own K (DraftRows.ks), never the batch's widest, so a row drafts what it would draft alone.

Keys: a row drafts only from its own key's history and adds to it. `key` is the key of rows that join next;
`queue_keys` gives the joining rows one each, in the order they join (the order a session admits them);
`keys` reads or sets the running rows'. Drafts are deterministic (q=None), like prompt lookup's, so the output
keeps exactly the target's distribution whatever the history holds.

Token trees (tree_width > 1, where the session can verify them: token_tree.py): instead of the one most frequent
path, the best `num_drafts` nodes of a tree grown best first over the match's continuations, up to tree_width
children per node. The forward is as wide as the chain's would be; where the chain's next token is uncertain, a
second guess replaces the chain's least likely deep tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..backends.rows import RowChange
from ..exact.token_tree import padded
from .base import (MATCH_CLASS_ACCEPTANCE, DraftChoice, DraftContext, Drafter, DraftOutcome, DraftOutlook, DraftRows,
                   Proposal, match_class)
from .suffix_cursor import CopyCursor
from .suffix_drafts import Draft, speculate, speculate_tree
from .suffix_history import SuffixHistory
from .suffix_index import MAX_MATCH, TokenLog

__all__ = ["SuffixDrafter", "SuffixHistory"]


@dataclass
class _Row:
    """What the drafter keeps of one running row."""

    log: TokenLog  # the suffix index of the row's text: its prompt, then what each step emitted
    key: object  # its history key: it drafts from that key's documents and joins them when it leaves
    mark: int  # the history's next_id when it joined: it drafts only from the documents before
    cursor: CopyCursor  # where its copy of its prompt stands (chains only)


class SuffixDrafter(Drafter):
    """Drafts from a suffix index of each row's context and a shared history of earlier requests (copies: no model
    forward, so its steps are free and the policy may verify them up to its max_copy_k).

    history: a SuffixHistory to share (a server's); a new one of history_tokens tokens otherwise (0: no history).
    key: the history key of rows that join (None: the unkeyed history). min_prob: the estimated acceptance below
    which a draft stops. max_spec_factor / max_spec_offset: a match of m tokens drafts at most m * factor + offset
    (a match of max_match tokens, the whole tail looked for, drafts as many as asked).
    """

    copies = True
    class_acceptance = MATCH_CLASS_ACCEPTANCE

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
        self._rows: dict[int, _Row] = {}  # per row id, in batch order
        self._pending: deque = deque()  # keys of rows not joined yet, in the order they join

    # ------------------------------------------------------------------ keys
    @property
    def keys(self) -> list:
        """The history key of each running row."""
        return [row.key for row in self._rows.values()]

    @keys.setter
    def keys(self, keys) -> None:
        keys = list(keys)
        if len(keys) != len(self._rows):
            raise ValueError(f"need one key per row ({len(self._rows)}), got {len(keys)}")
        for row, key in zip(self._rows.values(), keys):
            row.key = key

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
    def relayout(self, change: RowChange) -> None:
        """Joining rows get an index of their text, a key and a mark (all before any of them leaves); rows that
        leave (finished, cancelled, or after a failed step too: the text is the target's) join the history."""
        mark = self.history.next_id
        for text in change.appended:
            log = TokenLog(max(256, 2 * len(text.prompt)))
            log.extend(text.prompt)
            log.extend(text.output)
            self._rows[text.id] = _Row(log, self._next_key(), mark, CopyCursor(len(text.prompt)))
        ids = list(self._rows)
        for i in change.leaving(len(ids) - len(change.appended)):
            row = self._rows[ids[i]]
            self.history.add(row.log.tokens(), row.key)
        self._rows = {ids[i]: self._rows[ids[i]] for i in change.keep}

    def observe(self, outcome: DraftOutcome) -> None:
        rows = self._rows
        for text, tokens in zip(outcome.texts, outcome.emitted):
            row = rows[text.id]
            tokens = list(tokens)
            row.cursor.observe(row.log, tokens)
            row.log.extend(tokens)

    # ------------------------------------------------------------------ drafting
    def _draft(self, row: _Row, k: int, trees: bool, leaves: int | None) -> Draft:
        """A row's best draft: its own context's or its key's history's, whichever expects more accepted tokens
        (a tie goes to the row's own text, the more recent). With trees, the one whose tree expects more."""
        log = row.log
        tail = log.tail(self.max_match)
        own = speculate(log, tail, k, self.min_prob, self.factor, self.offset)
        if trees:
            row.cursor.offered = None  # trees branch where the cursor's single copy would not: it follows its own
        else:
            own = row.cursor.draft(log, tail, k, own, self.factor, self.offset)
        if not self.history.max_tokens:
            return self._with_tree(own, k, trees, leaves)
        # With chains only a draft scoring above own's is used: the history's search stops where none can.
        shared = self.history.speculate(tail, row.key, k, self.min_prob, self.factor, self.offset, row.mark,
                                        None if trees else own.score)
        if trees:
            own, shared = self._with_tree(own, k, trees, leaves), self._with_tree(shared, k, trees, leaves)
        if (shared.tree[2] <= own.tree[2]) if trees else (shared.score <= own.score):
            return own
        row.cursor.offered = None  # the history's draft: not a copy of the row's own text
        self.history.used(shared)  # keeps documents that keep proposing in the history (LRU)
        return shared

    def _with_tree(self, draft: Draft, k: int, trees: bool, leaves: int | None) -> Draft:
        if trees:
            draft.tree = speculate_tree(draft, k, self.min_prob, self.tree_width, leaves)
        return draft

    def outlook(self, rows: DraftRows) -> DraftOutlook:
        """Each row's draft at its own K (a draft's score, which picks the row's context or the history, depends on
        K: at the batch's widest a row could copy what it would not copy alone): how many drafts it has (0 where
        nothing matches; with trees, the nodes of its tree), its match length's class, and its score (the expected
        number of its tokens kept)."""
        trees = rows.trees and self.tree_width > 1
        drafts = [self._draft(self._rows[text.id], k, trees, rows.max_leaves) for text, k in zip(rows.texts, rows.ks)]
        widest = rows.widest
        return DraftOutlook([len((d.tree[0] if trees else d.tokens)[:widest]) for d in drafts],
                            [match_class(d.match) if d.tokens else None for d in drafts], [d.score for d in drafts],
                            free=True, plan=(trees, drafts))

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        trees, drafts = choice.outlook.plan
        k = choice.k
        if trees:  # the first n nodes of a best-first tree are the best tree of n nodes
            rows = [(t[:n] + text.tail(1) * (k - len(t[:n])), padded(p[:n], k))
                    for (t, p, _), n, text in zip((d.tree for d in drafts), choice.k_rows, context.texts)]
            return Proposal(torch.tensor([r for r, _ in rows], dtype=torch.long).reshape(len(rows), k),
                            parents=[p for _, p in rows], free=True)
        # Past a row's draft (or with none) its positions are not verified (k_rows stops there): pad.
        rows = [d.tokens[:k] + text.tail(1) * (k - len(d.tokens[:k])) for d, text in zip(drafts, context.texts)]
        return Proposal(torch.tensor(rows, dtype=torch.long).reshape(len(rows), k), free=True)

"""A smaller language model as the drafter (the classic setting of both papers)."""

from __future__ import annotations

import time

import torch

from ..backends.base import ModelBackend, caches_prefixes, cold_forwards, pad
from ..backends.prefix_cache import PrefixCache, common_prefix
from ..exact.sampling import greedy, sample_with_uniforms
from ..exact.token_tree import padded
from .base import DraftContext, Drafter, Proposal


class ModelDrafter(Drafter):
    """Drafts with its own KV cache, kept in step with the target's accepted tokens.

    Each row keeps a list of tokens that were emitted but are not in the draft's cache yet: the prompt until the
    first proposal, then normally the target's last token, and after a full acceptance also the last draft
    (sampled, never fed); after plain steps, every token since. The next proposal feeds them in its first forward.

    Catching up costs about a draft prefill per token missed, so a probe after a long plain run would cost in
    proportion to the run (~10 % of its time on a 2-core CPU). For such trials the loop calls limit_catch_up(): a
    row further behind than `catch_up_window` tokens restarts its cache from its last `catch_up_window` tokens.
    Only q changes (a shorter context), so the output stays exact; the draft's context grows again from there.

    tree_width W > 1 (where the session can verify trees): the chain is drafted W - 1 tokens shorter and the root
    gets the W - 1 next most likely tokens of the first draft distribution as siblings, the same K nodes in all.
    Every node is then a deterministic candidate (q is not used: token_tree.py's rule is exact for candidates
    chosen by any means independent of the verification's random numbers).
    """

    catch_up_window = 32

    def __init__(self, backend: ModelBackend, tree_width: int = 1):
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or not 1 <= tree_width <= 16:
            raise ValueError(f"tree_width must be an integer 1..16 (1: chains), got {tree_width!r}")
        self.tree_width = tree_width
        self.max_leaves = tree_width  # leaves a row's tree may have: the chain and its siblings (limit_tree_leaves)
        self._trees = False
        self._chain: list[list[int]] = []  # the chain of the last tree proposal, per row (what the cache saw)
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self.max_rows = getattr(backend, "max_rows", None)  # rows its cache can hold (None: no limit)
        self.forward_calls = 0
        self._pending: list[list[int]] = []
        self._fed: list[int] = []  # cache length per row once the last proposal fed its pending tokens (propose -> update)
        self._proposed = 0
        self.catch_up = 0  # tokens the last proposal had to feed for its longest row (normally 1 or 2) ...
        self.catch_up_s = 0.0  # ... and the seconds of a forward of their own, when every row was behind,
        self.catch_up_tokens = 0  # ... which fed this many tokens over all rows
        self.prefix_cache: PrefixCache | None = None
        self._history: list[list[int] | None] = []  # per row, the tokens its cache holds a prefix of (None: unknown)
        self._prompt_lengths: list[int] = []  # per row, the history's prefilled part: all a cached entry may lend

    def set_prefix_cache(self, max_tokens: int) -> None:
        self.prefix_cache = PrefixCache(max_tokens) if max_tokens and caches_prefixes(self.backend) else None

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, hidden=None) -> None:
        # Lazily: the prompts wait with the other pending tokens and are fed by the first proposal, so a batch
        # that the policy decodes plainly never pays for the draft's prefill.
        rows, masks = input_ids.tolist(), valid.tolist() if valid is not None else None
        self._pending = [[t for j, t in enumerate(r) if masks is None or masks[b][j]] for b, r in enumerate(rows)]
        self._history = [list(p) for p in self._pending]
        self._prompt_lengths = [len(p) for p in self._pending]
        self._fed = []
        self._proposed = 0
        lengths = self.backend.lengths
        if self.prefix_cache is not None and len(lengths) == len(self._pending) and not any(lengths):
            self._load_cached_prefixes()
        else:
            self.backend.reset(input_ids.shape[0])

    def _load_cached_prefixes(self) -> None:
        """Rows start from a cached prefix of their prompt. The first proposal feeds the rest of the prompt in a
        forward of its own (the catch-up), which then matches a cold one's last forward (reusable_prefix), as
        long as at least 2 tokens are left: so for a fixed K the draft's q is bit for bit a cold prefill's."""
        hits = []
        for prompt in self._pending:
            hit = self.prefix_cache.lookup(self.backend, prompt, [], None)
            if hit is not None and len(prompt) - hit[1] < 2:
                hit = None
            hits.append(hit)
            self.prefix_cache.record(len(prompt), hit[1] if hit else 0)
        if any(hits):
            self.backend.load_prefixes(hits)
            self._pending = [p[h[1]:] if h else p for p, h in zip(self._pending, hits)]

    def fork(self, batch_size: int) -> "ModelDrafter":
        if self.prefix_cache is not None:
            self.prefix_cache.make_room(self.backend, batch_size, [])
        other = ModelDrafter(self.backend.fork(batch_size), self.tree_width)
        other.prefix_cache = self.prefix_cache
        return other

    def merge(self, other: "ModelDrafter") -> None:
        self.backend.merge(other.backend)
        self._pending += other._pending
        self._history += other._history
        self._prompt_lengths += other._prompt_lengths
        self.forward_calls += other.forward_calls

    def max_drafts(self, k: int) -> list[int]:
        return [k] * len(self._pending)

    def limit_tree_leaves(self, leaves: int | None) -> None:
        self.max_leaves = self.tree_width if leaves is None else max(1, min(leaves, self.tree_width))

    def use_trees(self, allowed: bool) -> None:
        self._trees = allowed and self.tree_width > 1

    def behind(self) -> list[int]:
        """Per row, the tokens the next proposal would feed before drafting."""
        return [len(p) for p in self._pending]

    def limit_catch_up(self) -> None:
        """Rows more than catch_up_window tokens behind restart from their last catch_up_window tokens."""
        far = [b for b, p in enumerate(self._pending) if len(p) > self.catch_up_window]
        if far:
            self.backend.trim([0 if b in far else n for b, n in enumerate(self.backend.lengths)])
            for b in far:
                self._pending[b] = self._pending[b][-self.catch_up_window:]
                self._history[b] = None  # its cache now starts mid-text: nothing to park

    def propose(self, k: int, context: DraftContext, uniforms, num_drafts):
        self.catch_up, self.catch_up_s = max(map(len, self._pending), default=0), 0.0
        if self.catch_up > 2 and min(map(len, self._pending)) >= 2:
            # Every row is behind (plain steps since the last proposal): feed all but each row's last token in a
            # forward of its own, so that what follows is timed as steady drafting, the cost the policy learns.
            start = time.perf_counter()
            self.catch_up_tokens = sum(len(p) - 1 for p in self._pending)
            ids, valid = pad([p[:-1] for p in self._pending], self.backend.device, side="right")
            self.backend.forward(ids, valid, last_only=True)
            self.forward_calls += 1
            self._pending = [p[-1:] for p in self._pending]
            self.catch_up_s = time.perf_counter() - start
        cold = cold_forwards(self.backend)
        self._fed = [n + len(p) for n, p in zip(self.backend.lengths, self._pending)]
        # Right padding: the new tokens sit right after each row's cached ones (exact for sliding windows too).
        ids, valid = pad(self._pending, self.backend.device, side="right")
        siblings = min(self.tree_width - 1, k - 1, self.max_leaves - 1) if self._trees else 0
        tokens, probs, token, first = [], [], None, None
        sampled = context.sampled_index
        for i in range(k - siblings):
            # the rows' logit_bias and penalties along their own drafts (q sees what p will see at this position)
            logits = context.penalized(self.backend.forward(ids, valid, last_only=True)[:, -1], tokens)
            self.forward_calls += 1
            mask = context.draft_mask(i, token)  # the rows' grammars, followed along their own drafts
            token = greedy(context.masked(logits, mask))  # additive mask: branch-free
            if i == 0 and siblings:
                first = context.masked(logits, mask)
            if not context.all_greedy:
                q = context.probs(logits) if mask is None else context.probs(logits, mask)
                token[sampled] = sample_with_uniforms(q, uniforms[sampled, i])
                context.couple_drafts(token, q, i)
                probs.append(q)
            tokens.append(token)
            ids, valid = token.unsqueeze(1), None
        self._proposed = k - siblings
        # not clean: a backlog fed with the drafts, or a draft step's graph captured (cold): no sample of its cost
        clean = (bool(self.catch_up_s) or self.catch_up <= 2) and cold_forwards(self.backend) == cold
        if siblings:
            return self._tree_proposal(torch.stack(tokens, dim=1), first, siblings, num_drafts, clean)
        return Proposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None,
                        self.catch_up_s, self.catch_up_tokens if self.catch_up_s else 0, clean=clean)

    def _tree_proposal(self, chain: torch.Tensor, first: torch.Tensor, siblings: int, num_drafts,
                       clean: bool) -> Proposal:
        """The chain, then beside its first token the next most likely first tokens: a row with n nodes keeps the
        first n - s of its chain and s siblings (s = min(siblings, n - 1)), so its forward is as wide as asked."""
        top = torch.topk(first, siblings + 1, dim=-1).indices.tolist()
        rows, parents, self._chain = [], [], []
        for b, n in enumerate(num_drafts):
            s = min(siblings, max(n - 1, 0))
            mine = chain[b, : n - s].tolist()
            others = [t for t in top[b] if t != mine[0]][:s] if mine else []
            nodes = mine + others
            pad_to = chain.shape[1] + siblings
            rows.append(nodes + [nodes[-1] if nodes else 0] * (pad_to - len(nodes)))
            parents.append(padded(list(range(-1, len(mine) - 1)) + [-1] * len(others), pad_to))
            self._chain.append(mine)
        return Proposal(torch.tensor(rows, dtype=torch.long), None, self.catch_up_s,
                        self.catch_up_tokens if self.catch_up_s else 0, clean=clean, parents=parents)

    def update(self, emitted: list[list[int]], kept: list[int], hidden=None) -> None:
        k = self._proposed
        if self.prefix_cache is not None:  # what a leaving row parks; in place: no copy of the history per step
            for h, e in zip(self._history, emitted):
                if h is not None:
                    h.extend(e)
        if k == 0:  # nothing was fed: the new tokens just queue up (in place: a plain step costs O(new tokens))
            for pending, new in zip(self._pending, emitted):
                pending.extend(new)
            return
        # The cache saw the pending tokens and its drafts[:k-1]; keep what was accepted of those (after a tree, the
        # chain's tokens that were kept: a path through a sibling kept none of them).
        #
        # Worked example, one row, k = 3: the cache held 10 tokens and pending was [t] (the target's last token).
        # propose fed t (_fed = 11) and drew d1, fed d1 and drew d2, fed d2 and drew d3 (never fed): the cache
        # holds 13 = _fed + k - 1 tokens. Then, by what the target kept:
        #   kept 0, emitted [x]:             cached 0, trim to 11 (..., t),         pending [x]
        #   kept 1, emitted [d1, x]:         cached 1, trim to 12 (..., t, d1),     pending [x]
        #   kept 3, emitted [d1, d2, d3, b]: cached 2, trim to 13 (..., t, d1, d2), pending [d3, b]
        # After a tree whose chain was [d1, d2] and a sibling s of d1: a path through s kept 0 of the chain.
        if self._chain:
            kept = [common_prefix(c, e[:n]) for c, e, n in zip(self._chain, emitted, kept)]
            self._chain = []
        cached = [min(n, k - 1) for n in kept]
        self.backend.trim([f + c for f, c in zip(self._fed, cached)])
        self._pending = [e[c:] for e, c in zip(emitted, cached)]
        self._proposed, self._fed = 0, []  # _fed describes one proposal only: rows may join or leave before the next

    def discard(self) -> None:
        self.backend.reset(0)  # no park(): a failed forward may have written some layers and not others
        self._pending, self._history, self._fed, self._chain, self._proposed = [], [], [], [], 0
        self._prompt_lengths = []

    def select_rows(self, rows: list[int]) -> None:
        kept = set(rows)
        gone = [b for b in range(len(self._pending)) if b not in kept]
        if self.prefix_cache is not None and gone:  # rows that leave park their KV for prompts that start the same
            # its drafts' KV came from 1-token forwards: only the prompt's is lent
            self.prefix_cache.park(self.backend, gone, [self._history[b] for b in gone],
                                   [self._prompt_lengths[b] for b in gone])
        else:
            self.backend.select_rows(rows)
        self._history = [self._history[r] for r in rows] if self._history else []
        self._prompt_lengths = [self._prompt_lengths[r] for r in rows] if self._prompt_lengths else []
        self._pending = [self._pending[r] for r in rows]
        self._fed = [self._fed[r] for r in rows] if self._fed else []


"""A smaller language model as the drafter (the classic setting of both papers)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..backends.base import ModelBackend, capabilities, pad
from ..backends.prefix_cache import PrefixCache, common_prefix
from ..backends.rows import RowChange, RowText, move_rows
from ..exact.sampling import greedy, sample_with_uniforms
from ..exact.token_tree import padded
from .base import DraftChoice, DraftContext, Drafter, DraftOutcome, DraftOutlook, DraftRows, Proposal


@dataclass
class _Cached:
    """What the draft's cache holds of one row: text[start : start + its cache length] (the backend's lengths)."""

    text: RowText  # the row's text, where the session keeps it
    start: int = 0  # where the cache starts in the text: past 0 once a trial bounded its catch-up (_limit_catch_up)


@dataclass(frozen=True)
class _Fed:
    """What a proposal left in the cache, for observe to trim: row b holds fed[b] tokens of its text (from its start)
    and then the proposal's first drafted - 1 drafts."""

    fed: list[int]  # [B] cache length per row once the proposal fed its backlog
    drafted: int  # chain drafts drawn (the tree's siblings aside); the cache saw all but the last
    chains: list[list[int]] | None  # [B] a tree proposal's chain per row (what the cache saw); None: chains


class ModelDrafter(Drafter):
    """Drafts with its own KV cache, kept in step with each row's text.

    A row's cache holds a prefix of its text; what it lacks (the backlog: the prompt until the first proposal, then
    normally the target's last token, and after a full acceptance also the last draft, sampled but never fed; after
    plain steps, every token since) is read from the text and fed in the next proposal's first forward.

    Catching up costs about a draft prefill per token missed, so a probe after a long plain run would cost in
    proportion to the run (~10 % of its time on a 2-core CPU). For such trials (DraftChoice.trial) a row further
    behind than `catch_up_window` tokens restarts its cache from its last `catch_up_window` tokens. Only q changes
    (a shorter context), so the output stays exact; the draft's context grows again from there.

    tree_width W > 1 (where the session can verify trees): the chain is drafted W - 1 tokens shorter and the root
    gets the W - 1 next most likely tokens of the first draft distribution as siblings, the same K nodes in all.
    Every node is then a deterministic candidate (q is not used: token_tree.py's rule is exact for candidates
    chosen by any means independent of the verification's random numbers).
    """

    catch_up_window = 32
    drafts_from_model = True

    def __init__(self, backend: ModelBackend, tree_width: int = 1):
        if isinstance(tree_width, bool) or not isinstance(tree_width, int) or not 1 <= tree_width <= 16:
            raise ValueError(f"tree_width must be an integer 1..16 (1: chains), got {tree_width!r}")
        self.tree_width = tree_width
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self._capabilities = capabilities(backend)
        self.max_rows = self._capabilities.max_rows  # rows its cache can hold (None: no limit)
        self.forward_calls = 0
        self._rows: dict[int, _Cached] = {}  # per row id, in the backend's row order
        self.catch_up = 0  # tokens the last proposal had to feed for its longest row (normally 1 or 2) ...
        self.catch_up_s = 0.0  # ... and the seconds of a forward of their own, when every row was behind,
        self.catch_up_tokens = 0  # ... which fed this many tokens over all rows
        self.prefix_cache: PrefixCache | None = None

    @property
    def backends(self) -> tuple:
        return (self.backend,)

    def set_prefix_cache(self, max_tokens: int) -> None:
        """Keep up to max_tokens tokens of finished rows' prompts' KV for later prompts that start the same."""
        self.prefix_cache = PrefixCache(max_tokens) if max_tokens and self._capabilities.prefix_caching else None

    # ------------------------------------------------------------------ rows
    def relayout(self, change: RowChange) -> None:
        """Rows that leave park their prompt's KV in the prefix cache (a row whose cache starts mid-text: none;
        after a failed step nothing: a forward may have written some layers and not others); joining rows get an
        empty cache, or their prompt's longest cached prefix, and feed the rest lazily, with their first proposal
        (so a batch that the policy decodes plainly never pays for the draft's prefill)."""
        if change.broken:
            self.backend.reset(0)
            self._rows = {}
            return
        cache, before = self.prefix_cache, list(self._rows.values())
        if not before and self.backend.lengths:  # rows of a new backend's, or another user's: none of its own
            self.backend.select_rows([])
        fork = self._fork(change.appended) if change.appended else None
        move_rows(self.backend, change, [r.text for r in before], cache, fork, [r.start == 0 for r in before])
        rows = before + [_Cached(text) for text in change.appended]
        self._rows = {rows[i].text.id: rows[i] for i in change.keep}

    def _fork(self, texts) -> ModelBackend:
        """A fork of the cache for joining rows: each starts from a cached prefix of its prompt if at least 2 of its
        tokens are left to feed, so the first proposal's catch-up forward matches a cold one's last forward
        (reusable_prefix): for a fixed K the draft's q is then bit for bit a cold prefill's."""
        cache = self.prefix_cache
        if cache is not None:
            cache.make_room(self.backend, len(texts), [])
        fork = self.backend.fork(len(texts))
        if cache is None:
            fork.reset(len(texts))
            return fork
        hits = []
        for text in texts:
            hit = cache.lookup(fork, text.prompt, [], None)
            if hit is not None and len(text.prompt) - hit[1] < 2:
                hit = None
            hits.append(hit)
            cache.record(len(text.prompt), hit[1] if hit else 0)
        if any(hits):
            fork.load_prefixes(hits)
        return fork

    # ------------------------------------------------------------------ the step
    def outlook(self, rows: DraftRows) -> DraftOutlook:
        """Every row can take the step's widest K; behind: the tokens of its text its cache lacks. The plan: how
        many leaves a row's tree may have this step (1: chains)."""
        window = self.catch_up_window
        behind = [len(r.text) - r.start - n for r, n in zip(self._rows.values(), self.backend.lengths)]
        leaves = 1
        if rows.trees and self.tree_width > 1:
            leaves = self.tree_width if rows.max_leaves is None else max(1, min(rows.max_leaves, self.tree_width))
        return DraftOutlook([rows.widest] * len(behind), behind=behind,
                            probe_behind=behind if window is None else [min(n, window) for n in behind], plan=leaves)

    def _limit_catch_up(self) -> None:
        """Rows more than catch_up_window tokens behind restart from their last catch_up_window tokens."""
        lengths = self.backend.lengths
        far = [b for b, (r, n) in enumerate(zip(self._rows.values(), lengths))
               if len(r.text) - r.start - n > self.catch_up_window]
        if far:
            self.backend.trim([0 if b in far else n for b, n in enumerate(lengths)])
            rows = list(self._rows.values())
            for b in far:
                rows[b].start = len(rows[b].text) - self.catch_up_window

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        if choice.trial:  # a probe: its draft need not read every token it missed
            self._limit_catch_up()
        k, calls = choice.k, self.forward_calls
        pending = [r.text.since(r.start + n) for r, n in zip(self._rows.values(), self.backend.lengths)]
        self.catch_up, self.catch_up_s = max(map(len, pending), default=0), 0.0
        if self.catch_up > 2 and min(map(len, pending)) >= 2:
            # Every row is behind (plain steps since the last proposal): feed all but each row's last token in a
            # forward of its own, so that what follows is timed as steady drafting, the cost the policy learns.
            start = time.perf_counter()
            self.catch_up_tokens = sum(len(p) - 1 for p in pending)
            ids, valid = pad([p[:-1] for p in pending], self.backend.device, side="right")
            self.backend.forward(ids, valid, last_only=True)
            self.forward_calls += 1
            pending = [p[-1:] for p in pending]
            self.catch_up_s = time.perf_counter() - start
        cold = self._capabilities.cold_forwards
        colds = cold() if cold is not None else 0
        fed = [n + len(p) for n, p in zip(self.backend.lengths, pending)]
        # Right padding: the new tokens sit right after each row's cached ones (exact for sliding windows too).
        ids, valid = pad(pending, self.backend.device, side="right")
        siblings = min(self.tree_width - 1, k - 1, choice.outlook.plan - 1)
        tokens, probs, token, first = [], [], None, None
        sampled, uniforms = context.sampled_index, context.uniforms
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
        # not clean: a backlog fed with the drafts, or a draft step's graph captured (cold): no sample of its cost
        clean = (bool(self.catch_up_s) or self.catch_up <= 2) and (cold() if cold is not None else 0) == colds
        catch_up_tokens = self.catch_up_tokens if self.catch_up_s else 0
        if siblings:
            proposal = self._tree_proposal(torch.stack(tokens, dim=1), first, siblings, choice.k_rows, clean)
            proposal.plan = _Fed(fed, k - siblings, proposal.plan)
        else:
            proposal = Proposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None,
                                self.catch_up_s, catch_up_tokens, clean=clean, plan=_Fed(fed, k, None))
        proposal.forward_calls = self.forward_calls - calls
        return proposal

    def _tree_proposal(self, chain: torch.Tensor, first: torch.Tensor, siblings: int, k_rows: list[int],
                       clean: bool) -> Proposal:
        """The chain, then beside its first token the next most likely first tokens: a row with n nodes keeps the
        first n - s of its chain and s siblings (s = min(siblings, n - 1)), so its forward is as wide as asked. Its
        plan: each row's chain (what the cache saw)."""
        top = torch.topk(first, siblings + 1, dim=-1).indices.tolist()
        rows, parents, chains = [], [], []
        for b, n in enumerate(k_rows):
            s = min(siblings, max(n - 1, 0))
            mine = chain[b, : n - s].tolist()
            others = [t for t in top[b] if t != mine[0]][:s] if mine else []
            nodes = mine + others
            pad_to = chain.shape[1] + siblings
            rows.append(nodes + [nodes[-1] if nodes else 0] * (pad_to - len(nodes)))
            parents.append(padded(list(range(-1, len(mine) - 1)) + [-1] * len(others), pad_to))
            chains.append(mine)
        return Proposal(torch.tensor(rows, dtype=torch.long), None, self.catch_up_s,
                        self.catch_up_tokens if self.catch_up_s else 0, clean=clean, parents=parents, plan=chains)

    def observe(self, outcome: DraftOutcome) -> None:
        """The cache saw each row's backlog and its drafts[:k-1]: it keeps what was accepted of those (after a tree,
        the chain's tokens that were kept: a path through a sibling kept none of them) and forgets the rest. The
        tokens it lacks then (a rejected draft's correction, the bonus) are fed by the next proposal. After a step
        it did not draft, nothing: the new tokens are in the rows' texts, to be fed later.

        Worked example, one row, k = 3: the cache held 10 tokens of the text and lacked [t] (the target's last
        token). propose fed t (fed = 11) and drew d1, fed d1 and drew d2, fed d2 and drew d3 (never fed): the cache
        holds 13 = fed + k - 1 tokens. Then, by what the target kept:
          kept 0, emitted [x]:             cached 0, trim to 11 (..., t),         next feeds [x]
          kept 1, emitted [d1, x]:         cached 1, trim to 12 (..., t, d1),     next feeds [x]
          kept 3, emitted [d1, d2, d3, b]: cached 2, trim to 13 (..., t, d1, d2), next feeds [d3, b]
        After a tree whose chain was [d1, d2] and a sibling s of d1: a path through s kept 0 of the chain."""
        proposal = outcome.proposal
        if proposal is None:
            return
        plan, kept = proposal.plan, outcome.kept
        if plan.chains is not None:
            kept = [common_prefix(c, e[:n]) for c, e, n in zip(plan.chains, outcome.emitted, kept)]
        self.backend.trim([f + min(n, plan.drafted - 1) for f, n in zip(plan.fed, kept)])

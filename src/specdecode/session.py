"""A running batch: rows join between steps (their prompts prefilled beside the running rows), every step verifies
each row's proposal in one target forward, and rows leave when they finish (continuous batching).

The step, in the order of the paper: choose K (the policy, before any draft is drawn), propose (the drafter, and
the tokens each row's grammar forces), verify (one target forward, the exact rule per row), then trim the caches to
what was kept and emit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .backends.base import caches_prefixes, max_rows, pad
from .constrained import RowGrammars, with_forced
from .detokenize import IncrementalDetokenizer, find_stop
from .drafters import ModelDrafter, Proposal
from .results import GenerationResult, RowStats, Stats, TokenEvent
from .sampling import BatchSampling, RowGenerators
from .verification import Verified, token_logprobs, verify_rows, verify_tree_rows

MAX_FORCED = 16  # tokens of a forced run verified in one forward (a longer run continues next step)


@dataclass
class Row:
    """Host-side state of one row of the batch."""

    index: int
    request: object  # engine.Request
    detok: IncrementalDetokenizer | None
    coupled: bool  # drawn by Gumbel-max coupling: a seeded sampled row whose K the policy picks
    policy_state: object
    matcher: object | None  # the row's grammar state (constraints.Matcher), None when free
    tokens: list[int] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple] = field(default_factory=list)
    finish_reason: str | None = None
    stop_at: int | None = None  # where a stop string begins in the row's text
    stats: RowStats = field(default_factory=RowStats)

    @property
    def fixed_k(self) -> int | None:
        return self.request.num_speculative_tokens

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


class DecodingSession:
    """One running batch on a generator's models: rows join between steps and leave when they finish.

    add() queues a request; each step() first prefills queued prompts (at most prefill_tokens_per_step prompt
    tokens per step, None = all at once) in a cache of their own, merges rows whose prompt is done into the
    running batch with their first token, then runs one speculative step for every running row. At most
    max_batch rows run at once, and no more than the models' caches hold (llama.cpp: its sequences); the others
    wait their turn in order. A session owns the generator's caches while it runs: one per generator at a time.
    """

    def __init__(self, gen, policy=None, prefill_tokens_per_step: int | None = None, max_batch: int | None = None):
        self.gen, self.target, self.drafter = gen, gen.target, gen.drafter
        limits = [max_batch, max_rows(self.target), self.drafter.max_rows if self.drafter is not None else None]
        self.max_batch = min((n for n in limits if n), default=None)
        self.policy = policy or gen.policy
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.device = self.target.device
        self.rows: dict[int, Row] = {}
        self.active: list[Row] = []
        self.waiting: deque[Row] = deque()
        self._staging = None  # rows being prefilled: [rows, target fork, ids, valid, next column, copies, their fork]
        self.sampling = BatchSampling([], self.device)
        self.generators = RowGenerators([], self.device)
        self.grammars = RowGrammars([], self.target.vocab_size, self.device)
        self.cancelled: set[int] = set()
        self.hidden_wanted = self.drafter is not None and self.drafter.needs_hidden_states
        # Hidden states of a cached prefix are not kept: a drafter that reads them prefills whole prompts.
        self.prefix_cache = None if self.hidden_wanted else gen.prefix_cache
        self.shares_prompts = caches_prefixes(self.target) and not self.hidden_wanted
        self.trees = bool(getattr(self.target, "supports_trees", False)) and not self.hidden_wanted
        if self.trees and self.drafter is not None:  # a row's tree fits whatever the other rows' trees
            self.drafter.limit_tree_leaves(getattr(self.target, "tree_leaves", None))
        if hasattr(self.policy, "model_drafts"):  # only drafts that all cost a model forward may settle it
            self.policy.model_drafts = isinstance(self.drafter, ModelDrafter)
        max_k = self.policy.max_k
        self.stats = Stats(num_speculative_tokens=max_k, accepted_per_position=[0] * max_k,
                           proposed_per_position=[0] * max_k, policy="auto" if self.policy.adaptive else "fixed")
        self._started = None
        self.steps = 0  # step() calls so far: TokenEvent.step says which one decided a token
        self.target.reset(0)
        if self.drafter is not None:
            self.drafter.select_rows([])  # an empty batch: rows join through fork and merge

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting and self._staging is None

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return len(self.waiting) + (len(self._staging[0]) + len(self._staging[5]) if self._staging else 0)

    def add(self, request) -> int:
        """Queue a request; returns its row id (TokenEvent.row of its tokens). It joins at the next step."""
        index = len(self.rows)
        # The policy's K follows timings, which no seed reproduces: a seeded row it serves is drawn by coupling,
        # whose text does not depend on K (sampling.BatchSampling), so the seed alone fixes it.
        coupled = (request.num_speculative_tokens is None and self.policy.adaptive and request.seed is not None
                   and not request.params.greedy)
        tok = self.gen.tokenizer
        matcher = request.grammar.matcher() if request.grammar is not None else None
        row = Row(index, request, IncrementalDetokenizer(tok, request.prompt) if tok else None, coupled,
                  self.policy.new_row(), matcher)
        self.rows[index] = row
        self.waiting.append(row)
        self.stats.num_rows += 1
        self.stats.prompt_tokens += len(request.prompt)
        return index

    def abandon(self) -> None:
        """After a step that raised: every row leaves, and nothing of the caches is parked (a failed forward may have
        written some layers and not others). The generator's models are then free for a new session."""
        self.target.reset(0)
        if self.drafter is not None:
            self.drafter.discard()
        self.active, self._staging = [], None
        self.waiting.clear()

    def cancel(self, index: int) -> None:
        """End a row at the next step boundary (finish_reason "cancelled"), wherever it is."""
        self.cancelled.add(index)

    def step(self) -> list[TokenEvent]:
        """One iteration: admit() then decode(); the events of both."""
        return self.admit() + self.decode()

    def admit(self) -> list[TokenEvent]:
        """The first half of a step: prefill (a chunk of) the queued prompts; rows whose prompt is done join the
        batch with their first token, whose events are returned now (a server sends them before the decode)."""
        if self._started is None:
            self._started = time.perf_counter()
        self.steps += 1
        events = self._admit()
        self.stats.wall_time_s = time.perf_counter() - self._started
        return events

    def decode(self) -> list[TokenEvent]:
        """The second half of a step: one speculative step for every running row."""
        if self._started is None:
            self._started = time.perf_counter()
        events = self._decode_step() if self.active else []
        self.stats.wall_time_s = time.perf_counter() - self._started
        return events

    # ------------------------------------------------------------------ joining
    def _admit(self) -> list[TokenEvent]:
        """Prefill queued prompts (a chunk per step) beside the running rows; merge those that are done."""
        for row in list(self.waiting):
            if row.index in self.cancelled:
                self.waiting.remove(row)
                row.finish_reason = "cancelled"
        room = len(self.waiting) if self.max_batch is None else self.max_batch - len(self.active)
        if self._staging is None and self.waiting and room > 0:
            rows = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            self._staging = self._stage(rows)
        if self._staging is None:
            return []
        start = time.perf_counter()
        rows, fork, ids, valid, col, copies, extra = self._staging
        end = col + self._prefill_columns(ids.shape[1] - col, len(rows), rows[0].stats.cached_tokens + col)
        chunk_valid = valid[:, col:end] if valid is not None else None
        logits, hidden = _forward(fork, ids[:, col:end], chunk_valid, self.hidden_wanted, last_only=True)
        self.stats.target_forward_calls += 1
        if end < ids.shape[1]:
            self._staging[4] = end
        else:
            self._staging = None
            if copies:
                rows, ids, valid, logits = self._copy_prompts(rows, fork, copies, extra, logits)
            events = self._join(rows, fork, ids, valid, logits, hidden)
        self.stats.prefill_time_s += time.perf_counter() - start
        return [] if self._staging is not None else events

    def _stage(self, rows: list[Row]) -> list:
        """A fork of the target for joining rows, each starting from the longest prefix of its prompt whose KV is
        cached (a finished or a running row's); what is left of the prompts is prefilled from there. Rows with the
        same prompt (a request's n choices) prefill it once: the others copy its KV when it is done (_copy_prompts)."""
        copies = []  # (row, the joining row it copies: an index into the rows prefilled)
        if self.shares_prompts:
            first: dict[tuple, int] = {}
            unique = []
            for row in rows:
                at = first.setdefault(tuple(row.request.prompt), len(unique))
                if at == len(unique):
                    unique.append(row)
                else:
                    copies.append((row, at))
            rows = unique
        cache, prompts = self.prefix_cache, [r.request.prompt for r in rows]
        hits = [None] * len(rows)
        if cache is not None:
            # a running row's prompt only: its answer's KV came from decode steps, not a prefill (prefix_cache.py)
            running = [(r.request.prompt, min(n, len(r.request.prompt)))
                       for r, n in zip(self.active, self.target.lengths)]
            hits = [cache.lookup(self.target, p, running, self.prefill_tokens_per_step) for p in prompts]
            if not cache.make_room(self.target, len(rows) + len(copies), [h[0] for h in hits if h]):
                hits = [None] * len(rows)
        fork = self.target.fork(len(rows))
        if any(hits):
            fork.load_prefixes(hits)
        for row, hit in zip(rows, hits):
            row.stats.cached_tokens = hit[1] if hit else 0
            self.stats.cached_prompt_tokens += row.stats.cached_tokens
            if cache is not None:
                cache.record(len(row.request.prompt), row.stats.cached_tokens)
        ids, valid = pad([p[r.stats.cached_tokens:] for p, r in zip(prompts, rows)], self.device, side="left")
        extra = self.target.fork(len(copies)) if copies else None  # their rows, reserved now
        return [rows, fork, ids, valid, 0, copies, extra]

    def _copy_prompts(self, rows: list[Row], fork, copies: list, extra, logits):
        """Rows whose prompt another joining row has just prefilled start from a copy of its KV and its last logits
        (the same numbers a prefill of their own would give alone), after the prefilled rows."""
        extra.load_prefixes([(fork.kv_ref(i), len(row.request.prompt)) for row, i in copies])
        fork.merge(extra)
        for row, _ in copies:
            row.stats.cached_tokens = len(row.request.prompt)
            self.stats.cached_prompt_tokens += row.stats.cached_tokens
        rows = rows + [row for row, _ in copies]
        logits = torch.cat([logits, logits[[i for _, i in copies]]])
        ids, valid = pad([r.request.prompt for r in rows], self.device, side="left")
        return rows, ids, valid, logits

    def _prefill_columns(self, left: int, rows: int, position: int) -> int:
        """A row joining alone is cut at multiples of the budget from its prompt's start, as a cold prefill is, so
        one that starts from a cached prefix ends with the cold prefill's forwards (backends' reusable_prefix)."""
        step = max(1, self.prefill_tokens_per_step // rows) if self.prefill_tokens_per_step else left + position
        return min(left, step - position % step if rows == 1 else step)

    def _join(self, rows: list[Row], fork, ids, valid, logits, hidden) -> list[TokenEvent]:
        """Prefilled rows draw their first token from the prompt's last logits and join the running batch."""
        coupled = [r.coupled for r in rows]
        sampling = BatchSampling([r.request.params for r in rows], self.device, coupled)
        generators = RowGenerators([r.request.seed for r in rows], self.device, coupled,
                                   [r.request.seed_index for r in rows])
        grammars = RowGrammars([r.matcher for r in rows], self.target.vocab_size, self.device)
        u = generators.uniforms([0 if g or c else 1 for g, c in zip(sampling.greedy_rows, coupled)])
        sampling.noise = generators.noise(1, logits.shape[-1])
        masks, _ = grammars.verify_masks([[] for _ in rows], [0] * len(rows))
        scores = sampling.scores(logits[:, -1:], masks)
        first = verify_rows(ids[:, :0], None, scores, sampling, u, [0] * len(rows), self.gen.method)[1].tolist()
        generators.advance([1] * len(rows))
        grammars.advance([[t] for t in first])
        drafter = None
        if self.drafter is not None:
            drafter = self.drafter.fork(len(rows))
            calls = drafter.forward_calls
            if any(r.stats.cached_tokens for r in rows):  # the drafter takes whole prompts
                ids, valid = pad([r.request.prompt for r in rows], self.device, side="left")
            drafter.prefill(ids, valid, hidden)
            drafter.update([[t] for t in first], [0] * len(rows))
            self.stats.draft_forward_calls += drafter.forward_calls - calls
        self.stats.num_rows_with_first_token += len(rows)
        verified = Verified([[] for _ in rows], [0] * len(rows), first, scores)
        events = [e for b, row in enumerate(rows) for e in self._emit(row, verified, b, 0, 0)]
        keep = [i for i, r in enumerate(rows) if r.finish_reason is None and r.index not in self.cancelled]
        for i, r in enumerate(rows):
            if r.finish_reason is None and i not in keep:
                r.finish_reason = "cancelled"
        if keep:
            self._park_joined(rows, fork, keep)
            self.target.merge(fork)
            if drafter is not None:
                drafter.select_rows(keep)
                self.drafter.merge(drafter)
            generators.select(keep)
            self.generators.extend(generators)
            self.sampling = self.sampling.extend(sampling.select(keep))
            self.grammars = self.grammars.extend(grammars.select(keep))
            self.active += [rows[i] for i in keep]
        else:
            self._park_joined(rows, fork, keep)
        return events

    def _park_joined(self, rows: list[Row], fork, keep: list[int]) -> None:
        """Rows that finished at their first token leave the fork before it merges; with a prefix cache their
        prompt's KV is parked, so that the same prompt next does not prefill again."""
        gone = [i for i in range(len(rows)) if i not in set(keep)]
        if self.prefix_cache is None or not gone:
            fork.select_rows(keep)
            return
        held = fork.lengths
        for i, handle in zip(gone, fork.park(gone)):
            prompt = rows[i].request.prompt
            self.prefix_cache.insert(prompt[: held[i]], handle, exact=len(prompt))

    # ------------------------------------------------------------------ one speculative step
    def _decode_step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        active, sampling = self.active, self.sampling
        forced = self.grammars.forced([min(MAX_FORCED, r.remaining - 1) for r in active]) if self.grammars.any \
            else [[]] * len(active)
        if self.drafter is not None:  # a grammar's masks follow chains: constrained batches draft chains
            self.drafter.use_trees(self.trees and not self.grammars.any)
        k_rows = self._choose_k(forced)
        widths = [len(f) or k for f, k in zip(forced, k_rows)]
        last = torch.tensor([[r.tokens[-1]] for r in active], dtype=torch.long, device=self.device)
        lengths = self.target.lengths
        u_draft, u_verify = self.generators.step_uniforms(widths, sampling.greedy_rows)
        if sampling.any_coupled:
            sampling.noise = self.generators.noise(max(widths) + 1, self.target.vocab_size)
        proposal = self._propose(k_rows, u_draft)
        drafts, q = with_forced(proposal, forced, self.sampling)
        masks = None
        if self.grammars.any:  # free batches skip this: drafts.tolist() would be a host sync before the forward
            masks, widths = self.grammars.verify_masks(drafts.tolist(), widths)
        tree = proposal.parents
        t1 = self._clock()
        if tree is None:
            logits, hidden = _forward(self.target, torch.cat([last, drafts], dim=1), None, self.hidden_wanted)
        else:
            logits, hidden = self.target.forward_tree(torch.cat([last, drafts], dim=1), tree), None
        scores = sampling.scores(logits, masks)
        if tree is None:
            num_accepted, next_token = verify_rows(drafts, q, scores, sampling, u_verify, widths, self.gen.method)
            t2 = self._clock()
            verified = Verified(drafts.tolist(), num_accepted.tolist(), next_token.tolist(), scores)  # the one sync
        else:
            tokens = drafts.tolist()
            paths, next_tokens = verify_tree_rows(tokens, tree, scores, sampling, u_verify, widths)
            t2 = self._clock()
            verified = Verified.of_tree(tokens, tree, widths, paths, next_tokens, scores,
                                        any(r.request.logprobs is not None for r in active))
        t2 = t2 if self.gen.timing else time.perf_counter()
        accepted = verified.accepted
        if tree is None:
            self.target.trim([n + 1 + a for n, a in zip(lengths, accepted)])
        else:
            self.target.keep_paths(verified.paths)
        self.generators.advance([a + 1 for a in accepted])
        emitted = [verified.emitted(b) for b in range(len(active))]
        self.grammars.advance(emitted)
        if self.drafter is not None:
            kept = [0 if f else a for f, a in zip(forced, accepted)]
            self.drafter.update(emitted, kept, hidden if self.hidden_wanted else None)
        draft_s = t1 - t0 - proposal.catch_up_s if proposal.clean else None
        self._observe(max(widths), widths, forced, accepted, draft_s, t2 - t1, proposal.free)
        events = []
        for b, row in enumerate(active):  # (a tree row's last token is a bonus when its path ended at a leaf)
            k = verified.accepted[b] if verified.leaves and verified.leaves[b] else widths[b]
            events += self._emit(row, verified, b, k, len(forced[b]))
        self._count(widths, forced, accepted)
        self._drop_finished()
        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        self.stats.other_time_s += time.perf_counter() - t2
        return events

    def _propose(self, k_rows: list[int], uniforms) -> Proposal:
        """The drafter's proposal for rows that draft this step (forced rows are asked for nothing they keep)."""
        k = max(k_rows)
        if k == 0:
            return Proposal(torch.zeros(len(k_rows), 0, dtype=torch.long, device=self.device))
        calls = self.drafter.forward_calls
        self.sampling.grammars = self.grammars if self.grammars.any else None
        try:
            proposal = self.drafter.propose(k, self.sampling, uniforms, k_rows)
        finally:
            self.sampling.grammars = None
        if proposal.catch_up_s:
            self.policy.observe_catch_up(proposal.catch_up_tokens, proposal.catch_up_s)
        self.stats.draft_forward_calls += self.drafter.forward_calls - calls
        proposal.tokens = proposal.tokens.to(self.device)
        return proposal

    def _choose_k(self, forced: list[list[int]]) -> list[int]:
        """Drafts per row before any is drawn (what keeps the choice lossless): the policy's K, capped; rows whose
        grammar forces tokens verify those instead (certain drafts, free)."""
        caps = [0 if f else r.remaining - 1 for r, f in zip(self.active, forced)]
        widest = max([self.policy.max_k] + [r.fixed_k or 0 for r in self.active])
        if self.drafter is None or widest == 0 or max(caps) <= 0:
            return [0] * len(self.active)
        if getattr(self.policy, "settled", False) and not any(r.fixed_k for r in self.active):
            return [0] * len(self.active)  # no draft can pay here (policy.py, Settling): the drafter is not asked
        # each row drafts at its own K (and what it has left), never at the batch's widest: its drafts, and so its
        # seeded text, must not depend on the other rows
        self.drafter.own_k([min(c, self.policy.max_k if r.fixed_k is None else r.fixed_k)
                            for r, c in zip(self.active, caps)])
        caps = [min(c, d) for c, d in zip(caps, self.drafter.max_drafts(widest))]
        self.policy.note_drafting(self.drafter.drafts_free())  # drafts that run no model are priced free
        classes = self.drafter.draft_classes()  # None for a drafter without classes: its rows keep None
        for row, draft_class in zip(self.active, classes or ()):  # a long match's copy is worth more than a short one's
            self.policy.note_class(row.policy_state, draft_class)
        behind = self.drafter.behind() if self.policy.adaptive else None
        if behind is not None:  # what a draft's catch-up would cost: only the adaptive policy asks
            window = self.drafter.catch_up_window
            for row, n in zip(self.active, behind):
                self.policy.note_row(row.policy_state, n, n if window is None else min(n, window), row.remaining)
        k = self.policy.choose([r.policy_state for r in self.active], [min(c, self.policy.max_k) for c in caps])
        if k and self.policy.trial:
            self.drafter.limit_catch_up()  # a probe: its draft need not read every token it missed
        return [min(k if r.fixed_k is None else r.fixed_k, c) for r, c in zip(self.active, caps)]

    def _observe(self, k: int, widths: list[int], forced: list[list[int]], accepted: list[int],
                 draft_s: float | None, verify_s: float, free: bool) -> None:
        """Tell the policy what its rows did; a step widened by a row with a fixed K or a forced run taught it nothing
        it asked. draft_s None: the drafter caught up on many tokens with its drafts, not a draft step's cost; free:
        no model forward drafted (no draft step's cost either)."""
        mine = [i for i, r in enumerate(self.active) if r.fixed_k is None and not forced[i]]
        if not mine or max((widths[i] for i in mine), default=0) < k:
            return
        self.policy.note_drafting(free)
        self.policy.observe([self.active[i].policy_state for i in mine], k, [accepted[i] for i in mine],
                            len(self.active), draft_s, verify_s, [widths[i] for i in mine])

    def _count(self, widths: list[int], forced: list[list[int]], accepted: list[int]) -> None:
        """Statistics: model drafts proposed and kept per position; forced tokens apart (they were never in doubt)."""
        drafted = [0 if f else w for f, w in zip(forced, widths)]
        kept = [0 if f else a for f, a in zip(forced, accepted)]
        self.stats.add_verification(drafted, kept)
        for row, f, n, a in zip(self.active, forced, drafted, kept):
            row.stats.add_verification(n, a)
        self.stats.forced_tokens += sum(min(len(f), a) for f, a in zip(forced, accepted))

    def _clock(self) -> float:
        if self.gen.timing and self.device.type == "cuda":  # kernels run asynchronously: wait to time each phase
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ tokens out, rows out
    def _emit(self, row: Row, verified: Verified, b: int, k: int, n_forced: int) -> list[TokenEvent]:
        """Append row b's new tokens until it finishes; return their events (k: its drafts this step, n_forced: how
        many of them its grammar forced)."""
        tokens = verified.emitted(b)
        a = len(tokens) - 1
        kinds = ["forced" if n_forced else "accepted"] * a + [_last_kind(k, a)]
        lps, tops = [None] * len(tokens), [None] * len(tokens)
        if row.request.logprobs is not None:
            lps, tops = token_logprobs(verified.scores[b], tokens, row.request.logprobs)
        events = []
        stop_ids, stops = row.request.stop_ids, row.request.stops
        for token, kind, lp, top in zip(tokens, kinds, lps, tops):
            row.tokens.append(token)
            row.provenance.append(kind)
            if lp is not None:
                row.logprobs.append(lp)
                row.top_logprobs.append(top)
            row.stats.forced_tokens += kind == "forced"
            text = row.detok.add(token) if row.detok is not None else None
            if token in stop_ids:
                row.finish_reason = "stop"
            elif stops and (hit := find_stop(row.detok.text, text, stops)) is not None:
                row.finish_reason, row.stop_at = "stop", hit
                text = text[: max(0, len(text) - (len(row.detok.text) - hit))]
            elif row.remaining == 0:
                row.finish_reason = "length"
            done = row.finish_reason is not None
            if done and row.detok is not None and row.stop_at is None:
                text += row.detok.flush()
            events.append(TokenEvent(row.index, token, kind, text, done, row.finish_reason, self.steps, k, lp, top))
            if done:
                break
        return events

    def _drop_finished(self) -> None:
        for row in self.active:
            if row.finish_reason is None and row.index in self.cancelled:
                row.finish_reason = "cancelled"
        keep = [i for i, r in enumerate(self.active) if r.finish_reason is None]
        if len(keep) < len(self.active):
            self._park_or_drop(keep)
            if self.drafter is not None:
                self.drafter.select_rows(keep)
            self.generators.select(keep)
            self.sampling = self.sampling.select(keep)
            self.grammars = self.grammars.select(keep)
            self.active = [self.active[i] for i in keep]

    def _park_or_drop(self, keep: list[int]) -> None:
        """Finished rows leave the target's batch; with a prefix cache their KV stays, as a cache entry."""
        if self.prefix_cache is None:
            self.target.select_rows(keep)
            return
        kept = set(keep)
        gone = [i for i in range(len(self.active)) if i not in kept]
        held = self.target.lengths
        for i, handle in zip(gone, self.target.park(gone)):
            prompt = self.active[i].request.prompt
            self.prefix_cache.insert((prompt + self.active[i].tokens)[: held[i]], handle, exact=len(prompt))

    def result(self, indices: list[int] | None = None) -> GenerationResult:
        """The GenerationResult of these rows (all by default), with the session's statistics."""
        rows = [self.rows[i] for i in (indices if indices is not None else sorted(self.rows))]
        for row in rows:
            row.stats.new_tokens = len(row.tokens)
        self.stats.new_tokens = sum(len(r.tokens) for r in self.rows.values())
        self.stats.policy_summary = self.policy.summary()
        texts = None
        if self.gen.tokenizer is not None:
            texts = []
            for row in rows:
                if row.stop_at is None:
                    row.detok.flush()
                texts.append(row.detok.text[: row.stop_at] if row.stop_at is not None else row.detok.text)
        asked = [r.request.logprobs is not None for r in rows]
        return GenerationResult(token_ids=[r.tokens for r in rows], texts=texts, stats=self.stats,
                                finish_reasons=[r.finish_reason for r in rows],
                                provenance=[r.provenance for r in rows],
                                prompt_token_ids=[r.request.prompt for r in rows], row_stats=[r.stats for r in rows],
                                logprobs=[r.logprobs if a else None for r, a in zip(rows, asked)] if any(asked)
                                else None,
                                top_logprobs=[r.top_logprobs if a else None for r, a in zip(rows, asked)]
                                if any(asked) else None)


def _last_kind(k: int, accepted: int) -> str:
    """Provenance of the token after a row's kept drafts: the target's own step, its correction, or its bonus."""
    if k == 0:
        return "target"
    return "bonus" if accepted == k else "resampled"


def _forward(backend, ids, valid, hidden_wanted: bool, last_only: bool = False):
    """(logits, hidden or None): hidden states are asked for only when the drafter needs them."""
    if hidden_wanted:
        return backend.forward(ids, valid, last_only=last_only, output_hidden=True)
    return backend.forward(ids, valid, last_only=last_only), None

"""A running batch: rows join between steps (their prompts prefilled beside the running rows), every step verifies
each row's proposal in one target forward, and rows leave when they finish (continuous batching).
Rows are prefilled by admission.py's Admission; they join and leave through layout.py's RowLayout, which moves every
holder of per-row state at once; what each row holds on the host is row_batch.py's Row.

One step, in the order of the paper, with one value handed from each phase to the next:

    plan     -> StepPlan   K per row (the policy, asked once, before any draft is drawn), the tokens each row's grammar
                           forces, the widths verified, the step's random numbers
    propose  -> Drafts     the drafter's Proposal with forced runs in place, the grammar masks along it
    verify   -> Verified   one target forward, the exact rule per row (chains or token trees: decided here, once)
    commit                 caches, random streams, grammars and the drafter keep what was verified
    learn                  the policy observes the Outcome
    emit     -> events     tokens appended per row until it finishes; finished rows leave (one RowChange)
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .admission import Admission
from ..backends.base import capabilities, logits_and_hidden
from ..backends.rows import RowChange
from ..text.detokenize import IncrementalDetokenizer, find_stop
from ..drafters import DraftChoice, DraftContext, DraftOutcome, DraftOutlook, DraftRows, Proposal
from ..policy.choose import Outcome, Outlook
from ..exact.rejection import accept_greedy_lists
from .layout import RowLayout
from .results import GenerationResult, Stats, TokenEvent
from .row_batch import Row, RowBatch, result_of
from ..structured.row_grammars import with_forced
from ..exact.sampling import BatchSampling
from ..exact.verification import Verified, token_logprobs, verify_rows, verify_tree_rows

MAX_FORCED = 16  # tokens of a forced run verified in one forward (a longer run continues next step)


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~3 us more to build, every step
class StepPlan:
    """What a step verifies, fixed before any draft is drawn (what keeps the choice of K lossless). K = max(widths)."""

    forced: list[list[int]]  # [B][f_b] the tokens row b's grammar forces (f_b <= MAX_FORCED); [] for a free row
    k_rows: list[int]  # [B] drafts asked of the drafter for row b (0 for a forced row)
    widths: list[int]  # [B] tokens verified after row b's last token: f_b for a forced row, else k_rows[b]
    trial: bool  # the policy's probe or exploration: the drafter may bound its catch-up (still exact)
    outlook: DraftOutlook | None  # the drafter's outlook, handed back to it with the choice; None: it was not asked
    u_draft: torch.Tensor  # [B, K] float64: row b's uniforms drawing its drafts (zeros for greedy and coupled rows)
    u_verify: torch.Tensor  # [B, K+1] float64: its uniforms accepting them, then (column K) the token after
    noise: torch.Tensor | None  # [C, K+1, V] float64: the coupled rows' Gumbel noise; None: no coupled row


@dataclass(slots=True)
class Drafts:
    """The step's proposal as the target verifies it."""

    tokens: torch.Tensor  # [B, K'] the drafter's tokens with each forced row's run in place; row b's first widths[b]
    q: torch.Tensor | None  # [S, K', V] the sampled rows' draft distributions; None: deterministic drafts (one-hot)
    parents: list[list[int]] | None  # [B][K'] a token tree per row (token_tree.py); None: chains
    masks: torch.Tensor | None  # [B, K'+1, V] float32 additive grammar masks; None: no row constrained, or mask_rows
    widths: list[int]  # [B] the plan's widths, cut before the first token a row's grammar forbids
    proposal: Proposal  # the drafter's own, for its costs (catch_up_s, clean, free); empty when it was not asked
    asked: bool  # whether the drafter proposed this step (it observes its proposal)
    # [B][K'+1] the grammar masks as TokenMasks, in place of `masks`, for a greedy verification that reads each
    # position's argmax only (forward_argmax with allowed=: no [B, K'+1, V] tensor is built)
    mask_rows: list | None = None


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
        # what the target offers beyond its methods, read once (the loop reads nothing of a backend by name)
        self.capabilities = caps = capabilities(self.target)
        limits = [max_batch, caps.max_rows, self.drafter.max_rows if self.drafter is not None else None]
        self.max_batch = min((n for n in limits if n), default=None)
        self.policy = policy or gen.policy
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.device = self.target.device
        self.rows: dict[int, Row] = {}  # the rows added and not released (release)
        self._next_index = 0  # row ids are never reused, released or not
        self._released: set[int] = set()  # rows released while still running: forgotten once they finish
        self.cancelled: set[int] = set()
        self.hidden_wanted = self.drafter is not None and self.drafter.needs_hidden_states
        # Hidden states of a cached prefix are not kept: a drafter that reads them prefills whole prompts.
        self.prefix_cache = None if self.hidden_wanted else gen.prefix_cache
        self.trees = caps.trees and not self.hidden_wanted
        # only drafts that all cost a model forward may settle the policy (policy.py, Settling)
        self.policy.model_drafts = self.drafter is not None and self.drafter.drafts_from_model
        max_k = self.policy.max_k
        self.stats = Stats(num_speculative_tokens=max_k, accepted_per_position=[0] * max_k,
                           proposed_per_position=[0] * max_k, policy="auto" if self.policy.adaptive else "fixed")
        self.admission = Admission(self.target, caps, self.prefix_cache, prefill_tokens_per_step, self.hidden_wanted,
                                   caps.prefix_caching and not self.hidden_wanted, gen.method, self.stats)
        self.layout = RowLayout(self.target, self.prefix_cache, self.drafter, self.target.vocab_size)
        self.layout.reset()  # an empty batch: rows join through admission and the layout
        self._started = None
        self.steps = 0  # step() calls so far: TokenEvent.step says which one decided a token

    @property
    def batch(self) -> RowBatch:
        return self.layout.batch

    @property
    def active(self) -> list[Row]:
        return self.layout.batch.rows

    @property
    def sampling(self) -> BatchSampling:
        return self.layout.batch.sampling

    @property
    def waiting(self):
        return self.admission.waiting

    @property
    def shares_prompts(self) -> bool:
        """Whether rows that join with the same prompt prefill it once (a target with prefix caching)."""
        return self.admission.share

    @shares_prompts.setter
    def shares_prompts(self, share: bool) -> None:
        self.admission.share = share

    @property
    def idle(self) -> bool:
        return not self.active and not self.admission.waiting and self.admission.staging is None

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return self.admission.queued

    def add(self, request) -> int:
        """Queue a request; returns its row id (TokenEvent.row of its tokens). It joins at the next step."""
        index = self._next_index
        self._next_index += 1
        # The policy's K follows timings, which no seed reproduces: a seeded row it serves is drawn by coupling,
        # whose text does not depend on K (sampling.BatchSampling), so the seed alone fixes it.
        coupled = (request.num_speculative_tokens is None and self.policy.adaptive and request.seed is not None
                   and not request.params.greedy)
        tok = self.gen.tokenizer
        matcher = request.grammar.matcher() if request.grammar is not None else None
        row = Row(index, request, IncrementalDetokenizer(tok, request.prompt) if tok else None, coupled,
                  self.policy.new_row(), matcher)
        self.rows[index] = row
        self.admission.waiting.append(row)
        self.stats.num_rows += 1
        self.stats.prompt_tokens += len(request.prompt)
        return index

    def abandon(self) -> None:
        """After a step that raised: every row leaves, and nothing of the caches is parked (a failed forward may have
        written some layers and not others). The generator's models are then free for a new session."""
        self.layout.reset(broken=True)
        self.admission.clear()

    def cancel(self, index: int) -> None:
        """End a row at the next step boundary (finish_reason "cancelled"), wherever it is."""
        self.cancelled.add(index)

    def release(self, indices) -> None:
        """The caller is done with these rows (a server's request ended, answered or cancelled): their host state
        (request, tokens, detokenizer, grammar matcher) is forgotten once they have left the batch, and result()
        no longer knows them. A long-lived session that kept every row grew by each request's state (issue 41)."""
        self._released.update(indices)
        self._forget_released()

    def _forget_released(self) -> None:
        """Released rows that have finished leave `rows` (a finished row is out of the batch at a step boundary)."""
        done = [i for i in self._released if i not in self.rows or self.rows[i].finish_reason is not None]
        for index in done:
            self._released.discard(index)
            self.rows.pop(index, None)
            self.cancelled.discard(index)

    def step(self) -> list[TokenEvent]:
        """One iteration: admit() then decode(); the events of both."""
        return self.admit() + self.decode()

    def admit(self) -> list[TokenEvent]:
        """The first half of a step: prefill (a chunk of) the queued prompts; rows whose prompt is done join the
        batch with their first token, whose events are returned now (a server sends them before the decode)."""
        if self._started is None:
            self._started = time.perf_counter()
        self.steps += 1
        events = self._join()
        if self._released:
            self._forget_released()
        self.stats.wall_time_s = time.perf_counter() - self._started
        return events

    def decode(self) -> list[TokenEvent]:
        """The second half of a step: one speculative step for every running row."""
        if self._started is None:
            self._started = time.perf_counter()
        events = self._decode_step() if self.active else []
        if self._released:
            self._forget_released()
        self.stats.wall_time_s = time.perf_counter() - self._started
        return events

    # ------------------------------------------------------------------ one speculative step
    def _decode_step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        plan = self._plan()
        drafts = self._propose(plan)
        t1 = self._clock()
        counter = self.capabilities.cold_forwards
        cold = counter() if counter is not None else 0
        verified = self._verify(plan, drafts)
        t2 = self._clock()
        self._commit(plan, drafts, verified)
        # a forward that captured a CUDA graph (or ran its shape's first sight eagerly) is no sample of its cost
        warm = counter is None or counter() == cold
        self._learn(plan, drafts, verified, t1 - t0, t2 - t1 if warm else None)
        events = self._emit_all(plan, drafts, verified)
        self._count(drafts.widths, plan.forced, verified.accepted)
        self._drop_finished()
        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        self.stats.other_time_s += time.perf_counter() - t2
        return events

    def _plan(self) -> StepPlan:
        """Forced runs, K per row and the step's random numbers, before anything is drafted."""
        rows, grammars = self.active, self.batch.grammars
        forced = grammars.forced([min(MAX_FORCED, r.remaining - 1) for r in rows]) if grammars.any \
            else [[]] * len(rows)
        k_rows, trial, outlook = self._choose_k(forced)
        widths = [len(f) or k for f, k in zip(forced, k_rows)]
        u_draft, u_verify = self.batch.generators.step_uniforms(widths, self.sampling.greedy_rows)
        noise = self.batch.generators.noise(max(widths) + 1, self.target.vocab_size) \
            if self.sampling.any_coupled else None
        return StepPlan(forced, k_rows, widths, trial, outlook, u_draft, u_verify, noise)

    def _choose_k(self, forced: list[list[int]]) -> tuple[list[int], bool, DraftOutlook | None]:
        """Drafts per row before any is drawn (what keeps the choice lossless): the policy's K, capped by what the
        drafter's outlook offers; rows whose grammar forces tokens verify those instead (certain drafts, free). Also
        whether K is the policy's trial, and the outlook (None: the drafter was not asked)."""
        rows = self.active
        caps = [0 if f else r.remaining - 1 for r, f in zip(rows, forced)]
        single = self.capabilities.single_token_from  # past it each draft would cost a forward of its own
        if single is not None:
            caps = [min(c, max(0, single - 1 - n)) for c, n in zip(caps, self.target.lengths)]
        widest = max([self.policy.max_k] + [r.fixed_k or 0 for r in rows])
        if self.drafter is None or widest == 0 or max(caps) <= 0:
            return [0] * len(rows), False, None
        if self.policy.settled and not any(r.fixed_k for r in rows):
            return [0] * len(rows), False, None  # no draft can pay here (policy.py, Settling): the drafter is not asked
        # each row drafts at its own K (and what it has left), never at the batch's widest: its drafts, and so its
        # seeded text, must not depend on the other rows; a grammar's masks follow chains: constrained batches
        # draft chains
        ks = [min(c, self.policy.max_k if r.fixed_k is None else r.fixed_k) for r, c in zip(rows, caps)]
        trees = self.trees and not self.batch.grammars.any
        outlook = self.drafter.outlook(DraftRows(self.batch.texts, ks, widest, trees, self.capabilities.tree_leaves))
        caps = [min(c, d) for c, d in zip(caps, outlook.drafts)]
        behind = outlook.behind if self.policy.adaptive else None  # only the adaptive policy prices a catch-up
        choice = self.policy.decide(Outlook([r.policy_state for r in rows], [min(c, self.policy.max_k) for c in caps],
                                            outlook.free, outlook.classes, behind,
                                            None if behind is None else outlook.probe_behind,
                                            [r.remaining for r in rows]))
        k_rows = [min(choice.k if r.fixed_k is None else r.fixed_k, c) for r, c in zip(rows, caps)]
        return k_rows, choice.trial, outlook

    def _propose(self, plan: StepPlan) -> Drafts:
        """The drafter's proposal for rows that draft this step, with each forced row's run in its place, and the
        grammar masks along it (free batches skip them: drafts.tolist() would be a host sync before the forward)."""
        proposal = self._ask_drafter(plan)
        tokens, q = with_forced(proposal, plan.forced, self.sampling)
        masks, rows, widths = None, None, plan.widths
        if self.batch.grammars.any:
            rows, widths = self.batch.grammars.verify_mask_rows(tokens.tolist(), widths)
            width = max(widths, default=0)
            if width < tokens.shape[1]:  # the grammar cut every row short: no forward over drafts none can keep
                tokens, rows = tokens[:, :width], [row[:width + 1] for row in rows]
                q = None if q is None else q[:, :width]
            if not (self.capabilities.argmax_masks and proposal.parents is None and self._reads_argmax_only()):
                masks, rows = self.batch.grammars.stack(rows), None
        return Drafts(tokens, q, proposal.parents, masks, widths, proposal, max(plan.k_rows) > 0, rows)

    def _ask_drafter(self, plan: StepPlan) -> Proposal:
        """The drafter's Proposal for the plan's choice (an empty one where no row drafts: it is not asked)."""
        k = max(plan.k_rows)
        if k == 0:  # forced rows are asked for nothing they keep
            return Proposal(_no_drafts(len(plan.k_rows), self.device))
        batch = self.batch
        grammars, penalties = batch.grammars, batch.penalties
        context = DraftContext(batch.texts, self.sampling, plan.u_draft, plan.noise, grammars if grammars.any else None,
                               penalties if penalties.active else None)
        proposal = self.drafter.propose(DraftChoice(plan.outlook, plan.k_rows, k, plan.trial), context)
        self.stats.draft_forward_calls += proposal.forward_calls
        proposal.tokens = proposal.tokens.to(self.device)
        return proposal

    def _verify(self, plan: StepPlan, drafts: Drafts) -> Verified:
        """One target forward over each row's last token and its drafts, and the exact rule per row: the one place
        where a chain and a token tree differ (a tree's outcome is read back as a chain's, Verified.of_tree)."""
        argmax = self.capabilities.forward_argmax if drafts.parents is None and self._argmax_only(drafts) else None
        if argmax is not None:  # greedy rows that need no distribution: token ids in, argmaxes out, no tensor built
            lengths = self.target.lengths
            tokens = drafts.tokens.tolist() if drafts.tokens.shape[1] else [[] for _ in self.active]
            ids = np.array([[r.tokens[-1], *t] for r, t in zip(self.active, tokens)], dtype=np.int64)
            best = argmax(ids) if drafts.mask_rows is None else argmax(ids, allowed=drafts.mask_rows)
            accepted, next_tokens = accept_greedy_lists(tokens, best.tolist(), drafts.widths)
            return Verified(tokens, accepted, next_tokens, None,
                            kept_lengths=[n + 1 + a for n, a in zip(lengths, accepted)])
        masks = drafts.masks if drafts.mask_rows is None else self.batch.grammars.stack(drafts.mask_rows)
        last = torch.tensor([[r.tokens[-1]] for r in self.active], dtype=torch.long, device=self.device)
        ids, sampling = torch.cat([last, drafts.tokens], dim=1) if drafts.tokens.shape[1] else last, self.sampling
        if drafts.parents is None:
            lengths = self.target.lengths
            logits, hidden = logits_and_hidden(self.target, ids, None, self.hidden_wanted)
            # each position's logit_bias and penalties see the kept text and the drafts before it
            scores = sampling.scores(logits, masks, self.batch.penalties.along_chain(drafts.tokens))
            noise = None if plan.noise is None else plan.noise[:, : ids.shape[1]]  # the positions verified
            num_accepted, next_token = verify_rows(drafts.tokens, drafts.q, scores, sampling, plan.u_verify,
                                                   drafts.widths, self.gen.method, noise)
            accepted = num_accepted.tolist()  # the one sync
            # Row b's cache took its last token and all the drafts: it keeps the last token and the accepted ones.
            return Verified(drafts.tokens.tolist(), accepted, next_token.tolist(), scores, hidden=hidden,
                            kept_lengths=[n + 1 + a for n, a in zip(lengths, accepted)])
        scores = sampling.scores(self.target.forward_tree(ids, drafts.parents), masks,
                                 self.batch.penalties.along_tree(drafts.tokens, drafts.parents))  # node: ancestors
        tokens = drafts.tokens.tolist()
        paths, next_tokens = verify_tree_rows(tokens, drafts.parents, scores, sampling, plan.u_verify, drafts.widths,
                                              plan.noise)
        return Verified.of_tree(tokens, drafts.parents, drafts.widths, paths, next_tokens, scores,
                                any(r.request.logprobs is not None for r in self.active))

    def _argmax_only(self, drafts: Drafts) -> bool:
        """Whether the step's verification reads nothing of the target but its argmax at each position: greedy
        rows, no grammar mask to add (none, or only as TokenMasks for forward_argmax), no logit_bias or penalty, no
        log-probabilities asked, no hidden states for the drafter."""
        return drafts.masks is None and self._reads_argmax_only()

    def _reads_argmax_only(self) -> bool:
        return self.sampling.all_greedy and not self.hidden_wanted and not self.batch.penalties.active and \
            all(r.request.logprobs is None for r in self.active)

    def _commit(self, plan: StepPlan, drafts: Drafts, verified: Verified) -> None:
        """The target's cache, the random streams, the grammars and the drafter keep what was verified."""
        accepted = verified.accepted
        if verified.paths is None:
            self.target.trim(verified.kept_lengths)
        else:
            self.target.keep_paths(verified.paths)
        self.batch.generators.advance([a + 1 for a in accepted])
        emitted = [verified.emitted(b) for b in range(len(self.active))]
        self.batch.grammars.advance(emitted)
        self.batch.penalties.advance(emitted)  # the kept tokens only: a rejected draft never counts
        if self.drafter is not None:
            kept = [0 if f else a for f, a in zip(plan.forced, accepted)]
            asked = drafts.proposal if drafts.asked else None
            self.drafter.observe(DraftOutcome(self.batch.texts, emitted, kept, asked,
                                              verified.hidden if self.hidden_wanted else None))

    def _learn(self, plan: StepPlan, drafts: Drafts, verified: Verified, draft_s: float,
               verify_s: float | None) -> None:
        """Tell the policy what its rows did; a step widened by a row with a fixed K or a forced run taught it nothing
        it asked. A draft time that includes a backlog fed with the drafts (not clean) is no draft step's cost."""
        rows, widths, proposal = self.active, drafts.widths, drafts.proposal
        k = max(widths)
        mine = [i for i, r in enumerate(rows) if r.fixed_k is None and not plan.forced[i]]
        if max((widths[i] for i in mine), default=0) < k:
            mine = []
        self.policy.learn(Outcome(
            [rows[i].policy_state for i in mine], k, [verified.accepted[i] for i in mine], [widths[i] for i in mine],
            len(rows), draft_s - proposal.catch_up_s if proposal.clean else None, verify_s, proposal.free,
            proposal.catch_up_tokens, proposal.catch_up_s))

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
    def _emit_all(self, plan: StepPlan, drafts: Drafts, verified: Verified) -> list[TokenEvent]:
        events = []
        for b, row in enumerate(self.active):
            events += self._emit(row, verified, b, verified.drafts_behind_last(b, drafts.widths[b]),
                                 len(plan.forced[b]))
        return events

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
            self.stats.new_tokens += 1  # counted as emitted: result() cannot sum rows that were released
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
        """Finished rows leave the batch: one RowChange for every holder (the target's cache or the prefix cache,
        the drafter, the row batch)."""
        for row in self.active:
            if row.finish_reason is None and row.index in self.cancelled:
                row.finish_reason = "cancelled"
        keep = [i for i, r in enumerate(self.active) if r.finish_reason is None]
        if len(keep) < len(self.active):
            self.layout.apply(RowChange(tuple(keep)))

    # ------------------------------------------------------------------ rows in
    def _join(self) -> list[TokenEvent]:
        """Admission prefills a chunk of the queued prompts; rows whose prompt is done emit their first token and
        join the batch in one RowChange (those that finished at it, or were cancelled, pass through: they join
        and leave in the same change, so the prefix cache and the drafter see them too)."""
        room = None if self.max_batch is None else self.max_batch - len(self.active)
        joined = self.admission.step(self.active, room, self.cancelled)
        if joined is None:
            return []
        rows = joined.rows
        events = [e for b, row in enumerate(rows) for e in self._emit(row, joined.first, b, 0, 0)]
        for row in rows:
            if row.finish_reason is None and row.index in self.cancelled:
                row.finish_reason = "cancelled"
        before = len(self.active)
        keep = tuple(range(before)) + tuple(before + j for j, r in enumerate(rows) if r.finish_reason is None)
        self.layout.apply(RowChange(keep, tuple(r.text for r in rows), joined.hidden), joined.fork, joined.batch)
        return events

    def idle_prefill(self, abort_when: Callable[[], bool] | None = None) -> int:
        """Work for an idle server (an agent runs its tools between turns): one chunk of a parked answer's prefill,
        after which the next turn takes the answer from the cache, exactly (PrefixCache.prefill_answer). The tokens
        prefilled; 0 when there are none to do, or while rows run or wait. abort_when (a request has arrived): a
        backend that can stop a forward midway does, and Interrupted is raised (backends.base)."""
        if self.prefix_cache is None or not self.idle:
            return 0
        return self.prefix_cache.prefill_answer(self.target, self.prefill_tokens_per_step, abort_when)

    def result(self, indices: list[int] | None = None) -> GenerationResult:
        """The GenerationResult of these rows (all by default), with the session's statistics."""
        self.stats.policy_summary = self.policy.summary()
        rows = [self.rows[i] for i in (indices if indices is not None else sorted(self.rows))]
        return result_of(rows, self.stats, self.gen.tokenizer is not None)


def _last_kind(k: int, accepted: int) -> str:
    """Provenance of the token after a row's kept drafts: the target's own step, its correction, or its bonus."""
    if k == 0:
        return "target"
    return "bonus" if accepted == k else "resampled"


@functools.lru_cache(maxsize=256)
def _no_drafts(rows: int, device: torch.device) -> torch.Tensor:
    """A shared, empty [rows, 0] proposal (a plain step's): allocating one costs ~40 us right after a forward."""
    return torch.zeros(rows, 0, dtype=torch.long, device=device)

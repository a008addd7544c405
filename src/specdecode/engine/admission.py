"""Rows joining a running batch between steps: their prompts prefill in a fork of the target's cache (a chunk of
columns per step, from the longest prefix a prefix cache holds), draw their first token through the same exact
rule as a step (K = 0), and join the RowBatch. Rows with the same prompt prefill it once."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..backends.base import logits_and_hidden, pad
from .results import TokenEvent
from .row_batch import Row, RowBatch
from ..exact.verification import Verified, verify_rows


@dataclass
class Staging:
    """Rows whose prompts are being prefilled, a chunk per step, in a fork of the target."""

    rows: list[Row]  # [R] the rows prefilled: one per distinct prompt
    fork: object  # the target's fork holding their KV so far
    ids: torch.Tensor  # [R, L] what is left of each prompt after its cached prefix, left-padded
    valid: torch.Tensor | None  # [R, L] False at padding; None: nothing padded
    copies: list[tuple[Row, int]]  # rows whose prompt rows[i] has: (row, i); they copy its KV when it is done
    copies_fork: object | None  # the target's rows reserved for the copies (None: no copies)
    column: int = 0  # the next column of ids to prefill

    @property
    def size(self) -> int:
        return len(self.rows) + len(self.copies)


class Admission:
    """The joining half of a DecodingSession (session.py), which it is a base of: the waiting rows, the Staging
    being prefilled, and their join into the running batch. It reads the session's models, caches, limits and
    statistics, and emits a joining row's first token through the session's _emit."""

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
        staging = self._staging
        if staging is None:
            return []
        start = time.perf_counter()
        col, ids = staging.column, staging.ids
        end = col + self._prefill_columns(ids.shape[1] - col, len(staging.rows),
                                          staging.rows[0].stats.cached_tokens + col)
        chunk_valid = staging.valid[:, col:end] if staging.valid is not None else None
        logits, hidden = logits_and_hidden(staging.fork, ids[:, col:end], chunk_valid, self.hidden_wanted,
                                           last_only=True)
        self.stats.target_forward_calls += 1
        events = []
        if end < ids.shape[1]:
            staging.column = end
        else:
            self._staging = None
            rows, ids, valid = staging.rows, staging.ids, staging.valid
            if staging.copies:
                rows, ids, valid, logits = self._copy_prompts(staging, logits)
            events = self._join(rows, staging.fork, ids, valid, logits, hidden)
        self.stats.prefill_time_s += time.perf_counter() - start
        return events

    def _stage(self, rows: list[Row]) -> Staging:
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
        prompts = [r.request.prompt for r in rows]
        hits = [None] * len(rows)
        if self.prefix_cache is not None:
            # a running row's prompt only: its answer's KV came from decode steps, not a prefill (prefix_cache.py),
            # unless answers are lent
            lend = self.prefix_cache.answers == "lend"
            running = [(r.request.prompt + r.tokens, n) if lend else (r.request.prompt, min(n, len(r.request.prompt)))
                       for r, n in zip(self.active, self.target.lengths)]
            hits = self.prefix_cache.admit(self.target, prompts, running, self.prefill_tokens_per_step, len(copies))
        fork = self.target.fork(len(rows))
        if any(hits):
            fork.load_prefixes(hits)
        for row, hit in zip(rows, hits):
            row.stats.cached_tokens = hit[1] if hit else 0
            self.stats.cached_prompt_tokens += row.stats.cached_tokens
        ids, valid = pad([p[r.stats.cached_tokens:] for p, r in zip(prompts, rows)], self.device, side="left")
        copies_fork = self.target.fork(len(copies)) if copies else None  # their rows, reserved now
        return Staging(rows, fork, ids, valid, copies, copies_fork)

    def idle_prefill(self) -> int:
        """Work for an idle server (an agent runs its tools between turns): one chunk of a parked answer's prefill,
        after which the next turn takes the answer from the cache, exactly (PrefixCache.prefill_answer). The tokens
        prefilled; 0 when there are none to do, or while rows run or wait."""
        if self.prefix_cache is None or not self.idle:
            return 0
        return self.prefix_cache.prefill_answer(self.target, self.prefill_tokens_per_step)

    def _copy_prompts(self, staging: Staging, logits):
        """Rows whose prompt another joining row has just prefilled start from a copy of its KV and its last logits
        (the same numbers a prefill of their own would give alone), after the prefilled rows."""
        fork, copies = staging.fork, staging.copies
        staging.copies_fork.load_prefixes([(fork.kv_ref(i), len(row.request.prompt)) for row, i in copies])
        fork.merge(staging.copies_fork)
        for row, _ in copies:
            row.stats.cached_tokens = len(row.request.prompt)
            self.stats.cached_prompt_tokens += row.stats.cached_tokens
        rows = staging.rows + [row for row, _ in copies]
        logits = torch.cat([logits, logits[[i for _, i in copies]]])
        ids, valid = pad([r.request.prompt for r in rows], self.device, side="left")
        return rows, ids, valid, logits

    def _prefill_columns(self, left: int, rows: int, position: int) -> int:
        """A row joining alone is cut at multiples of the budget from its prompt's start, as a cold prefill is, so
        one that starts from a cached prefix ends with the cold prefill's forwards (backends' reusable_prefix).

        Worked example, a budget of 8 tokens per step: a row joining alone with 5 of its 18 prompt tokens cached
        (13 columns left) prefills 3 columns (prompt positions 5..7, ending where a cold prefill's first forward
        ends), then 8 (8..15), then 2 (16..17). Several rows joining together take budget // rows columns a step.
        A backend whose forwards' numbers depend on their size (llama.cpp: prefill_tile 64) also has a row's last
        forward start at the prompt's last multiple of its tile, so that a later prompt re-sending this one (the
        next turn of a chat) takes all of it but that forward from the cache and still computes what a cold
        prefill would (LlamaCppBackend.reusable_prefix): fewer than 64 tokens again, not 64 to 127."""
        step = max(1, self.prefill_tokens_per_step // rows) if self.prefill_tokens_per_step else left + position
        columns = min(left, step - position % step if rows == 1 else step)
        tile = getattr(self.target, "prefill_tile", None)
        if tile and rows == 1 and self.prefill_tokens_per_step and columns == left:
            tail = (position + left - 1) // tile * tile - position  # where the last forward starts
            columns = tail if 0 < tail < left else columns
        return columns

    def _join(self, rows: list[Row], fork, ids, valid, logits, hidden) -> list[TokenEvent]:
        """Prefilled rows draw their first token from the prompt's last logits and join the running batch."""
        joined = RowBatch.of(rows, self.target.vocab_size, self.device)
        sampling, generators, grammars = joined.sampling, joined.generators, joined.grammars
        u = generators.uniforms([0 if g or r.coupled else 1 for g, r in zip(sampling.greedy_rows, rows)])
        noise = generators.noise(1, logits.shape[-1])
        masks, _ = grammars.verify_masks([[] for _ in rows], [0] * len(rows))
        scores = sampling.scores(logits[:, -1:], masks, joined.penalties.at_draft([]))  # the prompt's penalties
        first = verify_rows(ids[:, :0], None, scores, sampling, u, [0] * len(rows), self.gen.method,
                            noise)[1].tolist()
        generators.advance([1] * len(rows))
        grammars.advance([[t] for t in first])
        joined.penalties.advance([[t] for t in first])
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
            self.batch = self.batch.extend(joined.select(keep))
        else:
            self._park_joined(rows, fork, keep)
        return events

    def _park_joined(self, rows: list[Row], fork, keep: list[int]) -> None:
        """Rows that finished at their first token leave the fork before it merges; with a prefix cache their
        prompt's KV is parked, so that the same prompt next does not prefill again."""
        kept = set(keep)
        gone = [i for i in range(len(rows)) if i not in kept]
        if self.prefix_cache is None or not gone:
            fork.select_rows(keep)
            return
        prompts = [rows[i].request.prompt for i in gone]
        self.prefix_cache.park(fork, gone, prompts, [len(p) for p in prompts])

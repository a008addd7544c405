"""Rows joining a running batch between steps: their prompts prefill in a fork of the target's cache (a chunk of
columns per step, from the longest prefix a prefix cache holds) and draw their first token through the same exact
rule as a step (K = 0). Rows with the same prompt prefill it once. `Admission.step` returns the rows whose prompt is
done (`Joined`); the session emits their first tokens and moves them into the running batch (layout.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from ..backends.base import Capabilities, logits_and_hidden, pad
from .results import Stats
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


@dataclass(frozen=True)
class Joined:
    """Rows whose prompts are done, with their first token drawn: what the session emits and moves into the batch."""

    rows: list[Row]  # [J] in the order they join (the rows prefilled, then the rows that copied their prompts)
    fork: object  # the target's fork holding their prompts' KV, one row each, in that order
    batch: RowBatch  # [J] their host state, its random streams, grammars and penalties past the first token
    first: Verified  # [J] their first tokens (K = 0) and the scores they were drawn from
    hidden: torch.Tensor | None  # [J, n, H] the target's last hidden states of the prompts (a drafter that reads them)


class Admission:
    """The rows waiting to join (`waiting`, in order) and the Staging being prefilled.

    target: the target backend (its forks prefill) and its Capabilities; prefix_cache: a PrefixCache or None;
    budget: prompt tokens prefilled per step (None: all at once); hidden: whether a drafter reads the prompts'
    hidden states; share: whether rows with the same prompt prefill it once (a backend with prefix caching);
    method: the verification method of the first token; stats: the session's statistics, which it adds to."""

    def __init__(self, target, capabilities: Capabilities, prefix_cache, budget: int | None, hidden: bool,
                 share: bool, method: str, stats: Stats):
        self.target, self.capabilities, self.prefix_cache = target, capabilities, prefix_cache
        self.budget, self.hidden, self.share, self.method, self.stats = budget, hidden, share, method, stats
        self.device = target.device
        self.waiting: deque[Row] = deque()
        self.staging: Staging | None = None

    @property
    def queued(self) -> int:
        return len(self.waiting) + (self.staging.size if self.staging else 0)

    def clear(self) -> None:
        self.waiting.clear()
        self.staging = None

    def step(self, running: Sequence[Row], room: int | None, cancelled: set[int]) -> Joined | None:
        """Prefill a chunk of the queued prompts beside the running rows (at most `room` more rows; None: any);
        the rows whose prompt is done, with their first token, or None. Waiting rows in `cancelled` leave first."""
        for row in list(self.waiting):
            if row.index in cancelled:
                self.waiting.remove(row)
                row.finish_reason = "cancelled"
        room = len(self.waiting) if room is None else room
        if self.staging is None and self.waiting and room > 0:
            rows = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            self.staging = self._stage(rows, running)
        staging = self.staging
        if staging is None:
            return None
        start = time.perf_counter()
        col, ids = staging.column, staging.ids
        end = col + self._prefill_columns(ids.shape[1] - col, len(staging.rows),
                                          staging.rows[0].stats.cached_tokens + col)
        chunk_valid = staging.valid[:, col:end] if staging.valid is not None else None
        logits, hidden = logits_and_hidden(staging.fork, ids[:, col:end], chunk_valid, self.hidden, last_only=True)
        self.stats.target_forward_calls += 1
        joined = None
        if end < ids.shape[1]:
            staging.column = end
        else:
            self.staging = None
            rows, fork = staging.rows, staging.fork
            if staging.copies:
                rows, logits = self._copy_prompts(staging, logits)
            joined = self._first_tokens(rows, fork, logits, hidden)
        self.stats.prefill_time_s += time.perf_counter() - start
        return joined

    def _stage(self, rows: list[Row], running: Sequence[Row]) -> Staging:
        """A fork of the target for joining rows, each starting from the longest prefix of its prompt whose KV is
        cached (a finished or a running row's); what is left of the prompts is prefilled from there. Rows with the
        same prompt (a request's n choices) prefill it once: the others copy its KV when it is done (_copy_prompts)."""
        copies = []  # (row, the joining row it copies: an index into the rows prefilled)
        if self.share:
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
            lent = [(r.request.prompt + r.tokens, n) if lend else (r.request.prompt, min(n, len(r.request.prompt)))
                    for r, n in zip(running, self.target.lengths)]
            hits = self.prefix_cache.admit(self.target, prompts, lent, self.budget, len(copies))
        fork = self.target.fork(len(rows))
        if any(hits):
            fork.load_prefixes(hits)
        for row, hit in zip(rows, hits):
            row.stats.cached_tokens = hit[1] if hit else 0
            self.stats.cached_prompt_tokens += row.stats.cached_tokens
        ids, valid = pad([p[r.stats.cached_tokens:] for p, r in zip(prompts, rows)], self.device, side="left")
        copies_fork = self.target.fork(len(copies)) if copies else None  # their rows, reserved now
        return Staging(rows, fork, ids, valid, copies, copies_fork)

    def _copy_prompts(self, staging: Staging, logits) -> tuple[list[Row], torch.Tensor]:
        """Rows whose prompt another joining row has just prefilled start from a copy of its KV and its last logits
        (the same numbers a prefill of their own would give alone), after the prefilled rows."""
        fork, copies = staging.fork, staging.copies
        staging.copies_fork.load_prefixes([(fork.kv_ref(i), len(row.request.prompt)) for row, i in copies])
        fork.merge(staging.copies_fork)
        for row, _ in copies:
            row.stats.cached_tokens = len(row.request.prompt)
            self.stats.cached_prompt_tokens += row.stats.cached_tokens
        return staging.rows + [row for row, _ in copies], torch.cat([logits, logits[[i for _, i in copies]]])

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
        step = max(1, self.budget // rows) if self.budget else left + position
        columns = min(left, step - position % step if rows == 1 else step)
        tile = self.capabilities.prefill_tile
        if tile and rows == 1 and self.budget and columns == left:
            tail = (position + left - 1) // tile * tile - position  # where the last forward starts
            columns = tail if 0 < tail < left else columns
        return columns

    def _first_tokens(self, rows: list[Row], fork, logits, hidden) -> Joined:
        """Prefilled rows draw their first token from the prompt's last logits, by the step's exact rule."""
        joined = RowBatch.of(rows, self.target.vocab_size, self.device)
        sampling, generators, grammars = joined.sampling, joined.generators, joined.grammars
        u = generators.uniforms([0 if g or r.coupled else 1 for g, r in zip(sampling.greedy_rows, rows)])
        noise = generators.noise(1, logits.shape[-1])
        masks, _ = grammars.verify_masks([[] for _ in rows], [0] * len(rows))
        scores = sampling.scores(logits[:, -1:], masks, joined.penalties.at_draft([]))  # the prompt's penalties
        no_drafts = torch.zeros(len(rows), 0, dtype=torch.long, device=self.device)
        first = verify_rows(no_drafts, None, scores, sampling, u, [0] * len(rows), self.method, noise)[1].tolist()
        generators.advance([1] * len(rows))
        grammars.advance([[t] for t in first])
        joined.penalties.advance([[t] for t in first])
        self.stats.num_rows_with_first_token += len(rows)
        return Joined(rows, fork, joined, Verified([[] for _ in rows], [0] * len(rows), first, scores), hidden)

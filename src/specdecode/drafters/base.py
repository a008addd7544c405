"""What the decoding loop needs from a drafter: proposals with the distributions they were drawn from."""

from __future__ import annotations

from typing import Protocol

import torch

from ..sampling import BatchSampling


class Drafter(Protocol):
    forward_calls: int  # model forwards spent drafting (0 for a drafter with no model)
    # Optional: `catch_up`, the tokens the last propose() had to feed before drafting (the prompt, or what plain
    # steps emitted), and `catch_up_s`, the seconds of a forward that fed them apart (0: none). The loop times
    # drafting without that forward; if the catch-up was fed with the drafts (catch_up > 2 and catch_up_s 0) the
    # step's draft time is not a draft step's cost and the policy does not learn from it. Optional too:
    # `behind()` (per row, tokens a proposal would feed first) and `limit_catch_up()` (bound that backlog, for a
    # probe: only q changes); the policy uses them to keep probes cheap.
    # Optional: `needs_hidden_states = True` makes the loop ask the target for its last hidden states and hand
    # them to prefill() and update() (EAGLE/Medusa-style heads); off by default, and then free.

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Take the (left-padded) prompts of a new batch."""

    def max_drafts(self, k: int) -> list[int]:
        """Per row, how many of k drafts the drafter can really propose now (prompt lookup: its match length)."""

    def propose(self, k: int, sampling: BatchSampling, uniforms: torch.Tensor | None,
                num_drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row [B, k], and q [S, k, V] for the S sampled rows of `sampling`, or None.

        q must be exactly the distribution each sampled row's token was drawn from, after the same warping as the
        target's (`sampling.probs`). A drafter that proposes deterministically returns q=None: the rejection step
        then treats its drafts as one-hot proposals, exactly, without a dense tensor. Greedy rows take argmaxes.
        uniforms [B, k]: row b's own random numbers for its first num_drafts[b] drafts; drafts past
        num_drafts[b] are ignored by the verification and must not use randomness. Rows that `sampling` marks as
        coupled draw argmax(log q + noise) instead (`sampling.couple_drafts`); a drafter that skips this stays exact,
        it only gets fewer of those rows' drafts accepted.
        """

    def update(self, drafts: list[list[int]], num_accepted: list[int], next_tokens: list[int]) -> None:
        """After verification: row b kept drafts[b][:num_accepted[b]] and then emitted next_tokens[b].

        Called after the prefill too, with no drafts, to hand over the first token.
        """

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows of the batch."""

    def fork(self, batch_size: int) -> "Drafter":
        """An empty drafter on the same model for new rows (continuous batching: prefilled, then merged)."""

    def merge(self, other: "Drafter") -> None:
        """Append the rows of a fork to this batch."""

"""What the decoding loop needs from a drafter: proposals with the distributions they were drawn from."""

from __future__ import annotations

from typing import Protocol

import torch

from ..sampling import SamplingParams


class Drafter(Protocol):
    vocab_size: int
    forward_calls: int

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Take the (left-padded) prompts of a new batch."""

    def propose(self, k: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row [B, k] and the distributions q [B, k, V] they were drawn from.

        q must be exactly the distribution each token was sampled from, after the same warping as the target's
        (a deterministic drafter returns one-hot rows). In greedy mode q may be None.
        """

    def update(self, drafts: list[list[int]], num_accepted: list[int], next_tokens: list[int]) -> None:
        """After verification: row b kept drafts[b][:num_accepted[b]] and then emitted next_tokens[b].

        Called after the prefill too, with no drafts, to hand over the first token.
        """

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows of the batch."""

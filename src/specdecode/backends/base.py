"""The narrow interface between the decoding loop and a model.

A backend holds one KV cache for a batch of rows. The loop only ever asks it to run new tokens and to forget
tokens: that is all speculative decoding needs, so other backends (a static-cache compiled one for GPUs,
llama.cpp for CPUs) can be added without touching the sampler or the loop.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ModelBackend(Protocol):
    vocab_size: int  # width of the logits returned (the vocabulary shared with the other model)
    device: torch.device
    max_positions: int | None  # the model's context length, when known

    def reset(self, batch_size: int) -> None:
        """Start an empty cache for batch_size rows."""

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Append input_ids [B, n] to the cache; return float logits [B, n, V] ([B, 1, V] if last_only).

        valid [B, n] marks real tokens; False marks padding (left padding of ragged inputs), which is never
        attended to. Each row's real tokens are placed at the positions that follow its cached tokens.
        """

    def trim(self, lengths: list[int]) -> None:
        """Row b keeps its first lengths[b] real tokens and forgets the rest (rejected drafts)."""

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows stop costing work)."""

    @property
    def lengths(self) -> list[int]:
        """Real tokens cached per row."""

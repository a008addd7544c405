"""Sampling parameters and the one function that turns logits into the distribution we sample from.

The same function makes the target's p and the draft's q: speculative decoding is lossless only if both
are warped identically (temperature, then top-k, then top-p, as transformers' logits warpers do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy decoding
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables top-p), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, with transformers' semantics (min_tokens_to_keep=1).

    Removed entries become -inf. Works on any leading shape [..., V]; returns float32.
    """
    if params.greedy:
        raise ValueError("warp_logits is for sampling; greedy decoding takes the argmax of the raw logits")
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        # Ties with the k-th value are kept, as in TopKLogitsWarper.
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - params.top_p)
        remove_sorted[..., -1:] = False  # min_tokens_to_keep = 1
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from, for both the target (p) and the draft (q)."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V]; a token of probability 0 is never drawn."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)

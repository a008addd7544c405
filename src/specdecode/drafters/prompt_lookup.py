"""Prompt lookup: draft by copying what followed the last occurrence of the current n-gram in the context.

No second model (Saxena 2023, "Prompt Lookup Decoding"). Helps when the output repeats the input (code
edits, summaries with quotes, retrieval answers). The proposal is deterministic, so q is one-hot: a draft x is
kept with probability p(x), and a rejection resamples from p with x removed, which is still exactly the target's
distribution.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams


class PromptLookupDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, vocab_size: int | None = None, device=None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # Left as None, both are taken from the target by the generator.
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else None
        self.forward_calls = 0  # no model: drafting is free
        self._context: list[list[int]] = []

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        rows = input_ids.tolist()
        masks = valid.tolist() if valid is not None else [[True] * len(r) for r in rows]
        self._context = [[t for t, v in zip(r, m) if v] for r, m in zip(rows, masks)]

    def _lookup(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            # the most recent earlier occurrence wins: recent text predicts best
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == tail:
                    follow = context[start + n: start + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [context[-1]] * k  # nothing to copy: a guess that costs only a rejection

    def propose(self, k: int, params: SamplingParams, generator):
        tokens = torch.tensor([self._lookup(c, k) for c in self._context], dtype=torch.long, device=self.device)
        if params.greedy:
            return tokens, None
        q = torch.zeros(len(self._context), k, self.vocab_size, device=self.device)
        q.scatter_(2, tokens.unsqueeze(-1), 1.0)
        return tokens, q

    def update(self, drafts: list[list[int]], num_accepted: list[int], next_tokens: list[int]) -> None:
        for context, d, n, t in zip(self._context, drafts, num_accepted, next_tokens):
            context.extend(d[:n] + [t])

    def select_rows(self, rows: list[int]) -> None:
        self._context = [self._context[r] for r in rows]

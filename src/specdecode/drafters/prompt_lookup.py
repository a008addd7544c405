"""Prompt lookup: draft by copying what followed the last occurrence of the current n-gram in the context.

No second model (Saxena 2023, "Prompt Lookup Decoding"). Helps when the output repeats the input (code
edits, summaries with quotes, retrieval answers). The proposal is deterministic, so it returns q=None: a draft x
is kept with probability p(x), and a rejection resamples from p with x removed, which is still exactly the
target's distribution, and no [B, K, V] tensor is built.
"""

from __future__ import annotations

import torch

from .base import Drafter, Proposal, match_class


class PromptLookupDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._context: list[list[int]] = []
        self._matches: list[list[int]] = []
        self._ngrams: list[int] = []  # the n-gram length each row's match was found at this step (0: none)

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, hidden=None) -> None:
        rows = input_ids.tolist()
        masks = valid.tolist() if valid is not None else [[True] * len(r) for r in rows]
        self._context = [[t for t, v in zip(r, m) if v] for r, m in zip(rows, masks)]

    def fork(self, batch_size: int) -> "PromptLookupDrafter":
        return PromptLookupDrafter(self.max_ngram, self.min_ngram)

    def merge(self, other: "PromptLookupDrafter") -> None:
        self._context += other._context

    def _lookup(self, context: list[int], k: int) -> list[int]:
        """What followed the most recent earlier occurrence of the longest matching tail n-gram ([] if none)."""
        return self._find(context, k)[0]

    def _find(self, context: list[int], k: int) -> tuple[list[int], int]:
        """_lookup's draft and the n-gram length it was found at ([], 0 if none)."""
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # the most recent occurrence: recent text predicts best
                if context[start:start + n] == tail:
                    return context[start + n: start + n + k], n
        return [], 0

    def max_drafts(self, k: int) -> list[int]:
        """How many drafts each row can really propose (the length of its match): a bound for the loop's K."""
        found = [self._find(c, k) for c in self._context]
        self._matches, self._ngrams = [m for m, _ in found], [n for _, n in found]
        return [len(m) for m in self._matches]

    def draft_classes(self) -> list[int | None]:
        """Per row, the class of the n-gram length its match was found at (None where none was found)."""
        return [match_class(n) if n else None for n in self._ngrams]

    def propose(self, k: int, context, uniforms, num_drafts):
        matches = self._matches or [self._lookup(c, k) for c in self._context]
        self._matches = []
        # Past the match (or with none) a row's drafts are not verified (num_drafts stops there): pad with anything.
        rows = [m[:k] + [c[-1]] * (k - len(m[:k])) for m, c in zip(matches, self._context)]
        return Proposal(torch.tensor(rows, dtype=torch.long))

    def update(self, emitted: list[list[int]], kept: list[int], hidden=None) -> None:
        for context, e in zip(self._context, emitted):
            context.extend(e)

    def select_rows(self, rows: list[int]) -> None:
        self._context = [self._context[r] for r in rows]

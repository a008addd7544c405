"""Prompt lookup: draft by copying what followed the last occurrence of the current n-gram in the context.

No second model (Saxena 2023, "Prompt Lookup Decoding"). Helps when the output repeats the input (code
edits, summaries with quotes, retrieval answers). The proposal is deterministic, so it returns q=None: a draft x
is kept with probability p(x), and a rejection resamples from p with x removed, which is still exactly the
target's distribution, and no [B, K, V] tensor is built.
"""

from __future__ import annotations

import torch

from .base import (MATCH_CLASS_ACCEPTANCE, DraftChoice, DraftContext, Drafter, DraftOutlook, DraftRows, Proposal,
                   match_class)


class PromptLookupDrafter(Drafter):
    """Copies what followed the latest earlier occurrence of each row's last n-gram (max_ngram down to min_ngram),
    read from the row's text where the session keeps it: it keeps nothing per row."""

    class_acceptance = MATCH_CLASS_ACCEPTANCE

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

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

    def outlook(self, rows: DraftRows) -> DraftOutlook:
        """Per row its match (what it can draft) and the class of the n-gram length it was found at."""
        found = [self._find(text.tokens(), rows.widest) for text in rows.texts]
        return DraftOutlook([len(m) for m, _ in found], [match_class(n) if n else None for _, n in found],
                            plan=[m for m, _ in found])

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        k = choice.k
        # Past the match (or with none) a row's drafts are not verified (k_rows stops there): pad with anything.
        rows = [m[:k] + text.tail(1) * (k - len(m[:k])) for m, text in zip(choice.outlook.plan, context.texts)]
        return Proposal(torch.tensor(rows, dtype=torch.long))

"""The grammar state of each row of a batch, as the decoding loop uses it.

A constrained row's distribution at every position is normalise(p * mask), where mask is what its grammar allows
after the tokens before that position (sampling.BatchSampling.warp applies it, identically for the target's p and
the draft's q). A step needs the masks along each row's proposed chain: the drafter asks for them position by
position while it drafts (draft_mask), the verifier for all K + 1 positions at once (verify_masks). Both walk the
row's matcher forward along the proposal and roll it back; only the tokens a row really emits advance it.
Where the grammar allows a single continuation, its tokens are proposed as drafts that need no model (forced).
"""

from __future__ import annotations

import torch


class RowGrammars:
    """matchers[b]: row b's grammar matcher (constraints.Matcher), or None for a free row."""

    def __init__(self, matchers: list, vocab_size: int, device=None):
        self.matchers = list(matchers)
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.any = any(m is not None for m in self.matchers)
        self._walked = [0] * len(self.matchers)  # tokens each matcher was advanced along the current draft
        self._draft_masks: list[list[torch.Tensor]] = [[] for _ in self.matchers]
        self._draft_path: list[list[int]] = [[] for _ in self.matchers]

    def __len__(self) -> int:
        return len(self.matchers)

    def select(self, rows: list[int]) -> "RowGrammars":
        return RowGrammars([self.matchers[r] for r in rows], self.vocab_size, self.device)

    def extend(self, other: "RowGrammars") -> "RowGrammars":
        return RowGrammars(self.matchers + other.matchers, self.vocab_size, self.device)

    def forced(self, limits: list[int]) -> list[list[int]]:
        """Per row, the tokens its grammar forces from here (at most limits[b]); [] for free rows."""
        return [m.forced(n) if m is not None and n > 0 else [] for m, n in zip(self.matchers, limits)]

    def advance(self, emitted: list[list[int]]) -> None:
        """Rows emitted these tokens (accepted drafts and the token after them)."""
        for m, tokens in zip(self.matchers, emitted):
            if m is not None:
                m.advance(tokens)

    # ------------------------------------------------------------------ masks along a proposal
    def draft_mask(self, i: int, previous: torch.Tensor | None) -> torch.Tensor | None:
        """[B, V] allowed tokens at draft position i; previous [B]: the drafts at position i - 1 (None at i = 0)."""
        if not self.any:
            return None
        if i == 0:
            self.rewind()
        prev = previous.tolist() if previous is not None and i > 0 else None
        masks = torch.ones(len(self.matchers), self.vocab_size, dtype=torch.bool)
        for b, m in enumerate(self.matchers):
            if m is None:
                continue
            if prev is not None:
                self._walk(b, prev[b])
            masks[b] = self._mask(b)
            self._draft_masks[b].append(masks[b])
        return masks.to(self.device)

    def rewind(self) -> None:
        """Undo the drafting walk: matchers back at the rows' emitted tokens."""
        for b, m in enumerate(self.matchers):
            if m is not None and self._walked[b]:
                m.rollback(self._walked[b])
            self._walked[b] = 0
        self._draft_masks = [[] for _ in self.matchers]
        self._draft_path = [[] for _ in self.matchers]

    def verify_masks(self, tokens: list[list[int]], k_rows: list[int]) -> tuple[torch.Tensor | None, list[int]]:
        """Masks [B, K + 1, V] along each row's first k_rows[b] proposed tokens, and k_rows cut before the first
        token its grammar does not allow (such a draft, from a drafter that ignores grammars, cannot be kept)."""
        if not self.any:
            return None, k_rows
        drafted = [(list(self._draft_path[b]), list(self._draft_masks[b])) for b in range(len(self.matchers))]
        self.rewind()
        width = max(k_rows, default=0) + 1
        masks = torch.ones(len(self.matchers), width, self.vocab_size, dtype=torch.bool)
        k_rows = list(k_rows)
        for b, m in enumerate(self.matchers):
            if m is None:
                continue
            path, known = drafted[b]
            for j in range(k_rows[b] + 1):
                # The drafter already computed the masks along its own drafts: reuse them while the path agrees.
                reuse = j < len(known) and path[:j] == tokens[b][:j]
                masks[b, j] = known[j] if reuse else self._mask(b)
                if j == k_rows[b]:
                    break
                if not masks[b, j, tokens[b][j]]:
                    # Only deterministic drafts can be disallowed (sampled drafts come from the masked q): for
                    # them a disallowed x has p(x) = 0, and the residual of a one-hot draft at p(x) = 0 is p
                    # itself, so stopping the row's drafts here is exactly what the rejection rule would do.
                    k_rows[b] = j
                    break
                self._walk(b, tokens[b][j])
        self.rewind()
        return masks.to(self.device), k_rows

    def _walk(self, b: int, token: int) -> None:
        consumed = self.matchers[b].advance([token])
        self._walked[b] += consumed
        self._draft_path[b].append(token)

    def _mask(self, b: int) -> torch.Tensor:
        mask = self.matchers[b].mask()
        # A state that allows nothing (a path past the grammar's end) is never sampled from; an all-False row would
        # only turn into NaNs in the distributions of positions that the verification never reaches.
        return mask if bool(mask.any()) else torch.ones_like(mask)

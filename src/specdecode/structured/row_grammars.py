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

from .constraints import TokenMask


class RowGrammars:
    """matchers[b]: row b's grammar matcher (constraints.Matcher), or None for a free row.

    Each position's allowed tokens are computed once (a constraints.TokenMask, llguidance's bitmask) and handed
    out in the form the consumer needs: bool [B, V] to the drafter (draft_mask), the additive form (0 / -inf,
    `scores + bias` = `scores.masked_fill(~mask, -inf)` bit for bit, without masked_fill's per-token branch) to the
    distributions (bias_for, verify_masks)."""

    def __init__(self, matchers: list, vocab_size: int, device=None):
        self.matchers = list(matchers)
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.any = any(m is not None for m in self.matchers)
        self._walked = [0] * len(self.matchers)  # tokens each matcher was advanced along the current draft
        self._draft_masks: list[list[TokenMask]] = [[] for _ in self.matchers]
        self._draft_path: list[list[int]] = [[] for _ in self.matchers]
        self._handed: tuple | None = None  # (the bool tensor draft_mask last returned, its rows' TokenMasks, bias)

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
        """[B, V] bool, allowed tokens at draft position i; previous [B]: the drafts at position i - 1 (None at
        i = 0). bias_for(the returned tensor) gives its additive form."""
        if not self.any:
            return None
        if i == 0:
            self.rewind()
        prev = previous.tolist() if previous is not None and i > 0 else None
        masks = torch.ones(len(self.matchers), self.vocab_size, dtype=torch.bool)
        rows: list[TokenMask | None] = [None] * len(self.matchers)
        for b, m in enumerate(self.matchers):
            if m is None:
                continue
            if prev is not None:
                self._walk(b, prev[b])
            rows[b] = self._mask(b)
            masks[b] = rows[b].as_bool()
            self._draft_masks[b].append(rows[b])
        masks = masks.to(self.device)
        self._handed = (masks, rows, None)
        return masks

    def bias_for(self, mask: torch.Tensor) -> torch.Tensor | None:
        """The additive form [B, V] of the bool mask draft_mask last returned (the drafter hands it back to the
        sampler), made once from the rows' bitmasks; None for any other tensor."""
        if self._handed is None or mask is not self._handed[0]:
            return None
        handed, rows, bias = self._handed
        if bias is None:
            bias = self.stack([[r] for r in rows])[:, 0]
            self._handed = (handed, rows, bias)
        return bias

    def rewind(self) -> None:
        """Undo the drafting walk: matchers back at the rows' emitted tokens."""
        for b, m in enumerate(self.matchers):
            if m is not None and self._walked[b]:
                m.rollback(self._walked[b])
            self._walked[b] = 0
        self._draft_masks = [[] for _ in self.matchers]
        self._draft_path = [[] for _ in self.matchers]
        self._handed = None

    def verify_masks(self, tokens: list[list[int]], k_rows: list[int]) -> tuple[torch.Tensor | None, list[int]]:
        """Masks along each row's first k_rows[b] proposed tokens, in additive form: float32 [B, K + 1, V], -0.0
        where allowed and -inf elsewhere (what sampling.BatchSampling.scores adds to the logits); and k_rows cut
        before the first token its grammar does not allow (such a draft, from a drafter that ignores grammars,
        cannot be kept)."""
        rows, k_rows = self.verify_mask_rows(tokens, k_rows)
        return (None if rows is None else self.stack(rows)), k_rows

    def verify_mask_rows(self, tokens: list[list[int]],
                         k_rows: list[int]) -> tuple[list[list[TokenMask | None]] | None, list[int]]:
        """verify_masks' masks as they are: per row, the TokenMask at each of its K + 1 positions (None: a free row,
        or a position past the row's drafts), for a greedy verification that reads each position's argmax only
        (TokenMask.argmax_of); stack() makes verify_masks' tensor of them."""
        if not self.any:
            return None, k_rows
        drafted = [(list(self._draft_path[b]), list(self._draft_masks[b])) for b in range(len(self.matchers))]
        self.rewind()
        width = max(k_rows, default=0) + 1
        k_rows = list(k_rows)
        masks: list[list[TokenMask | None]] = [[None] * width for _ in self.matchers]
        for b, m in enumerate(self.matchers):
            if m is None:
                continue
            path, known = drafted[b]
            for j in range(k_rows[b] + 1):
                # The drafter already computed the masks along its own drafts: reuse them while the path agrees.
                reuse = j < len(known) and path[:j] == tokens[b][:j]
                masks[b][j] = known[j] if reuse else self._mask(b)
                if j == k_rows[b]:
                    break
                if not masks[b][j].allows(tokens[b][j]):
                    # Only deterministic drafts can be disallowed (sampled drafts come from the masked q): for
                    # them a disallowed x has p(x) = 0, and the residual of a one-hot draft at p(x) = 0 is p
                    # itself, so stopping the row's drafts here is exactly what the rejection rule would do.
                    k_rows[b] = j
                    break
                self._walk(b, tokens[b][j])
        self.rewind()
        return masks, k_rows

    def stack(self, masks: list[list[TokenMask | None]]) -> torch.Tensor:
        """float32 [B, width, V] (width: the rows' positions): each TokenMask's additive form written in place;
        None (free rows, positions past a row's drafts): -0.0, every token allowed."""
        width = max((len(row) for row in masks), default=0)
        out = torch.empty(len(masks), width, self.vocab_size, dtype=torch.float32)
        view = out.numpy()
        for b, row in enumerate(masks):
            for j, mask in enumerate(row):
                if mask is None:
                    view[b, j].fill(-0.0)
                else:
                    mask.write_bias(view[b, j])
        return out.to(self.device)

    def _walk(self, b: int, token: int) -> None:
        consumed = self.matchers[b].advance([token])
        self._walked[b] += consumed
        self._draft_path[b].append(token)

    def _mask(self, b: int) -> TokenMask:
        mask = self.matchers[b].allowed()
        # A state that allows nothing (a path past the grammar's end) is never sampled from; an all-False row would
        # only turn into NaNs in the distributions of positions that the verification never reaches.
        return TokenMask.everything(self.vocab_size) if mask.empty else mask


def with_forced(proposal, forced: list[list[int]], sampling):
    """The step's drafts [B, K] and q: the drafter's, with each forced row's run in place of its drafts. A forced
    token is a deterministic draft (q one-hot where the batch has a dense q): kept with probability p(x), which is 1
    where the grammar allows x alone, so the verification needs no special case to stay exact."""
    tokens, q = proposal.tokens, proposal.q
    if not any(forced):
        return tokens, q
    width = max(tokens.shape[1], max(map(len, forced)))
    out = torch.zeros(tokens.shape[0], width, dtype=torch.long, device=tokens.device)
    out[:, : tokens.shape[1]] = tokens
    for b, run in enumerate(forced):
        if run:
            out[b, : len(run)] = torch.tensor(run, dtype=torch.long, device=tokens.device)
    if q is None:
        return out, None
    dense = torch.zeros(q.shape[0], width, q.shape[2], dtype=q.dtype, device=q.device)
    dense[:, : q.shape[1]] = q
    dense[:, q.shape[1]:] = 1.0 / q.shape[2]  # never read: past each model row's drafts
    position = {int(b): s for s, b in enumerate(sampling.sampled_index.tolist())}
    for b, run in enumerate(forced):
        if run and b in position:
            dense[position[b]] = 0.0
            dense[position[b], torch.arange(len(run)), torch.tensor(run)] = 1.0
            dense[position[b], len(run):] = 1.0 / q.shape[2]
    return out, dense

"""The sampling options that read the text so far, per row of a batch: logit_bias and the repetition, frequency and
presence penalties. They adjust the raw logits before the warping (sampling.BatchSampling.warp: temperature, top-k,
top-p, min-p), for the target's p and the draft's q alike.

At one position of one row, with raw logits l, its prompt + output before that position, and its output alone:

    l[t] += logit_bias[t]                                             OpenAI; vLLM; transformers' sequence_bias
    l[t] = l[t] / r if l[t] > 0 else l[t] * r   for t in prompt + output   repetition_penalty r: transformers, vLLM
    l[t] -= f * count(t) + p * (count(t) > 0)   for t in output            frequency f, presence p: OpenAI, vLLM

Exactness under speculation: every verified position (and every draft position's q) sees exactly the text before it
on its own path: what the row kept (this module's state), then the drafts between the row's last token and that
position (a chain's earlier drafts, a tree node's ancestors). A rejected draft never counts: the state only ever
takes the tokens a row emitted.

Cost: the state (which tokens the prompt + output hold, the output's counts) lives on the device as [B, V]
tensors that each step's emitted tokens update sparsely. A step applies it to its logits [B, P, V] elementwise
(like the warp), then rewrites the entries of the drafted tokens along each path (a gather and a scatter of
[B, P, N] values, N the step's drafts): nothing per token in Python, nothing that grows with the history. A batch
where no row sets an option holds nothing here and its steps never call it (`active`).
"""

from __future__ import annotations

import torch

from .token_tree import ancestors_mask

_SCALARS = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}  # a neutral row's values (no change to a logit)
_TABLES = {"bias": 0.0, "seen": False, "counts": 0.0}  # [B, V] state; None when no row of the batch needs it


class RowPenalties:
    """Each row's logit_bias and penalties, and the text each has so far, as device tensors over the vocabulary.

    bias [B, V] float32: the logit_bias; seen [B, V] bool: the tokens of prompt + output (repetition); counts [B, V]
    float32: each token's occurrences in the output (frequency, presence). A table exists only when some row needs
    it; rows without an option hold neutral values, whose arithmetic leaves a logit bit for bit as it was. Mutable:
    advance() records what the rows emitted; select and extend return a new object."""

    def __init__(self, params: list, prompts: list[list[int]], vocab_size: int, device=None):
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.rows = len(params)
        self.active = any(p.adjusts_logits for p in params)
        self.repetition = self.frequency = self.presence = None
        self.bias = self.seen = self.counts = None
        if not self.active:
            return
        self.repetition = self._column([p.repetition_penalty for p in params])
        self.frequency = self._column([p.frequency_penalty for p in params])
        self.presence = self._column([p.presence_penalty for p in params])
        if any(p.logit_bias for p in params):
            self.bias = torch.zeros(self.rows, vocab_size, dtype=torch.float32)
            for b, p in enumerate(params):
                for token, value in p.logit_bias:
                    self.bias[b, token] = value
            self.bias = self.bias.to(self.device)
        if any(p.repetition_penalty != 1 for p in params):
            self.seen = torch.zeros(self.rows, vocab_size, dtype=torch.bool, device=self.device)
            self._record(self.seen, [r if p.repetition_penalty != 1 else [] for r, p in zip(prompts, params)])
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            self.counts = torch.zeros(self.rows, vocab_size, dtype=torch.float32, device=self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device).view(-1, 1, 1)  # [B, 1, 1]

    def __len__(self) -> int:
        return self.rows

    # ------------------------------------------------------------------ rows in, rows out
    def select(self, rows: list[int]) -> "RowPenalties":
        out = self._empty(len(rows), self.active)
        if self.active:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            for name in (*_SCALARS, *_TABLES):
                value = getattr(self, name)
                setattr(out, name, None if value is None else value[index])
        return out

    def extend(self, other: "RowPenalties") -> "RowPenalties":
        out = self._empty(self.rows + other.rows, self.active or other.active)
        if out.active:
            for name, fill in (*_SCALARS.items(), *_TABLES.items()):
                mine, theirs = getattr(self, name), getattr(other, name)
                if mine is not None or theirs is not None or name in _SCALARS:
                    setattr(out, name, torch.cat([self._filled(name, fill), other._filled(name, fill)]))
        return out

    def _empty(self, rows: int, active: bool) -> "RowPenalties":
        out = RowPenalties([], [], self.vocab_size, self.device)
        out.rows, out.active = rows, active
        return out

    def _filled(self, name: str, fill) -> torch.Tensor:
        """This object's table or column `name`, or the neutral one of its rows where it has none."""
        value = getattr(self, name)
        if value is not None:
            return value
        if name in _SCALARS:
            return torch.full((self.rows, 1, 1), fill, dtype=torch.float32, device=self.device)
        dtype = torch.bool if isinstance(fill, bool) else torch.float32
        return torch.full((self.rows, self.vocab_size), fill, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ the text so far
    def advance(self, emitted: list[list[int]]) -> None:
        """Row b emitted the tokens emitted[b] (kept drafts and the token after them): one sparse update per table."""
        if not self.active or (self.seen is None and self.counts is None):
            return
        if self.seen is not None:
            self._record(self.seen, emitted)
        if self.counts is not None:
            rows = [b for b, tokens in enumerate(emitted) for _ in tokens]
            if rows:
                index = (torch.tensor(rows, device=self.device),
                         torch.tensor([t for tokens in emitted for t in tokens], device=self.device))
                self.counts.index_put_(index, torch.ones(len(rows), device=self.device), accumulate=True)

    def _record(self, table: torch.Tensor, tokens: list[list[int]]) -> None:
        rows = [b for b, row in enumerate(tokens) for _ in row]
        if rows:
            index = (torch.tensor(rows, device=self.device),
                     torch.tensor([t for row in tokens for t in row], device=self.device))
            table.index_put_(index, torch.tensor(True, device=self.device))

    # ------------------------------------------------------------------ a step's paths
    def along_chain(self, tokens: torch.Tensor) -> "PathPenalties | None":
        """The step's view for a chain of drafts tokens [B, K] verified at K + 1 positions: position j sees the
        drafts before it. None when no row has an option (the caller then adjusts nothing)."""
        if not self.active:
            return None
        k = tokens.shape[1]
        before = torch.ones(k + 1, k, dtype=torch.bool, device=self.device).tril(-1).unsqueeze(0)
        return PathPenalties(self, tokens, before)

    def along_tree(self, tokens: torch.Tensor, parents: list[list[int]]) -> "PathPenalties | None":
        """A token tree's view: tokens [B, N], parents[b] row b's tree (token_tree.py); position 0 (the root) sees
        no draft, position i + 1 (after node i) sees node i and its ancestors, never its siblings."""
        if not self.active:
            return None
        before = torch.stack([ancestors_mask(p)[:, 1:] for p in parents]).to(self.device)  # [B, N + 1, N]
        return PathPenalties(self, tokens, before)

    def at_draft(self, drafted: list[torch.Tensor]) -> "PathPenalties | None":
        """A drafter's view at its next position, after the drafts drafted [B] each (this step's, in order)."""
        if not self.active:
            return None
        if not drafted:
            return PathPenalties(self, None, None)
        tokens = torch.stack(drafted, dim=1).to(self.device)
        return PathPenalties(self, tokens, torch.ones(1, 1, len(drafted), dtype=torch.bool, device=self.device))

    # ------------------------------------------------------------------ the arithmetic
    def penalize(self, x: torch.Tensor, seen: torch.Tensor | None, counts: torch.Tensor | None) -> torch.Tensor:
        """The penalties of values x [B, P, *] given, elementwise, whether each token was seen and its output count
        (broadcast against x). One function for the dense pass and the path's rewrites, so that a token without
        drafts before it gets the same bits from both."""
        if seen is not None:
            r = self.repetition
            x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
        if counts is not None:
            x = x - (self.frequency * counts + self.presence * (counts > 0))
        return x


class PathPenalties:
    """One step's adjustment: the rows' state, then tokens [B, N] drafted this step, before [B or 1, P, N] whether
    position p's text holds draft n (None: no draft before any position). BatchSampling calls apply()."""

    __slots__ = ("state", "tokens", "before")

    def __init__(self, state: RowPenalties, tokens: torch.Tensor | None, before: torch.Tensor | None):
        self.state, self.tokens, self.before = state, tokens, before

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted logits (float32, a new tensor) of logits [B, P, V] (or [B, V]: one position)."""
        flat = logits.dim() == 2
        x = logits.float().unsqueeze(1) if flat else logits.float()
        s = self.state
        if s.bias is not None:
            x = x + s.bias.unsqueeze(1)
        if s.seen is None and s.counts is None:
            return x.squeeze(1) if flat else x
        out = s.penalize(x, None if s.seen is None else s.seen.unsqueeze(1),
                         None if s.counts is None else s.counts.unsqueeze(1))
        if self.tokens is not None and self.tokens.shape[1]:
            self._along_path(x, out)
        return out.squeeze(1) if flat else out

    def _along_path(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """Rewrite, in out, the entries of the drafted tokens at each position whose text holds some of them.

        extra[b, p, n]: how many of the drafts before position p equal draft n, so draft n's token at position p
        has seen = seen[token] or extra > 0 and count = counts[token] + extra. Entries where extra is 0 get the
        dense pass's value again (the same arithmetic on the same numbers); two drafts of one token write the same
        value."""
        s, tokens = self.state, self.tokens
        positions, n = out.shape[1], tokens.shape[1]
        before = self.before[:, :positions, :n].float()
        same = (tokens.unsqueeze(2) == tokens.unsqueeze(1)).float()  # [B, N, N]
        extra = torch.matmul(before, same)  # [B, P, N]: exact small integers
        index = tokens.unsqueeze(1).expand(-1, positions, -1)
        seen = None if s.seen is None else s.seen.gather(1, tokens).unsqueeze(1) | (extra > 0)
        counts = None if s.counts is None else s.counts.gather(1, tokens).unsqueeze(1) + extra
        out.scatter_(-1, index, s.penalize(raw.gather(-1, index), seen, counts))

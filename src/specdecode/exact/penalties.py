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

Cost: the state lives on the device as [B, V] tables (the logit bias; each token's repetition factor, r where the
prompt + output holds it and 1 elsewhere; the output's counts and the penalty they make), which each step's emitted
tokens update sparsely. A step applies them to its logits [B, P, V] with a few branch-free elementwise passes (like
the warp; torch.where and bool masks over a vocabulary cost ~25x more on the CPU), then rewrites the entries of the
drafted tokens along each path (a gather and a scatter of [B, P, N] values, N the step's drafts): nothing per token
in Python, nothing that grows with the history. A batch where no row sets an option holds nothing here and its steps
never call it (`active`).
"""

from __future__ import annotations

import torch

from .token_tree import ancestors_mask

_SCALARS = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}  # a neutral row's values (no change to a logit)
_TABLES = {"bias": 0.0, "factor": 1.0, "counts": 0.0, "penalty": 0.0}  # [B, V]; None when no row needs it


class RowPenalties:
    """Each row's logit_bias and penalties, and the text each has so far, as device tensors over the vocabulary.

    bias [B, V]: the logit_bias; factor [B, V]: the repetition penalty r at the tokens of prompt + output, 1
    elsewhere; counts [B, V]: each token's occurrences in the output; penalty [B, V]: frequency * count + presence
    where the count is positive (what a logit loses). A table exists only when some row needs it; rows without an
    option hold neutral values, whose arithmetic leaves a logit bit for bit as it was. Mutable: advance() records
    what the rows emitted; select and extend return a new object."""

    def __init__(self, params: list, prompts: list[list[int]], vocab_size: int, device=None):
        self.vocab_size = vocab_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.rows = len(params)
        self.active = any(p.adjusts_logits for p in params)
        self.repetition = self.frequency = self.presence = None
        self.bias = self.factor = self.counts = self.penalty = None
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
            self.factor = torch.ones(self.rows, vocab_size, dtype=torch.float32, device=self.device)
            self._record(prompts, output=False)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            self.counts = torch.zeros(self.rows, vocab_size, dtype=torch.float32, device=self.device)
            self.penalty = torch.zeros(self.rows, vocab_size, dtype=torch.float32, device=self.device)

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

    def _filled(self, name: str, fill: float) -> torch.Tensor:
        """This object's table or column `name`, or the neutral one of its rows where it has none."""
        value = getattr(self, name)
        if value is not None:
            return value
        shape = (self.rows, 1, 1) if name in _SCALARS else (self.rows, self.vocab_size)
        return torch.full(shape, fill, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ the text so far
    def advance(self, emitted: list[list[int]]) -> None:
        """Row b emitted the tokens emitted[b] (kept drafts and the token after them): sparse updates at them."""
        if not self.active or (self.factor is None and self.counts is None):
            return
        self._record(emitted)

    def _record(self, tokens: list[list[int]], output: bool = True) -> None:
        """Row b's text holds tokens[b] (the prompt: output=False, the repetition factor only)."""
        rows = [b for b, row in enumerate(tokens) for _ in row]
        if not rows:
            return
        index = (torch.tensor(rows, device=self.device),
                 torch.tensor([t for row in tokens for t in row], device=self.device))
        if self.factor is not None:
            self.factor.index_put_(index, self.repetition.view(-1)[index[0]])
        if output and self.counts is not None:
            self.counts.index_put_(index, torch.ones(len(rows), device=self.device), accumulate=True)
            f, p = self.frequency.view(-1)[index[0]], self.presence.view(-1)[index[0]]
            self.penalty.index_put_(index, penalty_of(self.counts[index], f, p))

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



def penalty_of(counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """What a logit loses to its output count: frequency x count + presence where the count is positive. The one
    formula for the table (advance) and the path's rewrites, so both give the same bits."""
    return frequency * counts + presence * (counts > 0).float()


def repeated(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x / factor where x > 0, x * factor where x < 0 (transformers' RepetitionPenaltyLogitsProcessor, bit for bit:
    the other term is an exact 0), with no branch: torch.where over a vocabulary costs ~25x these passes on the CPU."""
    return x.clamp(min=0) / factor + x.clamp(max=0) * factor


class PathPenalties:
    """One step's adjustment: the rows' state, then tokens [B, N] drafted this step, before [B or 1, P, N] whether
    position p's text holds draft n (None: no draft before any position). BatchSampling calls apply()."""

    __slots__ = ("state", "tokens", "before")

    def __init__(self, state: RowPenalties, tokens: torch.Tensor | None, before: torch.Tensor | None):
        self.state, self.tokens, self.before = state, tokens, before

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted logits (float32, a new tensor) of logits [B, P, V] (or [B, V]: one position).

        In place wherever the tensor is this call's own: on the CPU each fresh [B, P, V] buffer costs page faults
        (glibc hands large freed blocks back to the system), several times the arithmetic itself."""
        flat = logits.dim() == 2
        x = logits.float().unsqueeze(1) if flat else logits.float()
        s = self.state
        if s.bias is not None:
            x = x + s.bias.unsqueeze(1)
        if s.factor is None and s.counts is None:
            return x.squeeze(1) if flat else x
        path = self.tokens is not None and self.tokens.shape[1]
        index = self.tokens.unsqueeze(1).expand(-1, x.shape[1], -1) if path else None
        raw = x.gather(-1, index) if path else None  # before any change in place
        own = s.bias is not None  # x is this call's tensor
        if s.factor is not None:  # repeated(x, factor), with one buffer besides x
            factor = s.factor.unsqueeze(1)
            negative = x.clamp(max=0)
            x = (x.clamp_(min=0) if own else x.clamp(min=0)).div_(factor).addcmul_(negative, factor)  # one is 0
            own = True
        if s.counts is not None:
            x = x.sub_(s.penalty.unsqueeze(1)) if own else x - s.penalty.unsqueeze(1)
        if path:
            x.scatter_(-1, index, self._along_path(raw))
        return x.squeeze(1) if flat else x

    def _along_path(self, raw: torch.Tensor) -> torch.Tensor:
        """The adjusted values [B, P, N] of the drafted tokens at each position, from their raw (biased) logits.

        extra[b, p, n]: how many of the drafts before position p equal draft n, so draft n's token at position p
        has the factor r if extra > 0 (else the table's) and the count counts[token] + extra. Where extra is 0 this
        is the dense pass's value again (the same arithmetic on the same numbers); two drafts of one token get the
        same value."""
        s, tokens = self.state, self.tokens
        before = self.before[:, :raw.shape[1], :tokens.shape[1]].float()
        same = (tokens.unsqueeze(2) == tokens.unsqueeze(1)).float()  # [B, N, N]
        extra = torch.matmul(before, same)  # [B, P, N]: exact small integers
        value = raw
        if s.factor is not None:
            value = repeated(value, torch.where(extra > 0, s.repetition, s.factor.gather(1, tokens).unsqueeze(1)))
        if s.counts is not None:
            value = value - penalty_of(s.counts.gather(1, tokens).unsqueeze(1) + extra, s.frequency, s.presence)
        return value

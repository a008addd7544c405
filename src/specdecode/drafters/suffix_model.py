"""suffix+MODEL: the suffix drafter's copy where its index is confident, a draft model's proposal elsewhere.

The suffix drafter (suffix.py) costs no forward and, on text that repeats (the previous turn's answer, a file
edited again, a tool's output, boilerplate), proposes long runs the target keeps; on new text it has little or
nothing to offer, where a small draft model still drafts well. This drafter owns one of each and picks per row and
per step, in max_drafts (before the policy chooses K, so the choice cannot depend on the step's outcome): the
suffix's draft where the index expects at least `min_score` of its tokens kept, the model's elsewhere.

Exactness. Rows of one step mix. A model row's drafts come with its q. A suffix row's drafts are deterministic:
its q is one-hot at each draft, so min(1, p(x) / q(x)) = p(x) and the residual max(0, p - q) is p without x, which
is exactly the rule the verifier applies to q=None drafts (rejection.py). A step in which no drafting row needs
the model proposes q=None for the whole batch.

The model in step. When the model runs it drafts for the whole batch (one batched forward per draft) and the suffix
rows' model drafts are dropped: update() tells the model a suffix row kept only those of its drafts that equal the
emitted tokens (often none: kept=0), so it trims that row's cache to the context it holds and queues the rest of
the emitted tokens, as for a row whose drafts a grammar replaced. A step in which no drafting row needs the model
runs no model forward: the emitted tokens queue up as after a plain step (behind()), and the model's next proposal
feeds them first.

Cost. Such a step is free drafting: drafts_free() says so once max_drafts has planned the step (the policy prices
its drafts at zero and sees no backlog to catch up on) and Proposal.free after propose (the policy learns no draft
cost from it). A step that runs the model reports the model's forwards, catch-up and cleanliness as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import as_backend
from ..text.vocab import unwrap_model
from .base import Drafter, Proposal
from .model import ModelDrafter
from .suffix import SuffixDrafter

# A row copies the suffix's draft when the index expects at least one of its tokens kept (its Draft.score). A copy
# costs no forward and the model's draft K of them, so a copy pays below the model's own expected kept tokens, by a
# margin that depends on the machine. In tokens per second, (1 + kept) / (K c + v(K + 1)) with the policy's prior
# v(n) = 1 + 0.15 (n - 1) target steps: on this project's CPU pair (a draft step c ~0.3 target steps, acceptance
# ~0.7, K = 3) a copy expecting 0.6 kept tokens already makes as fast a step as the model's draft; with drafting
# cheaper next to verification and a better draft (c = 0.15, acceptance 0.8, K = 5) it takes about 1.6. One token
# sits between the two. (A copy saves the forwards only on a step where every row copies: the model drafts batched.)
MIN_SCORE = 1.0


@dataclass
class SourceCounts:
    """How the steps drafted: drafts proposed and kept per source, steps with and without a model forward."""

    suffix_drafts: int = 0
    suffix_kept: int = 0
    model_drafts: int = 0
    model_kept: int = 0
    free_steps: int = 0  # steps whose drafting rows all copied: no model forward
    model_steps: int = 0


class SuffixModelDrafter(Drafter):
    """Per row and step, the suffix drafter's copy where its index is confident, a draft model's proposal elsewhere.

    model: a ModelDrafter, or what a generator takes as a draft model (load_model's LoadedModel, a transformers
    causal LM, a ModelBackend). vocab_size: the vocabulary q is defined on, the target's; by default the model's
    tokenizer's (as load_model's llama.cpp and static backends restrict theirs), else its output layer's. suffix: a
    SuffixDrafter (its history, keys and thresholds); a new one with a history of its own by default. min_score:
    the expected number of kept tokens from which a row takes the suffix's draft (MIN_SCORE: why one token).
    """

    def __init__(self, model, suffix: SuffixDrafter | None = None, min_score: float = MIN_SCORE,
                 vocab_size: int | None = None):
        if not min_score > 0:
            raise ValueError(f"min_score must be > 0 (expected kept tokens of a suffix draft), got {min_score}")
        self.model_drafter, self.model_tokenizer = _model_drafter(model, vocab_size)
        self.suffix = suffix if suffix is not None else SuffixDrafter()
        self.min_score = min_score
        self.vocab_size = self.model_drafter.vocab_size
        self.max_rows = self.model_drafter.max_rows
        self.catch_up_window = self.model_drafter.catch_up_window
        self.counts = SourceCounts()
        self._copied: list[bool] | None = None  # per row, whether the suffix drafts it this step (max_drafts)
        self._drafted: list[int] = []  # per row, the drafts proposed this step (for the counts)
        self._model_tokens: torch.Tensor | None = None  # the model's drafts [B, K] on a step it ran

    @property
    def forward_calls(self) -> int:
        return self.model_drafter.forward_calls

    # ------------------------------------------------------------------ rows
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, hidden=None) -> None:
        self.suffix.prefill(input_ids, valid)
        self.model_drafter.prefill(input_ids, valid)
        self._copied, self._drafted, self._model_tokens = None, [], None

    def fork(self, batch_size: int) -> "SuffixModelDrafter":
        other = SuffixModelDrafter(self.model_drafter.fork(batch_size), self.suffix.fork(batch_size), self.min_score)
        other.counts, other.model_tokenizer = self.counts, self.model_tokenizer  # one tally for joining rows too
        return other

    def merge(self, other: "SuffixModelDrafter") -> None:
        self.model_drafter.merge(other.model_drafter)
        self.suffix.merge(other.suffix)
        self._copied, self._drafted, self._model_tokens = None, [], None

    def select_rows(self, rows: list[int]) -> None:
        self.model_drafter.select_rows(rows)
        self.suffix.select_rows(rows)
        self._copied, self._drafted, self._model_tokens = None, [], None

    def discard(self) -> None:
        self.model_drafter.discard()
        self.select_rows([])

    def set_prefix_cache(self, max_tokens: int) -> None:
        self.model_drafter.set_prefix_cache(max_tokens)

    def update(self, emitted: list[list[int]], kept: list[int], hidden=None) -> None:
        """The suffix index reads every emitted token; the model keeps its own rows' kept drafts, and of a suffix
        row's only those it drew the same as the emitted tokens (its cache holds exactly those tokens' keys and
        values); it trims the rest and feeds the emitted tokens after them next."""
        copied = self._copied or [False] * len(kept)
        self._count(kept, copied)
        self.suffix.update(emitted, kept)
        self.model_drafter.update(emitted, self._model_kept(emitted, kept, copied))
        self._copied, self._drafted, self._model_tokens = None, [], None

    def _model_kept(self, emitted: list[list[int]], kept: list[int], copied: list[bool]) -> list[int]:
        if self._model_tokens is None:  # the model did not run: it queues every emitted token whatever it is told
            return [0] * len(kept)
        drafts = self._model_tokens.tolist()  # after the loop's sync: no wait
        return [_agreed(d, e) if c else n for d, e, n, c in zip(drafts, emitted, kept, copied)]

    def _count(self, kept: list[int], copied: list[bool]) -> None:
        counts = self.counts
        for n, a, c in zip(self._drafted, kept, copied):
            if c:
                counts.suffix_drafts += n
                counts.suffix_kept += a
            else:
                counts.model_drafts += n
                counts.model_kept += a

    # ------------------------------------------------------------------ the step's plan
    def max_drafts(self, k: int) -> list[int]:
        """Plans the step: rows whose suffix draft expects min_score kept tokens copy it (as many drafts as it
        has), the others take the model's k."""
        lengths, scores = self.suffix.max_drafts(k), self.suffix.scores(k)
        self._copied = [s >= self.min_score for s in scores]
        return [n if c else k for n, c in zip(lengths, self._copied)]

    def own_k(self, ks: list[int]) -> None:
        self.suffix.own_k(ks)

    def draft_classes(self) -> list[int | None]:
        """The suffix index's classes for the rows that copy; None for the rows the model drafts."""
        classes = self.suffix.draft_classes()
        return [c if copied else None for c, copied in zip(classes, self._copied or [False] * len(classes))]

    def drafts_free(self) -> bool:
        return self._copied is not None and all(self._copied)

    def behind(self) -> list[int]:
        """The model's backlog per row; none on a step the suffix drafts alone (the model does not run)."""
        return [0] * len(self._copied) if self.drafts_free() else self.model_drafter.behind()

    def limit_catch_up(self) -> None:
        if not self.drafts_free():  # a step without the model keeps the model's cache whole for later
            self.model_drafter.limit_catch_up()

    # ------------------------------------------------------------------ drafting
    def propose(self, k: int, context, uniforms, num_drafts):
        if self._copied is None:  # asked without max_drafts: plan now
            self.max_drafts(k)
        copied, self._drafted = self._copied, list(num_drafts)
        suffix = self.suffix.propose(k, context, uniforms, num_drafts)
        if all(c or not n for c, n in zip(copied, num_drafts)):  # no drafting row needs the model
            self.counts.free_steps += 1
            return Proposal(suffix.tokens, free=True)
        self.counts.model_steps += 1
        model = self.model_drafter.propose(k, context, uniforms, num_drafts)
        self._model_tokens = model.tokens
        use = torch.tensor(copied, device=model.tokens.device).unsqueeze(1)
        tokens = torch.where(use, suffix.tokens.to(model.tokens.device), model.tokens)
        return Proposal(tokens, _one_hot_rows(model.q, tokens, copied, context), model.catch_up_s,
                        model.catch_up_tokens, model.clean)


def _one_hot_rows(q: torch.Tensor | None, tokens: torch.Tensor, copied: list[bool], context) -> torch.Tensor | None:
    """The model's q [S, K, V] with each copied sampled row's replaced by one-hot rows at its drafts: a deterministic
    draft's q, exactly (the verifier then applies the q=None rule to it, whatever the model drew for that row)."""
    if q is None:  # every row is greedy: no q at all
        return None
    sampled = [b for b, greedy in enumerate(context.greedy_rows) if not greedy]  # q's rows, read off the host
    rows = [s for s, b in enumerate(sampled) if copied[b]]
    if rows:
        drafts = tokens[[sampled[s] for s in rows]]
        q[rows] = torch.nn.functional.one_hot(drafts, q.shape[-1]).to(q.dtype)
    return q


def _agreed(drafts: list[int], emitted: list[int]) -> int:
    """How many of the emitted tokens, from the first, equal the model's drafts; never the last emitted token, which
    the model must be fed (its logits draft the next token), as after its own drafts."""
    n = 0
    while n < min(len(drafts), len(emitted) - 1) and drafts[n] == emitted[n]:
        n += 1
    return n


def _model_drafter(model, vocab_size: int | None) -> tuple[ModelDrafter, object | None]:
    """(drafter, the model's tokenizer or None): a ModelDrafter as it is; anything else a generator takes as a draft
    model, restricted to vocab_size (by default its tokenizer's length: the vocabulary the target shares)."""
    if isinstance(model, ModelDrafter):
        return model, None
    inner, tokenizer = unwrap_model(model)
    if vocab_size is None and tokenizer is not None:
        vocab_size = len(tokenizer)
    return ModelDrafter(as_backend(inner, vocab_size)), tokenizer

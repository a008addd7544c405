"""suffix+MODEL: the suffix drafter's copy where its index is confident, a draft model's proposal elsewhere.

The suffix drafter (suffix.py) costs no forward and, on text that repeats (the previous turn's answer, a file
edited again, a tool's output, boilerplate), proposes long runs the target keeps; on new text it has little or
nothing to offer, where a small draft model still drafts well. This drafter owns one of each and picks per row and
per step, in its outlook (before the policy chooses K, so the choice cannot depend on the step's outcome): the
suffix's draft where the index expects at least `min_score` of its tokens kept, the model's elsewhere.

Exactness. Rows of one step mix. A model row's drafts come with its q. A suffix row's drafts are deterministic:
its q is one-hot at each draft, so min(1, p(x) / q(x)) = p(x) and the residual max(0, p - q) is p without x, which
is exactly the rule the verifier applies to q=None drafts (rejection.py). A step in which no drafting row needs
the model proposes q=None for the whole batch.

The model in step. When the model runs it drafts for the whole batch (one batched forward per draft) and the suffix
rows' model drafts are dropped: the model is told a suffix row kept only those of its drafts that equal the emitted
tokens (often none: kept=0), so it trims that row's cache to the text it holds and feeds the rest of the row's
text next, as for a row whose drafts a grammar replaced. A step in which no drafting row needs the model runs no
model forward: the model is told it was not asked, and its next proposal feeds what the rows emitted meanwhile.

Cost. Such a step is free drafting: the outlook says so when every row copies (the policy prices its drafts at zero
and sees no backlog to catch up on), and Proposal.free after propose (the policy learns no draft cost from it). A
step that runs the model reports the model's forwards, catch-up and cleanliness as they are.

A combinator, not a relay: it asks its two drafters through the same four verbs the session asks it, and holds
nothing per row of its own (each part keeps its own cache, keyed by the rows' ids).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..backends import as_backend
from ..backends.rows import RowChange
from ..text.vocab import unwrap_model
from .base import DraftChoice, DraftContext, Drafter, DraftOutcome, DraftOutlook, DraftRows, Proposal
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


@dataclass(frozen=True)
class _Plan:
    """What the outlook decided and the proposal drew, for propose and observe."""

    copied: list[bool]  # [B] row b takes the suffix's draft (its expected kept tokens >= min_score)
    suffix: DraftOutlook  # the suffix's own outlook
    model: DraftOutlook | None  # the model's own outlook; None: every row copies, the model is not asked
    k_rows: list[int] | None = None  # [B] the drafts proposed (propose)
    suffix_proposal: Proposal | None = None  # the suffix's proposal (propose)
    model_proposal: Proposal | None = None  # the model's proposal; None: it did not run (propose)


class SuffixModelDrafter(Drafter):
    """Per row and step, the suffix drafter's copy where its index is confident, a draft model's proposal elsewhere.

    model: a ModelDrafter, or what a generator takes as a draft model (load_model's LoadedModel, a
    transformers causal LM, a ModelBackend). vocab_size: the vocabulary q is defined on, the target's; by default
    the model's tokenizer's (as load_model's llama.cpp and static backends restrict theirs), else its output
    layer's. suffix: a SuffixDrafter (its history, keys and thresholds), or any drafter whose outlook says how many
    of its drafts it expects kept; a new SuffixDrafter with a history of its own by default. min_score: the expected
    number of kept tokens from which a row takes the suffix's draft (MIN_SCORE: why one token).
    """

    def __init__(self, model, suffix: Drafter | None = None, min_score: float = MIN_SCORE,
                 vocab_size: int | None = None):
        if not min_score > 0:
            raise ValueError(f"min_score must be > 0 (expected kept tokens of a suffix draft), got {min_score}")
        self.model_drafter, self.model_tokenizer = _model_drafter(model, vocab_size)
        self.suffix = suffix if suffix is not None else SuffixDrafter()
        self.min_score = min_score
        self.vocab_size = self.model_drafter.vocab_size
        self.max_rows = self.model_drafter.max_rows
        self.copies = self.suffix.copies  # its free steps are the suffix's copies
        self.class_acceptance = self.suffix.class_acceptance  # its classes are the suffix's
        self.needs_hidden_states = self.model_drafter.needs_hidden_states or self.suffix.needs_hidden_states
        self.counts = SourceCounts()
        self.forward_calls = 0  # the model's forwards, as its proposals report them

    @property
    def backends(self) -> tuple:
        return self.model_drafter.backends

    def relayout(self, change: RowChange) -> None:
        for part in (self.model_drafter, self.suffix):
            part.relayout(change)

    def outlook(self, rows: DraftRows) -> DraftOutlook:
        """Plans the step: rows whose suffix draft expects min_score kept tokens copy it (as many drafts as it
        has, in its class), the others take the model's. A step where every row copies is free and feeds the model
        nothing; otherwise the backlog is the model's."""
        suffix = self.suffix.outlook(rows)
        copied = [s >= self.min_score for s in suffix.expected]
        if all(copied):
            zeros = [0] * len(copied)
            return DraftOutlook(suffix.drafts, suffix.classes, suffix.expected, True, zeros, zeros,
                                _Plan(copied, suffix, None))
        model = self.model_drafter.outlook(rows)
        classes = suffix.classes or [None] * len(copied)
        return DraftOutlook([n if c else m for n, m, c in zip(suffix.drafts, model.drafts, copied)],
                            [k if c else None for k, c in zip(classes, copied)], None, False, model.behind,
                            model.probe_behind, _Plan(copied, suffix, model))

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        plan = choice.outlook.plan
        copied = plan.copied
        suffix = self.suffix.propose(replace(choice, outlook=plan.suffix), context)
        if all(c or not n for c, n in zip(copied, choice.k_rows)):  # no drafting row needs the model
            self.counts.free_steps += 1
            return Proposal(suffix.tokens, free=True,
                            plan=replace(plan, k_rows=choice.k_rows, suffix_proposal=suffix))
        self.counts.model_steps += 1
        model = self.model_drafter.propose(replace(choice, outlook=plan.model), context)  # a copying row's: dropped
        self.forward_calls += model.forward_calls
        use = torch.tensor(copied, device=model.tokens.device).unsqueeze(1)
        tokens = torch.where(use, suffix.tokens.to(model.tokens.device), model.tokens)
        return Proposal(tokens, _one_hot_rows(model.q, tokens, copied, context), model.catch_up_s,
                        model.catch_up_tokens, model.clean, forward_calls=model.forward_calls,
                        plan=replace(plan, k_rows=choice.k_rows, suffix_proposal=suffix, model_proposal=model))

    def observe(self, outcome: DraftOutcome) -> None:
        """The suffix reads every emitted token; the model keeps its own rows' kept drafts, and of a suffix row's only
        those it drew the same as the emitted tokens (its cache holds exactly those tokens' keys and values); it
        trims the rest and feeds the row's text after them next."""
        plan = outcome.proposal.plan if outcome.proposal is not None else None
        if plan is None:
            for part in (self.suffix, self.model_drafter):
                part.observe(outcome)
            return
        self._count(plan.k_rows, outcome.kept, plan.copied)
        self.suffix.observe(replace(outcome, proposal=plan.suffix_proposal))
        model = plan.model_proposal
        kept = outcome.kept
        if model is not None:
            drafts = model.tokens.tolist()  # after the loop's sync: no wait
            kept = [_agreed(d, e) if c else n for d, e, n, c in zip(drafts, outcome.emitted, kept, plan.copied)]
        self.model_drafter.observe(replace(outcome, kept=kept, proposal=model))

    def _count(self, drafted: list[int], kept: list[int], copied: list[bool]) -> None:
        counts = self.counts
        for n, a, c in zip(drafted, kept, copied):
            if c:
                counts.suffix_drafts += n
                counts.suffix_kept += a
            else:
                counts.model_drafts += n
                counts.model_kept += a


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
    if isinstance(model, Drafter):  # a ModelDrafter, or a draft of another tokenizer (cross_vocab.py)
        return model, None
    inner, tokenizer = unwrap_model(model)
    if vocab_size is None and tokenizer is not None:
        vocab_size = len(tokenizer)
    return ModelDrafter(as_backend(inner, vocab_size)), tokenizer

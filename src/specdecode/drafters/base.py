"""What the decoding loop needs from a drafter, in four verbs, each handed one value and answering with one:

    outlook(DraftRows) -> DraftOutlook    what it can offer this step (drafts per row, their class, their cost),
                                          before the policy chooses K and before anything is drawn
    propose(DraftChoice, DraftContext) -> Proposal    the tokens the step verifies
    observe(DraftOutcome)                 what the step kept
    relayout(RowChange)                   rows joined, left or moved (backends/rows.py; a no-op by default)

A drafter reads each row's tokens where the session keeps them (RowText: the row's prompt and output, never copied);
what it keeps per row is its own cache of them (a model's KV, the suffix index), keyed by the row's id. Whatever it
needs between outlook and propose (what it found) travels in the outlook's `plan`, and between propose and observe
in the proposal's: a drafter holds no half-done step. Composition is a drafter over drafters (suffix_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..backends.rows import RowChange, RowText
from ..exact.sampling import BatchSampling, coupled_choice


@dataclass
class Proposal:
    """The tokens one step verifies, and what proposing them cost. q None: the drafts were chosen deterministically
    (the verifier then treats them as one-hot proposals, exactly, without a dense tensor)."""

    tokens: torch.Tensor  # [B, K] row b's chain is its first k_rows[b] tokens; the rest is padding, never verified
    q: torch.Tensor | None = None  # [S, K, V] each sampled row's draft distributions (warped and masked as p); None
    catch_up_s: float = 0.0  # seconds of a forward that fed a backlog (a prompt, plain steps' tokens) before drafting
    catch_up_tokens: int = 0  # ... and the tokens it fed, over all rows
    clean: bool = True  # False: a backlog was fed with the drafts, so the step's draft time is no draft step's cost
    free: bool = False  # no model forward ran (every draft copied): the policy prices it at zero, learns no cost
    parents: list[list[int]] | None = None  # [B][K] a tree per row (token_tree.py; DraftRows.trees, q None); None
    forward_calls: int = 0  # model forwards it ran (statistics)
    plan: object = None  # the drafter's own notes on what it drew, handed back to it in the DraftOutcome


@dataclass(slots=True)  # built every step: not frozen (StepPlan's note); the loop never changes one it handed over
class DraftRows:
    """The step's rows as a drafter's outlook reads them, before the policy chooses K."""

    texts: Sequence[RowText]  # [B] each row's text, in batch order (the session's own lists)
    ks: list[int]  # [B] row b's own K (its fixed K, else the policy's largest), capped by what it has left
    widest: int  # the step's largest K: row b's drafts are asked at most this wide
    trees: bool = False  # the step may verify token trees (a target that can, no row constrained)
    max_leaves: int | None = None  # the most leaves a row's tree may have (the target's tree_leaves); None: any


@dataclass(frozen=True, slots=True)
class DraftOutlook:
    """What a drafter can offer this step, known before anything is drawn: the policy chooses K from it, so K stays
    a function of the context (what keeps deterministic drafts and a timing-based K exact)."""

    drafts: list[int]  # [B] drafts row b can really offer (0: none); its K is capped by it
    classes: list[int | None] | None = None  # [B] the class of row b's draft (match_class), learned apart; None: none
    expected: list[float] | None = None  # [B] how many of row b's drafts are expected kept (a copy's); None: unknown
    free: bool = False  # proposing will run no model forward: the policy prices the drafting at zero
    behind: list[int] | None = None  # [B] tokens fed for row b before it drafts (a catch-up); None: never behind
    probe_behind: list[int] | None = None  # [B] what a trial would feed (behind, bounded by the catch-up window)
    plan: object = None  # the drafter's own notes (the drafts it found), handed back to propose in the DraftChoice


@dataclass(slots=True)
class DraftChoice:
    """What the step asks of the drafter once the policy has chosen."""

    outlook: DraftOutlook  # the drafter's own outlook for this step
    k_rows: list[int]  # [B] drafts asked of row b (<= outlook.drafts[b]; 0: none, its positions are padding)
    k: int  # max(k_rows) >= 1: the proposal's width
    trial: bool = False  # the policy's probe or exploration: the drafter may bound its catch-up (still exact)


@dataclass(slots=True)
class DraftOutcome:
    """What a step did, told to the drafter after verification (before the rows' texts take the new tokens)."""

    texts: Sequence[RowText]  # [B] the step's rows, in batch order
    emitted: list[list[int]]  # [B] row b's new tokens: the drafts it kept, then the target's next token
    kept: list[int]  # [B] how many of emitted[b] were this drafter's drafts (0 where a forced run replaced them)
    proposal: Proposal | None = None  # what this drafter proposed this step; None: it was not asked (a plain step)
    hidden: torch.Tensor | None = None  # [B, n, H] the target's last hidden states (a drafter that needs them)


@dataclass(slots=True)
class DraftContext:
    """What a drafter draws one step's tokens with, handed to propose() and never kept.

    The loop makes one per step; the drafter reads the rows' texts and settings through it, draws sampled rows with
    their uniforms and coupled rows with their noise, and follows the rows' grammars through it, so BatchSampling
    stays a fixed description of the rows."""

    texts: Sequence[RowText]  # [B] the rows' texts, as in the outlook
    sampling: BatchSampling  # [B] the rows' sampling settings
    uniforms: torch.Tensor | None = None  # [B, K] float64: row b's uniforms for its first k_rows[b] drafts (sampled)
    noise: torch.Tensor | None = None  # [C, K+1, V] float64: the coupled rows' Gumbel noise for this step's positions
    grammars: object | None = None  # row_grammars.RowGrammars [B] when some row is constrained, else None
    penalties: object | None = None  # penalties.RowPenalties [B] when some row has a logit_bias or penalty, else None

    @property
    def greedy_rows(self) -> list[bool]:
        return self.sampling.greedy_rows

    @property
    def all_greedy(self) -> bool:
        return self.sampling.all_greedy

    @property
    def sampled_index(self) -> torch.Tensor:
        return self.sampling.sampled_index

    def draft_mask(self, i: int, previous: torch.Tensor | None) -> torch.Tensor | None:
        """[B, V] bool: the tokens the rows' grammars allow at draft position i after the drafts before it
        (previous [B]: the tokens drafted at position i - 1); None when no row is constrained."""
        return None if self.grammars is None else self.grammars.draft_mask(i, previous)

    def penalized(self, logits: torch.Tensor, drafted: list[torch.Tensor]) -> torch.Tensor:
        """logits [B, V] at the draft position after this step's drafts `drafted` ([B] each, in order), adjusted by
        each row's logit_bias and penalties along its own drafts, as the target's p at that position is (the logits
        themselves when no row has one). A drafter calls it on its logits before masked() and probs()."""
        path = None if self.penalties is None else self.penalties.at_draft(drafted)
        return logits if path is None else path.apply(logits)

    def masked(self, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """What greedy rows take the argmax of: the logits with what the grammar forbids at -inf."""
        return self.sampling.masked(logits, self._additive(mask))

    def probs(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """[S, V] the sampled rows' draft distributions q, warped and masked exactly as the target's p."""
        return self.sampling.probs(logits, self._additive(mask))

    def couple_drafts(self, tokens: torch.Tensor, q: torch.Tensor, i: int) -> None:
        """Overwrite the coupled rows' draft tokens [B] at draft position i by argmax(log q + noise) (in place).

        q [S, V]: the sampled rows' draft distributions at that position. The target side takes
        argmax(log p + the same noise): the draft is kept exactly when the two agree."""
        if self.sampling.any_coupled:
            c = self.sampling.coupled_pos
            tokens[self.sampling.sampled_index[c]] = coupled_choice(torch.log(q[c]), self.noise[:, i])

    def _additive(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """A bool mask draft_mask handed out, in the additive form its grammar made once from the bitmask."""
        if mask is None or self.grammars is None:
            return mask
        bias = self.grammars.bias_for(mask)
        return mask if bias is None else bias


MATCH_CLASSES = (1, 2, 3, 5, 8, 15, 31)  # upper bounds of the match-length classes; longer matches are the last class
# The first copied token's acceptance per class, as match_class's docstring gives it: what the policy assumes of a
# class before it has verified any of its drafts (a copy after a long match is not judged by the short ones' misses)
MATCH_CLASS_ACCEPTANCE = (0.19, 0.53, 0.69, 0.71, 0.86, 0.95, 0.97, 0.98)


def match_class(length: int) -> int:
    """The class of a draft copied after a context match of `length` tokens (0 for 1 token ... 7 for 32 or more).
    Measured on the edit workload (default pair, scripts/suffix_edit_replay.py): the first copied token was kept 19 %
    of the time after a 1-token match, 53 % after 2, 69 % after 3, 71 % after 4-5, 86 % after 6-8 and 95-98 % after
    longer ones."""
    return next((i for i, hi in enumerate(MATCH_CLASSES) if length <= hi), len(MATCH_CLASSES))


class Drafter:
    """The drafter contract: four verbs (outlook, propose, observe, relayout) and six declarations."""

    max_rows: int | None = None  # rows its cache can hold (None: no limit)
    needs_hidden_states: bool = False  # True: the loop hands the target's last hidden states to observe/relayout
    model_tokenizer = None  # the tokenizer of a model it was built from, if known (the generator checks the target's)
    # every draft costs a model's forwards (none is a free copy): only such a drafter lets the policy settle, i.e.
    # stop drafting where no K could pay even with every draft kept (policy/choose.py)
    drafts_from_model: bool = False
    # some steps' drafts are copies that run no model (DraftOutlook.free): the generator lets the policy verify those
    # up to max_copy_tokens, far past a model draft's K, since a long match's copy is kept nearly whole
    copies: bool = False
    # per draft class (DraftOutlook.classes), the acceptance the policy assumes before that class's drafts were
    # verified (None: the batch's, which mixes every class's)
    class_acceptance: tuple[float, ...] | None = None

    @property
    def backends(self) -> tuple:
        """The model backends it runs its forwards on (none for a drafter that only copies)."""
        return ()

    def outlook(self, rows: DraftRows) -> DraftOutlook:
        """Per row, how many drafts it can really propose this step (prompt lookup: its match's length; at most
        rows.ks[b] where its drafts depend on K, else rows.widest) and what they are worth and cost. A row drafts at
        its own K, never at the batch's widest, so its drafts, and so its seeded text, never depend on other rows.
        A class (or an expectation) must be a function of the context alone, never of a random draw."""
        raise NotImplementedError

    def propose(self, choice: DraftChoice, context: DraftContext) -> Proposal:
        """choice.k draft tokens per row. Sampled rows draw with context.uniforms (row b's own random numbers for
        its first k_rows[b] drafts; drafts past those are ignored and must not use randomness); greedy rows take the
        argmax; coupled rows draw argmax(log q + noise) (`context.couple_drafts`). Under a grammar the masks are
        `context.draft_mask(i, previous)` and the distributions `context.probs(logits, mask)`, as the target's; a
        drafter that draws from its logits first passes them through `context.penalized(logits, drafts so far)`."""
        raise NotImplementedError

    def observe(self, outcome: DraftOutcome) -> None:
        """After verification: what each row emitted, and how many of those tokens were its own drafts. Every step
        (a plain one too, with no proposal); a drafter that reads the rows' texts may have nothing to do."""

    def relayout(self, change: RowChange) -> None:
        """Rows joined (their first token drawn), left or moved: a drafter with per-row state moves it likewise (its
        rows become (rows before + change.appended)[change.keep]); one without has nothing to do."""

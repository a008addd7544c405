"""What the decoding loop needs from a drafter: a Proposal per step, the tokens the step verifies.

A drafter subclasses `Drafter`, which gives every optional capability a default, so the loop reads no attribute
that is not declared here. A drafter with no model (prompt lookup, suffix) overrides propose/update/prefill and the
row bookkeeping; a model drafter also reports what catching up on a backlog cost (the policy prices it), and one
that drafts some steps without its model says which (drafts_free, Proposal.free: the policy prices them at zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..exact.sampling import BatchSampling, coupled_choice


@dataclass
class Proposal:
    """The tokens one step verifies, and what proposing them cost.

    tokens [B, K]: row b proposes a chain, its first num_drafts[b] tokens (the loop's k_rows); the rest is padding
    the verification ignores. q [S, K, V]: the distribution each sampled row's token was drawn from (after the same
    warping and grammar mask as the target's), or None when the drafts were chosen deterministically (the verifier
    then treats them as one-hot proposals, exactly, without a dense tensor). catch_up_s / catch_up_tokens: a
    forward that fed a backlog (a prompt, or tokens of plain steps) before drafting, timed apart; clean is False
    when a backlog was fed together with the drafts, so the step's draft time is not a draft step's cost. free: no
    model forward ran (a drafter with a model copied every draft this step): the policy prices such drafting at
    zero and learns no draft step's cost from it. parents: None for chains; else per row a token tree over its K
    tokens (token_tree.py: parents[b][i] is node i's parent, -1 the row's last token; drafts past num_drafts[b]
    are padding), only after use_trees(True) and only with q None.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0
    clean: bool = True
    free: bool = False
    parents: list[list[int]] | None = None


@dataclass(slots=True)
class DraftContext:
    """What a drafter needs for one step besides k and its uniforms, handed to propose() and never kept.

    The loop makes one per step; the drafter reads the rows' settings through it, draws coupled rows with its noise
    and follows the rows' grammars through it, so BatchSampling stays a fixed description of the rows."""

    sampling: BatchSampling  # [B] the rows' sampling settings
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


def match_class(length: int) -> int:
    """The class of a draft copied after a context match of `length` tokens (0 for 1 token ... 7 for 32 or more).
    Measured on the edit workload (default pair, scripts/suffix_edit_replay.py): the first copied token was kept 19 %
    of the time after a 1-token match, 53 % after 2, 69 % after 3, 71 % after 4-5, 86 % after 6-8 and 95-98 % after
    longer ones."""
    return next((i for i, hi in enumerate(MATCH_CLASSES) if length <= hi), len(MATCH_CLASSES))


class Drafter:
    """The drafter contract, with defaults for what most drafters do not need."""

    forward_calls: int = 0  # model forwards spent drafting (0 for a drafter with no model)
    max_rows: int | None = None  # rows its cache can hold (None: no limit)
    needs_hidden_states: bool = False  # True: the loop hands the target's last hidden states to prefill/update
    catch_up_window: int | None = None  # a probe feeds at most this many backlog tokens per row (None: no bound)
    model_tokenizer = None  # the tokenizer of a model it was built from, if known (the generator checks the target's)

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, hidden=None) -> None:
        """Take the (left-padded) prompts of a new batch."""
        raise NotImplementedError

    def max_drafts(self, k: int) -> list[int]:
        """Per row, how many of k drafts the drafter can really propose now (prompt lookup: its match length)."""
        raise NotImplementedError

    def propose(self, k: int, context: DraftContext, uniforms: torch.Tensor | None,
                num_drafts: list[int]) -> Proposal:
        """k draft tokens per row. Sampled rows draw with uniforms [B, k] (row b's own random numbers for its first
        num_drafts[b] drafts; drafts past those are ignored and must not use randomness); greedy rows take the
        argmax; coupled rows draw argmax(log q + noise) (`context.couple_drafts`). Under a grammar the masks are
        `context.draft_mask(i, previous)` and the distributions `context.probs(logits, mask)`, as the target's; a
        drafter that draws from its logits first passes them through `context.penalized(logits, drafts so far)`."""
        raise NotImplementedError

    def update(self, emitted: list[list[int]], kept: list[int], hidden=None) -> None:
        """After verification row b emitted the tokens emitted[b], of which the first kept[b] are drafts this drafter
        proposed (a row whose drafts were replaced, e.g. by tokens its grammar forced, kept none of its own). Called
        after the prefill too, with each row's first token."""
        raise NotImplementedError

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows of the batch."""
        raise NotImplementedError

    def discard(self) -> None:
        """Drop every row and keep nothing of them (after a failed step, whose forward may have left the cache half
        written: nothing of it may be parked for later prompts)."""
        self.select_rows([])

    def fork(self, batch_size: int) -> "Drafter":
        """An empty drafter on the same model for new rows (continuous batching: prefilled, then merged)."""
        raise NotImplementedError

    def merge(self, other: "Drafter") -> None:
        """Append the rows of a fork to this batch."""
        raise NotImplementedError

    def behind(self) -> list[int] | None:
        """Per row, the tokens the next proposal would feed before drafting (the policy prices a catch-up); None
        for a drafter that is never behind (no model, no cache)."""
        return None

    def draft_classes(self) -> list[int | None] | None:
        """After max_drafts(k): per row, the class of this step's draft, whose acceptance the policy learns apart
        (a copying drafter's match length, bucketed by match_class: a 16-token match is kept far more often than a
        1-token one), or None for a row whose draft has no class; None for a drafter without classes. A class must
        be a function of the context alone (as max_drafts is), never of a random draw: K then stays a function of
        what is known before the step, which keeps deterministic drafts exact."""
        return None

    def drafts_free(self) -> bool:
        """After max_drafts(k): whether this step's proposal will run no model forward (suffix+MODEL where the
        suffix drafts every row), so the policy prices its drafting at zero. False by default: the policy measures
        a drafter's cost, which is already near zero for one with no model."""
        return False

    def use_trees(self, allowed: bool) -> None:
        """Whether this step's proposal may be a token tree (the target can verify one and no row is
        constrained); a drafter that only proposes chains ignores it."""

    def limit_tree_leaves(self, leaves: int | None) -> None:
        """The most leaves a row's token tree may have, whatever the other rows' trees (the target's tree_leaves:
        on llama.cpp each leaf takes a spare sequence); None: no limit. A drafter that only proposes chains ignores
        it."""

    def own_k(self, ks: list[int]) -> None:
        """Before max_drafts: each row's own K this step (its fixed K, else the policy's largest). A drafter whose
        drafts depend on K (the suffix drafter's choice of source) drafts each row at its own K, never at the
        batch's widest, so that a row's drafts, and so its seeded text, never depend on the other rows."""

    def limit_catch_up(self) -> None:
        """Bound the backlog a probe feeds to catch_up_window tokens per row (only q changes: still exact)."""

    def set_prefix_cache(self, max_tokens: int) -> None:
        """Keep up to max_tokens tokens of finished rows' KV for prompts that start the same (a drafter with a model
        cache; others have nothing to keep)."""

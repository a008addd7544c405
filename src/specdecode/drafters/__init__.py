"""Drafters propose the tokens the target verifies; `as_drafter` wraps whatever the user passed."""

from __future__ import annotations

from ..backends import as_backend
from ..backends.rows import RowChange, RowText
from .base import DraftChoice, DraftContext, Drafter, DraftOutcome, DraftOutlook, DraftRows, Proposal
from .cross_vocab import CrossVocabDrafter, across_tokenizers
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter, SuffixHistory
from .suffix_model import SuffixModelDrafter

__all__ = ["CrossVocabDrafter", "DraftChoice", "DraftContext", "DraftOutcome", "DraftOutlook", "DraftRows", "Drafter",
           "ModelDrafter", "Proposal", "PromptLookupDrafter", "RowChange", "RowText", "SuffixDrafter", "SuffixHistory",
           "SuffixModelDrafter", "across_tokenizers", "as_drafter", "set_prefix_cache"]


def as_drafter(obj, vocab_size: int | None = None) -> Drafter | None:
    """A Drafter for obj: None stays None (plain decoding), a drafter as it is, a model or backend drafts."""
    if obj is None or isinstance(obj, Drafter):
        return obj
    if callable(getattr(obj, "propose", None)):
        raise TypeError(f"{type(obj).__name__} proposes drafts but is not a specdecode.drafters.Drafter: subclass "
                        f"Drafter (outlook, propose, observe, relayout) so the loop knows what it offers")
    return ModelDrafter(as_backend(obj, vocab_size))


def set_prefix_cache(drafter: Drafter | None, max_tokens: int) -> None:
    """Have the draft models in a drafter (itself, or suffix+MODEL's model) keep up to max_tokens tokens of finished
    rows' prompts' KV for later prompts that start the same (0: none); drafters without a model keep nothing."""
    model = drafter.model_drafter if isinstance(drafter, SuffixModelDrafter) else drafter
    if isinstance(model, (ModelDrafter, CrossVocabDrafter)):
        model.set_prefix_cache(max_tokens)

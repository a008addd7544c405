"""Drafters propose the tokens the target verifies; `as_drafter` wraps whatever the user passed."""

from __future__ import annotations

from ..backends import as_backend
from .base import DraftContext, Drafter, Proposal
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter, SuffixHistory
from .suffix_model import SuffixModelDrafter

__all__ = ["DraftContext", "Drafter", "ModelDrafter", "Proposal", "PromptLookupDrafter", "SuffixDrafter",
           "SuffixHistory", "SuffixModelDrafter", "as_drafter"]


def as_drafter(obj, vocab_size: int | None = None) -> Drafter | None:
    """A Drafter for obj: None stays None (plain decoding), a drafter as it is, a model or backend drafts."""
    if obj is None or isinstance(obj, Drafter):
        return obj
    if callable(getattr(obj, "propose", None)):
        raise TypeError(f"{type(obj).__name__} proposes drafts but is not a specdecode.drafters.Drafter: subclass "
                        f"Drafter (its methods have defaults) so the loop knows what it offers")
    return ModelDrafter(as_backend(obj, vocab_size))

"""Drafters propose the tokens the target verifies; `as_drafter` wraps whatever the user passed."""

from __future__ import annotations

from ..backends import as_backend
from .base import Drafter, LegacyDrafter, Proposal
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter, SuffixHistory
from .suffix_model import SuffixModelDrafter

__all__ = ["Drafter", "LegacyDrafter", "ModelDrafter", "Proposal", "PromptLookupDrafter", "SuffixDrafter",
           "SuffixHistory", "SuffixModelDrafter", "as_drafter", "is_drafter"]


def is_drafter(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("propose", "update", "prefill", "select_rows", "fork",
                                                                 "merge"))


def as_drafter(obj, vocab_size: int | None = None) -> Drafter | None:
    """A Drafter for obj: None stays None (plain decoding), a drafter as it is, a model or backend drafts."""
    if obj is None or isinstance(obj, Drafter):
        return obj
    if is_drafter(obj):  # written to the old duck-typed contract
        return LegacyDrafter(obj)
    return ModelDrafter(as_backend(obj, vocab_size))

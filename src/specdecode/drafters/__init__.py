"""Drafters propose the tokens the target verifies; `as_drafter` wraps whatever the user passed."""

from __future__ import annotations

from ..backends import as_backend
from .base import Drafter
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "ModelDrafter", "PromptLookupDrafter", "as_drafter", "is_drafter"]


def is_drafter(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("propose", "update", "prefill", "select_rows", "fork",
                                                                 "merge"))


def as_drafter(obj, vocab_size: int | None = None) -> Drafter | None:
    """A Drafter for obj: None stays None (plain decoding), a drafter as it is, a model or backend drafts."""
    if obj is None or is_drafter(obj):
        return obj
    return ModelDrafter(as_backend(obj, vocab_size))

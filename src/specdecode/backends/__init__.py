"""Model backends behind one interface, and `as_backend`, which wraps whatever the user passed.

Each backend is one module; importing this package imports none of them (transformers, llama.cpp and the like
load only when a backend of theirs is used).
"""

from __future__ import annotations

from importlib import import_module

from .base import ModelBackend, is_backend, pad

_BACKENDS = {"HFBackend": "hf", "LlamaCppBackend": "llamacpp", "StaticBackend": "static"}

__all__ = ["ModelBackend", "as_backend", "is_backend", "pad", *_BACKENDS]


def __getattr__(name):
    if name in _BACKENDS:
        return getattr(import_module(f".{_BACKENDS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_backend(obj, vocab_size: int | None = None) -> ModelBackend:
    """A ModelBackend for obj: a backend as it is, a transformers model wrapped in HFBackend."""
    if is_backend(obj):
        return obj
    if hasattr(obj, "get_output_embeddings") and hasattr(obj, "config"):
        from .hf import HFBackend

        return HFBackend(obj, vocab_size)
    raise TypeError(f"cannot use a {type(obj).__name__} as a model: pass a transformers causal LM, what "
                    f"specdecode.load_model returns, or a ModelBackend (forward/trim/reset/select_rows)")

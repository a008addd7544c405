"""Model loading: built-in models shipped on PyPI, local HF directories, GGUF files.

Importing this package imports none of its modules (the backends import models.sources without loading.py, which
imports the backends): the names below are looked up when first used."""

from importlib import import_module

_LAZY = {"DeviceUnavailableError": "sources", "LoadedModel": "sources", "ModelNotFoundError": "sources",
         "load_model": "loading"}

__all__ = ["LoadedModel", "ModelNotFoundError", "DeviceUnavailableError", "load_model"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Finding a model: built-in models shipped on PyPI (their catalog, preparing and converting them), local HF
directories, GGUF files, and the transformers loading the backends are built on. Below the backends (they import
it; nothing here imports a backend): picking the backend that loads a model is specdecode/loading.py, above them.

Importing this package imports none of its modules: the names below are looked up when first used."""

from importlib import import_module

_LAZY = {"DeviceUnavailableError": "sources", "LoadedModel": "sources", "ModelNotFoundError": "sources"}

__all__ = ["LoadedModel", "ModelNotFoundError", "DeviceUnavailableError"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

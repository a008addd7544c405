"""The engine: the generators (the public entry points), the running batch's step (session), rows joining
(admission), what the batch holds per row, results, and one request's options (params).

Names are imported on first use (as the package's own): a module that needs only engine.results (the bench's
records, the CLI built without torch) does not load the generators and torch with it."""

from importlib import import_module

_EXPORTS = {"AutoregressiveGenerator": "generators", "SpeculativeGenerator": "generators",
            "TokenStream": "generators", "GenerationParams": "params"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

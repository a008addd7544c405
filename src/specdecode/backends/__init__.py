"""Model backends behind one interface, `as_backend`, which wraps whatever the user passed, and the registry of the
backends `load_model` can build.

A backend is one module of this package that registers its loader at the bottom of the file:

    register_backend("llamacpp", load, help="GGUF models on llama.cpp's CPU kernels", claims=..., available=...)

Nothing else names it: load_model's `backend=`, its "auto" choice, and the CLI's --backend choices and help all
come from here. Importing this package imports no backend and not even torch (`specdecode --help` lists the
backends in a third of a second; importing them all takes seconds): names and help are read from the source of
the modules, and a module is imported when its backend is first used.
"""

from __future__ import annotations

import ast
import functools
import pkgutil
from dataclasses import dataclass
from importlib import import_module, resources
from typing import Callable

_LAZY = {"ModelBackend": "base", "is_backend": "base", "pad": "base",
         "HFBackend": "hf", "LlamaCppBackend": "llamacpp", "StaticBackend": "static"}

__all__ = ["BackendEntry", "as_backend", "backend_help", "get_backend", "register_backend", "registered_backends",
           *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_backend(obj, vocab_size: int | None = None):
    """A ModelBackend for obj: a backend as it is, a transformers model wrapped in HFBackend."""
    from .base import is_backend

    if is_backend(obj):
        return obj
    if hasattr(obj, "get_output_embeddings") and hasattr(obj, "config"):
        from .hf import HFBackend

        return HFBackend(obj, vocab_size)
    raise TypeError(f"cannot use a {type(obj).__name__} as a model: pass a transformers causal LM, what "
                    f"specdecode.load_model returns, or a ModelBackend (forward/trim/reset/select_rows)")


# ---------------------------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class BackendEntry:
    """What load_model needs of a backend.

    load(source, options) -> LoadedModel: source is a name or path (or a transformers model object, which a
    backend may refuse), options a models.sources.LoadOptions. claims(source, options) -> bool: backend="auto"
    runs this model on this backend (checked only when available() says its dependencies are installed).
    """

    name: str
    load: Callable
    help: str
    claims: Callable | None = None
    available: Callable[[], bool] = lambda: True


_registered: dict[str, BackendEntry] = {}


def register_backend(name: str, load: Callable, *, help: str, claims: Callable | None = None,
                     available: Callable[[], bool] | None = None) -> None:
    """Make a backend loadable by name. Backends of this package call it at import; a module elsewhere may too
    (its backend is then known once that module is imported)."""
    _registered[name] = BackendEntry(name, load, help, claims, available or (lambda: True))


def backend_help() -> dict[str, str]:
    """name -> one line of help, for every backend of this package and every one registered since, importing
    none of them."""
    return {**{name: help for name, (_, help, _) in _declared().items()},
            **{name: entry.help for name, entry in _registered.items()}}


def get_backend(name: str) -> BackendEntry:
    """The registered backend of that name, importing its module first if this package declares it."""
    if name not in _registered and name in _declared():
        import_module(f".{_declared()[name][0]}", __name__)
    if name not in _registered:
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(backend_help())}")
    return _registered[name]


def registered_backends() -> list[BackendEntry]:
    """Every backend, in the order backend_help() lists them (this package's modules are imported)."""
    return [get_backend(name) for name in backend_help()]


def claiming_backends() -> list[BackendEntry]:
    """The backends that may claim a model for "auto" (registered with `claims=`), in backend_help()'s order,
    importing only their modules: a backend that claims nothing is only ever named or the fallback, and importing
    transformers' (2 s of one core) before llama.cpp's load would keep that load waiting for it."""
    declared = _declared()
    names = [name for name in backend_help() if name in _registered or declared[name][2]]
    return [entry for entry in map(get_backend, names) if entry.claims is not None]


@functools.lru_cache(maxsize=None)
def _declared() -> dict[str, tuple[str, str, bool]]:
    """name -> (module, help, whether it passes claims=) of each `register_backend("name", ..., help="...")` call
    at the top level of this package's modules, read from their source without running them (name and help must be
    string literals)."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        source = resources.files(__name__).joinpath(f"{module.name}.py")
        if module.ispkg or not source.is_file():
            continue
        for node in ast.parse(source.read_text(encoding="utf-8")).body:
            call = node.value if isinstance(node, ast.Expr) else None
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "register_backend":
                help = next(k.value for k in call.keywords if k.arg == "help")
                claims = any(k.arg == "claims" for k in call.keywords)
                found[ast.literal_eval(call.args[0])] = (module.name, ast.literal_eval(help), claims)
    return found

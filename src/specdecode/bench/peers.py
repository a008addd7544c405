"""The models the peers of our decoding run on, set up from the user's options.

- transformers' methods: our target and draft (--peer-models same), or copies loaded as a transformers user loads
  them (stock: plain weights, no prepacking, no draft quantization), whatever backend ours run on;
- llama.cpp's methods: the GGUF files of the target and draft (the files ours run when they run on llama.cpp, the
  draft's lean Q4_0 copy included, else the GGUF of a built-in model or a .gguf file), the threads, and the
  llama-speculative binary.
With --draft suffix+MODEL the peers that run a draft model run MODEL (they have no suffix drafter).
"""

from __future__ import annotations

import math

from ..errors import OptionError
from .methods import METHOD_CLASSES
from .methods.base import LLAMACPP, TRANSFORMERS, LlamaPeerSetup

PEER_MODELS = ("stock", "same")


def _runs_on(methods, kind: str) -> bool:
    return any(METHOD_CLASSES[m].runs_on == kind for m in methods)


def stock_models(peer_models: str, opts, methods, sanity: bool, ours: str):
    """The models transformers' methods run on: ours ("same"), or as a transformers user loads them ("stock":
    plain fp32 weights, no prepacking, no draft quantization). (None, None) means ours. opts: the ModelOptions
    (specdecode.pairing.pair) ours were loaded with; ours: the backend our target runs on."""
    if peer_models not in PEER_MODELS:
        raise OptionError("peer_models", f"peer_models must be stock or same, got {peer_models!r}")
    ours_is_stock = (not opts.prepack and opts.draft_quantize in (None, "none") and opts.quantize in (None, "none")
                     and ours == "transformers")
    if peer_models == "same" or not _runs_on(methods, TRANSFORMERS) or ours_is_stock:
        return None, None
    from ..pairing.loading import load_model

    # transformers' methods need transformers models, whatever backend ours run on.
    stock = dict(device=opts.device, dtype=opts.dtype, device_map=opts.device_map,
                 trust_remote_code=opts.trust_remote_code, progress=False, backend="transformers")
    target = load_model(opts.target, **stock)
    draft = None
    if opts.draft_model is not None and not sanity:  # suffix+MODEL: MODEL
        draft = load_model(opts.draft_model, **stock)
    return target, draft


def llama_setup(opts, target_model, draft_model, methods, binary: str | None, sanity: bool) -> LlamaPeerSetup | None:
    """The GGUF files and threads llama.cpp's methods run on: the files ours run when they run on llama.cpp (a
    draft's lean Q4_0 copy where ours drafts on it: models/lean_gguf.py), else the GGUF of a built-in model or .gguf
    file (None for anything else: those methods are then left out)."""
    from ..models.lean_gguf import source_of
    from .llamacpp_peers import default_threads, gguf_file

    if not _runs_on(methods, LLAMACPP):
        return None

    def gguf(name, loaded):
        ours = file_run(loaded)
        path = ours if ours is not None else gguf_file(name, progress=False)
        return str(path) if path is not None else None

    draft, draft_is = None, None
    if opts.draft_model is not None and draft_model is not None and not sanity:  # suffix+MODEL: MODEL's file
        draft = gguf(opts.draft_model, draft_model)
        original = source_of(draft) if draft is not None else None
        draft_is = (None if draft is None else f"the file ours drafts on: the lean Q4_0 copy of {original}"
                    if original else "the file ours drafts on" if file_run(draft_model) is not None
                    else "the draft's GGUF file (ours runs the draft on another backend)")
    return LlamaPeerSetup(target_gguf=gguf(opts.target, target_model), draft_gguf=draft, draft_gguf_is=draft_is,
                          threads=opts.threads or default_threads(), speculative_binary=binary)


def file_run(loaded):
    """The GGUF file a model of ours runs on llama.cpp (a LoadedModel, or suffix+MODEL's drafter), else None."""
    part = model_part(loaded)
    for candidate in (part, getattr(part, "model", None)):
        path = getattr(candidate, "gguf_path", None)
        if path is not None:
            return path
    return None


def model_part(draft):
    """The draft model inside suffix+MODEL's drafter (its backend, whose .model is a transformers model on that
    backend), for the peers that run a draft model; any other draft as it is."""
    from ..drafters import SuffixModelDrafter

    return draft.model_drafter.backend if isinstance(draft, SuffixModelDrafter) else draft


def llama_context(prompt_ids: list[list[int]], max_new_tokens: int, extra: int) -> int:
    """A context that holds the longest prompt, the new tokens and a step of drafts, rounded up to 256: Llama with
    a draft keeps the logits of every position (n_ctx x vocabulary floats), so it stays small."""
    need = max(len(p) for p in prompt_ids) + max_new_tokens + extra + 16
    return 256 * math.ceil(need / 256)

"""Where each flag works: a flag the user gave that would do nothing on the backend or with the draft that runs is
refused before any model loads, with the flag, what runs, and what to use instead (issue 78: a flag accepted and
ignored tells the user something false about the run).

Only flags given on the command line (or from the environment) are checked, and only a value that asks for
something: a default the backend does not use (--prepack on llama.cpp) says nothing, and neither does a value that
asks for what the backend does anyway (--no-prepack, --dtype auto). `refuse_ignored` is what `generate`, `serve`
and `bench` call, after their own checks and before load_pair; each passes its own flags beside the model options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .console import CLIError, flag
from .options import AUTO, ModelOptions

TRANSFORMERS = ("transformers", "static")  # the backends that load a Hugging Face model through transformers
LLAMACPP = ("llamacpp",)
CACHES_PREFIXES = ("transformers", "llamacpp")  # the static backend keeps no KV of finished requests
TREES = ("transformers", "llamacpp")  # the static backend verifies chains only


@dataclass(frozen=True)
class Scope:
    """Where an option does something: the backends, whose backend counts (the target's, or either model's), the
    values that ask nothing of any backend, and what to use instead where it does nothing."""

    backends: tuple[str, ...]
    instead: str
    idle: tuple = ()
    models: str = "target"  # "target", or "either": the target's or the draft model's backend
    peers: bool = False  # bench: transformers' peers load their own models with it (bench/peers.py stock_models)


BACKEND_SCOPES = {
    "dtype": Scope(TRANSFORMERS, "a GGUF runs in the types it was quantized to: leave --dtype out, or run a Hugging "
                   "Face model (or a built-in one, converted) with --backend transformers", idle=("auto",),
                   models="either", peers=True),
    "quantize": Scope(TRANSFORMERS, "a GGUF is quantized already: run a GGUF quantized as you want (e.g. a Q8_0 "
                      "file), or quantize the fp32 weights with --backend transformers", idle=(None, "none")),
    "prepack": Scope(TRANSFORMERS, "llama.cpp lays out its weights itself: leave --prepack out, or prepack the "
                     "fp32 weights with --backend transformers", idle=(False,)),
    "trust_remote_code": Scope(TRANSFORMERS, "a GGUF runs no model code: leave it out (it is for transformers "
                               "models that bring their own, --backend transformers)", idle=(False,),
                               models="either", peers=True),
    "exact_greedy": Scope(LLAMACPP, "it picks llama.cpp's forward sizes: leave it out, or run a GGUF with "
                          "--backend llamacpp", idle=(False,)),
    "huge_pages": Scope(LLAMACPP, "it collapses llama.cpp's model memory: leave it out, or run a GGUF with "
                        "--backend llamacpp", idle=(False,), models="either"),
    "tree_width": Scope(TREES, "the static backend verifies chains: leave it out, or use --backend transformers "
                        "or llamacpp", idle=(1,)),
    "prefix_cache_tokens": Scope(CACHES_PREFIXES, "the static backend keeps no finished request's KV: "
                                 "--prefix-cache-tokens 0, or --backend transformers or llamacpp", idle=(0,)),
    "answer_kv": Scope(CACHES_PREFIXES, "the static backend keeps no finished request's KV: leave it out, or use "
                       "--backend transformers or llamacpp"),
    "prefix_cache_rows": Scope(LLAMACPP, "it reserves llama.cpp sequences; on transformers cached prefixes are "
                               "copies bounded by --prefix-cache-tokens alone: leave it out"),
}

SUFFIX_DRAFTS = ("suffix", "suffix+MODEL", "auto")
SPECULATIVE = ("suffix", "suffix+MODEL", "auto", "prompt-lookup", "MODEL")
# option -> (the drafts it works with, the values that ask nothing of a draft, what to use instead)
DRAFT_SCOPES = {
    "tree_width": (("suffix", "auto"), (1,), "token trees are the suffix draft's: use --draft suffix (a draft "
                   "model, alone or in suffix+MODEL, drafts chains)"),
    "suffix_history_tokens": (SUFFIX_DRAFTS, (), "the history is the suffix draft's: use --draft suffix or "
                              "suffix+MODEL, or leave it out"),
    "escaped_copies": (SUFFIX_DRAFTS, (False,), "it feeds the suffix draft's history: use --draft suffix or "
                       "suffix+MODEL, or leave it out"),
    "k": (SPECULATIVE, (AUTO, 0), "nothing is drafted, the target decodes alone: give a draft (auto, suffix, a "
          "model) or leave -k out"),
    "method": (SPECULATIVE, ("leviathan",), "nothing is drafted, so nothing is rejected: give a draft (auto, "
               "suffix, a model) or leave --method out"),
}


def spelled(option: str, value) -> str:
    """A flag as the user typed it: --prepack / --no-prepack, --dtype bfloat16."""
    if isinstance(value, bool):
        return flag(option) if value else "--no-" + flag(option)[2:]
    return f"{flag(option)} {value}"


def draft_kind(opts: ModelOptions) -> str:
    if not opts.has_draft:
        return "none"
    if opts.draft_is_auto:
        return "auto"
    if opts.draft_with_suffix:
        return "suffix+MODEL"
    if opts.draft_is_lookup:
        return opts.draft.lower()
    return "MODEL"


def backends_of(opts: ModelOptions) -> dict[str, tuple[str, str]]:
    """role -> (model, the backend that will load it), for the target and the draft model, if any (--draft auto's
    candidate counts: it may be loaded). Decided as load_model decides, without loading (opts checked first)."""
    from ..models.sources import LoadOptions
    from ..pairing.loading import choose_backend
    from ..pairing.pair import auto_draft_model

    options = LoadOptions(device=opts.device, dtype=opts.dtype, device_map=opts.device_map)
    draft = opts.draft_model or (auto_draft_model(opts) if opts.draft_is_auto else None)
    models = {"target": opts.target, **({"draft": draft} if draft else {})}
    return {role: (name, "static" if opts.compile else choose_backend(name, opts.backend, options).name)
            for role, name in models.items()}


def refuse_ignored(opts: ModelOptions, given: Optional[set] = None, values: Optional[dict] = None,
                   free_of_draft: tuple[str, ...] = (), peer_backends: tuple[str, ...] = ()) -> None:
    """A CLIError for the first option the user gave that would do nothing here. values: the command's own options
    beside the model options (serve's prefix cache, ...). free_of_draft: options the command uses whatever the
    draft (bench runs its suffix methods with -k and --suffix-history-tokens under --draft none). peer_backends:
    the backends bench's peers load their own models on."""
    from ..pairing.pair import check_options

    check_options(opts)  # a missing model or a bad value is said first, as load_pair would
    given = set(getattr(opts, "given", ()) if given is None else given)
    values = {**{name: getattr(opts, name) for name in BACKEND_SCOPES if hasattr(opts, name)},
              **{name: getattr(opts, name) for name in DRAFT_SCOPES if hasattr(opts, name)}, **(values or {})}
    if "k" not in free_of_draft:  # bench compares a comma list of K, with or without a draft
        values["k"] = opts.num_speculative_tokens
    runs = backends_of(opts)
    for option, scope in BACKEND_SCOPES.items():
        if option in given and option in values and values[option] not in scope.idle:
            _check_backend(option, values[option], scope, runs, peer_backends)
    kind = draft_kind(opts)
    for option, (drafts, idle, instead) in DRAFT_SCOPES.items():
        if option in given and option in values and option not in free_of_draft and values[option] not in idle \
                and kind not in drafts:
            raise CLIError(f"{spelled(option, values[option])} does nothing with --draft {opts.draft or 'none'}: "
                           f"{instead}")
    _check_transformers_only(opts, given, runs)
    _check_prefix_cache(given, values)


def _check_backend(option: str, value, scope: Scope, runs: dict, peer_backends: tuple) -> None:
    roles = ("target", "draft") if scope.models == "either" else ("target",)
    used = [role for role in roles if role in runs and runs[role][1] in scope.backends]
    if used or (scope.peers and set(peer_backends) & set(scope.backends)):
        return
    backend = runs["target"][1]
    whom = (f"the target ({runs['target'][0]})" if "draft" not in runs or scope.models == "target"
            else f"the target ({runs['target'][0]}) and the draft ({runs['draft'][0]})")
    raise CLIError(f"{spelled(option, value)} does nothing on the {backend} backend, which runs {whom}: "
                   f"{scope.instead}")


def _check_transformers_only(opts: ModelOptions, given: set, runs: dict) -> None:
    """What transformers does with the target's weights only where they are fp32 on the CPU (models/sources.py):
    prepacking, and int4 (bitsandbytes, CUDA) refused before the weights load rather than after."""
    if runs["target"][1] not in TRANSFORMERS:
        return
    import torch

    from ..models.sources import resolve_device, resolve_dtype

    device = None if opts.device_map is not None else resolve_device(opts.device)
    on_cuda = device is None or device.type == "cuda"
    if opts.quantize == "int4" and not on_cuda:
        raise CLIError("--quantize int4 needs a CUDA GPU (bitsandbytes): on the CPU use --quantize int8")
    if "prepack" in given and opts.prepack:
        dtype = resolve_dtype(opts.dtype, device or torch.device("cuda"))
        why = ("the target runs on a GPU" if on_cuda else f"--quantize {opts.quantize} replaces the fp32 weights"
               if opts.quantize not in (None, "none") else f"the weights are {str(dtype)[6:]}"
               if dtype != torch.float32 else None)
        if why is not None:
            raise CLIError(f"--prepack does nothing on the {runs['target'][1]} backend here: it lays out fp32 "
                           f"weights for the CPU, and {why}; leave --prepack out")


def _check_prefix_cache(given: set, values: dict) -> None:
    """serve: the prefix cache's own flags with the cache off (--prefix-cache-tokens 0)."""
    if values.get("prefix_cache_tokens", 1):
        return
    for option in ("prefix_cache_rows", "answer_kv"):
        if option in given:
            raise CLIError(f"{spelled(option, values[option])} does nothing with --prefix-cache-tokens 0 (no "
                           f"prefix cache): leave it out, or give the cache room")


GREEDY_IDLE = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None}  # what a greedy step reads of them: nothing


def refuse_sampling_at_greedy(given, values: dict, temperatures, idle: Optional[dict] = None) -> None:
    """A CLIError for a sampling option given where every temperature is 0: greedy takes the most likely token, with
    no draw to warp or seed (the penalties and --logit-bias still apply: they move the logits)."""
    if any(t > 0 for t in temperatures):
        return
    idle = {**GREEDY_IDLE, **(idle or {})}
    for name, value in values.items():
        if name in given and value != idle[name]:
            raise CLIError(f"{spelled(name, value)} does nothing at temperature 0 (greedy: the most likely token, "
                           f"no draw): give --temperature above 0, or leave it out")

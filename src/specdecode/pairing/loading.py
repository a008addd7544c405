"""Loading a model and its tokenizer, offline, through the backend that runs it: a built-in name, a local HF
directory, a .gguf file, or a hub id already in the local Hugging Face cache. Nothing is ever downloaded, no pickled
weights and no remote code are loaded unless asked for.

load_model hands the request to a backend of the registry (see backends/__init__.py): transformers (any of the
above, on CPU or GPU), static (a transformers model on a preallocated KV cache, with CUDA graphs on a GPU) and
llamacpp (GGUF models on llama.cpp's CPU kernels) register themselves there; `backend="auto"` takes a backend
that claims the model (llamacpp for a GGUF model on the CPU when llama-cpp-python is installed), transformers
otherwise. Finding a model and the transformers loading itself (from_pretrained, quantization, prepacking) are in
models/, below the backends, which import it; this module is above them.

Where a built-in model lives for the backend that would run it (locate_model) is decided here too, by the same
rule: a built-in model has two forms in the cache, the GGUF file that llama.cpp runs as it is (the installed file
of a one-part model, or the parts joined into <cache>/gguf/), checked against its sha256 once, and the fp32 Hugging
Face directory that transformers (and static) load, converted from that GGUF once into <cache>/models/; so
`specdecode models path` names the file a `generate` would open.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..backends import backend_help, claiming_backends, get_backend
from ..errors import OptionError
from ..models import catalog
from ..models.prepare import Progress, _gguf_location, _stamp_matches, prepare_gguf, prepare_model, tokenizer_prepared
from ..models.sources import LoadedModel, LoadOptions

AUTO_BACKEND = "auto"
DEFAULT_BACKEND = "transformers"  # what "auto" takes when no backend claims the model: it loads anything


def check_backend(name: str) -> None:
    """An OptionError unless name is "auto" or a registered backend (no backend is imported)."""
    if name != AUTO_BACKEND and name not in backend_help():
        raise OptionError("backend", f"backend must be one of {', '.join([AUTO_BACKEND, *backend_help()])}, "
                                     f"got {name!r}")


def choose_backend(source, backend: str, options: LoadOptions):
    """The registry entry that loads source: the one named, or for "auto" the first available backend that
    claims the model, transformers otherwise."""
    check_backend(backend)
    if backend != AUTO_BACKEND:
        return get_backend(backend)
    for entry in claiming_backends():
        if entry.available() and entry.claims(source, options):
            return entry
    return get_backend(DEFAULT_BACKEND)


def loads_on_llamacpp(name: str, backend: str, device: str) -> bool:
    """Whether a model would load on llama.cpp, told without loading or importing a backend: a GGUF model (a .gguf
    file or a built-in name) with backend llamacpp, or auto on the CPU where llama-cpp-python is installed."""
    import importlib.util

    from ..models.sources import is_gguf, resolve_device

    if backend != AUTO_BACKEND:
        return backend == "llamacpp" and is_gguf(name)
    return (is_gguf(name) and resolve_device(device).type == "cpu"
            and importlib.util.find_spec("llama_cpp") is not None)


def load_model(name_or_path, device: str = "cpu", dtype="auto", trust_remote_code: bool = False,
               device_map: str | None = None, quantize: str | None = None, prepack: bool = False,
               progress: Progress | bool | None = None, backend: str = AUTO_BACKEND, threads: int | None = None,
               backend_options: dict | None = None, exact_greedy: bool = False,
               max_rows: int | None = None, token_trees: bool = False, huge_pages: bool = True,
               lean_gguf: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer offline.

    name_or_path: a built-in name (see `specdecode models list`), a local HF directory, a .gguf file, or a hub
    id already in the local HF cache; a transformers model passes through. quantize: "int8" (CPU: torch's
    dynamic int8 Linear layers; CUDA: bitsandbytes) or "int4" (CUDA, bitsandbytes). Quantizing only the draft
    keeps the output exactly the target's distribution. prepack: on the CPU, store fp32 Linear weights in
    oneDNN's blocked layout, which makes a forward of a few tokens (speculative verification) cost about one
    decode step; the same function up to fp32 rounding (see models/optimize.py). Ignored off the CPU, for
    quantized models, and for non-fp32 models.

    backend: a registered backend ("transformers"; "static": the transformers model on StaticBackend, with a
    preallocated KV cache and CUDA graphs on a GPU; "llamacpp": a GGUF model, built-in or a .gguf file, on
    llama.cpp's CPU kernels, needs llama-cpp-python; dtype, quantize and prepack do not apply: the GGUF runs as it
    is quantized), or "auto": a backend that claims the model (llamacpp for a GGUF model on the CPU when
    llama-cpp-python is installed), transformers otherwise. The result's `backend` field says which.
    threads: CPU threads (llama.cpp's, or torch's for transformers; default: llama.cpp uses every core, torch
    keeps its setting). backend_options: keyword arguments for the backend (llamacpp: n_ctx, max_rows,
    max_tokens_per_forward, flash_attn, use_mmap, repack; see LlamaCppBackend; static: max_batch, max_len,
    compile, cuda_graphs; see StaticBackend; transformers takes none).
    max_rows: rows the model must decode at once (a server's batch): llama.cpp is built with that many sequences
    (default 1, and a batch of more rows is refused); the other backends take any batch and ignore it.
    exact_greedy: on llama.cpp, verify in forwards of at most 3 tokens (its kernels for 4 or more tokens round
    differently) and, on 2+ threads, of one token from position 256 on (where llama.cpp's one-token step splits
    its attention between threads), so that greedy output is token-for-token llama.cpp's own; slower. No effect
    elsewhere.
    token_trees: the model will verify token trees (--tree-width > 1): llama.cpp is then built with one KV stream
    for all rows and spare sequences for the branches; transformers verifies trees as it is.
    huge_pages: on llama.cpp, collapse the memory it allocated for the model into transparent huge pages, in a
    background thread (backends/huge_pages.py: fewer TLB misses, the same outputs); no effect elsewhere.
    lean_gguf: on llama.cpp, run a copy of the GGUF with its heavier matrices re-quantized to Q4_0 where that steps
    faster on this machine (models/lean_gguf.py: made and timed once); for a draft only, whose weights change q
    and not the output's distribution. No effect elsewhere.
    progress: a callback (description, done, total) told how preparing a built-in model goes (see
    models/prepare.py), or None; nothing is drawn here (a bool, the former switch, means no callback).
    """
    options = LoadOptions(device=device, dtype=dtype, trust_remote_code=trust_remote_code, device_map=device_map,
                          quantize=quantize, prepack=prepack, progress=progress, threads=threads,
                          backend_options=backend_options, exact_greedy=exact_greedy, max_rows=max_rows,
                          token_trees=token_trees, huge_pages=huge_pages, lean_gguf=lean_gguf)
    return choose_backend(name_or_path, backend, options).load(name_or_path, options)


# ----------------------------------------------------------------------------------------- where a built-in model lives
GGUF_BACKENDS = ("llamacpp",)  # the backends that run the GGUF itself; every other one loads the converted copy


@dataclass(frozen=True)
class ModelLocation:
    name: str
    backend: str  # the backend that would load the model
    path: Path  # the GGUF file (llama.cpp) or the converted Hugging Face directory (transformers, static)
    prepared: bool  # joined and checked, its tokenizer built (GGUF), or converted (directory): nothing to prepare

    @property
    def form(self) -> str:
        return "GGUF file" if self.backend in GGUF_BACKENDS else "converted Hugging Face directory"


def locate_model(name: str, backend: str = AUTO_BACKEND) -> ModelLocation:
    """The location of built-in model `name` for `backend` (auto: the backend a CPU load would choose)."""
    info = catalog.get_model_info(name)  # an unknown name fails here, with the known ones
    chosen = choose_backend(info.name, backend, LoadOptions()).name
    if chosen in GGUF_BACKENDS:
        path = _gguf_location(info)
        return ModelLocation(info.name, chosen, path, _stamp_matches(info, path) and tokenizer_prepared(info))
    return ModelLocation(info.name, chosen, catalog.model_path(info.name), catalog.is_cached(info.name))


def prepare_location(location: ModelLocation, progress=None) -> Path:
    """Make the location ready: join and check the GGUF, or convert it to the Hugging Face directory."""
    if location.backend in GGUF_BACKENDS:
        return prepare_gguf(location.name, progress=progress)[0]
    return prepare_model(location.name, progress=progress)

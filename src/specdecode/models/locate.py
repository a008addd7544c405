"""Where a built-in model lives for the backend that would run it, and whether it is ready there.

A built-in model has two forms in the cache: the GGUF file that llama.cpp runs as it is (the installed file of a
one-part model, or the parts joined into <cache>/gguf/), checked against its sha256 once; and the fp32 Hugging Face
directory that transformers (and static) load, converted from that GGUF once into <cache>/models/. Which one a
command uses is the backend's choice (backend "auto": llama.cpp for a GGUF model on the CPU when it is installed),
made here by the same rule as load_model's, so `specdecode models path` names the file a `generate` would open.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import registry
from .loading import AUTO_BACKEND, LoadOptions, choose_backend
from .prepare import _gguf_location, _stamp_matches, prepare_gguf, prepare_model, tokenizer_prepared  # the GGUF's rules

GGUF_BACKENDS = ("llamacpp",)  # the backends that run the GGUF itself; every other one loads the converted copy


@dataclass(frozen=True)
class ModelLocation:
    name: str
    backend: str  # the backend that would load the model
    path: Path  # the GGUF file (llama.cpp) or the converted Hugging Face directory (transformers, static)
    prepared: bool  # joined and checked with its tokenizer built (GGUF) or converted (directory): loading prepares nothing

    @property
    def form(self) -> str:
        return "GGUF file" if self.backend in GGUF_BACKENDS else "converted Hugging Face directory"


def locate_model(name: str, backend: str = AUTO_BACKEND) -> ModelLocation:
    """The location of built-in model `name` for `backend` (auto: the backend a CPU load would choose)."""
    info = registry.get_model_info(name)  # an unknown name fails here, with the known ones
    chosen = choose_backend(info.name, backend, LoadOptions()).name
    if chosen in GGUF_BACKENDS:
        path = _gguf_location(info)
        return ModelLocation(info.name, chosen, path, _stamp_matches(info, path) and tokenizer_prepared(info))
    return ModelLocation(info.name, chosen, registry.model_path(info.name), registry.is_cached(info.name))


def prepare_location(location: ModelLocation, progress=None) -> Path:
    """Make the location ready: join and check the GGUF, or convert it to the Hugging Face directory."""
    if location.backend in GGUF_BACKENDS:
        return prepare_gguf(location.name, progress=progress)[0]
    return prepare_model(location.name, progress=progress)

"""specdecode: lossless speculative decoding for Hugging Face causal language models.

Names are imported on first use, so that `specdecode --help` and argument errors do not wait for torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "SpeculativeGenerator": "engine.generators", "AutoregressiveGenerator": "engine.generators",
    "TokenStream": "engine.generators", "GenerationParams": "engine.params",
    "GenerationResult": "engine.results", "Stats": "engine.results", "RowStats": "engine.results",
    "TokenEvent": "engine.results", "SamplingParams": "exact.sampling", "VocabularyMismatchError": "text.vocab",
    "ModelDrafter": "drafters", "PromptLookupDrafter": "drafters", "SuffixDrafter": "drafters",
    "SuffixHistory": "drafters", "SuffixModelDrafter": "drafters",
    "load_model": "pairing.loading", "LoadedModel": "models.sources",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)

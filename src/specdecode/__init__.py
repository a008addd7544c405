"""specdecode: lossless speculative decoding for Hugging Face causal language models."""

from .drafters import ModelDrafter, PromptLookupDrafter
from .engine import AutoregressiveGenerator, SpeculativeGenerator, TokenStream
from .results import GenerationResult, Stats, TokenEvent
from .sampling import SamplingParams
from .vocab import VocabularyMismatchError

__version__ = "0.1.0"


def load_model(*args, **kwargs):
    """Load a model and its tokenizer (see specdecode.models.loading.load_model)."""
    from .models.loading import load_model as _load

    return _load(*args, **kwargs)


__all__ = ["ModelDrafter", "PromptLookupDrafter", "AutoregressiveGenerator", "SpeculativeGenerator", "TokenStream", "GenerationResult", "Stats",
           "TokenEvent", "SamplingParams", "VocabularyMismatchError", "load_model", "__version__"]

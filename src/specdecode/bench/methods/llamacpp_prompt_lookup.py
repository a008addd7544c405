"""llamacpp-prompt-lookup: llama-cpp-python's generation with LlamaPromptLookupDecoding drafting K tokens per step
(K = auto: its own default, 10)."""

from __future__ import annotations

from ..llamacpp_peers import LOOKUP_DEFAULT_TOKENS
from ..units import AUTO, Unit
from .llamacpp import LlamaCppPython


class LlamaCppPromptLookup(LlamaCppPython):
    name = "llamacpp-prompt-lookup"
    per_k = True
    plain = "llamacpp-plain"

    def lookup(self, unit: Unit) -> int:
        return LOOKUP_DEFAULT_TOKENS if unit.k == AUTO else unit.k

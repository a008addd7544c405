"""The bench's methods, in one table (METHOD_CLASSES): name -> class, in the order the report lists them.

Adding a peer is one file here: a BenchMethod subclass (its name, `unavailable`, `run`, and what its `report`
adds), imported and listed in METHOD_CLASSES below. The runner, the report, the CLI's --methods and its help read
the methods from this table only.
"""

from __future__ import annotations

from .base import BenchContext, BenchMethod
from .hf_assisted import HFAssisted
from .hf_plain import HFPlain
from .llamacpp_json_schema import LlamaCppJsonSchema
from .llamacpp_plain import LlamaCppPlain
from .llamacpp_prompt_lookup import LlamaCppPromptLookup
from .llamacpp_speculative import LlamaSpeculative
from .specdecode import SpecDecode
from .specdecode_copy import SpecDecodePromptLookup, SpecDecodeSuffix
from .specdecode_plain import SpecDecodePlain
from .specdecode_unconstrained import SpecDecodePlainUnconstrained, SpecDecodeUnconstrained

METHOD_CLASSES: dict[str, type[BenchMethod]] = {cls.name: cls for cls in (
    SpecDecodePlain, SpecDecode, SpecDecodePromptLookup, SpecDecodeSuffix, HFPlain, HFAssisted, LlamaCppPlain,
    LlamaCppPromptLookup, LlamaCppJsonSchema, SpecDecodePlainUnconstrained, SpecDecodeUnconstrained, LlamaSpeculative)}
METHODS = tuple(METHOD_CLASSES)
# BenchSettings' default methods: all but those that run only when named
ALL_BUT_ON_REQUEST = tuple(name for name, cls in METHOD_CLASSES.items() if not cls.on_request)


def default_methods(structured: bool = False, multi_turn: bool = False) -> tuple[str, ...]:
    """The methods run unless --methods names others: the default ones that fit the workload (free text, prompts
    with JSON schemas, or multi-turn sessions: every method that stops at the end of generation, so that ours with
    each draft and llama.cpp's peers compete in one run)."""
    if multi_turn:
        return tuple(name for name, cls in METHOD_CLASSES.items() if cls.stops_at_eos and not cls.structured_only)
    return tuple(name for name, cls in METHOD_CLASSES.items()
                 if cls.default and (cls.structured if structured else not cls.structured_only))


DEFAULT_METHODS = default_methods()


def plain_of(name: str) -> str | None:
    """The plain baseline of a method as the report names it (llama-speculative-dmax4 is llama-speculative's)."""
    cls = METHOD_CLASSES.get(name) or next((c for n, c in METHOD_CLASSES.items() if name.startswith(n + "-")), None)
    return cls.plain if cls is not None else None


__all__ = ["ALL_BUT_ON_REQUEST", "BenchContext", "BenchMethod", "DEFAULT_METHODS", "METHODS", "METHOD_CLASSES",
           "default_methods", "plain_of"]

"""A server's limits and options (the CLI's flags), and what the HTTP layer knows about the engine it serves."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import OptionError
from ..backends.prefix_cache import ANSWER_KV
from ..policy.speculation import MAX_K

JSON_LAYOUTS = ("compact", "model")

DEFAULT_ALIAS = "specdecode"  # always served unless --served-model-name says otherwise: what the README's examples use


@dataclass
class ServerSettings:
    """Limits and options of one server, checked here and only here: the CLI, a Ray Serve config and create_app
    all pass their values through this class. An OptionError names the field."""

    max_batch_size: int = 8
    max_queue: int = 64
    max_tokens_limit: int = 0  # the largest max_tokens a request may ask (0: as much as the context leaves)
    # Time bounds (0: none). A request that is making progress is never cut by default: a long answer that keeps
    # producing tokens runs as long as it needs, as on vLLM, Ollama and llama-server.
    queue_timeout: float = 600.0  # waiting for room in the batch (503); beyond it OpenAI's clients have given up
    stall_timeout: float = 120.0  # in the engine without progress (504): a hung or stuck engine, not a long answer
    request_timeout: float = 0.0  # from arrival to the end of the response (504): only where an operator asks
    api_key: str | None = None  # None or "": no key
    draft_name: str | None = None
    served_model_names: Sequence[str] = ()  # --served-model-name; empty: the target's name and "specdecode"
    prefill_tokens_per_step: int | None = 256  # prompt tokens prefilled per engine step (None or 0: whole prompts)
    static_batching: bool = False  # admit requests only when the running batch is done (for comparisons)
    max_speculative_tokens: int = MAX_K  # the largest fixed K a request may ask for
    max_prompt_chars: int = 1_000_000
    default_predict_tokens: int = 64
    shutdown_grace_s: float = 30.0  # in-flight batch: finish for this long, then cancel
    retry_after_s: int = 1
    prefix_cache_tokens: int = 65536  # KV of finished requests kept for prompts that start the same (0: off)
    prefix_cache_rows: int = 4  # llama.cpp: spare sequences that hold cached prefixes, beside max_batch_size
    grammar_cache_entries: int = 64  # compiled grammars kept (LRU): each distinct schema, regex or tool set is one
    answer_kv: str = "prefill"  # a finished answer's KV: prefilled again while idle, lent as decoded, or not lent
    escaped_copies: bool = True  # JSON answers: the suffix history takes the messages' texts JSON-escaped
    json_layout: str = "compact"  # a response_format's JSON: compact, or laid out as the model writes it (bounded)
    strict_tool_calls: bool = False  # tool calls in the template's own form only (no fenced or bare JSON)
    max_tool_calls: int = 0  # calls in one answer at most (0: the number of tools the request declares)
    malloc_mmap_threshold_kib: int = 128  # blocks this large get their own mapping (0: glibc's rising threshold;
    # allocator.py)

    def __post_init__(self):
        for name in ("max_batch_size", "max_queue", "max_prompt_chars", "default_predict_tokens"):
            _integer(name, getattr(self, name), 1)
        _integer("max_tokens_limit", self.max_tokens_limit, 0)
        _integer("max_speculative_tokens", self.max_speculative_tokens, 1, MAX_K)
        _integer("max_tool_calls", self.max_tool_calls, 0)
        _integer("retry_after_s", self.retry_after_s, 0)
        _integer("prefix_cache_tokens", self.prefix_cache_tokens, 0)
        _integer("prefix_cache_rows", self.prefix_cache_rows, 0)
        _integer("grammar_cache_entries", self.grammar_cache_entries, 1)
        _integer("malloc_mmap_threshold_kib", self.malloc_mmap_threshold_kib, 0, 32 * 1024)  # glibc's largest
        if self.answer_kv not in ANSWER_KV:
            raise OptionError("answer_kv", f"answer_kv must be one of {', '.join(ANSWER_KV)} (prefill: exact, lend: "
                                           f"equal up to float rounding, off: prompts only), got {self.answer_kv!r}")
        if self.json_layout not in JSON_LAYOUTS:
            raise OptionError("json_layout", f"json_layout must be one of {', '.join(JSON_LAYOUTS)} (compact: no "
                                             f"whitespace between tokens; model: the model's own layout, bounded), "
                                             f"got {self.json_layout!r}")
        if self.prefill_tokens_per_step is not None:
            _integer("prefill_tokens_per_step", self.prefill_tokens_per_step, 0)
            self.prefill_tokens_per_step = self.prefill_tokens_per_step or None  # 0: whole prompts at once
        for name in ("queue_timeout", "stall_timeout", "request_timeout"):
            if getattr(self, name) is None:  # a config file's null: no bound, as 0
                setattr(self, name, 0.0)
            _seconds(name, getattr(self, name), positive=False, zero="no limit")
        _seconds("shutdown_grace_s", self.shutdown_grace_s, positive=False)
        self.api_key = self.api_key or None
        if isinstance(self.served_model_names, str):
            self.served_model_names = (self.served_model_names,)
        self.served_model_names = tuple(self.served_model_names)
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise OptionError("served_model_names", f"served model names must be non-empty strings, got "
                                                    f"{list(self.served_model_names)!r}")


    @property
    def model_rows(self) -> int:
        """Rows the models' caches are built for: the batch, and the cached prefixes' spare rows."""
        return self.max_batch_size + (self.prefix_cache_rows if self.prefix_cache_tokens else 0)

    def tokens_cap(self, context_length: int | None) -> int | None:
        """The largest max_tokens a request may ask: --max-tokens-limit, else what the context leaves after a
        one-token prompt; None: no bound known."""
        if self.max_tokens_limit:
            return self.max_tokens_limit
        return context_length - 1 if context_length else None


def _integer(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise OptionError(name, f"{name} must be an integer {bound}, got {value!r}")


def _seconds(name: str, value, positive: bool, zero: str | None = None) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        meaning = f" (0: {zero})" if zero else ""
        raise OptionError(name, f"{name} must be a number of seconds {'> 0' if positive else '>= 0'}{meaning}, "
                                f"got {value!r}")


def served_names(model_name: str, given: Sequence[str] = ()) -> tuple[str, ...]:
    """The model ids a server answers to, the first being its main one.

    The names given (--served-model-name, repeatable) if any; otherwise the target's name and "specdecode".
    """
    return tuple(dict.fromkeys(given or (model_name, DEFAULT_ALIAS)))


@dataclass(frozen=True)
class ServedModel:
    """The served engine as the HTTP layer sees it, read once from the generator's public properties."""

    names: tuple[str, ...]
    tokenizer: Any
    has_draft: bool
    draft_name: str | None
    num_speculative_tokens: int
    context_length: int | None
    vocab_size: int | None
    created: int

    @classmethod
    def of(cls, generator, names: tuple[str, ...], tokenizer, draft_name: str | None) -> "ServedModel":
        has_draft = generator.has_draft
        return cls(names=names, tokenizer=tokenizer, has_draft=has_draft,
                   draft_name=(draft_name or "draft") if has_draft else None,
                   num_speculative_tokens=generator.num_speculative_tokens if has_draft else 0,
                   context_length=generator.context_length, vocab_size=generator.vocab_size,
                   created=int(time.time()))

    @property
    def name(self) -> str:
        return self.names[0]

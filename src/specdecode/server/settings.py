"""A server's limits and options (the CLI's flags), and what the HTTP layer knows about the engine it serves."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

DEFAULT_ALIAS = "specdecode"  # always served unless --served-model-name says otherwise: what the README's examples use


@dataclass
class ServerSettings:
    """Limits and options of one server."""

    max_batch_size: int = 8
    max_queue: int = 64
    max_tokens_limit: int = 2048
    request_timeout: float = 120.0  # seconds from arrival to the end of the response
    api_key: str | None = None
    draft_name: str | None = None
    served_model_names: Sequence[str] = ()  # --served-model-name; empty: the target's name and "specdecode"
    prefill_tokens_per_step: int | None = 256  # prompt tokens prefilled per engine step (None: whole prompts)
    batch_window_s: float = 0.0  # no longer used: requests join the running batch at the next step
    static_batching: bool = False  # admit requests only when the running batch is done (for comparisons)
    max_speculative_tokens: int = 32
    max_prompt_chars: int = 1_000_000
    default_predict_tokens: int = 64
    shutdown_grace_s: float = 30.0  # in-flight batch: finish for this long, then cancel
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_batch_size", "max_queue", "max_tokens_limit", "max_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        p = self.prefill_tokens_per_step
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ValueError(f"prefill_tokens_per_step must be an integer >= 1 (or None), got {p!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout!r}")
        if isinstance(self.served_model_names, str):
            self.served_model_names = (self.served_model_names,)
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ValueError(f"served model names must be non-empty strings, got {list(self.served_model_names)!r}")


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

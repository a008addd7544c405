"""What the bench times and what one timing gives: a Unit (a method at a temperature, with a K for a speculative
method) and a Measurement (one run of a unit over every prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.results import Stats
from ..policy.speculation import AUTO  # noqa: F401  (the K of the engine's adaptive policy, as the bench writes it)


@dataclass(frozen=True)
class Unit:
    """One thing that is timed: a method, at a temperature, with a K for the speculative ones."""

    method: str
    temperature: float
    k: int | str | None = None
    draft_max: int | None = None  # llama-speculative's --draft-max

    @property
    def name(self) -> str:
        """The method's name in the report: llama-speculative gets its draft-max (llama-speculative-dmax4)."""
        return self.method + (f"-dmax{self.draft_max}" if self.draft_max is not None else "")

    @property
    def label(self) -> str:
        return self.name + (f" K={self.k}" if self.k is not None else "") + f" T={self.temperature:g}"


@dataclass
class Measurement:
    """One run of one method over all prompts.

    per_prompt_tokens: new tokens of each row; per_prompt_seconds: wall time of each generate() call (one per
    prompt, or per batch under --batch-size). Rows are in the order of the batches, flattened."""

    tokens: int
    seconds: float
    per_prompt_tokens: list[int]
    per_prompt_seconds: list[float]
    stats: Stats | None = None  # ours: merged over the prompts
    target_calls: int = 0  # hf-assisted: forward calls counted with hooks
    draft_calls: int = 0
    extra: dict = field(default_factory=dict)  # llama-speculative: what it printed
    texts: list[str] | None = None  # each row's output, kept when the workload checks them (JSON schemas)
    token_ids: list[list[int]] | None = None  # each row's new tokens, kept when decoded until the end of generation
    call_stats: list[Stats] | None = None  # ours: each generate() call's (the multi-turn report groups them by turn)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / self.tokens if self.tokens else float("nan")


def int_ks(ks) -> list[int]:
    """The fixed K values of a list that may hold "auto"."""
    return [k for k in ks if k != AUTO]

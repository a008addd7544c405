"""The settings of one `specdecode bench` run, checked before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import OptionError
from ..pairing.pair import DEFAULT_SUFFIX_HISTORY_TOKENS
from .methods import ALL_BUT_ON_REQUEST, METHODS
from .units import AUTO


@dataclass
class BenchSettings:
    ks: list = field(default_factory=lambda: [AUTO])  # numbers of draft tokens per step, or "auto"
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 64
    runs: int = 3
    warmup: int = 1
    top_k: int = 0
    top_p: float = 1.0
    methods: tuple[str, ...] = ALL_BUT_ON_REQUEST  # every method but those run only when named (on_request)
    seed: int = 0
    method: str = "leviathan"  # our rejection sampler
    cost_repeats: int = 3
    batch_size: int = 1  # rows per generate() call
    llama_draft_max: list[int] = field(default_factory=lambda: [2, 3, 4, 8])  # llama-speculative --draft-max values
    suffix_history_tokens: int = DEFAULT_SUFFIX_HISTORY_TOKENS  # specdecode-suffix's history of earlier requests

    def check(self) -> None:
        if not self.ks or any(k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1)
                              for k in self.ks):
            # K = 0 is plain decoding, which the bench times as specdecode-plain
            raise OptionError("k", f"k values must be 'auto' or integers >= 1 (K = 0 is specdecode-plain), got "
                                   f"{self.ks}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if self.runs < 1:
            raise ValueError("--runs must be >= 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.llama_draft_max or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                           for n in self.llama_draft_max):
            raise ValueError(f"--llama-draft-max values must be integers >= 1, got {self.llama_draft_max}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}: choose among {', '.join(METHODS)}")

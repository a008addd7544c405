"""How many draft tokens a step verifies, as every entry point takes it: "auto" or a fixed K.

One parse for the library, the CLI, the server and bench, so "auto", 0 and the upper bound mean the same thing
everywhere: K = 0 is plain decoding (the draft stays loaded but is never asked), "auto" lets the speculation
policy pick K in 0..max_k before every step.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
MAX_K = 32  # a verification of more tokens than this costs more than it can save on any hardware we know
MAX_COPY_K = 64  # ... except a free copy's under "auto" (AdaptivePolicy's max_copy_k): a long match's copy (a file
                 # re-emitted whole) is kept nearly whole, and on a CPU each verified token costs ~0.3 of a step


@dataclass(frozen=True)
class Speculation:
    k: int | None  # a fixed K (0 = plain decoding); None = auto

    @classmethod
    def parse(cls, value) -> "Speculation":
        """From "auto", an integer 0..MAX_K, its digits, or a Speculation; a ValueError names the rule otherwise."""
        if isinstance(value, Speculation):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text == AUTO:
                return cls(None)
            if text.isascii() and text.isdigit():
                value = int(text)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_K:
            raise ValueError(f"num_speculative_tokens (K) must be 'auto' or an integer 0..{MAX_K} "
                             f"(0 = plain decoding), got {value!r}")
        return cls(value)

    @property
    def auto(self) -> bool:
        return self.k is None

    def __str__(self) -> str:
        return AUTO if self.k is None else str(self.k)

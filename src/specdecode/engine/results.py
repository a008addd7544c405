"""What a generation call returns: tokens, texts, statistics, and streamed token events."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Provenance = Literal["accepted", "resampled", "bonus", "target", "forced"]


@dataclass(frozen=True)
class TokenEvent:
    """One new token, emitted as soon as it is decided.

    provenance: "accepted" (a draft token the target kept), "resampled" (the target's correction after a
    rejection), "bonus" (the target's extra token after all drafts were accepted), "target" (plain decoding,
    and the first token, which comes from the target's prefill) or "forced" (the row's grammar allowed this token
    alone, so it rode in the verification forward as a certain draft).
    logprob / top_logprobs: when the row asked for them, the token's log-probability and the most likely tokens'
    (id, log-probability), best first, under the distribution the token was drawn from (after temperature,
    top-k, top-p and the grammar mask; greedy rows: log-softmax of the masked logits).
    """

    row: int
    token_id: int
    provenance: Provenance
    text: str | None = None  # the text this token adds to the row (may be "" while a character is incomplete)
    finished: bool = False  # True on the row's last token
    finish_reason: str | None = None  # "length" | "stop" (EOS, a stop string or stop token) on the last token
    step: int = 0  # the step of the decoding session that decided this token (tokens of one step share it)
    num_drafts: int = 0  # how many drafts the row proposed in that step (0: a plain target step or the prefill)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class Stats:
    """Counters and timings of one generate() call, summed over the rows of the batch."""

    num_rows: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    # The user's K: a fixed K, or under -k auto the most drafts a model's step may choose (max_speculative_tokens).
    num_speculative_tokens: int = 0
    # The most tokens one step may verify: K, or under -k auto with a drafter that copies (suffix, suffix+MODEL)
    # the copy limit (max_copy_tokens), far past a model's K since a long match's copy is kept nearly whole.
    copy_limit: int = 0
    policy: str = "fixed"  # "auto" (adaptive K) or "fixed"
    k_histogram: dict[int, int] = field(default_factory=dict)  # verification steps per K chosen (0: plain)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0  # tokens the rows' grammars forced, verified as certain drafts (not in proposed_tokens)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of a prefill
    verification_steps: int = 0  # row-steps: one per row per target verification call
    target_forward_calls: int = 0
    draft_forward_calls: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted_per_position[i]: draft i+1 kept
    proposed_per_position: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    other_time_s: float = 0.0
    wall_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0.0 when nothing was proposed)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target verification call and row (1.0 for plain decoding)."""
        emitted = self.new_tokens - self.num_rows_with_first_token
        return emitted / self.verification_steps if self.verification_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Throughput after the prefill: what speculation speeds up."""
        decode_time = self.wall_time_s - self.prefill_time_s
        emitted = self.new_tokens - self.num_rows_with_first_token
        return emitted / decode_time if decode_time > 0 else 0.0

    # The first token of each row comes from the prefill, not from a verification step.
    num_rows_with_first_token: int = 0

    @property
    def mean_k(self) -> float:
        """Mean number of drafts per verification step (plain steps count as 0)."""
        steps = sum(self.k_histogram.values())
        return sum(k * n for k, n in self.k_histogram.items()) / steps if steps else 0.0

    @property
    def plain_steps(self) -> int:
        return self.k_histogram.get(0, 0)

    # What the speculation policy reports at the end of the call (learned costs, acceptance, probes).
    policy_summary: dict = field(default_factory=dict)

    def add_verification(self, k_rows: list[int], accepted: list[int]) -> None:
        """One target verification: row b proposed k_rows[b] drafts and kept accepted[b] of them."""
        self.target_forward_calls += 1
        k = max(k_rows, default=0)
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        for counts in (self.proposed_per_position, self.accepted_per_position):
            counts.extend([0] * (k - len(counts)))
        self.verification_steps += len(accepted)
        self.proposed_tokens += sum(k_rows)
        self.accepted_tokens += sum(accepted)
        for i in range(k):
            self.proposed_per_position[i] += sum(kr > i for kr in k_rows)
            self.accepted_per_position[i] += sum(a > i for a in accepted)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "tokens_per_second",
                     "decode_tokens_per_second", "mean_k", "plain_steps"):
            d[name] = getattr(self, name)
        return d


@dataclass
class RowStats:
    """One row's own share of the counters (a server reports these per request)."""

    new_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    verification_steps: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (OpenAI's prompt_tokens_details)

    def add_verification(self, k: int, accepted: int) -> None:
        self.verification_steps += 1
        self.proposed_tokens += k
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.new_tokens - 1) / self.verification_steps if self.verification_steps else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length)


@dataclass
class GenerationResult:
    """token_ids[i] holds only the NEW tokens of row i; texts is None when no tokenizer is known."""

    token_ids: list[list[int]]
    texts: list[str] | None
    stats: Stats
    finish_reasons: list[str]
    provenance: list[list[str]]
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    row_stats: list[RowStats] = field(default_factory=list)
    # Per row and token, when a row asked for logprobs (None for rows that did not; the whole field None if none did).
    logprobs: list[list[float] | None] | None = None
    top_logprobs: list[list[tuple[tuple[int, float], ...]] | None] | None = None

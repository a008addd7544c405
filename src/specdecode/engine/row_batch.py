"""What the running batch holds per row on the host: a Row (its request, tokens, text and statistics) and the
RowBatch of the rows in batch order, with their sampling settings, random streams, grammar states and the state of
their logit_bias and penalties."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..text.detokenize import IncrementalDetokenizer
from ..exact.penalties import RowPenalties
from .results import RowStats
from ..structured.row_grammars import RowGrammars
from ..exact.sampling import BatchSampling, RowGenerators


@dataclass
class Row:
    """Host-side state of one row of the batch."""

    index: int
    request: object  # engine.Request
    detok: IncrementalDetokenizer | None
    coupled: bool  # drawn by Gumbel-max coupling: a seeded sampled row whose K the policy picks
    policy_state: object
    matcher: object | None  # the row's grammar state (constraints.Matcher), None when free
    tokens: list[int] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple] = field(default_factory=list)
    finish_reason: str | None = None
    stop_at: int | None = None  # where a stop string begins in the row's text
    stats: RowStats = field(default_factory=RowStats)

    @property
    def fixed_k(self) -> int | None:
        return self.request.num_speculative_tokens

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


@dataclass(frozen=True)
class RowBatch:
    """Everything the running batch holds per row on the host, in row order; select and extend return a new batch
    (the models' caches hold the same rows in the same order: the session moves them together)."""

    rows: list[Row]  # [B]
    sampling: BatchSampling  # [B] the rows' sampling settings
    generators: RowGenerators  # [B] the rows' random streams
    grammars: RowGrammars  # [B] the rows' grammar states (None for a free row)
    penalties: RowPenalties  # [B] the rows' logit_bias and penalties with their text so far (inactive: none set)

    @classmethod
    def of(cls, rows: list[Row], vocab_size: int, device) -> "RowBatch":
        coupled, params = [r.coupled for r in rows], [r.request.params for r in rows]
        return cls(rows, BatchSampling(params, device, coupled),
                   RowGenerators([r.request.seed for r in rows], device, coupled, [r.request.seed_index for r in rows]),
                   RowGrammars([r.matcher for r in rows], vocab_size, device),
                   RowPenalties(params, [r.request.prompt for r in rows], vocab_size, device))

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, keep: list[int]) -> "RowBatch":
        return RowBatch([self.rows[i] for i in keep], self.sampling.select(keep), self.generators.select(keep),
                        self.grammars.select(keep), self.penalties.select(keep))

    def extend(self, other: "RowBatch") -> "RowBatch":
        return RowBatch(self.rows + other.rows, self.sampling.extend(other.sampling),
                        self.generators.extend(other.generators), self.grammars.extend(other.grammars),
                        self.penalties.extend(other.penalties))

"""What the running batch holds per row on the host: a Row (its request, tokens, text and statistics) and the
RowBatch of the rows in batch order, with their sampling settings, random streams, grammar states and the state of
their logit_bias and penalties."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.rows import RowChange, RowText
from ..text.detokenize import IncrementalDetokenizer
from ..exact.penalties import RowPenalties
from .results import GenerationResult, RowStats, Stats
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
    text: RowText = field(init=False)  # its prompt and tokens as the models' holders read them (the same lists)

    def __post_init__(self):
        self.text = RowText(self.index, self.request.prompt, self.tokens)

    @property
    def fixed_k(self) -> int | None:
        return self.request.num_speculative_tokens

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


@dataclass(frozen=True)
class RowBatch:
    """Everything the running batch holds per row on the host, in row order; select, extend and apply return a new
    batch (the models' caches hold the same rows in the same order: layout.RowLayout moves them together)."""

    rows: list[Row]  # [B]
    sampling: BatchSampling  # [B] the rows' sampling settings
    generators: RowGenerators  # [B] the rows' random streams
    grammars: RowGrammars  # [B] the rows' grammar states (None for a free row)
    penalties: RowPenalties  # [B] the rows' logit_bias and penalties with their text so far (inactive: none set)
    texts: tuple[RowText, ...] = ()  # [B] the rows' texts, as a drafter reads them

    @classmethod
    def of(cls, rows: list[Row], vocab_size: int, device) -> "RowBatch":
        coupled, params = [r.coupled for r in rows], [r.request.params for r in rows]
        return cls(rows, BatchSampling(params, device, coupled),
                   RowGenerators([r.request.seed for r in rows], device, coupled, [r.request.seed_index for r in rows]),
                   RowGrammars([r.matcher for r in rows], vocab_size, device),
                   RowPenalties(params, [r.request.prompt for r in rows], vocab_size, device),
                   tuple(r.text for r in rows))

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, keep: list[int]) -> "RowBatch":
        return RowBatch([self.rows[i] for i in keep], self.sampling.select(keep), self.generators.select(keep),
                        self.grammars.select(keep), self.penalties.select(keep), tuple(self.texts[i] for i in keep))

    def extend(self, other: "RowBatch") -> "RowBatch":
        return RowBatch(self.rows + other.rows, self.sampling.extend(other.sampling),
                        self.generators.extend(other.generators), self.grammars.extend(other.grammars),
                        self.penalties.extend(other.penalties), self.texts + other.texts)

    def apply(self, change: RowChange, appended: "RowBatch | None" = None) -> "RowBatch":
        """(this batch + appended)[change.keep]: `appended` holds the change's appended rows, in its order."""
        before, joining = change.split(len(self))
        batch = self if before == list(range(len(self))) else self.select(before)
        if joining:
            batch = batch.extend(appended if joining == list(range(len(appended))) else appended.select(joining))
        order = [i for i in change.keep if i < len(self)] + [i for i in change.keep if i >= len(self)]
        return batch if order == list(change.keep) else batch.select([order.index(i) for i in change.keep])


def result_of(rows: list[Row], stats: Stats, texts: bool) -> GenerationResult:
    """The GenerationResult of these rows with the session's statistics (texts: whether there is a tokenizer)."""
    for row in rows:
        row.stats.new_tokens = len(row.tokens)
    decoded = None
    if texts:
        decoded = []
        for row in rows:
            if row.stop_at is None:
                row.detok.flush()
            decoded.append(row.detok.text[: row.stop_at] if row.stop_at is not None else row.detok.text)
    asked = [r.request.logprobs is not None for r in rows]
    return GenerationResult(token_ids=[r.tokens for r in rows], texts=decoded, stats=stats,
                            finish_reasons=[r.finish_reason for r in rows], provenance=[r.provenance for r in rows],
                            prompt_token_ids=[r.request.prompt for r in rows], row_stats=[r.stats for r in rows],
                            logprobs=[r.logprobs if a else None for r, a in zip(rows, asked)] if any(asked) else None,
                            top_logprobs=[r.top_logprobs if a else None for r, a in zip(rows, asked)]
                            if any(asked) else None)

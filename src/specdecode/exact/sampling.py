"""Sampling parameters and the one function that turns logits into the distribution we sample from.

The same function makes the target's p and the draft's q: speculative decoding is lossless only if both
are warped identically (temperature, then top-k, then top-p, then min-p, as transformers' logits warpers do). The
options that depend on the text so far (logit_bias, repetition, frequency and presence penalties) adjust the logits
before that warping, along each position's own path (penalties.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch


GREEDY_EPS = 1e-5  # temperatures below this are greedy decoding (as in vLLM): 1/T would overflow the logits


@dataclass(frozen=True)
class SamplingParams:
    """A row's sampling settings, checked and normalised once, here, for the library, the CLI and the server."""

    temperature: float = 1.0  # 0 (or below GREEDY_EPS, stored as 0.0) means greedy decoding
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0 disables: drop tokens below min_p x the top probability (after top-p)
    presence_penalty: float = 0.0  # subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of prompt + output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its raw logit); a dict is accepted

    def __post_init__(self):
        if not _number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        if not _number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables top-p), got {self.top_p!r}")
        if not _number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables min-p), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 disables), "
                                 f"got {value!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 disables; above 1 discourages repeats), "
                             f"got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "temperature", 0.0 if self.temperature < GREEDY_EPS else float(self.temperature))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit_bias or a penalty changes the logits before the warping (penalties.py)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


PENALTY_LIMIT = 2.0  # presence and frequency penalties: OpenAI's range, [-2, 2]
BIAS_LIMIT = 100.0  # a logit_bias value: OpenAI's range, [-100, 100]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """A logit_bias (mapping or pairs of token id -> value) as sorted (id, value) pairs, checked. Whether the ids
    are in the model's vocabulary is checked where the vocabulary is known (engine.SpeculativeGenerator.request)."""
    pairs = list(bias.items()) if hasattr(bias, "items") else list(bias or ())
    out = {}
    for pair in pairs:
        token, value = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (pair, None)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not _number(value) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be numbers in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {value!r} "
                             f"for token {token}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p, with transformers' semantics (min_tokens_to_keep=1); a
    row's logit_bias and penalties need the text before each position and are not applied here (penalties.py).

    Removed entries become -inf. Works on any leading shape [..., V]; returns float32. One row of BatchSampling.warp,
    so the per-row batched path and this one cannot drift apart.
    """
    if params.greedy:
        raise ValueError("warp_logits is for sampling; greedy decoding takes the argmax of the raw logits")
    return BatchSampling([params], logits.device).warp(logits.unsqueeze(0)).squeeze(0)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from, for both the target (p) and the draft (q)."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V]; a token of probability 0 is never drawn."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim (the first maximum; a NaN counts as the maximum). On the CPU numpy's argmax
    gives the same index ~15x faster on a 152k vocabulary (6 us against 85 us on an AMD EPYC, 2 threads): at
    llama.cpp's 26 ms a token, torch's was 0.5 % of every plain step."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX and not logits.requires_grad \
            and not logits.is_neg() and logits.dim() > 0:
        return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1), dtype=np.int64))
    return torch.argmax(logits, dim=-1)


_NUMPY_ARGMAX = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# Per-row sampling: every row of a batch has its own settings and its own random stream.


class BatchSampling:
    """The sampling settings of each row of a batch, as tensors, so one warp serves rows with different settings.

    Rows with temperature 0 are greedy: they take the argmax of the raw logits and never draw random numbers.
    A sampled row may be *coupled* (`coupled[b]`): it then draws each token by the Gumbel-max trick with noise
    that belongs to its output position, not to the step, so its text depends on its seed alone, never on how
    many drafts a step proposed or which drafter proposed them (Daliri et al. 2024, "drafter-invariant
    speculative decoding"). That is what lets the speculation policy pick K from timings for a seeded row.
    A step's noise is not kept here: the loop hands it to the drafter (drafters.DraftContext) and to the verifier.

    Immutable: select and extend return a new object; nothing is set on it for one step.
    """

    def __init__(self, params: list[SamplingParams], device=None, coupled: list[bool] | None = None):
        self.params = list(params)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.greedy_rows = [p.greedy for p in self.params]
        self.coupled = [bool(c) and not p.greedy for p, c in zip(self.params, coupled or [False] * len(self.params))]
        self.any_coupled = any(self.coupled)
        flags = [c for c, g in zip(self.coupled, self.greedy_rows) if not g]  # over the sampled rows
        # Positions, among the sampled rows, of the coupled rows and of those the rejection sampler serves.
        self.coupled_pos = torch.tensor([i for i, c in enumerate(flags) if c], dtype=torch.long, device=self.device)
        self.rejection_pos = torch.tensor([i for i, c in enumerate(flags) if not c], dtype=torch.long,
                                          device=self.device)
        self.all_greedy = all(self.greedy_rows)
        self.any_greedy = any(self.greedy_rows)
        sampled = [p for p in self.params if not p.greedy]
        # Per-row tensors over the rows that sample (greedy rows are never warped).
        self.sampled_index = torch.tensor([i for i, g in enumerate(self.greedy_rows) if not g], dtype=torch.long,
                                          device=self.device)
        self.greedy_index = torch.tensor([i for i, g in enumerate(self.greedy_rows) if g], dtype=torch.long,
                                         device=self.device)
        self.temperature = torch.tensor([p.temperature for p in sampled], dtype=torch.float32, device=self.device)
        self.top_k = [p.top_k for p in sampled]
        self.top_p = torch.tensor([p.top_p for p in sampled], dtype=torch.float32, device=self.device)
        self.any_top_k = any(k > 0 for k in self.top_k)
        self.any_top_p = any(p.top_p < 1.0 for p in sampled)
        self.any_temperature = any(p.temperature != 1.0 for p in sampled)
        self.min_p = torch.tensor([p.min_p for p in sampled], dtype=torch.float32, device=self.device)
        self.any_min_p = any(p.min_p > 0 for p in sampled)
        self._frozen = True

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"BatchSampling is immutable: {name} cannot be set (select/extend make a new one)")
        object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return len(self.params)

    def select(self, rows: list[int]) -> "BatchSampling":
        return BatchSampling([self.params[r] for r in rows], self.device, [self.coupled[r] for r in rows])

    def extend(self, other: "BatchSampling") -> "BatchSampling":
        return BatchSampling(self.params + other.params, self.device, self.coupled + other.coupled)

    def warp(self, logits: torch.Tensor, mask: torch.Tensor | None = None, path=None) -> torch.Tensor:
        """Warped scores [S, ..., V] of the sampled rows (logits [B, ..., V] of all rows); float32.

        Exactly `warp_logits` applied row by row with each row's own settings. mask [B, ..., V] (a grammar's allowed
        tokens: bool, or its additive form, see `additive`) is applied after the warping: the constrained
        distribution is normalise(p * mask). Where the warping left no allowed token (top-k/top-p cut them all) the
        row falls back to warping the masked logits, the only distribution left that respects the grammar; p and q
        go through this same function. path (penalties.PathPenalties, None when no row has a logit_bias or a
        penalty): the text before each position, whose options adjust the logits first."""
        if path is not None:
            logits = path.apply(logits)
        scores = self._warp(logits)
        if mask is None:
            return scores
        bias = self.additive(mask)
        masked = scores + (bias[self.sampled_index] if self.any_greedy else bias)
        # all -inf <=> the max is -inf (a NaN row is neither); one reduction instead of isneginf + all
        empty = masked.amax(dim=-1) == float("-inf")
        if empty.any():
            fallback = self._warp(logits + bias)
            masked = torch.where(empty.unsqueeze(-1), fallback, masked)
        return masked

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """A grammar mask in additive form, float32 [..., V]: -0.0 where allowed, -inf elsewhere, so that
        `scores + additive(mask)` is `scores.masked_fill(~mask, -inf)` bit for bit (x + -0.0 = x, x + -inf = -inf
        for finite x), without masked_fill's data-dependent branch per token (0.25-0.6 ms on 152k ids, against
        ~20 us for the add). A float mask is taken to be in that form already (RowGrammars.verify_masks makes it;
        drafters.DraftContext hands the drafter's bool masks over in that form, made once from the grammar's
        bitmask); any other bool mask is converted without a branch: -(1/m - 1)."""
        if mask.is_floating_point():
            return mask
        return mask.float().reciprocal_().sub_(1.0).neg_()

    def masked(self, logits: torch.Tensor, mask: torch.Tensor | None, path=None) -> torch.Tensor:
        """logits (as float32) with what the grammar forbids at -inf; what greedy rows take the argmax of (after
        their logit_bias and penalties along path, when given)."""
        if path is not None:
            logits = path.apply(logits)
        return logits if mask is None else logits.float() + self.additive(mask)

    def _warp(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits[self.sampled_index].float() if self.any_greedy else logits.float()
        extra = (1,) * (scores.dim() - 1)
        if self.any_temperature:
            scores = scores / self.temperature.view(-1, *extra)
        vocab = scores.shape[-1]
        if self.any_top_k:
            widest = min(max(self.top_k), vocab)
            top = torch.topk(scores, widest, dim=-1).values
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in self.top_k], device=scores.device)
            index = (k.clamp(max=widest) - 1).view(-1, *extra).expand(*top.shape[:-1], 1)
            kth = top.gather(-1, index)
            off = (k >= vocab).view(-1, *extra)  # top_k 0 (or >= V) keeps everything
            scores = scores.masked_fill((scores < kth) & ~off, float("-inf"))
        if self.any_top_p:
            sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            remove_sorted = cumulative <= (1.0 - self.top_p).view(-1, *extra)
            remove_sorted[..., -1:] = False  # min_tokens_to_keep = 1
            remove_sorted &= (self.top_p < 1.0).view(-1, *extra)
            remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
            scores = scores.masked_fill(remove, float("-inf"))
        if self.any_min_p:  # after top-p, as transformers' MinPLogitsWarper; the top token always stays
            probs = scores.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * self.min_p.view(-1, *extra)
            scores = scores.masked_fill(probs < floor, float("-inf"))
        return scores

    def probs(self, logits: torch.Tensor, mask: torch.Tensor | None = None, path=None) -> torch.Tensor:
        """The distribution each sampled row draws from: [S, ..., V]."""
        return torch.softmax(self.warp(logits, mask, path), dim=-1)

    def scores(self, logits: torch.Tensor, mask: torch.Tensor | None = None, path=None) -> torch.Tensor:
        """[B, ..., V] scores whose softmax is what each row draws from (its argmax for greedy rows): greedy rows'
        logits as they are, sampled rows' warped; both masked by the grammar, both after the rows' logit_bias and
        penalties along path (when given). Verification and logprobs read these."""
        if path is not None:
            logits = path.apply(logits)
        if self.all_greedy:
            return self.masked(logits, mask)
        sampled = self.warp(logits, mask)
        if not self.any_greedy:
            return sampled
        out = logits.float() if mask is None else self.masked(logits, mask)
        return out.index_put((self.sampled_index,), sampled)  # out of place: logits may be the model's own tensor


class RowGenerators:
    """One random stream per row, so that a row's tokens never depend on which other rows share its batch.

    Row seeds are given per row (None: fresh entropy). Each step a row draws its uniforms in one call, and how many
    it draws depends only on its own K, never on the other rows. A coupled row (see BatchSampling) draws no
    uniforms: its stream gives one Gumbel noise vector per output position, in order, kept until used.
    """

    def __init__(self, seeds: list[int | None], device=None, coupled: list[bool] | None = None,
                 seed_indices: list[int] | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.coupled = [bool(c) for c in (coupled or [False] * len(seeds))]
        self.pending: list[list[torch.Tensor]] = [[] for _ in seeds]  # coupled rows' noise for coming positions
        self.streams = [row_stream(seed, index) for seed, index in zip(seeds, seed_indices or [0] * len(seeds))]

    def __len__(self) -> int:
        return len(self.streams)

    def select(self, rows: list[int]) -> "RowGenerators":
        """These rows' streams (shared, not copied: a stream moves on wherever its row is) as a new object."""
        return self._of([self.coupled[r] for r in rows], [self.pending[r] for r in rows],
                        [self.streams[r] for r in rows])

    def extend(self, other: "RowGenerators") -> "RowGenerators":
        return self._of(self.coupled + other.coupled, self.pending + other.pending, self.streams + other.streams)

    def _of(self, coupled, pending, streams) -> "RowGenerators":
        out = RowGenerators([], self.device)
        out.coupled, out.pending, out.streams = coupled, pending, streams
        return out

    def noise(self, positions: int, vocab: int) -> torch.Tensor | None:
        """Gumbel noise [C, positions, V] (float64) of the coupled rows' next output positions; None if none.

        Position j of a row is always the j-th vector its stream produced, however the steps were cut."""
        rows = [b for b, c in enumerate(self.coupled) if c]
        if not rows:
            return None
        for b in rows:
            stream = self.streams[b]
            while len(self.pending[b]) < positions:
                g = stream.random(vocab)  # [0, 1) float64
                # -log(-log u) is Gumbel(0, 1), computed in place; u == 0 gives -inf, a token that is never chosen
                # (probability 2^-53)
                with np.errstate(divide="ignore"):
                    np.negative(np.log(np.negative(np.log(g, out=g), out=g), out=g), out=g)
                self.pending[b].append(torch.from_numpy(g).to(self.device))
        return torch.stack([v for b in rows for v in self.pending[b][:positions]]).view(len(rows), positions, vocab)

    def advance(self, emitted: list[int]) -> None:
        """Row b emitted emitted[b] tokens: its noise for those positions is used up."""
        for b, n in enumerate(emitted):
            if self.coupled[b]:
                del self.pending[b][:n]

    def step_uniforms(self, k_rows: list[int], greedy_rows: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step's randomness: (for the drafts [B, K], for the verification [B, K+1]).

        A sampled row with k drafts draws 2k + 1 uniforms in one call: k to sample its drafts, k to accept them,
        one for the token after them (u_verify[:, K]). Greedy and coupled rows draw nothing.
        """
        k = max(k_rows, default=0)
        silent = [g or c for g, c in zip(greedy_rows, self.coupled)]  # rows that draw no uniforms
        if all(silent):  # no per-row work on the hot path, and no allocation: read-only zeros of the shape
            return _zeros(len(k_rows), k, self.device), _zeros(len(k_rows), k + 1, self.device)
        counts = [0 if s else 2 * n + 1 for n, s in zip(k_rows, silent)]
        u = self.uniforms(counts)
        u_draft = torch.zeros(len(k_rows), k, dtype=u.dtype, device=self.device)
        u_verify = torch.zeros(len(k_rows), k + 1, dtype=u.dtype, device=self.device)
        for n in set(k_rows):  # rows with the same k move together
            rows = torch.tensor([b for b, (m, c) in enumerate(zip(k_rows, counts)) if m == n and c],
                                dtype=torch.long, device=self.device)
            if len(rows):
                u_draft[rows, :n] = u[rows, :n]
                u_verify[rows, :n] = u[rows, n:2 * n]
                u_verify[rows, k] = u[rows, 2 * n]
        return u_draft, u_verify

    def uniforms(self, counts: list[int]) -> torch.Tensor:
        """[B, max(counts)] uniforms in [0, 1): row b's first counts[b] entries come from its own stream."""
        out = np.zeros((len(counts), max(counts, default=0)))
        for b, (stream, n) in enumerate(zip(self.streams, counts)):
            if n:
                out[b, :n] = stream.random(n)
        return torch.from_numpy(out).to(self.device)  # one copy to the device, whatever the batch


@functools.lru_cache(maxsize=512)
def _zeros(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """Shared [rows, cols] float64 zeros: the uniforms of a step whose rows draw none (greedy or coupled), which
    nothing writes to. Two allocations a step cost ~40 us right after a forward has swept the caches."""
    return torch.zeros(rows, cols, dtype=torch.float64, device=device)


def stream_seed(seed: int, index: int = 0) -> int:
    """The 63-bit seed of row `index` of a request seeded with `seed`: numpy's SeedSequence mixes both, so two
    seeds never share a row's stream (an S + index rule would give seed S + 1's row 0 to seed S's row 1), and a
    request's row 0 is the same stream whether it runs alone or in any batch."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"a seed must be an integer >= 0, got {seed!r}")
    state = np.random.SeedSequence(entropy=seed, spawn_key=(index,)).generate_state(2, np.uint32)
    return ((int(state[1]) << 32) | int(state[0])) & 0x7FFF_FFFF_FFFF_FFFF


def row_stream(seed: int | None, index: int = 0) -> np.random.Generator:
    """The generator that draws every random number of a row (its uniforms, or its Gumbel noise when coupled), on
    every device: numpy's PCG64 seeded with all 63 bits of stream_seed (PCG64 hashes them into its 128-bit state).
    Not torch's generators: the CPU one (MT19937) keeps only the low 32 bits of a seed, so seeds 14375 and 53572
    drew the same numbers; and a host stream makes a seed's draws the same on every device. PCG64 also draws and
    takes logs ~2.5x faster than torch's CPU generator, and a coupled row draws a whole vocabulary per token.
    None: fresh entropy from the OS (128 bits)."""
    return np.random.Generator(np.random.PCG64(None if seed is None else stream_seed(seed, index)))


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per distribution in probs [..., V], given one uniform per row u [...].

    A token of probability 0 is never drawn (its CDF step is empty), token 0 is a token like any other.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = (u.double() * cdf[..., -1]).unsqueeze(-1)
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Below the total, the first cdf entry above the target is a step, a token of positive probability. u * total
    # can round up to total: only then fall back to the last token of positive probability (a pass over the
    # vocabulary, ~0.2 ms on 152k ids: skipped on the CPU when no row needs it; elsewhere the check would be a sync).
    if probs.device.type == "cpu" and bool((target < cdf[..., -1:]).all()):
        return token
    last_positive = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(token, last_positive)


def coupled_choice(log_probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max draw argmax(log p + g) over the last dim: exactly a sample of p when g is Gumbel(0, 1) noise.

    Any scores equal to log p up to a constant per distribution (warped logits) give the same token."""
    return greedy(log_probs.double() + noise)

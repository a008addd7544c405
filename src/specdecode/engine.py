"""The decoding loop: prefill, draft K, verify K+1 in one target forward, accept, roll back, repeat.

`SpeculativeGenerator` is the speculative loop; `AutoregressiveGenerator` is the same loop with no drafter
(K = 0), so plain and speculative decoding share every line of bookkeeping and return the same result type.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .backends.hf import HFBackend
from .detokenize import IncrementalDetokenizer
from .drafters.model import ModelDrafter, pad
from .rejection import METHODS, verify, verify_greedy
from .results import GenerationResult, RowStats, Stats, TokenEvent
from .sampling import SamplingParams, greedy, logits_to_probs, sample
from .vocab import shared_vocab_size

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


@dataclass
class _Row:
    """Host-side state of one prompt of the batch."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    detok: IncrementalDetokenizer | None
    tokens: list[int] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_at: int | None = None  # where a stop string begins in the row's text
    stats: RowStats = field(default_factory=RowStats)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)


class TokenStream:
    """Iterates over TokenEvents as tokens are decided; `.result` holds the GenerationResult at the end.

    `cancel(row)` ends one row at the next step (its finish_reason becomes "cancelled"); closing the
    iterator early ends them all.
    """

    def __init__(self, steps_factory: Callable[[set[int]], Iterator[list[TokenEvent]]]):
        self.cancelled: set[int] = set()
        self._steps = steps_factory(self.cancelled)
        self.result: GenerationResult | None = None

    def cancel(self, row: int) -> None:
        self.cancelled.add(row)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            try:
                events = next(self._steps)
            except StopIteration as done:
                self.result = done.value
                return
            yield from events

    def close(self) -> None:
        self._steps.close()


def _unwrap(model_or_loaded):
    """(model, tokenizer) from a transformers model or from what load_model returns."""
    if hasattr(model_or_loaded, "model") and hasattr(model_or_loaded, "tokenizer"):
        return model_or_loaded.model, model_or_loaded.tokenizer
    return model_or_loaded, None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


class SpeculativeGenerator:
    """Speculative decoding of `target` with `draft`: exactly the target's output distribution, faster.

    target: a transformers causal LM, or what `load_model` returns (model + tokenizer), or a ModelBackend.
    draft: the same kinds, or any Drafter. method: "leviathan" (Algorithm 1, vectorised) or "chen"
    (Algorithm 2, the sequential loop). vocab_size: the shared vocabulary, needed only when two bare models
    without tokenizers have embedding matrices of different sizes.
    """

    provenance_of_last = ("resampled", "bonus")

    def __init__(self, target, draft, num_speculative_tokens: int = 4, method: str = "leviathan",
                 tokenizer=None, vocab_size: int | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        _check_k(num_speculative_tokens, allow_zero=draft is None)
        target_model, target_tok = _unwrap(target)
        draft_model, draft_tok = _unwrap(draft) if draft is not None else (None, None)
        self.tokenizer = tokenizer or target_tok or draft_tok
        vocab = shared_vocab_size(target_model, draft_model, target_tok or tokenizer, draft_tok, vocab_size)
        self.target = target_model if hasattr(target_model, "trim") else HFBackend(target_model, vocab)
        if draft is None:
            self.drafter = None
        elif hasattr(draft_model, "propose"):
            self.drafter = draft_model
            if getattr(self.drafter, "vocab_size", None) is None:
                self.drafter.vocab_size = vocab
            if getattr(self.drafter, "device", "unset") is None:
                self.drafter.device = self.target.device
        else:
            backend = draft_model if hasattr(draft_model, "trim") else HFBackend(draft_model, vocab)
            self.drafter = ModelDrafter(backend)
        self.num_speculative_tokens = num_speculative_tokens
        self.method = method
        self.eos_token_ids = _eos_ids(getattr(self.target, "model", None), self.tokenizer)

    # ------------------------------------------------------------------ public API
    @property
    def has_draft(self) -> bool:
        return self.drafter is not None

    @property
    def context_length(self) -> int | None:
        """The target's context window in tokens (prompt + new tokens), when the model says."""
        return self.target.max_positions

    @property
    def vocab_size(self) -> int:
        """The vocabulary that p and q are defined on (the tokenizer's, when known)."""
        return self.target.vocab_size

    @property
    def target_model(self):
        """The target's transformers model (None for a non-transformers backend)."""
        return getattr(self.target, "model", None)

    def generate(self, prompts: Prompts, max_new_tokens: int | Sequence[int] = 64, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False,
                 stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                 num_speculative_tokens: int | None = None,
                 on_token: Callable[[TokenEvent], None] | None = None) -> GenerationResult:
        stream = self.stream(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, ignore_eos=ignore_eos, stop=stop,
                             stop_token_ids=stop_token_ids, num_speculative_tokens=num_speculative_tokens)
        for event in stream:
            if on_token is not None:
                on_token(event)
        return stream.result

    def stream(self, prompts: Prompts, max_new_tokens: int | Sequence[int] = 64, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False,
               stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
               num_speculative_tokens: int | None = None) -> TokenStream:
        """Like generate(), as an iterator of TokenEvents. Arguments are checked here, before any work."""
        params = SamplingParams(temperature, top_k, top_p)
        prompt_ids = self._encode(prompts)
        limits = _per_row(max_new_tokens, len(prompt_ids))
        for i, (ids, limit) in enumerate(zip(prompt_ids, limits)):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"max_new_tokens must be an integer >= 1, got {limit!r}")
            context = self.target.max_positions
            if context and len(ids) + limit > context:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={limit} that exceeds the "
                                 f"model's context of {context} tokens: shorten the prompt or lower max_new_tokens")
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        _check_k(k, allow_zero=self.drafter is None)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or use load_model()")
        stop_ids = set(stop_token_ids or ()) | (set() if ignore_eos else self.eos_token_ids)
        return TokenStream(lambda cancelled: self._run(prompt_ids, limits, params, seed, stop_ids, stops, k,
                                                       cancelled))

    # ------------------------------------------------------------------ the loop
    def _run(self, prompt_ids, limits, params, seed, stop_ids, stops, k_max, cancelled):
        device = self.target.device
        generator = torch.Generator(device=device)  # the call's own randomness: seeded once, here
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        rows = [_Row(i, p, limit, IncrementalDetokenizer(self.tokenizer, p) if self.tokenizer else None)
                for i, (p, limit) in enumerate(zip(prompt_ids, limits))]
        stats = Stats(num_rows=len(rows), prompt_tokens=sum(map(len, prompt_ids)), num_speculative_tokens=k_max,
                      accepted_per_position=[0] * k_max, proposed_per_position=[0] * k_max)
        start = time.perf_counter()

        # Prefill both models on the whole prompt; the target's last logits give the first new token.
        ids, valid = pad(prompt_ids, device, side="left")
        self.target.reset(len(rows))
        first = self._pick(self.target.forward(ids, valid, last_only=True)[:, -1], params, generator)
        stats.target_forward_calls += 1
        if self.drafter is not None:
            drafter_calls = self.drafter.forward_calls
            self.drafter.prefill(ids, valid)
            stats.draft_forward_calls += self.drafter.forward_calls - drafter_calls
        first = first.tolist()
        no_drafts = [[] for _ in rows]
        if self.drafter is not None:
            self.drafter.update(no_drafts, [0] * len(rows), first)
        stats.num_rows_with_first_token = len(rows)
        stats.prefill_time_s = time.perf_counter() - start
        events = [e for row, t in zip(rows, first) for e in self._emit(row, [t], ["target"], stop_ids, stops)]
        active = self._drop_finished(rows, cancelled)
        yield events

        while active:
            t0 = time.perf_counter()
            k = min(k_max, max(r.remaining for r in active) - 1)
            last = torch.tensor([[r.tokens[-1]] for r in active], dtype=torch.long, device=device)
            lengths = self.target.lengths
            if k > 0:
                drafter_calls = self.drafter.forward_calls
                drafts, q = self.drafter.propose(k, params, generator)
                stats.draft_forward_calls += self.drafter.forward_calls - drafter_calls
            else:
                drafts, q = last[:, :0], None
            t1 = self._clock(device)
            logits = self.target.forward(torch.cat([last, drafts], dim=1))
            if params.greedy:
                num_accepted, next_token = verify_greedy(drafts, logits)
            else:
                p = logits_to_probs(logits, params)
                if q is None:  # k == 0: nothing to verify, the "bonus" is a plain target sample
                    q = p[:, :0]
                num_accepted, next_token = verify(drafts, q, p, generator, self.method)
            t2 = self._clock(device)
            drafts_l, accepted_l, next_l = drafts.tolist(), num_accepted.tolist(), next_token.tolist()
            self.target.trim([n + 1 + a for n, a in zip(lengths, accepted_l)])
            if self.drafter is not None:
                self.drafter.update(drafts_l, accepted_l, next_l)

            stats.add_verification(k, accepted_l)
            events = []
            for row, d, a, t in zip(active, drafts_l, accepted_l, next_l):
                row.stats.add_verification(k, a)
                last_kind = "target" if k == 0 else self.provenance_of_last[a == k]
                events += self._emit(row, d[:a] + [t], ["accepted"] * a + [last_kind], stop_ids, stops)
            active = self._drop_finished(active, cancelled)
            t3 = time.perf_counter()
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += t2 - t1
            stats.other_time_s += t3 - t2
            yield events

        for row in rows:
            row.stats.new_tokens = len(row.tokens)
        stats.new_tokens = sum(len(r.tokens) for r in rows)
        stats.wall_time_s = time.perf_counter() - start
        return self._result(rows, stats)

    # ------------------------------------------------------------------ helpers
    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
        return greedy(logits) if params.greedy else sample(logits_to_probs(logits, params), generator)

    @staticmethod
    def _clock(device) -> float:
        if device.type == "cuda":  # kernels run asynchronously: wait so each phase gets its own time
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _emit(self, row: _Row, tokens: list[int], kinds: list[str], stop_ids: set[int],
              stops: list[str]) -> list[TokenEvent]:
        """Append tokens to a row until it finishes; return their events."""
        events = []
        for token, kind in zip(tokens, kinds):
            row.tokens.append(token)
            row.provenance.append(kind)
            text = row.detok.add(token) if row.detok is not None else None
            if token in stop_ids:
                row.finish_reason = "stop"
            elif stops and (hit := _find_stop(row.detok.text, text, stops)) is not None:
                row.finish_reason, row.stop_at = "stop", hit
                text = text[: max(0, len(text) - (len(row.detok.text) - hit))]
            elif row.remaining == 0:
                row.finish_reason = "length"
            done = row.finish_reason is not None
            if done and row.detok is not None and row.stop_at is None:
                text += row.detok.flush()
            events.append(TokenEvent(row.index, token, kind, text, done, row.finish_reason))
            if done:
                break
        return events

    def _drop_finished(self, active: list[_Row], cancelled: set[int]) -> list[_Row]:
        for row in active:
            if row.finish_reason is None and row.index in cancelled:
                row.finish_reason = "cancelled"
        keep = [i for i, r in enumerate(active) if r.finish_reason is None]
        if keep and len(keep) < len(active):
            self.target.select_rows(keep)
            if self.drafter is not None:
                self.drafter.select_rows(keep)
        return [active[i] for i in keep]

    def _encode(self, prompts: Prompts) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given: pass a string, a list of strings or a list of token-id lists")
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer: pass token ids, tokenizer=, or use load_model()")
                ids = self.tokenizer(prompt)["input_ids"] if prompt else []
            else:
                ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty: give at least one token of text to continue")
            vocab = self.target.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
            encoded.append(ids)
        return encoded

    def _result(self, rows: list[_Row], stats: Stats) -> GenerationResult:
        texts = None
        if self.tokenizer is not None:
            texts = []
            for row in rows:
                if row.stop_at is None:
                    row.detok.flush()
                texts.append(row.detok.text[: row.stop_at] if row.stop_at is not None else row.detok.text)
        return GenerationResult(token_ids=[r.tokens for r in rows], texts=texts, stats=stats,
                                finish_reasons=[r.finish_reason for r in rows],
                                provenance=[r.provenance for r in rows], prompt_token_ids=[r.prompt for r in rows],
                                row_stats=[r.stats for r in rows])


class AutoregressiveGenerator(SpeculativeGenerator):
    """Plain decoding of the target with the same loop, cache handling and result type (K = 0)."""

    def __init__(self, target, tokenizer=None, vocab_size: int | None = None):
        super().__init__(target, None, num_speculative_tokens=0, tokenizer=tokenizer, vocab_size=vocab_size)


def _check_k(k, allow_zero: bool) -> None:
    lowest = 0 if allow_zero else 1
    if isinstance(k, bool) or not isinstance(k, int) or k < lowest:
        raise ValueError(f"num_speculative_tokens must be an integer >= {lowest}, got {k!r}")


def _per_row(value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"max_new_tokens has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _find_stop(text: str, delta: str | None, stops: list[str]) -> int | None:
    """Index in text where the earliest stop string begins, searching only where the new delta can reach."""
    if not delta:
        return None
    hits = []
    for s in stops:
        pos = text.find(s, max(0, len(text) - len(delta) - len(s) + 1))
        if pos >= 0:
            hits.append(pos)
    return min(hits) if hits else None

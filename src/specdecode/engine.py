"""The decoding loop: prefill, draft K, verify K+1 in one target forward, accept, roll back, repeat.

`SpeculativeGenerator` is the speculative loop; `AutoregressiveGenerator` is the same loop with no drafter
(K = 0), so plain and speculative decoding share every line of bookkeeping and return the same result type.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .backends import as_backend, pad
from .detokenize import IncrementalDetokenizer
from .drafters import as_drafter
from .policy import make_policy
from .rejection import METHODS, verify, verify_greedy
from .results import GenerationResult, RowStats, Stats, TokenEvent
from .sampling import BatchSampling, RowGenerators, SamplingParams
from .vocab import shared_vocab_size

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


@dataclass
class _Row:
    """Host-side state of one prompt of the batch."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    detok: IncrementalDetokenizer | None
    fixed_k: int | None  # a K the policy may not change for this row (seeded sampling under "auto")
    policy_state: object
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
    """(model, tokenizer) from a Hugging Face model or from what load_model returns."""
    if hasattr(model_or_loaded, "model") and hasattr(model_or_loaded, "tokenizer"):
        return model_or_loaded.model, model_or_loaded.tokenizer
    return model_or_loaded, None


def _tokenizer_eos(tokenizer) -> set[int]:
    value = getattr(tokenizer, "eos_token_id", None)
    return set() if value is None else set([value] if isinstance(value, int) else value)


class SpeculativeGenerator:
    """Speculative decoding of `target` with `draft`: exactly the target's output distribution, faster.

    target: a Hugging Face causal LM, what `load_model` returns (model + tokenizer), or a ModelBackend.
    draft: the same kinds, or any Drafter. num_speculative_tokens: "auto" (the speculation policy picks K before
    every step, 0..max_speculative_tokens, from measured acceptance and costs; never slower than plain decoding
    by design) or a fixed K. method: "leviathan" (Algorithm 1, vectorised) or "chen" (Algorithm 2, the
    sequential loop). vocab_size: the shared vocabulary, needed only when two bare models without tokenizers have
    embedding matrices of different sizes. timing: time each phase (draft, verify); on a GPU this costs a host
    sync per phase, so there it is off unless asked for (the policy then learns whole-step costs).
    """

    provenance_of_last = ("resampled", "bonus")
    seeded_k = 3  # under "auto", seeded sampled rows use this fixed K: timing-driven choices are not reproducible

    def __init__(self, target, draft, num_speculative_tokens: int | str = "auto", method: str = "leviathan",
                 tokenizer=None, vocab_size: int | None = None, max_speculative_tokens: int = 8,
                 timing: bool | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        target_model, target_tok = _unwrap(target)
        draft_model, draft_tok = _unwrap(draft) if draft is not None else (None, None)
        self.tokenizer = tokenizer or target_tok or draft_tok
        vocab = shared_vocab_size(target_model, draft_model, target_tok or tokenizer, draft_tok, vocab_size)
        self.target = as_backend(target_model, vocab)
        self.drafter = as_drafter(draft_model, vocab)
        self.max_speculative_tokens = max_speculative_tokens
        self.policy = make_policy(num_speculative_tokens if draft is not None else 0, max_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens if draft is not None else 0
        self.method = method
        self.timing = self.target.device.type != "cuda" if timing is None else timing
        self.eos_token_ids = set(getattr(self.target, "eos_token_ids", ())) | _tokenizer_eos(self.tokenizer)

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
        """The target backend's underlying model object, when it has one (None otherwise)."""
        return getattr(self.target, "model", None)

    def generate(self, prompts: Prompts, max_new_tokens: int | Sequence[int] = 64, temperature=1.0, top_k=0,
                 top_p=1.0, seed=None, ignore_eos: bool = False,
                 stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                 num_speculative_tokens: int | str | None = None,
                 on_token: Callable[[TokenEvent], None] | None = None) -> GenerationResult:
        stream = self.stream(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, ignore_eos=ignore_eos, stop=stop,
                             stop_token_ids=stop_token_ids, num_speculative_tokens=num_speculative_tokens)
        for event in stream:
            if on_token is not None:
                on_token(event)
        return stream.result

    def stream(self, prompts: Prompts, max_new_tokens: int | Sequence[int] = 64, temperature=1.0, top_k=0,
               top_p=1.0, seed=None, ignore_eos: bool = False, stop: str | Sequence[str] | None = None,
               stop_token_ids: Sequence[int] | None = None,
               num_speculative_tokens: int | str | None = None) -> TokenStream:
        """Like generate(), as an iterator of TokenEvents. Arguments are checked here, before any work.

        temperature, top_k, top_p and seed take one value for every row or a list with one per row. A row's
        output depends only on its own prompt, settings and seed, never on the other rows of the batch: an int
        seed S seeds row i with S + i, so row i equals a solo call with seed=S + i.
        """
        prompt_ids = self._encode(prompts)
        n = len(prompt_ids)
        params = [SamplingParams(t, k, p) for t, k, p in zip(_per_row(temperature, n, "temperature"),
                                                            _per_row(top_k, n, "top_k"), _per_row(top_p, n, "top_p"))]
        seeds = _row_seeds(seed, n)
        limits = _per_row(max_new_tokens, n, "max_new_tokens")
        for i, (ids, limit) in enumerate(zip(prompt_ids, limits)):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"max_new_tokens must be an integer >= 1, got {limit!r}")
            context = self.target.max_positions
            if context and len(ids) + limit > context:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={limit} that exceeds the "
                                 f"model's context of {context} tokens: shorten the prompt or lower max_new_tokens")
        policy = self.policy
        if num_speculative_tokens is not None and num_speculative_tokens != self.num_speculative_tokens:
            policy = make_policy(num_speculative_tokens if self.drafter is not None else 0,
                                 self.max_speculative_tokens)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or use load_model()")
        stop_ids = set(stop_token_ids or ()) | (set() if ignore_eos else self.eos_token_ids)
        return TokenStream(lambda cancelled: self._run(prompt_ids, limits, params, seeds, stop_ids, stops, policy,
                                                       cancelled))

    # ------------------------------------------------------------------ the loop
    def _run(self, prompt_ids, limits, params, seeds, stop_ids, stops, policy, cancelled):
        device = self.target.device
        sampling = BatchSampling(params, device)
        generators = RowGenerators(seeds, device)  # each row's own randomness: seeded once, here
        adaptive = policy.name == "adaptive"
        rows = [_Row(i, p, limit, IncrementalDetokenizer(self.tokenizer, p) if self.tokenizer else None,
                     min(self.seeded_k, policy.max_k) if adaptive and seed is not None and not par.greedy else None,
                     policy.new_row())
                for i, (p, limit, par, seed) in enumerate(zip(prompt_ids, limits, params, seeds))]
        stats = Stats(num_rows=len(rows), prompt_tokens=sum(map(len, prompt_ids)), num_speculative_tokens=policy.max_k,
                      accepted_per_position=[0] * policy.max_k, proposed_per_position=[0] * policy.max_k,
                      policy="auto" if adaptive else "fixed")
        hidden_wanted = getattr(self.drafter, "needs_hidden_states", False)
        start = time.perf_counter()

        # Prefill both models on the whole prompt; the target's last logits give the first new token.
        ids, valid = pad(prompt_ids, device, side="left")
        self.target.reset(len(rows))
        logits, hidden = self._target_forward(ids, valid, hidden_wanted, last_only=True)
        u = generators.uniforms([0 if g else 1 for g in sampling.greedy_rows])
        first = self._verify(ids[:, :0], None, logits[:, -1:], sampling, u, [0] * len(rows))[1].tolist()
        stats.target_forward_calls += 1
        if self.drafter is not None:
            drafter_calls = self.drafter.forward_calls
            self.drafter.prefill(ids, valid, **({"hidden": hidden} if hidden_wanted else {}))
            self.drafter.update([[] for _ in rows], [0] * len(rows), first)
            stats.draft_forward_calls += self.drafter.forward_calls - drafter_calls
        stats.num_rows_with_first_token = len(rows)
        stats.prefill_time_s = time.perf_counter() - start
        events = [e for row, t in zip(rows, first) for e in self._emit(row, [t], ["target"], stop_ids, stops)]
        active, sampling = self._drop_finished(rows, rows, sampling, generators, cancelled)
        yield events

        while active:
            t0 = time.perf_counter()
            k_rows = self._choose_k(active, policy)
            k = max(k_rows)
            last = torch.tensor([[r.tokens[-1]] for r in active], dtype=torch.long, device=device)
            lengths = self.target.lengths
            u_draft, u_verify = generators.step_uniforms(k_rows, sampling.greedy_rows)
            if k > 0:
                drafter_calls = self.drafter.forward_calls
                drafts, q = self.drafter.propose(k, sampling, u_draft, k_rows)
                drafts = drafts.to(device)
                stats.draft_forward_calls += self.drafter.forward_calls - drafter_calls
            else:
                drafts, q = last[:, :0], None
            t1 = self._clock(device)
            logits, hidden = self._target_forward(torch.cat([last, drafts], dim=1), None, hidden_wanted)
            num_accepted, next_token = self._verify(drafts, q, logits, sampling, u_verify, k_rows)
            t2 = self._clock(device)
            drafts_l, accepted_l, next_l = drafts.tolist(), num_accepted.tolist(), next_token.tolist()  # the sync
            t2 = t2 if self.timing else time.perf_counter()
            self.target.trim([n + 1 + a for n, a in zip(lengths, accepted_l)])
            if self.drafter is not None:
                self.drafter.update(drafts_l, accepted_l, next_l, **({"hidden": hidden} if hidden_wanted else {}))
            policy.observe([r.policy_state for r in active], k, accepted_l, len(active), t1 - t0, t2 - t1, k_rows)

            stats.add_verification(k_rows, accepted_l)
            events = []
            for row, d, kr, a, t in zip(active, drafts_l, k_rows, accepted_l, next_l):
                row.stats.add_verification(kr, a)
                last_kind = "target" if kr == 0 else self.provenance_of_last[a == kr]
                events += self._emit(row, d[:a] + [t], ["accepted"] * a + [last_kind], stop_ids, stops)
            active, sampling = self._drop_finished(active, rows, sampling, generators, cancelled)
            t3 = time.perf_counter()
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += t2 - t1
            stats.other_time_s += t3 - t2
            yield events

        for row in rows:
            row.stats.new_tokens = len(row.tokens)
        stats.new_tokens = sum(len(r.tokens) for r in rows)
        stats.wall_time_s = time.perf_counter() - start
        stats.policy_summary = policy.summary()
        return self._result(rows, stats)

    # ------------------------------------------------------------------ helpers
    def _choose_k(self, active: list[_Row], policy) -> list[int]:
        """K for each row before its drafts are drawn (what keeps the choice lossless): the policy's, capped."""
        caps = [r.remaining - 1 for r in active]
        if self.drafter is None or policy.max_k == 0 or max(caps) <= 0:
            return [0] * len(active)
        caps = [min(c, d) for c, d in zip(caps, self.drafter.max_drafts(policy.max_k))]
        k = policy.choose([r.policy_state for r in active], caps)
        return [min(k if r.fixed_k is None else r.fixed_k, c) for r, c in zip(active, caps)]

    def _target_forward(self, ids, valid, hidden_wanted: bool, last_only: bool = False):
        if hidden_wanted:
            return self.target.forward(ids, valid, last_only=last_only, output_hidden=True)
        return self.target.forward(ids, valid, last_only=last_only), None

    def _verify(self, drafts, q, logits, sampling: BatchSampling, u, k_rows):
        """(num_accepted, next_token) per row: greedy rows by argmax, sampled rows by the rejection sampler."""
        if sampling.all_greedy:
            return verify_greedy(drafts, logits, k_rows)
        s = sampling.sampled_index
        k_rows = torch.tensor(k_rows, device=logits.device)
        accepted, tokens = verify(drafts[s], q, sampling.probs(logits), u[s], self.method, k_rows[s])
        if not sampling.any_greedy:
            return accepted, tokens
        g = torch.tensor([i for i, greedy in enumerate(sampling.greedy_rows) if greedy], device=logits.device)
        g_accepted, g_tokens = verify_greedy(drafts[g], logits[g], k_rows[g])
        num_accepted = torch.empty(len(sampling), dtype=torch.long, device=logits.device)
        next_token = torch.empty_like(num_accepted)
        num_accepted[s], next_token[s] = accepted, tokens
        num_accepted[g], next_token[g] = g_accepted, g_tokens
        return num_accepted, next_token

    def _clock(self, device) -> float:
        if self.timing and device.type == "cuda":  # kernels run asynchronously: wait so each phase gets its time
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

    def _drop_finished(self, active: list[_Row], rows, sampling: BatchSampling, generators: RowGenerators,
                       cancelled: set[int]) -> tuple[list[_Row], BatchSampling]:
        for row in active:
            if row.finish_reason is None and row.index in cancelled:
                row.finish_reason = "cancelled"
        keep = [i for i, r in enumerate(active) if r.finish_reason is None]
        if keep and len(keep) < len(active):
            self.target.select_rows(keep)
            if self.drafter is not None:
                self.drafter.select_rows(keep)
            generators.select(keep)
            sampling = sampling.select(keep)
        return [active[i] for i in keep], sampling

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


def _per_row(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one value, or one per prompt")
        return list(value)
    return [value] * n


def _row_seeds(seed, n: int) -> list[int | None]:
    """Row seeds: an int S seeds row i with S + i; a list gives each row its own (None: fresh randomness)."""
    seeds = _per_row(seed, n, "seed") if isinstance(seed, (list, tuple)) else (
        [None] * n if seed is None else [seed + i for i in range(n)] if isinstance(seed, int) else [seed])
    for s in seeds:
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ValueError(f"seed must be an integer (or None, or one per prompt), got {s!r}")
    return seeds


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

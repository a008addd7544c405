"""The decoding loop: prefill, draft K, verify K+1 in one target forward, accept, roll back, repeat.

`SpeculativeGenerator` holds the models, the sampler settings and the speculation policy; a `DecodingSession`
is one running batch: rows join at a step boundary (their prompts prefilled in chunks beside the running rows,
then merged into the shared cache) and leave when they finish, so a server can batch continuously. `generate`
and `stream` are a session whose rows all join at once. `AutoregressiveGenerator` is the same loop with no
drafter (K = 0): plain and speculative decoding share every line of bookkeeping and return the same result type.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .backends import as_backend, pad
from .detokenize import IncrementalDetokenizer
from .drafters import as_drafter
from .policy import RowState, make_policy
from .rejection import METHODS, verify, verify_greedy
from .results import GenerationResult, RowStats, Stats, TokenEvent
from .sampling import BatchSampling, RowGenerators, SamplingParams
from .vocab import shared_vocab_size

Prompts = str | Sequence[str] | Sequence[Sequence[int]]
CLEAN_CATCH_UP = 2  # tokens a drafter feeds before drafting in steady speculation (the bonus step's last draft too)


@dataclass
class Request:
    """One prompt with its own settings: what a row of a batch is made from."""

    prompt: list[int]
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    stops: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None  # a fixed K for this row (0: plain); None: the session's policy


@dataclass
class _Row:
    """Host-side state of one row of the batch."""

    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    fixed_k: int | None  # a K the policy may not change for this row (the request's own)
    coupled: bool  # drawn by Gumbel-max coupling: a seeded sampled row whose K the policy picks
    policy_state: object
    tokens: list[int] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_at: int | None = None  # where a stop string begins in the row's text
    stats: RowStats = field(default_factory=RowStats)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


class TokenStream:
    """Iterates over TokenEvents as tokens are decided; `.result` holds the GenerationResult at the end.

    `cancel(row)` ends one row at the next step (its finish_reason becomes "cancelled"); closing the
    iterator early ends them all.
    """

    def __init__(self, session: "DecodingSession", rows: list[int]):
        self.session, self.rows = session, rows
        self.result: GenerationResult | None = None
        self._closed = False

    def cancel(self, row: int) -> None:
        self.session.cancel(row)

    def __iter__(self) -> Iterator[TokenEvent]:
        while not self._closed and not self.session.idle:
            yield from self.session.step()
        if not self._closed:
            self.result = self.session.result(self.rows)

    def close(self) -> None:
        self._closed = True


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
    every step, 0..max_speculative_tokens, from measured acceptance and costs, and decodes plainly when no K pays)
    or a fixed K. method: "leviathan" (Algorithm 1, vectorised) or "chen" (Algorithm 2, the sequential loop).
    vocab_size: the shared vocabulary, needed only when two bare models without tokenizers have embedding
    matrices of different sizes. timing: time each phase (draft, verify); on a GPU this costs a host sync per
    phase, so there it is off unless asked for (the policy then learns whole-step costs).
    """

    provenance_of_last = ("resampled", "bonus")

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
        self.num_speculative_tokens = num_speculative_tokens if draft is not None else 0
        self.policy = make_policy(self.num_speculative_tokens, max_speculative_tokens)
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
        prompt_ids = self.encode(prompts)
        n = len(prompt_ids)
        settings = zip(prompt_ids, _per_row(max_new_tokens, n, "max_new_tokens"),
                       _per_row(temperature, n, "temperature"), _per_row(top_k, n, "top_k"),
                       _per_row(top_p, n, "top_p"), _row_seeds(seed, n))
        requests = [self.request(ids, limit, t, k, p, s, ignore_eos, stop, stop_token_ids)
                    for ids, limit, t, k, p, s in settings]
        policy = None
        if num_speculative_tokens is not None and num_speculative_tokens != self.num_speculative_tokens:
            policy = make_policy(num_speculative_tokens if self.drafter is not None else 0,
                                 self.max_speculative_tokens)
        session = DecodingSession(self, policy)
        return TokenStream(session, [session.add(r) for r in requests])

    def request(self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False,
                stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                num_speculative_tokens: int | None = None) -> Request:
        """A checked Request for one prompt of token ids (clear errors before any work).

        num_speculative_tokens fixes this row's K (0 = plain decoding, e.g. for a side-by-side race) whatever the
        session's policy; None leaves it to the policy."""
        params = SamplingParams(temperature, top_k, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        context = self.target.max_positions
        if context and len(prompt_ids) + max_new_tokens > context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} that "
                             f"exceeds the model's context of {context} tokens: shorten the prompt or lower "
                             f"max_new_tokens")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer (or None), got {seed!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or use load_model()")
        stop_ids = frozenset(stop_token_ids or ()) | (frozenset() if ignore_eos else frozenset(self.eos_token_ids))
        k = num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"a request's num_speculative_tokens must be an integer >= 0 (or None), got {k!r}")
        if k and self.drafter is None:
            raise ValueError("this generator has no draft: num_speculative_tokens must be 0 or None")
        return Request(list(prompt_ids), max_new_tokens, params, seed, stop_ids, tuple(stops), k)

    def session(self, policy=None, prefill_tokens_per_step: int | None = None,
                max_batch: int | None = None) -> "DecodingSession":
        """A batch that rows join and leave between steps (continuous batching; see DecodingSession)."""
        return DecodingSession(self, policy, prefill_tokens_per_step, max_batch)

    def encode(self, prompts: Prompts) -> list[list[int]]:
        """Token ids of each prompt (text needs the tokenizer); clear errors for empty or out-of-vocabulary ones."""
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


class DecodingSession:
    """One running batch on a generator's models: rows join between steps and leave when they finish.

    add() queues a request; each step() first prefills queued prompts (at most prefill_tokens_per_step prompt
    tokens per step, None = all at once) in a cache of their own, merges rows whose prompt is done into the
    running batch with their first token, then runs one speculative step for every running row. At most
    max_batch rows run at once, and no more than the backends' `max_rows` (llama.cpp: its sequences); the others
    wait their turn in order. A session owns the generator's caches while it runs: one session per generator at a
    time.
    """

    def __init__(self, gen: SpeculativeGenerator, policy=None, prefill_tokens_per_step: int | None = None,
                 max_batch: int | None = None):
        self.gen, self.target, self.drafter = gen, gen.target, gen.drafter
        # Rows that may run at once: the user's bound and what each model's cache can hold (llama.cpp: its sequences).
        limits = [max_batch, getattr(self.target, "max_rows", None), getattr(self.drafter, "max_rows", None)]
        self.max_batch = min((n for n in limits if n), default=None)
        self.policy = policy or gen.policy
        self.adaptive = self.policy.name == "adaptive"
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.device = self.target.device
        self.rows: dict[int, _Row] = {}
        self.active: list[_Row] = []
        self.waiting: deque[_Row] = deque()
        self._staging = None  # rows being prefilled: (rows, target fork, ids, valid, next column)
        self.sampling = BatchSampling([], self.device)
        self.generators = RowGenerators([], self.device)
        self.cancelled: set[int] = set()
        self.hidden_wanted = getattr(self.drafter, "needs_hidden_states", False)
        max_k = self.policy.max_k
        self.stats = Stats(num_speculative_tokens=max_k, accepted_per_position=[0] * max_k,
                           proposed_per_position=[0] * max_k, policy="auto" if self.adaptive else "fixed")
        self._started = None
        self.steps = 0  # step() calls so far: TokenEvent.step says which one decided a token
        self.target.reset(0)
        if self.drafter is not None:
            self.drafter.select_rows([])  # an empty batch: rows join through fork and merge

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting and self._staging is None

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return len(self.waiting) + (len(self._staging[0]) if self._staging else 0)

    def add(self, request: Request) -> int:
        """Queue a request; returns its row id (TokenEvent.row of its tokens). It joins at the next step."""
        index = len(self.rows)
        fixed_k = request.num_speculative_tokens
        # The policy's K follows timings, which no seed reproduces: a seeded row it serves is drawn by coupling,
        # whose text does not depend on K (sampling.BatchSampling), so the seed alone fixes it.
        coupled = fixed_k is None and self.adaptive and request.seed is not None and not request.params.greedy
        tok = self.gen.tokenizer
        row = _Row(index, request, IncrementalDetokenizer(tok, request.prompt) if tok else None, fixed_k, coupled,
                   self.policy.new_row())
        self.rows[index] = row
        self.waiting.append(row)
        self.stats.num_rows += 1
        self.stats.prompt_tokens += len(request.prompt)
        return index

    def cancel(self, index: int) -> None:
        """End a row at the next step boundary (finish_reason "cancelled"), wherever it is."""
        self.cancelled.add(index)

    def step(self) -> list[TokenEvent]:
        """One iteration: admit() then decode(); the events of both."""
        return self.admit() + self.decode()

    def admit(self) -> list[TokenEvent]:
        """The first half of a step: prefill (a chunk of) the queued prompts; rows whose prompt is done join the
        batch with their first token, whose events are returned now (a server sends them before the decode)."""
        if self._started is None:
            self._started = time.perf_counter()
        self.steps += 1
        events = self._admit()
        self.stats.wall_time_s = time.perf_counter() - self._started
        return events

    def decode(self) -> list[TokenEvent]:
        """The second half of a step: one speculative step for every running row."""
        if self._started is None:
            self._started = time.perf_counter()
        events = self._decode_step() if self.active else []
        self.stats.wall_time_s = time.perf_counter() - self._started
        return events

    # ------------------------------------------------------------------ joining
    def _admit(self) -> list[TokenEvent]:
        """Prefill queued prompts (a chunk per step) beside the running rows; merge those that are done."""
        for row in list(self.waiting):
            if row.index in self.cancelled:
                self.waiting.remove(row)
                row.finish_reason = "cancelled"
        room = len(self.waiting) if self.max_batch is None else self.max_batch - len(self.active)
        if self._staging is None and self.waiting and room > 0:
            rows = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            ids, valid = pad([r.request.prompt for r in rows], self.device, side="left")
            self._staging = [rows, self.target.fork(len(rows)), ids, valid, 0]
        if self._staging is None:
            return []
        start = time.perf_counter()
        rows, fork, ids, valid, col = self._staging
        width = ids.shape[1]
        step_cols = width - col
        if self.prefill_tokens_per_step:
            step_cols = min(step_cols, max(1, self.prefill_tokens_per_step // len(rows)))
        end = col + step_cols
        chunk_valid = valid[:, col:end] if valid is not None else None
        logits, hidden = _forward(fork, ids[:, col:end], chunk_valid, self.hidden_wanted, last_only=True)
        self.stats.target_forward_calls += 1
        if end < width:
            self._staging[4] = end
            self.stats.prefill_time_s += time.perf_counter() - start
            return []
        self._staging = None
        coupled = [r.coupled for r in rows]
        sampling = BatchSampling([r.request.params for r in rows], self.device, coupled)
        generators = RowGenerators([r.request.seed for r in rows], self.device, coupled)
        u = generators.uniforms([0 if g or c else 1 for g, c in zip(sampling.greedy_rows, coupled)])
        sampling.noise = generators.noise(1, logits.shape[-1])
        first = _verify(ids[:, :0], None, logits[:, -1:], sampling, u, [0] * len(rows), self.gen.method)[1].tolist()
        generators.advance([1] * len(rows))
        drafter = None
        if self.drafter is not None:
            drafter = self.drafter.fork(len(rows))
            calls = drafter.forward_calls
            drafter.prefill(ids, valid, **({"hidden": hidden} if self.hidden_wanted else {}))
            drafter.update([[] for _ in rows], [0] * len(rows), first)
            self.stats.draft_forward_calls += drafter.forward_calls - calls
        self.stats.num_rows_with_first_token += len(rows)
        events = [e for row, t in zip(rows, first) for e in self._emit(row, [t], ["target"])]
        keep = [i for i, r in enumerate(rows) if r.finish_reason is None and r.index not in self.cancelled]
        for i, r in enumerate(rows):
            if r.finish_reason is None and i not in keep:
                r.finish_reason = "cancelled"
        if keep:
            fork.select_rows(keep)
            self.target.merge(fork)
            if drafter is not None:
                drafter.select_rows(keep)
                self.drafter.merge(drafter)
            generators.select(keep)
            self.generators.extend(generators)
            self.sampling = self.sampling.extend(sampling.select(keep))
            self.active += [rows[i] for i in keep]
        self.stats.prefill_time_s += time.perf_counter() - start
        return events

    # ------------------------------------------------------------------ one speculative step
    def _decode_step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        active, sampling = self.active, self.sampling
        k_rows = self._choose_k()
        k = max(k_rows)
        last = torch.tensor([[r.tokens[-1]] for r in active], dtype=torch.long, device=self.device)
        lengths = self.target.lengths
        u_draft, u_verify = self.generators.step_uniforms(k_rows, sampling.greedy_rows)
        if sampling.any_coupled:
            sampling.noise = self.generators.noise(k + 1, self.target.vocab_size)
        if k > 0:
            calls = self.drafter.forward_calls
            drafts, q = self.drafter.propose(k, sampling, u_draft, k_rows)
            drafts = drafts.to(self.device)
            catch_up_s = getattr(self.drafter, "catch_up_s", 0.0)
            if catch_up_s and hasattr(self.policy, "observe_catch_up"):
                self.policy.observe_catch_up(getattr(self.drafter, "catch_up_tokens", 0), catch_up_s)
            mixed = not catch_up_s and getattr(self.drafter, "catch_up", 0) > CLEAN_CATCH_UP
            self.stats.draft_forward_calls += self.drafter.forward_calls - calls
        else:
            drafts, q, catch_up_s, mixed = last[:, :0], None, 0.0, False
        t1 = self._clock()
        logits, hidden = _forward(self.target, torch.cat([last, drafts], dim=1), None, self.hidden_wanted)
        num_accepted, next_token = _verify(drafts, q, logits, sampling, u_verify, k_rows, self.gen.method)
        t2 = self._clock()
        drafts_l, accepted_l, next_l = drafts.tolist(), num_accepted.tolist(), next_token.tolist()  # the one sync
        t2 = t2 if self.gen.timing else time.perf_counter()
        self.target.trim([n + 1 + a for n, a in zip(lengths, accepted_l)])
        self.generators.advance([a + 1 for a in accepted_l])
        if self.drafter is not None:
            self.drafter.update(drafts_l, accepted_l, next_l, **({"hidden": hidden} if self.hidden_wanted else {}))
        self._observe(k, k_rows, accepted_l, None if mixed else t1 - t0 - catch_up_s, t2 - t1)

        self.stats.add_verification(k_rows, accepted_l)
        events = []
        for row, d, kr, a, t in zip(active, drafts_l, k_rows, accepted_l, next_l):
            row.stats.add_verification(kr, a)
            last_kind = "target" if kr == 0 else self.gen.provenance_of_last[a == kr]
            events += self._emit(row, d[:a] + [t], ["accepted"] * a + [last_kind], kr)
        self._drop_finished()
        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        self.stats.other_time_s += time.perf_counter() - t2
        return events

    def _observe(self, k: int, k_rows: list[int], accepted: list[int], draft_s: float | None,
                 verify_s: float) -> None:
        """Tell the policy what its rows did; a step widened by a row with a fixed K taught it nothing it asked.
        draft_s None: the drafter caught up on many tokens with its drafts, so the time is not a draft step's."""
        mine = [i for i, r in enumerate(self.active) if r.fixed_k is None]
        if not mine or max((k_rows[i] for i in mine), default=0) < k:
            return
        self.policy.observe([self.active[i].policy_state for i in mine], k, [accepted[i] for i in mine],
                            len(self.active), draft_s, verify_s, [k_rows[i] for i in mine])

    def _choose_k(self) -> list[int]:
        """K for each row before its drafts are drawn (what keeps the choice lossless): the policy's, capped."""
        caps = [r.remaining - 1 for r in self.active]
        widest = max([self.policy.max_k] + [r.fixed_k or 0 for r in self.active])
        if self.drafter is None or widest == 0 or max(caps) <= 0:
            return [0] * len(self.active)
        caps = [min(c, d) for c, d in zip(caps, self.drafter.max_drafts(widest))]
        behind = getattr(self.drafter, "behind", None)
        if self.adaptive and behind is not None:  # what a draft's catch-up would cost: only the adaptive policy asks
            window = getattr(self.drafter, "catch_up_window", None)
            for row, n in zip(self.active, behind()):
                state = row.policy_state
                if isinstance(state, RowState):  # a policy of the user's own may keep other state
                    state.behind, state.probe_behind = n, n if window is None else min(n, window)
                    state.remaining = row.remaining
        k = self.policy.choose([r.policy_state for r in self.active], [min(c, self.policy.max_k) for c in caps])
        if k and getattr(self.policy, "trial", False) and hasattr(self.drafter, "limit_catch_up"):
            self.drafter.limit_catch_up()  # a probe: its draft need not read every token it missed
        return [min(k if r.fixed_k is None else r.fixed_k, c) for r, c in zip(self.active, caps)]

    def _clock(self) -> float:
        if self.gen.timing and self.device.type == "cuda":  # kernels run asynchronously: wait to time each phase
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ tokens out, rows out
    def _emit(self, row: _Row, tokens: list[int], kinds: list[str], k: int = 0) -> list[TokenEvent]:
        """Append tokens to a row until it finishes; return their events (k: the row's drafts this step)."""
        events = []
        stop_ids, stops = row.request.stop_ids, row.request.stops
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
            events.append(TokenEvent(row.index, token, kind, text, done, row.finish_reason, self.steps, k))
            if done:
                break
        return events

    def _drop_finished(self) -> None:
        for row in self.active:
            if row.finish_reason is None and row.index in self.cancelled:
                row.finish_reason = "cancelled"
        keep = [i for i, r in enumerate(self.active) if r.finish_reason is None]
        if len(keep) < len(self.active):
            self.target.select_rows(keep)
            if self.drafter is not None:
                self.drafter.select_rows(keep)
            self.generators.select(keep)
            self.sampling = self.sampling.select(keep)
            self.active = [self.active[i] for i in keep]

    def result(self, indices: list[int] | None = None) -> GenerationResult:
        """The GenerationResult of these rows (all by default), with the session's statistics."""
        rows = [self.rows[i] for i in (indices if indices is not None else sorted(self.rows))]
        for row in rows:
            row.stats.new_tokens = len(row.tokens)
        self.stats.new_tokens = sum(len(r.tokens) for r in self.rows.values())
        self.stats.policy_summary = self.policy.summary()
        texts = None
        if self.gen.tokenizer is not None:
            texts = []
            for row in rows:
                if row.stop_at is None:
                    row.detok.flush()
                texts.append(row.detok.text[: row.stop_at] if row.stop_at is not None else row.detok.text)
        return GenerationResult(token_ids=[r.tokens for r in rows], texts=texts, stats=self.stats,
                                finish_reasons=[r.finish_reason for r in rows],
                                provenance=[r.provenance for r in rows],
                                prompt_token_ids=[r.request.prompt for r in rows], row_stats=[r.stats for r in rows])


class AutoregressiveGenerator(SpeculativeGenerator):
    """Plain decoding of the target with the same loop, cache handling and result type (K = 0)."""

    def __init__(self, target, tokenizer=None, vocab_size: int | None = None):
        super().__init__(target, None, num_speculative_tokens=0, tokenizer=tokenizer, vocab_size=vocab_size)


def _forward(backend, ids, valid, hidden_wanted: bool, last_only: bool = False):
    """(logits, hidden or None): hidden states are asked for only when the drafter needs them."""
    if hidden_wanted:
        return backend.forward(ids, valid, last_only=last_only, output_hidden=True)
    return backend.forward(ids, valid, last_only=last_only), None


def _verify(drafts, q, logits, sampling: BatchSampling, u, k_rows: list[int], method: str):
    """(num_accepted, next_token) per row: greedy rows by argmax, sampled rows by the rejection sampler, coupled
    rows by the argmax of their warped logits plus their positions' noise (a greedy check on perturbed scores)."""
    if sampling.all_greedy:
        return verify_greedy(drafts, logits, k_rows)
    s = sampling.sampled_index
    k_rows = torch.tensor(k_rows, device=logits.device)
    if not sampling.any_coupled:
        accepted, tokens = verify(drafts[s], q, sampling.probs(logits), u[s], method, k_rows[s])
        if not sampling.any_greedy:
            return accepted, tokens
        parts = [(s, accepted, tokens)]
    else:
        scores = sampling.warp(logits)
        r, c = sampling.rejection_pos, sampling.coupled_pos
        parts = [(s[c], *verify_greedy(drafts[s[c]], scores[c].double() + sampling.noise, k_rows[s[c]]))]
        if len(r):
            parts.append((s[r], *verify(drafts[s[r]], None if q is None else q[r], torch.softmax(scores[r], dim=-1),
                                        u[s[r]], method, k_rows[s[r]])))
    if sampling.any_greedy:
        g = sampling.greedy_index
        parts.append((g, *verify_greedy(drafts[g], logits[g], k_rows[g])))
    num_accepted = torch.empty(len(sampling), dtype=torch.long, device=logits.device)
    next_token = torch.empty_like(num_accepted)
    for rows, accepted, tokens in parts:
        num_accepted[rows], next_token[rows] = accepted, tokens
    return num_accepted, next_token


def _per_row(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one value, or one per prompt")
        return list(value)
    return [value] * n


def _row_seeds(seed, n: int) -> list:
    """Row seeds: an int S seeds row i with S + i; a list gives each row its own (None: fresh randomness)."""
    if isinstance(seed, (list, tuple)):
        return _per_row(seed, n, "seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(n)]
    return [seed] * n  # None, or a bad value that request() rejects with a clear error


def _find_stop(text: str, delta: str | None, stops: Sequence[str]) -> int | None:
    """Index in text where the earliest stop string begins, searching only where the new delta can reach."""
    if not delta:
        return None
    hits = []
    for s in stops:
        pos = text.find(s, max(0, len(text) - len(delta) - len(s) + 1))
        if pos >= 0:
            hits.append(pos)
    return min(hits) if hits else None

"""The decoding loop: prefill, draft K, verify K+1 in one target forward, accept, roll back, repeat.

`SpeculativeGenerator` holds the models, the sampler settings and the speculation policy; a `DecodingSession`
is one running batch: rows join at a step boundary (their prompts prefilled in chunks beside the running rows,
then merged into the shared cache) and leave when they finish, so a server can batch continuously. `generate`
and `stream` are a session whose rows all join at once. `AutoregressiveGenerator` is the same loop with no
drafter (K = 0): plain and speculative decoding share every line of bookkeeping and return the same result type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..backends import as_backend
from ..backends.base import eos_token_ids, underlying_model
from ..drafters import Drafter, across_tokenizers, as_drafter, set_prefix_cache
from ..errors import OptionError
from ..policy.choose import make_policy
from ..policy.estimates import CostPrior
from ..exact.rejection import METHODS
from .params import MAX_LOGPROBS, GenerationParams, per_row  # noqa: F401  (MAX_LOGPROBS: where callers found it)
from .results import GenerationResult, TokenEvent
from ..exact.sampling import SamplingParams
from .session import DecodingSession
from ..policy.speculation import AUTO, MAX_COPY_K, Speculation
from ..text.vocab import shared_vocab_size, tokenizer_eos_ids, unwrap_model

Prompts = str | Sequence[str] | Sequence[Sequence[int]]
GRAMMAR_CACHE_ENTRIES = 64  # compiled grammars kept by default (a server sets its own: --grammar-cache)
# request()'s settings in their positional order from before GenerationParams (kept for its callers)
_POSITIONAL = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop", "stop_token_ids",
               "num_speculative_tokens", "constraint", "logprobs", "seed_index", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "logit_bias")


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
    grammar: object | None = None  # constraints.CompiledGrammar: the row's output follows it; None: free text
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives (None: off)
    seed_index: int = 0  # row of its request: the row's random stream is stream_seed(seed, seed_index)


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


class SpeculativeGenerator:
    """Speculative decoding of `target` with `draft`: exactly the target's output distribution, faster.

    target: a Hugging Face causal LM, what `load_model` returns (model + tokenizer), or a ModelBackend.
    draft: the same kinds, or any Drafter. num_speculative_tokens: "auto" (the speculation policy picks K before
    every step, 0..max_speculative_tokens, from measured acceptance and costs, and decodes plainly when no K pays)
    or a fixed K. method: "leviathan" (Algorithm 1, vectorised) or "chen" (Algorithm 2, the sequential loop).
    vocab_size: the shared vocabulary, needed only when two bare models without tokenizers have embedding
    matrices of different sizes. timing: time each phase (draft, verify); on a GPU this costs a host sync per
    phase, so there it is off unless asked for (the policy then learns whole-step costs). prefix_cache_tokens: keep
    up to this many tokens of finished rows' KV and start new prompts that begin the same from a copy of it
    (prefix_cache.py; 0: off; a llama.cpp backend needs max_rows above the batch for the parked prefixes).
    cost_prior: what the policy takes a step to cost before it has timed one (policy.estimates.CostPrior; by
    default a GPU's shape; the CLI and the server pass this machine's recorded costs of the target, or a CPU's
    shape: pairing.starting_costs). max_copy_tokens: with "auto" and a drafter that copies (suffix, suffix+MODEL), how
    many tokens a step whose drafts are all free copies may verify (a long match's copy is kept nearly whole; the
    policy times those verifications and picks the K that pays); a model's drafts stay within max_speculative_tokens.
    fixed_costs: the policy takes cost_prior's costs for every step instead of timing it (policy.choose, fixed
    costs), so K and every forward's size follow the tokens alone: a request gives the same text every run.
    """

    def __init__(self, target, draft, num_speculative_tokens: int | str = "auto", method: str = "leviathan",
                 tokenizer=None, vocab_size: int | None = None, max_speculative_tokens: int = 8,
                 timing: bool | None = None, prefix_cache_tokens: int = 0, cost_prior: CostPrior | None = None,
                 max_copy_tokens: int = MAX_COPY_K, fixed_costs: bool = False):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        target_model, target_tok = unwrap_model(target)
        draft_model, draft_tok = unwrap_model(draft) if draft is not None else (None, None)
        if isinstance(draft_model, Drafter):  # a drafter around a model of its own (suffix+MODEL) names its tokenizer
            draft_tok = draft_model.model_tokenizer
        # a draft of another tokenizer drafts through its text (drafters/cross_vocab.py): it proposes target tokens
        draft_model, draft_tok = across_tokenizers(draft_model, draft_tok, target_tok or tokenizer)
        self.tokenizer = tokenizer or target_tok or draft_tok
        vocab = shared_vocab_size(target_model, draft_model, target_tok or tokenizer, draft_tok, vocab_size)
        self.target = as_backend(target_model, vocab)
        self.drafter = as_drafter(draft_model, vocab)
        self.max_speculative_tokens = max_speculative_tokens
        # a drafter that copies (suffix, suffix+MODEL) verifies its free steps' copies up to max_copy_tokens
        copies = self.drafter is not None and self.drafter.copies
        self.max_copy_tokens = max(max_speculative_tokens, max_copy_tokens) if copies else None
        self.speculation = Speculation.parse(num_speculative_tokens if draft is not None else 0)
        self.num_speculative_tokens = str(self.speculation) if self.speculation.auto else self.speculation.k
        self.cost_prior, self.fixed_costs = cost_prior, fixed_costs
        self.policy = self._policy(self.speculation)
        self.method = method
        self.timing = self.target.device.type != "cuda" if timing is None else timing
        self.eos_token_ids = eos_token_ids(self.target) | tokenizer_eos_ids(self.tokenizer)
        self._grammars = None  # the tokenizer's grammar compiler, made when a request first needs one
        self.grammar_cache_entries = GRAMMAR_CACHE_ENTRIES
        self.prefix_cache = None
        self.set_prefix_cache(prefix_cache_tokens)

    def fix_costs(self) -> None:
        """From now on the policy (and every policy a request's own K makes) keeps cost_prior's costs (fixed_costs)."""
        self.fixed_costs = self.policy.fixed_costs = True

    def _policy(self, speculation: Speculation):
        copies = {} if self.max_copy_tokens is None else {"max_copy_k": self.max_copy_tokens}
        classes = self.drafter.class_acceptance if self.drafter is not None else None  # a copying drafter's, per class
        extra = {**copies, **({"class_prior": classes} if classes is not None else {}),
                 **({"fixed_costs": True} if self.fixed_costs else {})}
        return make_policy(speculation, self.max_speculative_tokens, self.cost_prior, **extra)

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
        return underlying_model(self.target)

    def generate(self, prompts: Prompts, params: GenerationParams | None = None,
                 on_token: Callable[[TokenEvent], None] | None = None, **overrides) -> GenerationResult:
        """Decode every prompt (a batch of rows) to the end; see stream() for the settings. on_token is called with
        each TokenEvent as it is decided."""
        stream = self.stream(prompts, params, **overrides)
        for event in stream:
            if on_token is not None:
                on_token(event)
        return stream.result

    def stream(self, prompts: Prompts, params: GenerationParams | None = None, **overrides) -> TokenStream:
        """Like generate(), as an iterator of TokenEvents. Arguments are checked here, before any work.

        params: a GenerationParams (None: its defaults); overrides: any of its fields as keywords, on top of it
        (return_logprobs= is logprobs=). max_new_tokens, temperature, top_k, top_p, min_p, presence_penalty,
        frequency_penalty, repetition_penalty, logit_bias ({token id: value}), seed, json_schema, grammar and regex
        take one value for every row or a list with one per row (None: that row is free). A row's output depends
        only on its own prompt, settings and seed, never on the other rows of the batch. An int seed S is one
        request of n rows: row i draws from the stream of (S, i), mixed by numpy's SeedSequence, so different seeds
        never share a stream and row 0 equals a solo call with seed=S; a list gives each row its own seed (each a
        one-row request), or (seed, index) pairs. json_schema (a dict or JSON text), json_object, grammar (Lark, as
        llguidance takes it) or regex constrain a row's output; at most one of them per row. logprobs=N reports
        every new token's log-probability and the N most likely tokens at its position (0..20) in result.logprobs
        / result.top_logprobs. num_speculative_tokens ("auto" or a K) is the policy of this call's session.
        The output stays exactly the target's under every option.
        """
        prompt_ids = self.encode(prompts)
        rows = per_row(len(prompt_ids), params, overrides)
        k = rows[0][0].num_speculative_tokens  # one value for the call (not a per-row keyword): its session's policy
        requests = [self._request(ids, p, i, None) for ids, (p, i) in zip(prompt_ids, rows)]
        policy = None
        if k is not None:
            speculation = Speculation.parse(k if self.drafter is not None else 0)
            if speculation != self.speculation:
                policy = self._policy(speculation)
        session = _limits_named(DecodingSession(self, policy))
        return TokenStream(session, [session.add(r) for r in requests])

    def constraint(self, json_schema=None, grammar=None, regex=None, json_object: bool = False):
        """The ConstraintSpec of these arguments (None when all are None); a ConstraintError names a bad one."""
        if json_schema is None and grammar is None and regex is None and not json_object:
            return None  # free text: the grammar engine is not even imported
        from ..structured.constraints import ConstraintSpec

        return ConstraintSpec.of(json_schema=json_schema, grammar=grammar, regex=regex, json_object=json_object)

    def request(self, prompt_ids: list[int], *args, params: GenerationParams | None = None, seed_index: int = 0,
                constraint=None, **overrides) -> Request:
        """A checked Request for one prompt of token ids (clear errors before any work): one row of a session.

        params: a GenerationParams (None: its defaults); overrides: any of its fields as keywords, on top of it
        (positionally, in request()'s order before GenerationParams: max_new_tokens, temperature, top_k, top_p,
        seed, ignore_eos, stop, stop_token_ids, num_speculative_tokens, constraint, logprobs, seed_index, min_p, the
        penalties, logit_bias).
        num_speculative_tokens fixes this row's K (0 = plain decoding, e.g. for a side-by-side race) whatever the
        session's policy; None leaves it to the policy. constraint: a constraints.ConstraintSpec, in place of the
        params' own (compiled here, so an invalid schema fails now). seed_index: the row of its request (row i of a
        request seeded S draws from the stream of (S, i)). penalties.py has the penalties' formulas."""
        if len(args) > len(_POSITIONAL):
            raise TypeError(f"request() takes at most {len(_POSITIONAL)} settings positionally")
        named = dict(zip(_POSITIONAL, args))
        seed_index = named.pop("seed_index", seed_index)
        constraint = named.pop("constraint", constraint)
        params = GenerationParams.merged(params, {**named, **overrides})
        k = params.num_speculative_tokens
        if k == AUTO:
            raise ValueError("a request's num_speculative_tokens is a fixed K (0 = plain) or None (the policy's)")
        return self._request(prompt_ids, params, seed_index, k, constraint)

    def _request(self, prompt_ids: list[int], params: GenerationParams, seed_index: int, k: int | None,
                 constraint=None) -> Request:
        """The Request of checked params for this generator: what needs the model is checked here."""
        outside = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise OptionError("logit_bias", f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size}): "
                                            f"{outside[:5]}")
        context = self.target.max_positions
        if context and len(prompt_ids) + params.max_new_tokens > context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens={params.max_new_tokens} "
                             f"that exceeds the model's context of {context} tokens: shorten the prompt or lower "
                             f"max_new_tokens")
        if isinstance(seed_index, bool) or not isinstance(seed_index, int) or seed_index < 0:
            raise ValueError(f"seed_index must be an integer >= 0, got {seed_index!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or use load_model()")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                       else frozenset(self.eos_token_ids))
        if k and self.drafter is None:
            raise ValueError("this generator has no draft: num_speculative_tokens must be 0 or None")
        grammar = self._compile(constraint if constraint is not None else params.constraint)
        return Request(list(prompt_ids), params.max_new_tokens, params.sampling, params.seed, stop_ids, params.stop,
                       k, grammar, params.logprobs, seed_index)

    def _compile(self, constraint):
        if constraint is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs (json_schema, grammar, regex) need a tokenizer: use load_model() "
                             "or pass tokenizer=")
        return self.prepare_grammars().compile(constraint)

    def prepare_grammars(self):
        """The tokenizer's grammar compiler, built now where it was not (~2 s on a 152k vocabulary): a server builds
        it at start-up rather than in its first structured request's time to the first token."""
        if self._grammars is None:
            from ..structured.constraints import GrammarCompiler

            self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size,
                                                           eos_token_ids=sorted(self.eos_token_ids))
            self._grammars.cache_size = self.grammar_cache_entries
        return self._grammars

    def set_grammar_cache(self, entries: int) -> None:
        """Keep up to `entries` compiled grammars (LRU; each distinct json_schema, regex or tool set is one).

        The cache belongs to the tokenizer's shared compiler, so the bound holds for every generator of this tokenizer.
        """
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
            raise ValueError(f"the grammar cache holds an integer >= 1 of grammars, got {entries!r}")
        self.grammar_cache_entries = entries
        if self._grammars is not None:  # shrinks at its next compile
            self._grammars.cache_size = entries

    def grammar_cache(self):
        """The compiled grammars' cache (hits, misses, maxsize, currsize); None before a request needed one."""
        return self._grammars.cache_info() if self._grammars is not None else None

    def set_prefix_cache(self, max_tokens: int) -> None:
        """Keep up to max_tokens tokens of finished rows' KV to reuse for prompts that start with them (0: off)."""
        self.prefix_cache = _prefix_cache(self.target, max_tokens)
        set_prefix_cache(self.drafter, max_tokens)

    def session(self, policy=None, prefill_tokens_per_step: int | None = None,
                max_batch: int | None = None) -> "DecodingSession":
        """A batch that rows join and leave between steps (continuous batching; see DecodingSession)."""
        return _limits_named(DecodingSession(self, policy, prefill_tokens_per_step, max_batch))

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


class AutoregressiveGenerator(SpeculativeGenerator):
    """Plain decoding of the target with the same loop, cache handling and result type (K = 0)."""

    def __init__(self, target, tokenizer=None, vocab_size: int | None = None):
        super().__init__(target, None, num_speculative_tokens=0, tokenizer=tokenizer, vocab_size=vocab_size)


def _prefix_cache(target, max_tokens: int):
    from ..backends.prefix_cache import PrefixCache

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"prefix_cache_tokens must be an integer >= 0 (0: off), got {max_tokens!r}")
    cache = PrefixCache(max_tokens)
    return cache if cache.usable(target) else None


def _limits_named(session: DecodingSession) -> DecodingSession:
    """The session's Stats with the user's K and the copy limit apart. The session sizes its counters by the widest
    step its policy may verify, which under -k auto with a copying drafter is the copy limit (64), not the K a
    model's drafts keep to: a user who left K at auto's cap of 8 would read 64 as their K."""
    stats, policy = session.stats, session.policy
    stats.copy_limit = policy.max_k
    stats.num_speculative_tokens = policy.model_k
    return session

"""One request's options as one value: `GenerationParams`, which the library's generate(), the CLI and the server's
request translation build and the engine reads.

It is checked once, when it is made: the sampling values by `exact.sampling.SamplingParams` (which it extends, so
a new sampling option declared there is a field here too), the rest below. What needs the model (token ids in the
vocabulary, the context window, a tokenizer for stop strings, a draft for a fixed K, compiling a grammar) is
checked by the generator's `request()`. generate(), stream() and request() take every field as a keyword without
naming it (`merged`), so a new option is one field, its translation from a request body (server/translate.py) and
its test (tests/test_generation_params.py checks that every field reaches both).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import OptionError
from ..exact.sampling import SamplingParams
from ..policy.speculation import AUTO, Speculation

MAX_LOGPROBS = 20  # top alternatives per position a row may ask for (OpenAI's limit)
# generate()'s and stream()'s keywords that take a list with one value per prompt (any other value is every row's;
# a dict is one value: a schema, a logit_bias). stop is a list of strings for every row, so it is not among them.
PER_ROW = frozenset({"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "json_schema", "grammar",
                     "regex"})
ALIASES = {"return_logprobs": "logprobs"}  # generate()'s and stream()'s name of a field, kept for their callers


@dataclass(frozen=True)
class GenerationParams(SamplingParams):
    """How to generate for one request: the sampling settings (SamplingParams' fields: temperature, top_k, top_p,
    min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias) and the fields below. Frozen and
    checked when made (a ValueError names the field); `dataclasses.replace` makes a changed copy, checked again."""

    max_new_tokens: int = 64  # new tokens at most per row
    seed: int | None = None  # row i of the request draws the stream (seed, i); None: fresh randomness
    stop: tuple[str, ...] = ()  # stop strings (not output); one string is accepted for one stop
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a row besides the end-of-sequence tokens
    ignore_eos: bool = False  # do not end a row at an end-of-sequence token
    num_speculative_tokens: int | str | None = None  # K: "auto" or 0..32; None: the generator's (see request())
    json_schema: dict | str | None = None  # constraints, at most one: the output is JSON valid under this schema,
    json_object: bool = False  # ... any JSON object,
    grammar: str | None = None  # ... follows this Lark (or GBNF) grammar,
    regex: str | None = None  # ... or matches this regular expression as a whole
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives (0..20)
    # derived once from the fields above, not set by callers:
    sampling: SamplingParams = field(default=None, init=False, repr=False, compare=False)  # the rows' sampler
    constraint: Any = field(default=None, init=False, repr=False, compare=False)  # structured.ConstraintSpec | None

    def __post_init__(self):
        super().__post_init__()  # the sampling values: SamplingParams' checks and normal forms (greedy is 0.0)
        _set = _setter(self)
        _set("sampling", SamplingParams(*(getattr(self, f.name) for f in fields(SamplingParams))))
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise OptionError("max_new_tokens", f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise OptionError("seed", f"seed must be an integer >= 0 (or None), got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise OptionError("logprobs", f"logprobs must be an integer 0..{MAX_LOGPROBS} (or None), "
                                          f"got {self.logprobs!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise OptionError("stop", "stop strings must be non-empty strings")
        _set("stop", stop)
        _set("stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.num_speculative_tokens is not None:
            k = Speculation.parse(self.num_speculative_tokens).k  # its ValueError names the rule
            _set("num_speculative_tokens", AUTO if k is None else k)
        if self.json_schema is not None or self.grammar is not None or self.regex is not None or self.json_object:
            # only then: free text never imports the grammar engine's module
            from ..structured.constraints import ConstraintSpec

            _set("constraint", ConstraintSpec.of(json_schema=self.json_schema, grammar=self.grammar,
                                                 regex=self.regex, json_object=self.json_object))

    @classmethod
    def merged(cls, params: "GenerationParams | None", overrides: dict) -> "GenerationParams":
        """params (None: the defaults) with these fields changed; a TypeError names a keyword that is no field."""
        if params is not None and not isinstance(params, GenerationParams):
            raise TypeError(f"params must be a GenerationParams (or None), got {type(params).__name__}; give "
                            f"single settings as keywords (max_new_tokens=...)")
        overrides = _canonical(overrides)
        if not overrides:
            return params if params is not None else cls()
        return replace(params, **overrides) if params is not None else cls(**overrides)


def per_row(n: int, params: GenerationParams | None, overrides: dict) -> list[tuple[GenerationParams, int]]:
    """(params, seed index) of each of n rows: a PER_ROW keyword given as a list or tuple gives each row its own
    value, any other value is every row's. An int seed S is one request of n rows (row i draws the stream (S, i)); a
    list gives each row a request of its own (None: fresh randomness), or a (seed, index) pair: row `index` of the
    request seeded `seed` (a caller that cuts one request into several calls keeps each row's stream that way)."""
    overrides = _canonical(overrides)
    seed = overrides.get("seed", params.seed if params is not None else None)
    lists = {name: _column(value, n, name) for name, value in overrides.items()
             if name in PER_ROW and isinstance(value, (list, tuple))}
    if "seed" in lists:
        pairs = [s if isinstance(s, tuple) and len(s) == 2 else (s, 0) for s in lists["seed"]]
        lists["seed"], indices = [s for s, _ in pairs], [i for _, i in pairs]
    else:  # an int S: row i of the request; None (or a bad value, which GenerationParams refuses): 0
        indices = list(range(n)) if isinstance(seed, int) and not isinstance(seed, bool) else [0] * n
    base = GenerationParams.merged(params, {k: v for k, v in overrides.items() if k not in lists})
    if not lists:
        return [(base, i) for i in indices]
    return [(replace(base, **{name: column[r] for name, column in lists.items()}), indices[r]) for r in range(n)]


# The fields a caller sets: the keywords generate(), stream(), request() and the server's Job take (besides ALIASES).
NAMES = frozenset(f.name for f in fields(GenerationParams) if f.init)


def _setter(obj):
    """A setter of a frozen dataclass's fields, for its own __post_init__ (normal forms and derived values)."""
    return lambda name, value: object.__setattr__(obj, name, value)


def _canonical(overrides: dict) -> dict:
    out = {ALIASES.get(name, name): value for name, value in overrides.items()}
    unknown = sorted(out.keys() - NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}: the settings are GenerationParams' fields "
                        f"({', '.join(sorted(NAMES))})")
    return out


def _column(value, n: int, name: str) -> list:
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one value, or one per prompt")
    return list(value)


def takes_params_keywords(cls):
    """A class decorator for a class with a `params: GenerationParams` keyword (the server's Job): cls(...,
    temperature=0.8) is cls(..., params=GenerationParams(temperature=0.8)), on top of a params= given too, as
    generate() takes them."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, params: GenerationParams | None = None, **kwargs):
        settings = {name: kwargs.pop(name) for name in (NAMES | ALIASES.keys()) & kwargs.keys()}
        init(self, *args, params=GenerationParams.merged(params, settings), **kwargs)

    cls.__init__ = __init__
    return cls

"""Grammar constraints for structured outputs: JSON schema, any JSON object, Lark grammar, regex.

A constraint restricts which token may come next. At every position of a constrained row the grammar gives a mask
of allowed tokens, and the distribution sampled from is normalise(p * mask). Speculative decoding stays lossless as
long as that same mask multiplies both the target's p and the draft's q at the same position: the accept/reject
rule then recovers exactly the constrained target distribution. So the decoding loop walks a Matcher along a drafted
path (advance), asks for the mask at each position (mask), and undoes the rejected part (rollback).

Some grammar states leave a single continuation of text (an object schema starts with `{"id`); forced() returns
its canonical tokens so the loop can propose them as drafts without running a draft model. llguidance allows only
that canonical tokenization of forced text, so at each position of a forced run the mask is one-hot on the forced
token: the constrained distribution gives it probability 1, and verifying it as a draft with a one-hot q always
keeps it (the target still has to run over it, for the positions after it).

The engine is llguidance (see docs/STRUCTURED_OUTPUTS.md for the measurements behind that choice). JSON schemas are
compiled compact (no whitespace between tokens, `{"a":1,"b":2}`) unless the schema says otherwise through
llguidance's "x-guidance" key, e.g. {"x-guidance": {"whitespace_flexible": true}, ...}.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import numpy as np
import torch

from .distinct_calls import DISTINCT_CALLS, DistinctCallsMatcher, TokenTable
from ..text.vocab import token_ids

KINDS = ("json_schema", "json_object", "grammar", "regex")
# Compact JSON: fewer tokens, more forced tokens (free drafts), and no runaway whitespace from small models.
JSON_DEFAULTS = {"whitespace_flexible": False}
ANY_OBJECT_SCHEMA = '{"type":"object"}'
MAX_ERROR_CHARS = 2000
CacheInfo = namedtuple("CacheInfo", "hits misses maxsize currsize")


class ConstraintError(ValueError):
    """A constraint that cannot be used: wrong arguments, or a schema/grammar/regex the engine rejects."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise ConstraintError(f"structured outputs need the llguidance package ({e}); install it with: "
                              f"pip install 'llguidance>=1.9,<2'") from e
    return llguidance


# ---------------------------------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class ConstraintSpec:
    """What a request asks for, in a canonical form (so equal constraints share one compiled grammar).

    distinct_calls: a tool grammar that allows several calls, whose matchers refuse a call identical to an earlier
    one (distinct_calls.py); the flag, not the grammar's text, picks that matcher."""

    kind: str
    source: str
    distinct_calls: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.distinct_calls and self.kind != "grammar":
            raise ConstraintError(f"distinct_calls applies to a (tool) grammar, not to a {self.kind}")

    @classmethod
    def of(cls, json_schema: dict | str | None = None, grammar: str | None = None, regex: str | None = None,
           json_object: bool = False) -> "ConstraintSpec | None":
        """The constraint the arguments ask for; None when they ask for none. A grammar whose first line is
        DISTINCT_CALLS (as tool_dialects.ToolFormat writes a grammar of several calls) asks for distinct calls: the
        one place its text is read for it, when a request is parsed."""
        if not isinstance(json_object, bool):
            raise ConstraintError(f"json_object must be true or false, not {type(json_object).__name__}")
        given = [name for name, value in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex))
                 if value is not None] + (["json_object"] if json_object else [])
        if len(given) > 1:
            raise ConstraintError(f"give at most one of json_schema, json_object, grammar, regex (got "
                                  f"{', '.join(given)}); combine them into one grammar instead")
        if not given:
            return None
        if json_object:
            return cls("json_object", "")
        if json_schema is not None:
            return cls("json_schema", _canonical_schema(json_schema))
        if grammar is not None:
            text = _nonempty_text("grammar", grammar)
            return cls("grammar", text, distinct_calls=text.startswith(DISTINCT_CALLS))
        return cls("regex", _nonempty_text("regex", regex))


def _canonical_schema(schema) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ConstraintError(f"json_schema is not valid JSON ({e}); pass a JSON object or a dict") from e
    if not isinstance(schema, dict):
        raise ConstraintError(f"json_schema must be a JSON object (a dict), not {type(schema).__name__}")
    try:
        # Key order is kept, not sorted: llguidance emits properties in the order the schema declares them, and
        # that order is the user's (e.g. "reasoning" before "answer"). NaN/Infinity are not JSON.
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"json_schema cannot be written as JSON ({e}); use only JSON values in it") from e


def _nonempty_text(name: str, text) -> str:
    if not isinstance(text, str):
        raise ConstraintError(f"{name} must be a string, not {type(text).__name__}")
    if not text.strip():
        raise ConstraintError(f"{name} is empty; give the {name} text or leave {name} out")
    return text


# ------------------------------------------------------------------------------------------------- compilation
def _grammar_text(spec: ConstraintSpec) -> str:
    """llguidance's grammar definition for a spec (this only wraps text; errors come when a matcher is built)."""
    llg = _llguidance()
    if spec.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_DEFAULTS)
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if "::=" in spec.source:  # a llama.cpp GBNF grammar: llguidance converts it to Lark
        return llg.grammar_from("grammar", spec.source)
    return llg.LLMatcher.grammar_from_lark(spec.source)


def _fix_hint(kind: str) -> str:
    return {
        "json_schema": "fix the schema (llguidance supports JSON Schema draft 2020-12 minus a few keywords; add "
                       "\"x-guidance\": {\"lenient\": true} to it to ignore the keywords it does not implement)",
        "json_object": "this is a bug in specdecode",
        "regex": "fix the regex (Rust regex syntax, matched against the whole output; no look-around or "
                 "back-references)",
        "grammar": "fix the grammar (Lark syntax as llguidance reads it, with a `start` rule, or GBNF with `root`)",
    }[kind]


def _trimmed(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


class GrammarCompiler:
    """One tokenizer's grammar environment; compiled grammars cached (LRU, bounded). Safe to share across threads."""

    _instances: "OrderedDict[tuple, tuple[weakref.ref, GrammarCompiler]]" = OrderedDict()
    _instances_lock = threading.Lock()
    max_instances = 8

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=None, cache_size: int = 64):
        llg = _llguidance()
        eos = _eos_ids(tokenizer, eos_token_ids)
        try:
            self.ll_tokenizer = llg.hf.from_tokenizer(tokenizer, eos_token=eos)
        except (ValueError, TypeError, AttributeError) as e:
            raise ConstraintError(f"cannot build the grammar engine's vocabulary from {type(tokenizer).__name__} "
                                  f"({e}); structured outputs need a fast (tokenizers-backed) Hugging Face "
                                  f"tokenizer") from e
        self.vocab_size = int(vocab_size)
        self.n_tokens = self.ll_tokenizer.vocab_size  # ids the engine knows; those past it are never allowed
        self.eos_token_ids = tuple(eos)
        self.eos_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.eos_mask[[t for t in eos if t < self.vocab_size]] = True
        self.eos_token_mask = TokenMask.of_ids(eos, self.vocab_size)  # what a finished grammar allows
        self.cache_size = cache_size
        self._cache: OrderedDict[ConstraintSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids=None) -> "GrammarCompiler":
        """The shared compiler of this tokenizer object (building one takes ~2 s on a 152k vocabulary)."""
        key = (id(tokenizer), int(vocab_size), tuple(_eos_ids(tokenizer, eos_token_ids)))
        with cls._instances_lock:
            entry = cls._instances.get(key)
            # id() is reused once an object dies: the weak reference tells a live entry from a stale one.
            if entry is not None and entry[0]() is tokenizer:
                cls._instances.move_to_end(key)
                return entry[1]
            compiler = cls(tokenizer, vocab_size, eos_token_ids)
            cls._instances[key] = (_weak(tokenizer), compiler)
            while len(cls._instances) > cls.max_instances:
                cls._instances.popitem(last=False)
            return compiler

    def compile(self, spec: ConstraintSpec) -> "CompiledGrammar":
        """The compiled grammar of spec; ConstraintError (with the engine's message) if the engine rejects it."""
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._hits += 1
                self._cache.move_to_end(spec)
                return found
            self._misses += 1
        # Compiled outside the lock (llguidance releases the GIL while it builds), so a large schema from one
        # request does not hold up the engine thread's lookups of grammars already compiled.
        compiled = CompiledGrammar(spec, self, self._build(spec))
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self.cache_size, len(self._cache))

    def _build(self, spec: ConstraintSpec):
        llg = _llguidance()
        try:
            text = _grammar_text(spec)
        except ValueError as e:
            raise ConstraintError(f"invalid {spec.kind}: {e}; {_fix_hint(spec.kind)}") from e
        # Terse errors: they reach API clients, and the verbose ones dump the parser state and the whole grammar.
        limits = llg.LLParserLimits(verbose_errors=False)
        template = llg.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=limits)
        if template.is_error():
            raise ConstraintError(f"invalid {spec.kind}: {_trimmed(template.get_error().strip())}; "
                                  f"{_fix_hint(spec.kind)}")
        template.compute_bitmask()
        if template.is_error():  # it compiles, but the first mask finds that no output can match it
            raise ConstraintError(f"the {spec.kind} can never be satisfied: no output matches it (llguidance: "
                                  f"{template.get_error().split(chr(10))[0]}); {_fix_hint(spec.kind)}")
        return template


def _eos_ids(tokenizer, eos_token_ids) -> list[int]:
    if eos_token_ids is None:
        eos_token_ids = getattr(tokenizer, "eos_token_id", None)
    ids = token_ids(eos_token_ids)
    if not ids:
        raise ConstraintError("the tokenizer has no eos token, so a constrained output could never end; pass "
                              "eos_token_ids=[...] with the ids generation stops on")
    return sorted(ids)


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:  # not weak-referenceable: keep it alive instead, so its id cannot be reused
        return lambda: obj


class CompiledGrammar:
    """A grammar compiled for one tokenizer; matcher() gives each output its own state."""

    def __init__(self, spec: ConstraintSpec, compiler: GrammarCompiler, template):
        self.spec = spec
        self.compiler = compiler
        self._template = template  # never advanced: copying it is ~10 us, building a matcher anew ~1 ms
        self._lock = threading.Lock()
        self.warnings: list[str] = list(template.get_grammar_warnings())

    def matcher(self) -> "Matcher":
        """A fresh state at the start of the output (a tool grammar that allows several calls refuses repeats:
        distinct_calls.py)."""
        with self._lock:
            engine = self._template.deep_copy()
        matcher = Matcher(engine, self.compiler)
        if self.spec.distinct_calls:
            return DistinctCallsMatcher(matcher, TokenTable.of(self.compiler))
        return matcher


# ----------------------------------------------------------------------------------------------------- the mask
# Row b of this table is the additive form of one bitmask byte b (bit j = token 8i + j, little-endian): -0.0 where
# the bit is set, -inf where it is not. x + (-0.0) is x exactly (signed zeros included) and x + (-inf) is -inf for
# every finite x, so scores + bias is bit for bit scores.masked_fill(~mask, -inf), and it is branch-free: on a
# 152k vocabulary a masked_fill with a bool mask costs 0.25-0.6 ms (a data-dependent branch per token, which a
# grammar's scattered allowed ids mispredict), the table lookup and the add ~20 us each.
_BIAS_OF_BYTE = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, np.float32(-0.0),
                         np.float32(-np.inf)).astype(np.float32)


class TokenMask:
    """One position's allowed tokens over a vocabulary of `width` ids (the logits' width), kept as the grammar
    engine's bitmask (bit t of the little-endian bytes: token t allowed). Ids at or past `known` (the tokenizer's
    length) are never allowed; `bits=None` allows every id (a free row's mask). Made once per position, read in
    the form each consumer needs: as_bool() for indexing, bias() (0 / -inf, added to scores) for the distributions.
    Immutable; the tensors it hands out are its own copies, made on first use."""

    __slots__ = ("bits", "known", "width", "_bool", "_bias")

    def __init__(self, bits: np.ndarray | None, known: int, width: int):
        self.bits = bits
        self.known = min(int(known), int(width))
        self.width = int(width)
        self._bool = self._bias = None

    @classmethod
    def of_ids(cls, ids, width: int) -> "TokenMask":
        ids = [int(t) for t in ids if 0 <= int(t) < width]
        bits = np.packbits(np.isin(np.arange(width), ids), bitorder="little")
        return cls(bits, width, width)

    @classmethod
    def everything(cls, width: int) -> "TokenMask":
        return cls(None, width, width)

    @property
    def empty(self) -> bool:
        """No id below the width is allowed."""
        if self.bits is None:
            return self.width == 0
        full, rest = divmod(self.known, 8)
        return not (self.bits[:full].any() or (rest and int(self.bits[full]) & ((1 << rest) - 1)))

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.width:
            return False
        if self.bits is None:
            return True
        return token < self.known and bool((int(self.bits[token >> 3]) >> (token & 7)) & 1)

    def count(self) -> int:
        """How many ids are allowed."""
        if self.bits is None:
            return self.width
        full, rest = divmod(self.known, 8)
        tail = int(self.bits[full]) & ((1 << rest) - 1) if rest else 0
        return int(np.unpackbits(self.bits[:full]).sum()) + bin(tail).count("1")

    def without(self, ids) -> "TokenMask":
        """This mask less the given ids."""
        bits = self.bits.copy() if self.bits is not None else np.packbits(np.ones(self.width, bool), bitorder="little")
        for t in ids:
            bits[t >> 3] &= ~np.uint8(1 << (t & 7))
        return TokenMask(bits, self.known, self.width)

    def as_bool(self) -> torch.Tensor:
        """bool [width]: True where allowed (a new tensor the caller may keep; not to be written to)."""
        if self._bool is None:
            if self.bits is None:
                self._bool = torch.ones(self.width, dtype=torch.bool)
            else:
                bits = np.unpackbits(self.bits, count=self.width, bitorder="little")
                if self.known < self.width:  # padded logits: ids past the tokenizer are never text
                    bits[self.known:] = 0
                self._bool = torch.from_numpy(bits.view(np.bool_))
        return self._bool.clone()

    def bias(self) -> torch.Tensor:
        """float32 [width]: -0.0 where allowed, -inf elsewhere; scores + bias() = scores.masked_fill(~mask, -inf).
        Cached: not to be written to."""
        if self._bias is None:
            out = np.empty(self.width, dtype=np.float32)
            self.write_bias(out)
            self._bias = torch.from_numpy(out)
        return self._bias

    def argmax_of(self, scores: np.ndarray) -> int:
        """The index greedy() takes of scores + bias() (the first of equal maxima, as numpy's and torch's argmax),
        from scores [width] alone where the mask allows their own argmax: then no other allowed token can come
        before it. What a greedy step of a constrained row needs, without the [width] bias."""
        top = int(np.argmax(scores))
        if self.allows(top):
            return top
        bias = np.empty(self.width, dtype=np.float32)
        self.write_bias(bias)
        return int(np.argmax(scores[: self.width] + bias))

    def write_bias(self, out: np.ndarray) -> None:
        """Write bias() into out (float32 [width], e.g. a row of a batch's bias tensor) without an extra copy."""
        if self._bias is not None:
            out[:] = self._bias.numpy()
            return
        if self.bits is None:
            out.fill(-0.0)
            return
        whole = min(self.known // 8, len(self.bits))
        np.take(_BIAS_OF_BYTE, self.bits[:whole], axis=0, out=out[: whole * 8].reshape(whole, 8))
        done = whole * 8
        if done < self.known:  # a last partial byte
            out[done:self.known] = _BIAS_OF_BYTE[self.bits[whole], : self.known - done]
            done = self.known
        out[done:] = -np.inf


# ---------------------------------------------------------------------------------------------------- the state
class Matcher:
    """One output's position in its grammar. Not thread-safe: one row, one thread.

    Rollback depth is unlimited (llguidance keeps every consumed token). An EOS token is consumed only where the
    grammar may end; it is tracked here rather than in llguidance, whose stopped states accept EOS without
    recording it, which would make rollback counts drift.
    """

    def __init__(self, engine, compiler: GrammarCompiler):
        self._engine = engine
        self._compiler = compiler
        self.vocab_size = compiler.vocab_size
        self._words = np.zeros((compiler.n_tokens + 31) // 32, dtype=np.int32)
        self._consumed = 0  # tokens llguidance holds (rollback bound)
        self._ended = False  # an EOS was consumed after them

    def mask(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed next (only EOS once the grammar is finished)."""
        return self.allowed().as_bool()

    def allowed(self) -> "TokenMask":
        """The tokens allowed next, as llguidance's bitmask (a copy): the loop makes the bool or the additive form
        it needs from it (only EOS once the grammar is finished)."""
        if self._ended:
            return self._compiler.eos_token_mask
        self._engine.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._engine.is_error():
            # Only a resource limit inside llguidance gets here (advance never feeds it a disallowed token):
            # ending the row beats dropping its constraint; `error` says why.
            return self._compiler.eos_token_mask
        return TokenMask(self._words.view(np.uint8).copy(), self._compiler.n_tokens, self.vocab_size)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens of the text the grammar forces from here (canonical tokenization); no advance."""
        if limit <= 0 or self._ended or self._engine.is_stopped():
            return []
        tokens = self._engine.compute_ff_tokens()[:limit]
        for i, token in enumerate(tokens):
            if token >= self.vocab_size:
                return tokens[:i]
        return tokens

    def advance(self, tokens) -> int:
        """Consume tokens in order; the count consumed (stops before the first one the grammar does not allow)."""
        if self._ended:
            return 0
        tokens = [int(t) for t in tokens]
        head = self._text_tokens(tokens)
        n = self._engine.try_consume_tokens(head) if head else 0
        self._consumed += n
        if n < len(head) or n == len(tokens):
            return n
        if tokens[n] in self._compiler.eos_token_ids and self._engine.is_accepting():
            self._ended = True
            return n + 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""
        if n < 0 or n > self._consumed + self._ended:
            raise ValueError(f"cannot roll back {n} tokens: only {self._consumed + self._ended} were consumed")
        if n and self._ended:
            self._ended = False
            n -= 1
        if n and not self._engine.rollback(n):
            raise RuntimeError(f"grammar rollback failed: {self._engine.get_error()}")
        self._consumed -= n

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS (or an EOS was consumed)."""
        return self._ended or self._engine.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output may end here (EOS is allowed), though the grammar may also allow more."""
        return self._ended or self._engine.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the engine gave up on this row (a resource limit), else None."""
        return _trimmed(self._engine.get_error()) if self._engine.is_error() else None

    def copy(self) -> "Matcher":
        """An independent matcher in the same state (same rollback history)."""
        twin = Matcher(self._engine.deep_copy(), self._compiler)
        twin._consumed, twin._ended = self._consumed, self._ended
        return twin

    def _text_tokens(self, tokens: list[int]) -> list[int]:
        """The tokens before the first EOS or out-of-range id: llguidance enters a permanent error state on an
        id it does not know, and EOS is handled here."""
        eos = self._compiler.eos_token_ids
        limit = min(self._compiler.n_tokens, self.vocab_size)
        for i, token in enumerate(tokens):
            if token in eos or not 0 <= token < limit:
                return tokens[:i]
        return tokens

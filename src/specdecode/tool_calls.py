"""Tool calls (OpenAI function calling) in the Hermes / Qwen2.5 format: which templates can show them, the grammar
that allows only valid calls, and the parser that reads calls back out of the text, whole or as it streams.

The format is what Qwen2.5's chat template writes for an assistant's tool calls (and what its system prompt asks
the model for), one block per call, blocks joined by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar is a Lark grammar for llguidance, so it goes through the structured-output path like any response_format
(constraints.py): the same mask on p and q at every position, the forced text (`<tool_call>\\n{"name": "`, a tool's
name once its first letters decide it, `", "arguments": {"city": "`) proposed as certain drafts. Arguments follow
the tool's `parameters` JSON Schema, written with the separators of the template's `tojson` (", " and ": "), so a
call in the history is rendered back exactly as the model wrote it.

tool_choice "required" allows only calls; "auto" allows free text that never contains `<tool_call>`, calls, or
(where `<tool_call>` is a token of its own, as in Qwen2.5) text and then calls, as Qwen2.5 writes when it says what
it is about to do: the text comes back as message.content beside message.tool_calls, as OpenAI's API and vLLM's
Hermes parser return it. A named function allows one call of that function. parallel_tool_calls=False allows one
call at most.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = OPEN + '\n{"name": "'  # a call's text up to its name
NAME_END = '", "arguments": '  # between the name and the arguments
TAIL = "}\n" + CLOSE  # after the arguments
SEPARATOR = "\n"  # between two calls
# The separators of json.dumps / jinja's tojson, which the template uses to render a call's arguments back.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_PROBE = "specdecode_probe_tool"


class ToolError(ValueError):
    """A tool definition, tool_choice or tool message that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # the JSON Schema of the arguments (an object)
    description: str | None = None

    def rendered(self) -> dict:
        """The tool as the chat template receives it (OpenAI's shape, without `strict`)."""
        function = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


# ------------------------------------------------------------------------------------------------ the template
_SUPPORT: dict[str, bool] = {}


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows tools to the model and writes calls in this module's format
    (checked by rendering a probe tool and a probe call once per template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or OPEN not in template:
        return False
    if template not in _SUPPORT:
        _SUPPORT[template] = _renders_tools(tokenizer)
    return _SUPPORT[template]


def _renders_tools(tokenizer) -> bool:
    probe = Tool(_PROBE, {"type": "object", "properties": {"x": {"type": "integer"}}})
    call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE, "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    try:
        shown = tokenizer.apply_chat_template(messages[:1], tools=[probe.rendered()], tokenize=False,
                                              add_generation_prompt=True)
        written = tokenizer.apply_chat_template(messages, tools=[probe.rendered()], tokenize=False)
    except Exception:  # a template that fails on tools or tool calls does not support them
        return False
    return _PROBE in shown and HEAD + _PROBE + NAME_END + '{"x": 1}' + TAIL in written


# ------------------------------------------------------------------------------------------------ the request
def parse_tools(tools: list) -> list[Tool]:
    """Tools from OpenAI's `tools` list ({"type": "function", "function": {name, description, parameters,
    strict}}); ToolError names the first bad one. Arguments always follow the schema (strict or not)."""
    parsed, names = [], set()
    for i, item in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                            f'{{...}}}}}} (function tools are the only kind)', where)
        function = item["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                            f"{name!r}", f"{where}.function.name")
        if name in names:
            raise ToolError(f"{where}.function.name: two tools are named {name!r}; give each tool its own name",
                            f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = _checked_parameters(function.get("parameters"), f"{where}.function.parameters")
        parsed.append(Tool(name, parameters, description))
    if not parsed:
        raise ToolError("tools is empty: give at least one tool, or leave tools out", "tools")
    return parsed


def _checked_parameters(schema, where: str) -> dict:
    """The arguments' schema, checked by the grammar engine (so a schema it cannot enforce is a 400 here)."""
    if schema is None:
        return dict(EMPTY_PARAMETERS)  # OpenAI: no parameters means a function without arguments
    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON Schema object, not {type(schema).__name__}", where)
    if not isinstance(schema.get("x-guidance", {}), dict):
        raise ToolError(f'{where}["x-guidance"] must be an object of llguidance options', where)
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where} must describe an object (\"type\": \"object\"), not {schema['type']!r}: a "
                        f"call's arguments are a JSON object", where)
    from .constraints import _llguidance

    llg = _llguidance()
    try:
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(_layout(schema)))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise ToolError(f"{where} is not a JSON Schema the grammar engine can enforce: {error.strip()[:500]}; fix "
                        f"the schema (JSON Schema draft 2020-12; add \"x-guidance\": {{\"lenient\": true}} to ignore "
                        f"keywords it does not implement)", where)
    return schema


def _layout(schema: dict) -> dict:
    """The schema with the template's JSON layout as llguidance's defaults (its own "x-guidance" wins)."""
    out = dict(schema)
    out.setdefault("type", "object")
    out["x-guidance"] = {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}
    return out


def parse_tool_choice(choice, tools: list[Tool] | None) -> str | None:
    """"none", "auto", "required" or a tool's name (from {"type": "function", "function": {"name": ...}});
    None when there are no tools and none is asked for."""
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                            f'{{"name": ...}}}}, got {choice!r}', "tool_choice")
        if choice != "none" and not tools:
            raise ToolError(f'tool_choice {choice!r} needs tools: give tools, or leave tool_choice out',
                            "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    known = [t.name for t in tools or []]
    if name not in known:
        raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools "
                        f"({', '.join(map(repr, known)) or 'none given'}); name one of them", "tool_choice")
    return name


def check_tool_messages(messages: list[dict]) -> None:
    """Every tool message answers a call of an earlier assistant message (by tool_call_id)."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            calls.add(call["id"])
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not call_id:
                raise ToolError(f"messages[{i}] (role \"tool\") needs a tool_call_id: the id of the call it answers",
                                f"messages[{i}].tool_call_id")
            if call_id not in calls:
                raise ToolError(f"messages[{i}].tool_call_id is {call_id!r}, which matches no tool call of an "
                                f"earlier assistant message; answer a call by its id", f"messages[{i}].tool_call_id")


# ------------------------------------------------------------------------------------------------ the grammar
def markers(tokenizer) -> tuple[str, str]:
    """`<tool_call>` and `</tool_call>` as Lark terms for this tokenizer: a token of their own where the vocabulary
    has one (Qwen2.5's added tokens 151657 and 151658, which the grammar engine reads as special tokens, written
    `<[id]>`), their text otherwise."""
    terms = []
    for text in (OPEN, CLOSE):
        added = (tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}).get(text)
        terms.append(f"<[{added}]>" if added is not None else json.dumps(text))
    return terms[0], terms[1]


def tool_grammar(tools: list[Tool], choice: str, parallel: bool = True,
                 marks: tuple[str, str] = (json.dumps(OPEN), json.dumps(CLOSE))) -> str:
    """The Lark grammar (llguidance's dialect) of an answer under tool_choice `choice` ("auto", "required" or a
    tool's name): calls of the allowed tools, arguments valid under their schemas; with "auto" also free text
    without `<tool_call>` in it, and (with token markers) such text followed by calls. marks: the tokenizer's
    markers() (their text by default)."""
    allowed = [t for t in tools if t.name == choice] if choice not in ("auto", "required") else tools
    rules = []
    for i, tool in enumerate(allowed):
        head = json.dumps(HEAD[len(OPEN):] + tool.name + NAME_END)
        rules.append(f"call_{i}: {marks[0]} {head} args_{i} {json.dumps(TAIL[:-len(CLOSE)])} {marks[1]}")
        rules.append(f"args_{i}: %json {json.dumps(_layout(tool.parameters))}")
    calls = "call" if not parallel or choice not in ("auto", "required") else f'call ({json.dumps(SEPARATOR)} call)*'
    start = "start: calls"
    if choice == "auto":
        # text then calls only where the marker is a token: as text, `<tool_call>` could not end a greedy TEXT
        start = "start: TEXT | TEXT? calls" if marks[0].startswith("<[") else "start: TEXT | calls"
    return "\n".join([start, f"calls: {calls}", "call: " + " | ".join(f"call_{i}" for i in range(len(allowed))),
                      *rules, "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"])


# ------------------------------------------------------------------------------------------------ the answer
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # the JSON text of the arguments, as the model wrote it
    complete: bool = False

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Reads one answer's text as it grows: content, or tool calls in this module's format. feed() returns the
    deltas to stream (OpenAI's shape), finish() the rest; whole answers go through the same two calls, so a
    streamed answer assembles to the whole one.

    An answer is content, calls, or content and then calls: content ends where `<tool_call>` begins (the newline
    before it is the template's, not the content's, so a call in the history renders back as it was written), and
    everything after is calls. Text that may still become a call's head or tail is held back until it is decided."""

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _text: str = ""  # everything fed so far
    _done: int = 0  # characters of _text already turned into deltas
    _mode: str = "content"  # "calls" from the first `<tool_call>` on
    _separator: str = ""  # the newline between the content and the first call, not the content's

    def feed(self, text: str) -> list[dict]:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict]:
        if self._mode == "calls":
            return self._calls(final)
        rest = self._text[self._done:]
        found = rest.find(OPEN)
        if found < 0:  # content so far: all of it, but an end that may still become "\n<tool_call>"
            end = len(rest) if final else len(rest) - max(_held(rest, SEPARATOR + OPEN), _held(rest, OPEN))
        else:
            end = found - (1 if rest[:found].endswith(SEPARATOR) else 0)
        delta = rest[:end]
        self._done += end
        self.content += delta
        deltas = [{"content": delta}] if delta else []
        if found >= 0:
            self._mode, self._separator, self._done = "calls", rest[end:found], self._done + (found - end)
            deltas += self._calls(final)
        return deltas

    def _calls(self, final: bool) -> list[dict]:
        deltas = []
        while True:
            rest = self._text[self._done:]
            current = self.calls[-1] if self.calls and not self.calls[-1].complete else None
            if current is None:  # between calls: the next head (after a separator), up to the name's end
                start = len(SEPARATOR) if self.calls and rest.startswith(SEPARATOR) else 0
                end = rest.find(NAME_END, start)
                if not rest[start:].startswith(HEAD) or end < 0:
                    break
                call = ToolCall(len(self.calls), call_id(), rest[start + len(HEAD):end])
                self.calls.append(call)
                self._done += end + len(NAME_END)
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                continue
            # In the arguments: compact JSON has no newline, so the first "}\n</tool_call>" ends them.
            end = rest.find(TAIL)
            if end >= 0:
                piece, current.complete = rest[:end], True
                self._done += end + len(TAIL)
            else:
                held = _held(rest, TAIL)
                piece = rest if final else rest[:len(rest) - held]
                if final and held and _is_json(current.arguments + rest[:-held]):  # whole, cut in the closing marker
                    piece, current.complete = rest[:-held], True
                self._done += len(rest) if current.complete else len(piece)
            if piece:
                current.arguments += piece
                deltas.append({"index": current.index, "function": {"arguments": piece}})
            if end < 0:
                break
        if final and self._done < len(self._text):  # an unfinished head (cut by max_tokens): content, not lost
            rest = (self._separator if not self.calls else "") + self._text[self._done:]
            self.content += rest
            deltas.append({"content": rest})
            self._done = len(self._text)
        return deltas


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (to hold back until it is decided)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def rendered_call(call: dict) -> dict:
    """An assistant message's tool call as the template takes it: the arguments as a JSON value, so the template's
    tojson writes them back as the model wrote them. ToolError when they are not JSON."""
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolError(f"a tool call's arguments are not JSON ({e}): {arguments[:200]!r}") from None
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": copy.deepcopy(arguments)}}

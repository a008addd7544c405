"""Tool calls (OpenAI function calling): the request's tools, tool_choice and tool messages, checked, and the
format of the answer's calls.

How a template writes calls, the grammar that allows only valid calls of the declared tools and the parser that
reads them back are per dialect (tool_dialects.py: Hermes / Qwen2.5, Qwen3, Mistral, Llama 3, and the fenced or
bare JSON that small models write instead); `tool_format` picks the dialect of a tokenizer's template. The grammar
goes through the structured-output path like any response_format (constraints.py): the same mask on p and q at
every position, forced text proposed as certain drafts.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

from .tool_dialects import STRICT_LAYOUT, ToolFormat, dialect_of, layout
from .tool_parser import ToolCall, ToolCallParser, call_id  # noqa: F401  (the parser's names, kept here)

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes dialect's call, as its template writes it:
HEAD = OPEN + '\n{"name": "'  # a call's text up to its name
NAME_END = '", "arguments": '  # between the name and the arguments
TAIL = "}\n" + CLOSE  # after the arguments
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


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


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template shows tools to the model and writes calls in a known dialect."""
    return dialect_of(tokenizer) is not None


def tool_format(tokenizer, tools: list[Tool], choice: str, parallel: bool = True, max_calls: int | None = None,
                strict: bool = False, answer: dict | None = None) -> ToolFormat:
    """The answer's format for these tools on this tokenizer's template (ToolError if it has no tool format):
    strict keeps only the template's own form (no fenced or bare JSON at the start of the answer); max_calls caps
    the calls of one answer (None: the number of tools); answer: a response_format's JSON Schema, which an answer
    that is no call follows (under auto)."""
    dialect = dialect_of(tokenizer)
    if dialect is None:
        raise ToolError("the chat template has no tool format", "tools")
    return ToolFormat.of(tokenizer, dialect, tools, choice, parallel, max_calls, strict, answer)


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
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(layout(schema, STRICT_LAYOUT)))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise ToolError(f"{where} is not a JSON Schema the grammar engine can enforce: {error.strip()[:500]}; fix "
                        f"the schema (JSON Schema draft 2020-12; add \"x-guidance\": {{\"lenient\": true}} to ignore "
                        f"keywords it does not implement)", where)
    return schema


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

"""Tool-call dialects: the forms in which chat templates write an assistant's calls, which one a tokenizer's
template uses, and the Lark grammar (llguidance) of an answer that allows only valid calls of the declared tools.

Every form is a JSON object {"name": <a declared tool>, "arguments" or "parameters": <arguments valid under the
tool's schema>}, wrapped the dialect's way:

    hermes   Qwen2.5, Hermes: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, calls joined by "\\n"
    qwen3    the same, after an optional <think>...</think> block (content)
    mistral  [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...], an optional "id" after the arguments
    llama3   {"name": "f", "parameters": {...}} as the whole answer (one call: the template renders no more)

and, unless strict, the start forms that models write instead of their template's (Qwen2.5-Coder-1.5B answers
its own template with a ```json block: the first token of `<tool_call>` has log-probability -23 there): at the
very start of the answer, a ```json fence or none around one call object, a list of them, or one in the double
braces of Qwen's system-prompt example, with "arguments" or "parameters" and any (bounded) whitespace.

Under tool_choice "auto" the model's own tokens decide whether an answer is a call: free text is any text that
neither contains the dialect's marker nor starts with a start form's opening up to a declared tool's name (so
ordinary JSON in an answer stays text); once a marker or such an opening is written, the rest is constrained to
valid calls. With a response_format as well (an agent with tools and a typed output), the answer under auto is
either calls or the JSON that format asks for, never free text. "required" allows calls only, a named function
one call of it. After a call comes another call or
the end; calls are capped (parallel_tool_calls false: one; else max_calls, by default the number of tools) and,
with more than one allowed, a call identical to an earlier one is refused (distinct_calls.py).

Adding a dialect: subclass Dialect, give it `detect` (does a template's rendering of a probe call look like
yours?) and `native` (its calls' grammar), and put it in DIALECTS before the ones it could be mistaken for.
"""

from __future__ import annotations

import dataclasses
import json
import random
import string
from dataclasses import dataclass

from .distinct_calls import DISTINCT_CALLS
from .tool_parser import THINK_CLOSE, THINK_OPEN, ToolCallParser, call_id
from .tool_patterns import FREE_LAYOUT, WS, Pattern, alt, lit, opt, seq, terminal

PROBE = "specdecode_probe_tool"
PROBE_ID = "a1b2c3d4e"  # 9 letters and digits: Mistral's templates refuse other ids
STRICT_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}  # jinja's tojson
FENCE = seq(lit("```"), opt(lit("json")), WS)
KINDS = {"object": lit(""), "list": seq(lit("["), WS), "double": seq(lit("{"), WS)}
ALL_SHAPES = tuple((fence, kind) for fence in (False, True) for kind in KINDS)
KEYS = ("arguments", "parameters")


def layout(schema: dict, defaults: dict) -> dict:
    """The schema with a JSON layout as llguidance's defaults (its own "x-guidance" wins)."""
    out = dict(schema)
    out.setdefault("type", "object")
    out["x-guidance"] = {**defaults, **(schema.get("x-guidance") or {})}
    return out


def _plain(schema: dict) -> dict:
    return {key: value for key, value in schema.items() if key != "x-guidance"}


def _refers(schema) -> bool:
    """Whether a schema uses "$ref" anywhere (to definitions that only resolve from its own root)."""
    if isinstance(schema, dict):
        return "$ref" in schema or any(_refers(v) for v in schema.values())
    return isinstance(schema, list) and any(_refers(v) for v in schema)


def opening(shapes, names: list[str]) -> Pattern:
    """The text that starts a start form's call, up to and including the quoted name of a declared tool."""
    return alt(*[seq(WS, FENCE if fence else lit(""), KINDS[kind], lit("{"), WS, lit('"name"'), WS, lit(":"), WS,
                     lit('"'), alt(*[lit(n) for n in names]), lit('"')) for fence, kind in shapes])


@dataclass(frozen=True)
class Dialect:
    """How one family of templates writes calls. marker: the text that opens calls after content (None: calls
    start the answer); max_calls: the most the template renders in one message (None: any)."""

    name: str = ""
    marker: str | None = None
    max_calls: int | None = None
    think: bool = False
    strict_shapes: tuple = ()  # the start forms that are the dialect's own (kept when strict)
    strict_keys: tuple = ("arguments",)
    hidden_shape: tuple | None = None  # the start form its calls read as where the marker is a special token

    def detect(self, tokenizer, written: str) -> "Dialect | None":
        """This dialect (fitted to the template) when `written`, the template's rendering of a probe call of
        {"x": 1}, is in its form; None otherwise."""
        raise NotImplementedError

    def native(self, tools, cap: int, terms: dict) -> list[str]:
        """Lark rules defining `native`, the calls in the template's own form ([] for none besides the start
        forms); args_i is the i-th tool's arguments in the template's layout."""
        return []

    def markers(self) -> list[str]:
        """Texts the grammar names as tokens where the vocabulary has them."""
        return [m for m in (self.marker,) if m]

    def shapes(self, strict: bool) -> tuple:
        return self.strict_shapes if strict else ALL_SHAPES

    def keys(self, strict: bool) -> tuple:
        return self.strict_keys if strict else KEYS

    def new_id(self) -> str:
        return call_id()


@dataclass(frozen=True)
class Hermes(Dialect):
    name: str = "hermes"
    marker: str = "<tool_call>"
    close: str = "</tool_call>"
    hidden_shape: tuple = (False, "object")

    def detect(self, tokenizer, written):
        return self if f'<tool_call>\n{{"name": "{PROBE}", "arguments": {{"x": 1}}}}\n</tool_call>' in written else None

    def native(self, tools, cap, terms):
        calls = "hcall" + (f' ("\\n" hcall){{0,{cap - 1}}}' if cap > 1 else "")
        rules = [f"native: {calls}", "hcall: " + " | ".join(f"hcall_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            head = json.dumps(f'\n{{"name": "{tool.name}", "arguments": ')
            rules.append(f'hcall_{i}: {terms[self.marker]} {head} args_{i} "}}\\n" {terms[self.close]}')
        return rules

    def markers(self):
        return [self.marker, self.close]


@dataclass(frozen=True)
class Qwen3(Hermes):
    """Hermes calls after a <think> block, where the template reasons and the vocabulary has the think tokens."""

    name: str = "qwen3"
    think: bool = True

    def detect(self, tokenizer, written):
        added = _added(tokenizer)
        thinks = THINK_OPEN in added and THINK_CLOSE in added and THINK_OPEN in tokenizer.chat_template
        return self if thinks and super().detect(tokenizer, written) else None

    def markers(self):
        return super().markers() + [THINK_OPEN, THINK_CLOSE]


@dataclass(frozen=True)
class Mistral(Dialect):
    name: str = "mistral"
    marker: str = "[TOOL_CALLS]"
    gap: str = " "  # between the marker and the list, as the template writes it
    hidden_shape: tuple = (False, "list")

    def detect(self, tokenizer, written):
        call = f'{{"name": "{PROBE}", "arguments": {{"x": 1}}'
        at = written.find(self.marker)
        end = written.find("[" + call, at)
        return dataclasses.replace(self, gap=written[at + len(self.marker):end]) if 0 <= at < end else None

    def native(self, tools, cap, terms):
        more = f' (", " mcall){{0,{cap - 1}}}' if cap > 1 else ""
        rules = [f'native: {terms[self.marker]} {json.dumps(self.gap + "[")} mcall{more} "]"',
                 "mcall: " + " | ".join(f"mcall_{i}" for i in range(len(tools))),
                 'MISTRAL_ID: /, "id": "[A-Za-z0-9]{9}"/']
        for i, tool in enumerate(tools):
            head = json.dumps(f'{{"name": "{tool.name}", "arguments": ')
            rules.append(f'mcall_{i}: {head} args_{i} MISTRAL_ID? "}}"')
        return rules

    def new_id(self) -> str:  # the template refuses ids that are not 9 letters and digits
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass(frozen=True)
class Llama3(Dialect):
    """The whole answer is one call object: the template's own form is a start form."""

    name: str = "llama3"
    max_calls: int = 1  # the template raises on a message with two calls
    strict_shapes: tuple = ((False, "object"),)
    strict_keys: tuple = ("parameters",)

    def detect(self, tokenizer, written):
        return self if f'{{"name": "{PROBE}", "parameters": {{"x": 1}}}}' in written else None


DIALECTS: list[Dialect] = [Qwen3(), Hermes(), Mistral(), Llama3()]  # the first whose probe matches wins
_FOUND: dict[tuple, Dialect | None] = {}  # by template and whether the vocabulary has the think tokens


def dialect_of(tokenizer) -> Dialect | None:
    """The dialect the tokenizer's chat template writes calls in (a probe tool shown, a probe call rendered),
    None when it shows no tools or writes calls in no known form; found once per template."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    key = (template, THINK_OPEN in _added(tokenizer) and THINK_CLOSE in _added(tokenizer))
    if key not in _FOUND:
        written = _written(tokenizer)
        _FOUND[key] = next((d for d in (x.detect(tokenizer, written) for x in DIALECTS) if d), None) \
            if written else None
    return _FOUND[key]


def _written(tokenizer) -> str | None:
    tool = {"type": "function", "function": {"name": PROBE, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}
    call = {"id": PROBE_ID, "type": "function", "function": {"name": PROBE, "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        shown = tokenizer.apply_chat_template(messages[:1], tools=[tool], tokenize=False, add_generation_prompt=True)
        written = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False)
    except Exception:  # a template that fails on tools or tool calls has no tool format
        return None
    return written if PROBE in shown else None


def _added(tokenizer) -> dict:
    return tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}


def _hidden(tokenizer, marker: str) -> bool:
    """Whether the answer's text, decoded without special tokens as the server decodes it, loses the marker."""
    added = _added(tokenizer).get(marker)
    return added is not None and not tokenizer.decode([added], skip_special_tokens=True)


def marker_term(tokenizer, text: str) -> str:
    """A marker as a Lark term: the token of its own where the vocabulary has one (an added token, which the
    grammar engine reads as special: `<[151657]>`), its text otherwise."""
    added = _added(tokenizer).get(text)
    return f"<[{added}]>" if added is not None else json.dumps(text)


@dataclass(frozen=True)
class ToolFormat:
    """A request's tools as one dialect writes them: the answer's grammar, and the parser that reads it back.
    choice: "auto", "required" or a tool's name; max_calls: the cap on calls in one answer; hidden: the marker
    is a special token, which the answer's text (decoded without special tokens) does not show (Mistral's
    [TOOL_CALLS]): its calls are read as the start form they look like, and no text may come before them."""

    dialect: Dialect
    tools: tuple
    choice: str
    max_calls: int
    strict: bool
    terms: tuple  # (marker text, its Lark term) for this tokenizer
    hidden: bool = False
    answer: str | None = None  # auto with a response_format: the JSON Schema (text) a content answer follows

    @classmethod
    def of(cls, tokenizer, dialect: Dialect, tools, choice: str, parallel: bool = True,
           max_calls: int | None = None, strict: bool = False, answer: dict | None = None) -> "ToolFormat":
        named = choice not in ("auto", "required")
        allowed = tuple(t for t in tools if t.name == choice) if named else tuple(tools)
        cap = 1 if named or not parallel else (max_calls or len(tools))
        cap = min(cap, dialect.max_calls or cap)
        terms = tuple((m, marker_term(tokenizer, m)) for m in dialect.markers())
        hidden = dialect.marker is not None and _hidden(tokenizer, dialect.marker)
        # the layout of the start forms (bounded free whitespace): a call object may be written in it as well
        answer = json.dumps(layout(answer, FREE_LAYOUT)) if answer is not None and choice == "auto" else None
        return cls(dialect, allowed, choice, cap, strict, terms, hidden, answer)

    @property
    def marker_is_token(self) -> bool:
        return self.dialect.marker is not None and dict(self.terms)[self.dialect.marker].startswith("<[")

    def grammar(self) -> str:
        terms = dict(self.terms)
        native = self.dialect.native(self.tools, self.max_calls, terms)
        for i, tool in enumerate(self.tools if native else ()):
            native.append(f"args_{i}: %json {json.dumps(layout(tool.parameters, STRICT_LAYOUT))}")
        shapes = self.dialect.shapes(self.strict)
        answer = []
        if self.answer:  # the grammar engine's lexer cannot take an opening and the answer's JSON both from "{":
            schema = json.loads(self.answer)
            clash = ("list",) if schema["type"] == "array" else ("object", "double")
            answer = [f"answer: %json {json.dumps(self._answer(schema, (False, 'object') in shapes))}"]
            shapes = tuple((fence, kind) for fence, kind in shapes if fence or kind not in clash)
        forms = self._forms(shapes) if shapes else []
        # auto: free text, or with a response_format the answer's JSON (no text before a call then)
        body = [] if self.choice != "auto" else ["answer"] if self.answer else ["TEXT"]
        if native:
            text_first = body == ["TEXT"] and self.marker_is_token and not self.hidden
            body.append("TEXT? native" if text_first else "native")
        if forms:
            body.append("forms")
        head = [DISTINCT_CALLS] if self.max_calls > 1 else []
        start = "start: think? body" if self.dialect.think else "start: body"
        return "\n".join(head + [start, "body: " + " | ".join(body), *native, *forms, *self._think(terms),
                                 *(self._text() if body[:1] == ["TEXT"] else []),
                                 *answer])

    def _answer(self, answer: dict, bare_calls: bool) -> dict:
        """The JSON an answer under auto with a response_format may be: that format's, or (bare_calls) a call
        object as a start form writes it, which the parser reads as a call. Tools whose schemas refer to their own
        definitions are left to the other forms (their references would not resolve here)."""
        calls = [{"type": "object", "properties": {"name": {"const": tool.name}, key: _plain(tool.parameters)},
                  "required": ["name", key], "additionalProperties": False}
                 for tool in (self.tools if bare_calls else ()) if not _refers(tool.parameters)
                 for key in self.dialect.keys(self.strict)]
        if not calls:
            return answer
        top = {key: answer.pop(key) for key in ("$defs", "definitions", "x-guidance") if key in answer}
        return {"anyOf": [answer, *calls], **top}  # the answer's definitions and layout stay at the root

    def parser(self) -> ToolCallParser:
        shapes = self._read_shapes()
        opening_ = opening(shapes, [t.name for t in self.tools]) if shapes else None
        return ToolCallParser(self.dialect.marker, opening_, self.dialect.think, self.dialect.new_id)

    def _read_shapes(self) -> tuple:
        """The start forms the parser reads as calls (and free text may not start with)."""
        shapes = self.dialect.shapes(self.strict)
        hidden = self.dialect.hidden_shape if self.hidden else None
        return shapes + ((hidden,) if hidden and hidden not in shapes else ())

    def _forms(self, shapes) -> list[str]:
        """The start forms: an opening (one terminal, up to the tool's quoted name, so that free text dies exactly
        where a call begins), the rest of the call, the list's other items, the closing brackets and fence."""
        keys = alt(*[lit(f'"{k}"') for k in self.dialect.keys(self.strict)])
        rules = [f"FSEP: {terminal(seq(WS, lit(','), WS, keys, WS, lit(':'), WS))}",
                 f"FEND: {terminal(seq(WS, lit('}')))}", f"LEND: {terminal(seq(WS, lit(']')))}",
                 f"FENCE_END: {terminal(seq(WS, lit('```')))}"]
        items, forms = [], []
        for i, tool in enumerate(self.tools):
            rules.append(f"fargs_{i}: %json {json.dumps(layout(tool.parameters, FREE_LAYOUT))}")
            rules.append(f"fcall_{i}: FSEP fargs_{i} FEND")
            rules.append(f"ITEM_{i}: " + terminal(seq(WS, lit(","), WS, lit("{"), WS, lit('"name"'), WS, lit(":"),
                                                      WS, lit(f'"{tool.name}"'))))
            items.append(f"ITEM_{i} fcall_{i}")
            for s, (fence, kind) in enumerate(shapes):
                rules.append(f"F{s}_{i}: {terminal(opening([(fence, kind)], [tool.name]))}")
                tail = {"object": "", "double": " FEND", "list": (" item{0,%d}" % (self.max_calls - 1)
                                                                  if self.max_calls > 1 else "") + " LEND"}[kind]
                rules.append(f"form_{s}_{i}: F{s}_{i} fcall_{i}{tail}{' FENCE_END' if fence else ''}")
                forms.append(f"form_{s}_{i}")
        return ["forms: " + " | ".join(forms), "item: " + " | ".join(items), *rules]

    def _think(self, terms: dict) -> list[str]:
        if not self.dialect.think:
            return []
        return [f"think: {terms[THINK_OPEN]} THINK_TEXT? {terms[THINK_CLOSE]} THINK_GAP?",
                "THINK_TEXT: /(?s:.*)/", "THINK_GAP: /\\n{1,2}/"]

    def _text(self) -> list[str]:
        """Free text: anything without the marker, and (with start forms) not starting with their opening."""
        parts = ["/(?s:.*)/"]
        if self.dialect.marker:
            parts.append(f"~/(?s:.*){lit(self.dialect.marker).full}(?s:.*)/")
        shapes = self._read_shapes()
        if shapes:
            parts.append(f"~/{opening(shapes, [t.name for t in self.tools]).full}(?s:.*)/")
        return ["TEXT: " + " & ".join(parts)]

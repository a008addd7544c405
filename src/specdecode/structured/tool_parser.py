"""Reading tool calls back out of an answer's text, whole or as it streams, in any dialect of tool_dialects.py.

An answer is content, calls, or content and then calls. Every dialect writes a call as a JSON object whose first
key is "name" and whose second is "arguments" (or "parameters"), inside some wrapping (`<tool_call>` blocks,
`[TOOL_CALLS] [...]`, a ```json fence, a list, Qwen's double braces): once the answer is in its calls, the parser
finds each object's head and reads the arguments to the end of their JSON value, and the wrapping in between is
never content. Where the calls start:

- at a marker (`<tool_call>`, `[TOOL_CALLS]`) anywhere: the text before it is content (less the newline the
  template writes between the two, so the history renders back as the model wrote it);
- at the very start of the answer, with an opening of the dialect's start forms (a fence, a bare object or list
  naming a declared tool): the grammar lets no other text begin that way, so such an answer is calls.

While streaming, text that may still become a marker or an opening is held back until it is decided. A call cut by
max_tokens is returned as far as its arguments got (finish_reason "length"), and an unfinished head is dropped:
nothing of a call is ever returned as content.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from .tool_patterns import WS, Pattern, alt, lit, seq

NAME = Pattern("[A-Za-z0-9_-]{1,64}", "[A-Za-z0-9_-]{0,64}")


def _head(name: Pattern) -> Pattern:
    """A call object's text up to its arguments."""
    return seq(lit("{"), WS, lit('"name"'), WS, lit(":"), WS, lit('"'), name, lit('"'), WS, lit(","), WS,
               alt(lit('"arguments"'), lit('"parameters"')), WS, lit(":"), WS)


HEAD = _head(NAME)
_HEAD = re.compile(_head(Pattern(f"(?P<name>{NAME.full})", NAME.prefix)).full)
_WRAPPING = r"(?:<tool_call>|</tool_call>|\[TOOL_CALLS\]|```(?:json)?|[\s\[\]{},])*"
_CUT_HEAD = re.compile(_WRAPPING + HEAD.prefix)  # the start of a call, cut before its arguments
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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


class _Arguments:
    """A JSON value read piece by piece: where it ends (its brackets' depth outside strings), and its text in the
    layout of jinja's tojson (", " and ": ", no other whitespace outside strings), the layout the templates render
    a call's arguments back in: a start form's pretty-printed arguments come back as the template will show them."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> tuple[int | None, str]:
        """(the index just past the value's end in `text`, or None if it goes on after it; the text read, laid
        out)."""
        out = []
        for i, char in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char.isspace():
                continue
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
            out.append(char + " " if not self.in_string and char in ",:" else char)
            if self.depth == 0 and not self.in_string and char in "}]":
                return i + 1, "".join(out)
        return None, "".join(out)


@dataclass
class ToolCallParser:
    """One answer's reader. feed() returns the deltas to stream (OpenAI's shape: {"content": ...} or a call's
    {"index", "id", "type", "function": {"name", "arguments"}} then its {"index", "function": {"arguments"}}
    pieces), finish() the rest; whole answers go through the same two calls, so a streamed answer assembles to
    the whole one.

    marker: the text that opens calls after content (None: the dialect has none); opening: the start forms'
    opening (None: none); think: the answer may open with a <think> block (content); new_id: the calls' ids."""

    marker: str | None = "<tool_call>"
    opening: Pattern | None = None
    think: bool = False
    new_id: Callable[[], str] = call_id
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _text: str = ""  # everything fed so far
    _done: int = 0  # characters of _text already turned into deltas
    _mode: str = ""  # "think", "start", "content", then "calls" from a call's opening on
    _args: _Arguments | None = None  # the arguments being read
    _separator: str = ""  # the newline between the content and the first call, not the content's

    def __post_init__(self):
        self._mode = "think" if self.think else "start"
        self._full = re.compile(self.opening.full) if self.opening else None
        self._prefix = re.compile(self.opening.prefix) if self.opening else None

    def feed(self, text: str) -> list[dict]:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict]:
        deltas: list[dict] = []
        if self._mode == "think":
            deltas += self._think(final)
        if self._mode == "start":
            self._start(final)
        if self._mode == "content":
            deltas += self._content(final)
        if self._mode == "calls":
            deltas += self._calls(final)
        return deltas

    def _think(self, final: bool) -> list[dict]:
        """A leading <think> block is content; the start of the answer proper is after it."""
        rest = self._text[self._done:]
        if not final and THINK_OPEN.startswith(rest):
            return []  # may still open one
        if not rest.startswith(THINK_OPEN):
            self._mode = "start"
            return []
        end = rest.find(THINK_CLOSE)
        if end < 0 and not final:
            return self._emit_content(len(rest) - _held(rest, THINK_CLOSE))
        self._mode = "start"
        return self._emit_content(len(rest) if end < 0 else end + len(THINK_CLOSE))

    def _start(self, final: bool) -> None:
        """At the start of the answer an opening of the start forms makes it calls; text that may still become one
        is held back."""
        rest = self._text[self._done:]
        if self._full is None or not rest:
            self._mode = "content" if self._full is None or final else "start"
        elif self._full.match(rest):
            self._mode = "calls"
        elif final and self._prefix.fullmatch(rest) and '"name"' in rest:
            self._done = len(self._text)  # a call cut in its opening: not content
        elif final or not self._prefix.fullmatch(rest):
            self._mode = "content"

    def _content(self, final: bool) -> list[dict]:
        rest = self._text[self._done:]
        found = rest.find(self.marker) if self.marker else -1
        if found < 0:  # content so far: all of it, but an end that may still become "\n" + marker
            held = 0 if final or not self.marker else max(_held(rest, "\n" + self.marker), _held(rest, self.marker))
            return self._emit_content(len(rest) - held)
        end = found - (1 if rest[:found].endswith("\n") else 0)
        deltas = self._emit_content(end)
        self._separator = rest[end:found]
        self._done += found - end
        self._mode = "calls"
        return deltas

    def _emit_content(self, end: int) -> list[dict]:
        delta = self._text[self._done:self._done + end]
        self._done += end
        self.content += delta
        return [{"content": delta}] if delta else []

    def _calls(self, final: bool) -> list[dict]:
        deltas: list[dict] = []
        while True:
            rest = self._text[self._done:]
            if self._args is None:  # between calls: the next head, up to its arguments
                head = _HEAD.search(rest)
                if head is None:
                    break
                call = ToolCall(len(self.calls), self.new_id(), head.group("name"))
                self.calls.append(call)
                self._args = _Arguments()
                self._done += head.end()
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                continue
            call = self.calls[-1]
            end, piece = self._args.scan(rest)
            self._done += len(rest) if end is None else end
            if piece:
                call.arguments += piece
                deltas.append({"index": call.index, "function": {"arguments": piece}})
            if end is None:
                break
            call.complete, self._args = True, None
        if final:
            deltas += self._leftover()
        return deltas

    def _leftover(self) -> list[dict]:
        """At the end, what follows the last call: wrapping or a cut head (dropped), or, before any call, text
        that turned out not to open one (content, as it was written)."""
        rest = self._text[self._done:]
        self._done = len(self._text)
        if not rest or self.calls or _CUT_HEAD.fullmatch(rest):
            return []
        rest = self._separator + rest
        self.content += rest
        return [{"content": rest}]


def _held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (to hold back until it is decided)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

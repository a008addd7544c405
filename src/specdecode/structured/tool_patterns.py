"""Regular expressions written once and read three ways: as Lark terminals for llguidance (the grammar that
constrains a tool call's opening), as Python regexes for the parser that reads the same text back, and as the
regex of every *prefix* of a match (what the streaming parser holds back while text may still become a call).

Only the syntax Rust's regex crate (llguidance) and Python's `re` share is written: escaped literals, `[ \\t]`
classes, bounded repetition and non-capturing groups.
"""

from __future__ import annotations

from dataclasses import dataclass

_META = set("\\.+*?()|[]{}^$")
# Whitespace between the pieces of a call: bounded, so a model that would rather write something the grammar
# refuses cannot run away into blank lines (SGLang's one-call cap loops on whitespace: sgl-project/sglang#17998).
WS_REGEX = r"[ \t]{0,2}(?:\n[ \t]{0,24})?"
# llguidance's JSON options for JSON laid out as the model writes it, within that bound (indented or not)
FREE_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": WS_REGEX}


@dataclass(frozen=True)
class Pattern:
    full: str  # matches the pattern's strings
    prefix: str  # matches every prefix of them (the empty string included)


def lit(text: str) -> Pattern:
    escaped = [_escape(c) for c in text]
    prefix = ""
    for piece in reversed(escaped):  # "abc" -> (?:a(?:b(?:c)?)?)?
        prefix = f"(?:{piece}{prefix})?"
    return Pattern("".join(escaped), prefix)


def seq(*parts: Pattern) -> Pattern:
    """The parts one after the other; a prefix ends inside one of them."""
    parts = tuple(p for p in parts if p.full)
    full = "".join(p.full for p in parts)
    prefixes = ["".join(p.full for p in parts[:i]) + parts[i].prefix for i in range(len(parts))]
    return Pattern(full, "(?:" + "|".join(prefixes or [""]) + ")")


def alt(*parts: Pattern) -> Pattern:
    return Pattern("(?:" + "|".join(p.full for p in parts) + ")", "(?:" + "|".join(p.prefix for p in parts) + ")")


def opt(part: Pattern) -> Pattern:
    return Pattern(f"(?:{part.full})?", part.prefix)


WS = Pattern(WS_REGEX, WS_REGEX)  # every prefix of bounded whitespace is bounded whitespace


def terminal(pattern: Pattern) -> str:
    """The pattern as a Lark regex literal."""
    if "/" in pattern.full:
        raise ValueError(f"a terminal cannot hold '/': {pattern.full}")
    return f"/{pattern.full}/"


def _escape(char: str) -> str:
    if char in _META:
        return "\\" + char
    return {"\n": "\\n", "\t": "\\t"}.get(char, char)

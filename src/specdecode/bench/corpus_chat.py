"""`specdecode bench serve --workload corpus`: the chat questions, of six kinds: short factual answers, explanations,
code from a description, a translation, a summary of a long text, and a follow-up turn that quotes the previous
answer (two requests: the second's messages hold the first answer as the assistant's message and ask about it).

The short questions are the generic ones of speculative-decoding benchmarks' categories; the texts to translate and
to summarize are read at run time from the standard library by a rule (docstrings of its top-level modules, in
SHA-256 order of the module's file name), so no text of them is chosen here either.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CHAT_KINDS = ("factual", "explanation", "code", "translation", "summary", "follow-up")
SUMMARY_CHARS = (1500, 6000)  # a module docstring this long is the long text to summarize
TRANSLATION_CHARS = (150, 500)  # a function docstring's first paragraph this long is the text to translate
TRANSLATIONS = ("French", "German")


@dataclass(frozen=True)
class ChatTask:
    kind: str
    name: str
    turns: tuple[Callable[[list[str]], list[dict]], ...]  # each turn's messages, given the earlier turns' answers

    def turn_kind(self, turn: int) -> str:
        """The kind a turn's timings are reported under: a two-turn task's first turn apart from its follow-up."""
        return self.kind if turn == len(self.turns) - 1 else f"{self.kind}: first turn"


def _user(text: str) -> Callable[[list[str]], list[dict]]:
    return lambda _answers: [{"role": "user", "content": text}]


def _quoting(first: str, second: str) -> tuple[Callable[[list[str]], list[dict]], ...]:
    def follow_up(answers: list[str]) -> list[dict]:
        return [{"role": "user", "content": first}, {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": second}]
    return (_user(first), follow_up)


FACTUAL = ("What is the capital of Australia? Answer in one short sentence.",
           "Which planet of the solar system is the largest? Answer in one short sentence.",
           "Who wrote the novel Pride and Prejudice? Answer in one short sentence.")
EXPLANATION = ("Explain in one paragraph why the sky is blue.",
               "Explain in one paragraph the difference between a process and a thread.")
CODE = ("Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals given as "
        "(start, end) pairs and returns them sorted. Output only the code.",
        "Write a Python class `LRUCache` with a capacity, and get(key) and put(key, value) methods that run in O(1). "
        "Output only the code.")
FOLLOW_UPS = (("Write a Python function that tells whether a string is a palindrome, ignoring case, spaces and "
               "punctuation.",
               "Repeat that function exactly as you wrote it, adding a docstring and a comment on each line; output "
               "the whole function again."),
              ("Give three short tips for writing clear commit messages.",
               "Quote your second tip word for word, then explain it in more detail."))


def _stdlib_modules() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())


def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def long_texts(count: int = 2) -> list[tuple[str, str]]:
    """(module, docstring) of the first `count` top-level standard-library modules whose docstring is 1,500-6,000
    characters long."""
    found = []
    for path in _stdlib_modules():
        tree = _tree(path)
        text = tree and ast.get_docstring(tree)
        if text and SUMMARY_CHARS[0] <= len(text) <= SUMMARY_CHARS[1]:
            found.append((path.name, text))
            if len(found) == count:
                break
    return found


def prose_paragraphs(count: int = 2) -> list[tuple[str, str]]:
    """(module.function, paragraph) of the first `count` public functions' docstrings (the modules in turn, one a
    module) whose first paragraph is prose of 150-500 characters (no doctest, no code, no table)."""
    found = []
    for path in _stdlib_modules():
        tree = _tree(path)
        for node in tree.body if tree else ():
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            first = " ".join(doc.split("\n\n")[0].split())
            if TRANSLATION_CHARS[0] <= len(first) <= TRANSLATION_CHARS[1] and ">>>" not in doc and \
                    not any(mark in first for mark in ("`", "{", "|", "==", "->", "::")):
                found.append((f"{path.stem}.{node.name}", first))
                break
        if len(found) == count:
            break
    return found


def chat_tasks(kinds: tuple[str, ...] = CHAT_KINDS) -> list[ChatTask]:
    """The chat questions of the kinds asked, kind after kind in CHAT_KINDS' order."""
    unknown = set(kinds) - set(CHAT_KINDS)
    if unknown or not kinds:
        raise ValueError(f"unknown chat kind(s) {sorted(unknown)}: use {', '.join(CHAT_KINDS)}")
    made: dict[str, list[ChatTask]] = {
        "factual": [ChatTask("factual", f"factual {i + 1}", (_user(q),)) for i, q in enumerate(FACTUAL)],
        "explanation": [ChatTask("explanation", f"explanation {i + 1}", (_user(q),))
                        for i, q in enumerate(EXPLANATION)],
        "code": [ChatTask("code", f"code {i + 1}", (_user(q),)) for i, q in enumerate(CODE)],
        "follow-up": [ChatTask("follow-up", f"follow-up {i + 1}", _quoting(*pair)) for i, pair in
                      enumerate(FOLLOW_UPS)]}
    if "translation" in kinds:
        made["translation"] = [
            ChatTask("translation", f"translation {where}", (_user(
                f"Translate this text into {language}. Output only the translation.\n\n{text}"),))
            for (where, text), language in zip(prose_paragraphs(len(TRANSLATIONS)), TRANSLATIONS)]
    if "summary" in kinds:
        made["summary"] = [ChatTask("summary", f"summary {where}", (_user(
            f"Summarize the following text in three sentences.\n\n{text}"),)) for where, text in long_texts()]
    return [task for kind in CHAT_KINDS if kind in kinds for task in made[kind]]

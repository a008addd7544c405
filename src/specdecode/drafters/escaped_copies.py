"""Escaped copies: the texts of a conversation as a JSON string holds them, for the suffix drafter to copy.

An agent reads a file through a tool and writes it back, changed, through another. The tool result sits in the
prompt as raw text (Qwen's template: <tool_response>...</tool_response>), but the write call's arguments are JSON,
where the same text is escaped (newlines as \\n, quotes as \\", backslashes doubled): its tokens differ, and the
suffix drafter, which copies tokens, finds no match. So for a request whose answer is JSON (tools, a json
response_format) the server adds to the suffix history, under the key of the row the request becomes and before
that row joins (so its mark includes them), the tokens of each tool and user message's text as JSON escapes it
(json.dumps with ensure_ascii=False, without the quotes: models write non-ASCII text as it is). A text that escaping
leaves unchanged is skipped: its tokens are in the prompt already.

An agent re-sends its whole history every turn: a text is added once while its document lives in the history
(a bounded map from the key and the escaped text's hash to the document's id), and seeing it again keeps that
document from being evicted first. Drafts stay deterministic, whatever they copy: the output is exactly the
target's.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Iterable

from .suffix import SuffixDrafter

MAX_REMEMBERED = 4096  # escaped texts whose document ids are kept (least recently seen forgotten first)
COPIED_ROLES = ("tool", "user")  # whose texts an answer copies: tool results, and code pasted by the user


def escaped(text: str) -> str | None:
    """The text as it stands inside a JSON string, quotes left out; None where escaping changes nothing."""
    inner = json.dumps(text, ensure_ascii=False)[1:-1]
    return inner if inner != text else None


def escaped_texts(messages: Iterable[tuple[str, str]]) -> list[str]:
    """The distinct escaped texts of (role, text) messages of the copied roles, in order."""
    found = (escaped(text) for role, text in messages if role in COPIED_ROLES and text)
    return list(dict.fromkeys(t for t in found if t))


def suffix_of(drafter) -> SuffixDrafter | None:
    """The suffix drafter with a history inside a drafter (itself, or suffix+MODEL's suffix half); None if none."""
    suffix = drafter if isinstance(drafter, SuffixDrafter) else getattr(drafter, "suffix", None)
    if isinstance(suffix, SuffixDrafter) and suffix.history.max_tokens:
        return suffix
    return None


class EscapedCopies:
    """Adds escaped texts to a drafter's suffix history, each once while its document lives (see the module doc).

    tokenizer: the model's (texts are encoded without special tokens). A drafter without a suffix history makes
    add() do nothing."""

    def __init__(self, drafter, tokenizer, max_remembered: int = MAX_REMEMBERED):
        self.suffix = suffix_of(drafter)
        self.tokenizer = tokenizer
        self.max_remembered = max_remembered
        self.added = 0  # documents added
        self._docs: OrderedDict = OrderedDict()  # (key, digest) -> document id, least recently seen first
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.suffix is not None

    def add(self, texts: Iterable[str]) -> int:
        """Add the texts not held yet under the key of the next row to join; how many were added."""
        if self.suffix is None:
            return 0
        history, key, added = self.suffix.history, self.suffix.next_key, 0
        with self._lock:
            for text in texts:
                name = (key, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest())
                doc_id = self._docs.get(name)
                if doc_id is not None and history.touch(doc_id):
                    self._docs.move_to_end(name)
                    continue
                try:
                    tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                except Exception:  # e.g. a lone surrogate escaping kept: no copy, and the request goes on
                    continue
                doc_id = history.add(tokens, key)
                if doc_id is None:
                    continue
                self._docs[name] = doc_id
                self._docs.move_to_end(name)
                added += 1
                while len(self._docs) > self.max_remembered:
                    self._docs.popitem(last=False)
        self.added += added
        return added

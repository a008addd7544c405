"""Incremental detokenization: the text each new token adds, without re-decoding the whole row each time."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing token list; holds back text while a multi-byte character is still incomplete.

    Decoding a token alone can differ from its text in context (leading spaces, byte-level pieces), so each
    call decodes a short window that starts a few tokens back and keeps only what is new. `text` is the
    continuation as it reads after the prompt, and it is what the engine returns as the row's text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_ids[-4:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self._rust = _rust_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            return self._rust(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release what is held back (an incomplete character at the very end), when the row finishes."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        delta = self._decode(self.tokens[self.prefix_offset:])[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def _rust_decoder(tokenizer):
    """The `tokenizers` library's own decode where transformers' decode is exactly it (a fast tokenizer whose decode
    and _decode are not overridden, asked not to clean up spaces): two calls per token through transformers' wrapper
    cost ~40 us a token; None otherwise."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode \
            or kind._decode is not TokenizersBackend._decode or not hasattr(backend, "decode"):
        return None
    return backend.decode


def find_stop(text: str, delta: str | None, stops) -> int | None:
    """Index in text where the earliest stop string begins, searching only where the new delta can reach."""
    if not delta:
        return None
    hits = []
    for s in stops:
        pos = text.find(s, max(0, len(text) - len(delta) - len(s) + 1))
        if pos >= 0:
            hits.append(pos)
    return min(hits) if hits else None

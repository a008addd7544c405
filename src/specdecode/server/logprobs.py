"""Log-probabilities in OpenAI's two shapes, from the engine's per-token (logprob, top (id, logprob) pairs).

/v1/completions (the legacy shape): {"tokens": [text], "token_logprobs": [float], "top_logprobs": [{text: float}],
"text_offset": [int]}; OpenAI always lists the sampled token among a position's top_logprobs, so one may hold N + 1.
/v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": null}, exactly N alternatives.

A token is named by its own text, which `TokenTexts` reads from the tokenizer's vocabulary (see there).
"""

from __future__ import annotations

import json
import math
import re

from ..text.token_bridge import byte_level_alphabet
from .schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf (a token top-k, top-p or the grammar excluded): JSON has no -inf
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces
_SPM_SPACE = "\u2581"  # SentencePiece's word-boundary mark, a space in the text


def _decoder_kinds(tokenizer) -> set[str]:
    """The types of a fast tokenizer's decoders ("ByteLevel", "ByteFallback", "Metaspace", ...); empty if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    kinds, todo = set(), [decoder]
    while todo:
        node = todo.pop()
        kinds.add(node.get("type"))
        todo += node.get("decoders") or []
    return kinds


class TokenTexts:
    """Each token id's own bytes and text, as logprobs name tokens.

    bytes: the token's raw bytes where the vocabulary says what they are: byte-level BPE (GPT-2, Qwen, Llama 3),
    whose pieces map back to bytes one character each; SentencePiece (Llama 2, Gemma), whose "<0xE2>" pieces are a
    byte and whose "▁" is a space; added tokens (<|im_end|>) their text. A piece in neither form is decoded alone
    and its UTF-8 taken. text: those bytes as UTF-8, so a token that holds part of a character reads as the
    replacement character U+FFFD (its bytes field still holds the real bytes, as OpenAI's does).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        self.sentencepiece = bool(kinds & {"ByteFallback", "Metaspace"})
        self.added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __len__(self) -> int:
        return len(self._cache)  # token ids named so far: at most the vocabulary

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token id."""
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self.byte_level:
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if isinstance(piece, str) and self.sentencepiece:
            byte = _SPM_BYTE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace(_SPM_SPACE, " ").encode("utf-8")
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text.encode("utf-8")


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class CompletionLogprobBuilder:
    """The legacy shape for one choice, token by token; text_offset counts from the start of the choice's text."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.offset = 0

    def add(self, token_ids, logprobs, tops) -> CompletionLogprobs:
        """The entries of these tokens (a whole choice, or a chunk's tokens): tops[i] is position i's (id, logprob)
        pairs, best first; None or () when only the sampled token's logprob was asked for."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token, logprob, top in zip(token_ids, logprobs, tops):
            text = self.texts(token)[0]
            listed: dict[str, float] = {}
            for alternative, value in (*(top or ()), (token, logprob)):  # the sampled token last: listed if new
                listed.setdefault(self.texts(alternative)[0], finite(value))
            out.tokens.append(text)
            out.token_logprobs.append(finite(logprob))
            out.top_logprobs.append(listed)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(texts: TokenTexts, token_ids, logprobs, tops) -> ChatLogprobs:
    """The chat shape of these tokens (a whole choice, or a chunk's tokens)."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = texts(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(raw)}

    content = [TokenLogprob(**entry(token, logprob), top_logprobs=[TopLogprob(**entry(*a)) for a in top or ()])
               for token, logprob, top in zip(token_ids, logprobs, tops)]
    return ChatLogprobs(content=content)

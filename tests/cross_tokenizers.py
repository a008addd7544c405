"""Tokenizers that differ from the fixture's (conftest.build_tokenizer, byte-level BPE), for drafts across tokenizers:
a SentencePiece-style one built here (word-boundary marks, byte-fallback pieces, a <bos> it puts before every text,
as Gemma's), trained to split the fixture's tokens otherwise; and the real ones shipped in the GGUFs, where prepared."""

from __future__ import annotations

import functools
import json

import pytest

from conftest import CORPUS

SPACE = "\u2581"


def build_metaspace_tokenizer(vocab_size: int = 200):
    """A BPE with SentencePiece's conventions: spaces as "▁" attached to the next word, "<0xNN>" pieces for bytes it
    has no token for, <bos> put before every text, ids unrelated to the fixture's. Trained on reversed text and
    "rra rar rr" runs, so it merges "rr" and "ra" where the fixture's tokenizer merges "ar" and "arr"."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", SPACE)
    bpe.pre_tokenizer = pre_tokenizers.Split(SPACE, behavior="merged_with_next")
    alphabet = sorted(set("".join(CORPUS).replace(" ", SPACE)))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    bpe.train_from_iterator(([" rra rar arr ra r a rr " * 3] + [c[::-1] for c in CORPUS]) * 4, trainer)
    data = json.loads(bpe.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces: what a text outside the trained alphabet is spelled with
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def real_tokenizer(name: str):
    """A built-in model's tokenizer as load_model gives it (built from its GGUF once); skips the test where the
    model is not installed."""
    from specdecode.models import catalog

    info = catalog.get_model_info(name)
    if not info.installed:
        pytest.skip(f"{name} is not installed: {info.pip_command}")
    return _load_tokenizer(name)


@functools.lru_cache(maxsize=None)
def _load_tokenizer(name: str):  # Gemma's 262k vocabulary takes ~10 s to load: once per session
    from transformers import AutoTokenizer

    from specdecode.models.prepare import prepare_gguf

    return AutoTokenizer.from_pretrained(str(prepare_gguf(name)[1]))

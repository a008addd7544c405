"""The vocabulary that target and draft share, and the check that they share one at all.

Models of one family often pad their embedding matrices to different sizes (Qwen2.5: 151936 rows for the
small models, 152064 for 7B) around the same tokenizer. The padded rows are never real tokens, so both
models are restricted to the tokenizer's vocabulary: p and q then live on the same set of tokens.
"""

from __future__ import annotations

import torch


class VocabularyMismatchError(ValueError):
    pass


def embedding_rows(model) -> int | None:
    """Rows of a model's output layer; a backend's or drafter's vocab_size; None for a drafter with no model."""
    if not hasattr(model, "get_output_embeddings"):
        return getattr(model, "vocab_size", None)
    output = model.get_output_embeddings()
    # out_features also exists on quantized and prepacked Linear layers, whose .weight is not a tensor
    rows = getattr(output, "out_features", None)
    if rows is None and isinstance(getattr(output, "weight", None), torch.Tensor):
        rows = output.weight.shape[0]
    return rows if rows is not None else model.config.vocab_size


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = [t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t)]
    example = sorted(differing, key=str)[0]
    raise VocabularyMismatchError(
        f"the target and draft tokenizers differ: {len(differing)} tokens have different ids "
        f"(e.g. {example!r}: target {target_vocab.get(example)}, draft {draft_vocab.get(example)}; "
        f"vocabulary sizes {len(target_vocab)} and {len(draft_vocab)}). A drafter built around a model of another "
        f"tokenizer must propose the target's tokens: pass the draft model itself (what load_model returns), which "
        f"drafts through its text (drafters/cross_vocab.py), or a drafter of the target's tokenizer")


def shared_vocab_size(target, draft=None, target_tokenizer=None, draft_tokenizer=None,
                      vocab_size: int | None = None) -> int:
    rows = {"target": embedding_rows(target)}
    if rows["target"] is None:
        raise TypeError(f"cannot use a {type(target).__name__} as the target model: pass a transformers causal LM, "
                        f"what specdecode.load_model returns, or a ModelBackend (forward/trim/reset/select_rows)")
    if draft is not None and embedding_rows(draft) is not None:
        rows["draft"] = embedding_rows(draft)
    smallest = min(rows.values())
    if target_tokenizer is not None and draft_tokenizer is not None:
        check_same_tokenizer(target_tokenizer, draft_tokenizer)
    tokenizer = target_tokenizer or draft_tokenizer
    if vocab_size is None and tokenizer is not None:
        vocab_size = len(tokenizer)
    if vocab_size is None:
        if len(set(rows.values())) > 1:
            raise VocabularyMismatchError(
                f"the models' vocabularies differ in size ({rows}) and no tokenizer was given to tell whether "
                f"they are the same vocabulary padded differently: pass the tokenizer (or load both with "
                f"load_model), or vocab_size=N with the size of the shared vocabulary")
        return smallest
    if vocab_size > smallest:
        raise VocabularyMismatchError(
            f"the vocabulary has {vocab_size} tokens but a model's embedding has only {smallest} rows ({rows}): "
            f"the tokenizer does not belong to these models")
    return vocab_size


def unwrap_model(model_or_loaded):
    """(model, tokenizer) from a Hugging Face model or from what load_model returns."""
    if hasattr(model_or_loaded, "model") and hasattr(model_or_loaded, "tokenizer"):
        return model_or_loaded.model, model_or_loaded.tokenizer
    return model_or_loaded, None


def token_ids(value) -> set[int]:
    """An eos_token_id as tokenizers and configs give it (None, one id or a list of ids) as a set of ints: the one
    place this is normalised."""
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(t) for t in value}


def tokenizer_eos_ids(tokenizer) -> set[int]:
    return token_ids(getattr(tokenizer, "eos_token_id", None))

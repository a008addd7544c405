"""The prompts every method decodes: token ids encoded once for all, and the batches of each generate() call."""

from __future__ import annotations

from ..text.chat import encode_chat, has_chat_template


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when asked and the tokenizer has one.

    Every method gets these same ids, so no method tokenizes differently from another.
    """
    if tokenizer is None:
        raise ValueError("bench needs the target's tokenizer to encode its prompts")
    encoded = []
    for text in texts:
        if chat and has_chat_template(tokenizer):
            ids = encode_chat(tokenizer, text)
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("a prompt encodes to no tokens")
        encoded.append(list(ids))
    return encoded


def make_batches(prompt_ids: list, batch_size: int) -> list[list]:
    """Consecutive prompts in batches of batch_size rows; the set is cycled to fill the last batch, so every
    generate() call has the same number of rows."""
    batches = []
    for start in range(0, len(prompt_ids), batch_size):
        batches.append([prompt_ids[(start + j) % len(prompt_ids)] for j in range(batch_size)])
    return batches

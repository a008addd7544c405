"""Chat prompts: a conversation turned into the token ids the model continues, through its tokenizer's template.

The one implementation used by the server, the command line and the benchmarks, so that a conversation is encoded
the same way everywhere.
"""

from __future__ import annotations

from typing import Mapping, Sequence


class ChatTemplateError(ValueError):
    """The conversation could not be formatted with the tokenizer's chat template."""


class NoChatTemplateError(ChatTemplateError):
    """The tokenizer has no chat template."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer, messages: str | Sequence[Mapping], tools: Sequence[Mapping] | None = None) -> list[int]:
    """Token ids of `messages` ({"role", "content"} dicts, or a string: one user turn) ready for the assistant.
    tools: function tools in OpenAI's shape, shown to the model by the template (None: no tools).

    The template's text already holds the model's special tokens (BOS included), so it is encoded with
    add_special_tokens=False: no second BOS.
    """
    if tokenizer is None:
        raise NoChatTemplateError("chat prompts need a tokenizer, and the model has none")
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError("the model's tokenizer has no chat template: send a plain text prompt instead")
    conversation = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    if not conversation:
        raise ChatTemplateError("the conversation has no messages")
    try:
        text = tokenizer.apply_chat_template(conversation, tools=list(tools) if tools else None,
                                             add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template rejects the conversation (roles out of order, a missing user turn...)
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

"""What a chat's next turn will re-send of an answer, for the prefix cache (prefix_cache.PrefixCache.resend).

A client sends the answer back as the response gave it: the message's content and its tool calls, which the chat
template then writes in its own form. That is not always the text the model generated: a small model writes a call
as fenced or bare JSON, which the parser accepts (tool_dialects.py) and the template renders as, say, a <tool_call>
block. The prefix cache matches tokens, so it would lend nothing of such an answer; given the conversation rendered
with the answer as the client will send it, it prefills that while the server is idle instead.
"""

from __future__ import annotations

from typing import Callable

from ..structured.tool_calls import rendered_call


def resender(conversation: list[dict], tokenizer, tools=None) -> Callable[[str], list[int]]:
    """For a chat request: an answer's text -> the token ids of the conversation with that answer as the next turn
    re-sends it (called in the server's idle time). conversation: the request's messages as the template takes
    them (plain dicts: a parked answer keeps them, not the request's body, until then); tools: the request's
    translate.Tools, or None."""

    def resend(text: str) -> list[int]:
        return answer_ids(tokenizer, conversation, tools, text)

    return resend


def answer_ids(tokenizer, conversation: list[dict], tools, text: str) -> list[int]:
    """The conversation and the assistant's answer (text read by the request's tool-call parser, if it has tools),
    rendered by the chat template as a later turn holds it and tokenized as a prompt is (chat.encode_chat)."""
    message = {"role": "assistant", "content": text}
    if tools is not None:
        parser = tools.format.parser()
        parser.feed(text)
        parser.finish()
        if parser.calls:  # content "" rather than None, as clients send it back (the templates test its truth)
            message = {"role": "assistant", "content": parser.content or "",
                       "tool_calls": [rendered_call(call.to_dict()) for call in parser.calls]}
    rendered = tokenizer.apply_chat_template(conversation + [message], tools=tools.shown if tools else None,
                                             add_generation_prompt=False, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])

"""Response assembly: OpenAI's bodies and server-sent-event chunks for completions and chat completions (and
/predict's body), built in one place from the engine's results.

The provenance extension: a streamed request with `"specdecode": {"provenance": true}` gets one chunk per token,
each with a top-level "specdecode" object that plain OpenAI clients ignore:

    "specdecode": {"tokens": [{"id": 1234, "text": " the", "provenance": "accepted", "step": 7, "num_drafts": 4}],
                   "stats": {"acceptance_rate": 0.75, "mean_accepted_length": 3.2, "proposed_tokens": 16,
                             "accepted_tokens": 12, "verification_steps": 4, "new_tokens": 14}}

provenance is "accepted" (a draft token the target kept), "resampled" (the target's correction after a rejected
draft), "bonus" (the target's extra token after every draft was accepted), "target" (plain decoding, and the
first token, from the prefill) or "forced" (the response_format grammar allowed this token alone); step is the
engine step that decided the token, num_drafts the drafts the row proposed in that step. stats are the row's
running counters over the tokens streamed so far (the final, exact ones come in the usage chunk's "speculative",
with stream_options.include_usage).

With logprobs, every token gets a chunk (one that completes no character yet has empty text) carrying its
logprobs in OpenAI's shape for the endpoint (logprobs.py).
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel

from ..structured.tool_parser import ToolCallParser
from .batcher import Done
from .logprobs import CompletionLogprobBuilder, TokenTexts, chat_logprobs
from .schemas import (ChatChoice, ChatCompletionResponse, ChatResponseMessage, CompletionChoice, CompletionResponse,
                      PredictResponse, PromptTokensDetails, SpeculativeStats, Usage)


def finish_reason(reason: str | None, called: bool = False) -> str:
    """OpenAI's finish reasons are "stop", "length" and "tool_calls" (an answer that ended after its tool calls); a
    row that ended otherwise (cancelled) reads "stop"."""
    if reason not in ("stop", "length"):
        return "stop"
    return "tool_calls" if called and reason == "stop" else reason


def usage(done: Done) -> Usage:
    """Prompt tokens once per prompt (however many choices it has), completion tokens summed over the choices."""
    prompt = sum(done.prompt_tokens)
    completion = sum(len(t) for t in done.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=done.stats.cached_prompt_tokens))


def speculative(done: Done, draft_name: str | None) -> SpeculativeStats:
    """This request's own counters (its rows of the engine batch: done.stats), plus its batch's call count and
    time."""
    s = done.stats
    return SpeculativeStats(draft_model=draft_name, num_speculative_tokens=s.num_speculative_tokens,
                            copy_limit=s.copy_limit, acceptance_rate=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
                            proposed_tokens=s.proposed_tokens, accepted_tokens=s.accepted_tokens,
                            forced_tokens=s.forced_tokens, verification_steps=s.verification_steps,
                            target_forward_calls=s.target_forward_calls, batch_size=done.batch_size,
                            wall_time_s=s.wall_time_s)


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


class Responder:
    """Builds the answer to one request of a kind ("completion", "chat" or "predict"), whole or as chunks.

    With logprobs (not None), token_texts names the tokens in them. With tool_calls (chat: the request's
    tool_dialects.ToolFormat), each answer is read by its parser: its calls go to message.tool_calls (streamed as
    OpenAI's tool_calls deltas)."""

    def __init__(self, kind: str, model: str, draft_name: str | None, provenance: bool = False,
                 logprobs: int | None = None, token_texts: TokenTexts | None = None, tool_calls=None):
        if logprobs is not None and token_texts is None:
            raise ValueError("logprobs need token_texts to name the tokens")
        self.kind, self.model, self.draft_name = kind, model, draft_name
        self.chat = kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.provenance = provenance
        self.logprobs, self.token_texts = logprobs, token_texts
        self.tool_calls = tool_calls if self.chat else None
        self._parsers: dict[int, ToolCallParser] = {}  # a streamed choice's tool-call parser
        self._rows: dict[int, RunningStats] = {}
        self._offsets: dict[int, CompletionLogprobBuilder] = {}  # a streamed choice's text offsets so far

    # ------------------------------------------------------------------ whole responses
    def body(self, done: Done) -> BaseModel:
        reasons = [finish_reason(r) for r in done.finish_reasons]
        if self.kind == "predict":
            stats = done.stats.to_dict()
            stats["batch_size"] = done.batch_size
            return PredictResponse(text=done.texts[0], finish_reason=reasons[0], stats=stats)
        common = dict(id=self.id, created=self.created, model=self.model, usage=usage(done),
                      speculative=speculative(done, self.draft_name))
        logprobs = [self._logprobs(i, done) for i in range(len(reasons))]
        if self.chat:
            choices = [self._chat_choice(i, text, reason, lp)
                       for i, (text, reason, lp) in enumerate(zip(done.texts, reasons, logprobs))]
            return ChatCompletionResponse(choices=choices, **common)
        choices = [CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=reason)
                   for i, (text, reason, lp) in enumerate(zip(done.texts, reasons, logprobs))]
        return CompletionResponse(choices=choices, **common)

    def _chat_choice(self, index: int, text: str, reason: str, logprobs) -> ChatChoice:
        if not self.tool_calls:
            return ChatChoice(index=index, message=ChatResponseMessage(content=text), logprobs=logprobs,
                              finish_reason=reason)
        parser = self.tool_calls.parser()
        parser.feed(text)
        parser.finish()
        calls = [call.to_dict() for call in parser.calls] or None
        message = ChatResponseMessage(content=parser.content if parser.content or not calls else None,
                                      tool_calls=calls)
        return ChatChoice(index=index, message=message, logprobs=logprobs,
                          finish_reason=finish_reason(reason, bool(calls)))

    def _logprobs(self, index: int, done: Done) -> BaseModel | None:
        """A whole choice's logprobs in the endpoint's shape (None when not asked for)."""
        result = done.result
        if self.logprobs is None or result.logprobs is None or result.logprobs[index] is None:
            return None
        tokens, values = result.token_ids[index], result.logprobs[index]
        tops = (result.top_logprobs[index] if result.top_logprobs is not None else None) or [None] * len(tokens)
        if self.chat:
            return chat_logprobs(self.token_texts, tokens, values, tops)
        return CompletionLogprobBuilder(self.token_texts).add(tokens, values, tops)

    # ------------------------------------------------------------------ server-sent events
    def opening(self, index: int) -> dict | None:
        """The chunk that opens a choice before its first token: the role, in chat; nothing in completions."""
        return self._chunk([self._choice(index, None, None)]) if self.chat else None

    def delta(self, index: int, text: str, finish: str | None = None) -> dict:
        """A choice's next text; with `finish`, its last chunk."""
        if self.tool_calls:
            return self._tool_delta(index, text, finish)
        return self._chunk([self._choice(index, text, finish and finish_reason(finish))])

    def _tool_delta(self, index: int, text: str, finish: str | None) -> dict:
        """The text read by the choice's parser: content, or tool_calls deltas (a call's id, type and name first,
        its arguments in pieces after); the last chunk has the parser's held-back rest."""
        parser = self._parsers.get(index) or self._parsers.setdefault(index, self.tool_calls.parser())
        parts = parser.feed(text) + (parser.finish() if finish else [])
        delta: dict = {}
        content = "".join(p["content"] for p in parts if "content" in p)
        if content:
            delta["content"] = content
        calls = [p for p in parts if "content" not in p]
        if calls:
            delta["tool_calls"] = calls
        reason = finish and finish_reason(finish, bool(parser.calls))
        return self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}])

    def token(self, index: int, event) -> dict | None:
        """The chunk of one token event (a TokenEvent): its text, with logprobs its logprobs, with provenance its
        "specdecode" object; None when there is nothing to send (a token that completes no character yet, and
        neither logprobs nor provenance asked for)."""
        with_logprobs = self.logprobs is not None and event.logprob is not None
        if not (self.provenance or with_logprobs):
            if not event.text:
                return None
            chunk = self.delta(index, event.text)
            held = self.tool_calls and not chunk["choices"][0]["delta"]  # a tool call's text may be held back
            return None if held else chunk
        chunk = self.delta(index, event.text or "")
        if with_logprobs:
            chunk["choices"][0]["logprobs"] = self._token_logprobs(index, event).model_dump()
        if self.provenance:
            stats = self._rows.setdefault(index, RunningStats())
            stats.add(event)
            token = {"id": event.token_id, "text": event.text or "", "provenance": event.provenance,
                     "step": event.step, "num_drafts": event.num_drafts}
            chunk["specdecode"] = {"tokens": [token], "stats": stats.to_dict()}
        return chunk

    def _token_logprobs(self, index: int, event) -> BaseModel:
        tokens, values, tops = [event.token_id], [event.logprob], [event.top_logprobs]
        if self.chat:
            return chat_logprobs(self.token_texts, tokens, values, tops)
        builder = self._offsets.setdefault(index, CompletionLogprobBuilder(self.token_texts))
        return builder.add(tokens, values, tops)

    def usage_chunk(self, done: Done) -> dict:
        """The last chunk before [DONE] with stream_options.include_usage: no choices, the usage and statistics."""
        return self._chunk([], usage=usage(done).model_dump(),
                           speculative=speculative(done, self.draft_name).model_dump())

    def _chunk(self, choices: list[dict], **extra) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, index: int, text: str | None, finish: str | None) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if text is None and self.tool_calls:  # the answer may be calls: content stays null until text comes
            return {"index": index, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                    "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


class RunningStats:
    """A row's speculative counters over the token events streamed so far (RowStats' fields, counted from them).

    The first event is the prefill's token; after it, each run of events with one step number is one verification
    step, which proposed num_drafts drafts and kept the events marked "accepted" (a "forced" event is a token the
    grammar allowed alone, no draft's)."""

    def __init__(self):
        self.new_tokens = self.proposed_tokens = self.accepted_tokens = self.verification_steps = 0
        self._last_step: int | None = None

    def add(self, event) -> None:
        first = self.new_tokens == 0
        self.new_tokens += 1
        if first:  # the prefill's token; a decoding step of the same engine step starts a new run
            return
        if event.step != self._last_step:
            self._last_step = event.step
            self.verification_steps += 1
            self.proposed_tokens += event.num_drafts
        self.accepted_tokens += event.provenance == "accepted"

    def to_dict(self) -> dict:
        steps, proposed = self.verification_steps, self.proposed_tokens
        return {"acceptance_rate": self.accepted_tokens / proposed if proposed else 0.0,
                "mean_accepted_length": (self.new_tokens - 1) / steps if steps else 0.0,
                "proposed_tokens": proposed, "accepted_tokens": self.accepted_tokens,
                "verification_steps": steps, "new_tokens": self.new_tokens}

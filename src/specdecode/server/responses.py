"""Response assembly: OpenAI's bodies and server-sent-event chunks for completions and chat completions (and
/predict's body), built in one place from the engine's results.

The provenance extension: a streamed request with `"specdecode": {"provenance": true}` gets one chunk per token,
each with a top-level "specdecode" object that plain OpenAI clients ignore:

    "specdecode": {"tokens": [{"id": 1234, "text": " the", "provenance": "accepted", "step": 7, "num_drafts": 4}],
                   "stats": {"acceptance_rate": 0.75, "mean_accepted_length": 3.2, "proposed_tokens": 16,
                             "accepted_tokens": 12, "verification_steps": 4, "new_tokens": 14}}

provenance is "accepted" (a draft token the target kept), "resampled" (the target's correction after a rejected
draft), "bonus" (the target's extra token after every draft was accepted) or "target" (plain decoding, and the
first token, from the prefill); step is the engine step that decided the token, num_drafts the drafts the row
proposed in that step. stats are the row's running counters over the tokens streamed so far (the final, exact ones
come in the usage chunk's "speculative", with stream_options.include_usage).
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel

from .batcher import Done
from .schemas import (ChatChoice, ChatCompletionResponse, ChatResponseMessage, CompletionChoice, CompletionResponse,
                      PredictResponse, SpeculativeStats, Usage)


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish reasons are "stop" and "length"; a row that ended otherwise (cancelled) reads "stop"."""
    return reason if reason in ("stop", "length") else "stop"


def usage(done: Done) -> Usage:
    prompt = sum(done.prompt_tokens)
    completion = sum(len(t) for t in done.token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def speculative(done: Done, draft_name: str | None) -> SpeculativeStats:
    """This request's own counters (its rows of the engine batch), plus its batch's call count and time."""
    s, rows = done.stats, done.row_stats
    proposed = sum(r.proposed_tokens for r in rows)
    accepted = sum(r.accepted_tokens for r in rows)
    steps = sum(r.verification_steps for r in rows)
    emitted = sum(r.new_tokens - 1 for r in rows if r.new_tokens)  # the first token comes from the prefill
    return SpeculativeStats(draft_model=draft_name, num_speculative_tokens=s.num_speculative_tokens,
                            acceptance_rate=accepted / proposed if proposed else 0.0,
                            mean_accepted_length=emitted / steps if steps else 0.0, proposed_tokens=proposed,
                            accepted_tokens=accepted, verification_steps=steps,
                            target_forward_calls=s.target_forward_calls, batch_size=done.batch_size,
                            wall_time_s=s.wall_time_s)


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


class Responder:
    """Builds the answer to one request of a kind ("completion", "chat" or "predict"), whole or as chunks."""

    def __init__(self, kind: str, model: str, draft_name: str | None, provenance: bool = False):
        self.kind, self.model, self.draft_name = kind, model, draft_name
        self.chat = kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.provenance = provenance
        self._rows: dict[int, RunningStats] = {}

    # ------------------------------------------------------------------ whole responses
    def body(self, done: Done) -> BaseModel:
        reasons = [finish_reason(r) for r in done.finish_reasons]
        if self.kind == "predict":
            stats = done.stats.to_dict()
            stats["batch_size"] = done.batch_size
            return PredictResponse(text=done.texts[0], finish_reason=reasons[0], stats=stats)
        common = dict(id=self.id, created=self.created, model=self.model, usage=usage(done),
                      speculative=speculative(done, self.draft_name))
        if self.chat:
            choices = [ChatChoice(index=i, message=ChatResponseMessage(content=text), finish_reason=reason)
                       for i, (text, reason) in enumerate(zip(done.texts, reasons))]
            return ChatCompletionResponse(choices=choices, **common)
        choices = [CompletionChoice(index=i, text=text, finish_reason=reason)
                   for i, (text, reason) in enumerate(zip(done.texts, reasons))]
        return CompletionResponse(choices=choices, **common)

    # ------------------------------------------------------------------ server-sent events
    def opening(self, index: int) -> dict | None:
        """The chunk that opens a choice before its first token: the role, in chat; nothing in completions."""
        return self._chunk([self._choice(index, None, None)]) if self.chat else None

    def delta(self, index: int, text: str, finish: str | None = None) -> dict:
        """A choice's next text; with `finish`, its last chunk."""
        return self._chunk([self._choice(index, text, finish and finish_reason(finish))])

    def token(self, index: int, event) -> dict | None:
        """The chunk of one token event (a TokenEvent): its text, with provenance its "specdecode" object; None
        when there is nothing to send (a token that completes no character yet, without provenance)."""
        if not self.provenance:
            return self.delta(index, event.text) if event.text else None
        stats = self._rows.setdefault(index, RunningStats())
        stats.add(event)
        token = {"id": event.token_id, "text": event.text or "", "provenance": event.provenance, "step": event.step,
                 "num_drafts": event.num_drafts}
        chunk = self.delta(index, event.text or "")
        chunk["specdecode"] = {"tokens": [token], "stats": stats.to_dict()}
        return chunk

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
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


class RunningStats:
    """A row's speculative counters over the token events streamed so far (RowStats' fields, counted from them).

    The first event is the prefill's token; after it, each run of events with one step number is one verification
    step, which proposed num_drafts drafts and kept the events marked "accepted"."""

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

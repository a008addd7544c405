"""Request and response bodies of the HTTP API (pydantic), shaped like OpenAI's where OpenAI has an equivalent.

Requests are validated strictly: a string where a number belongs, a float where an integer belongs, or a boolean
where an integer belongs is a 400, never silently coerced. Limits that depend on the server's settings
(max_tokens, num_speculative_tokens) are checked by the app, which knows them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
UNSUPPORTED = ("logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias")
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _integral_float(value):
    """JSON Schema counts 1.0 as an integer: accept integral floats, still refuse 2.5, "2" and true."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def Int(ge: int | None = None, le: int | None = None):
    """An integer field type with bounds (documented as minimum/maximum) that also takes integral floats."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral_float)]


TokenCount = Int(ge=1)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


def _check_stop(value):
    if value is None:
        return value
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(items)}")
    if any(s == "" for s in items):
        raise ValueError("stop strings must not be empty")
    return value


class StreamOptions(_Request):
    include_usage: Optional[bool] = Field(False, description="Send a last chunk with usage and speculative "
                                                             "statistics before `data: [DONE]`.")


class _Sampling(_Request):
    """Fields shared by completions, chat completions and /predict."""

    model: Optional[str] = Field(None, description="The served model's id (see /v1/models); may be left out.")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=2.0, description="0 (or below 1e-5) is greedy.")
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[Int(ge=-1)] = Field(
        None, description="Extension: sample from the k likeliest tokens (0 or -1 disables).")
    seed: Optional[Int(ge=SEED_MIN, le=SEED_MAX)] = Field(
        None, description="Same seed, same output: a seeded request runs in a batch of its own.")
    stop: Optional[Union[str, list[str]]] = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} stop strings; the stop string is not returned.")
    num_speculative_tokens: Optional[Int(ge=0)] = Field(
        None, description="Extension: draft tokens per verification (the server's -k if left out).")
    n: Optional[Int(ge=1, le=1)] = Field(1, description="Only 1 completion per prompt.")
    user: Optional[str] = None

    # Accepted only at their neutral values, so a client relying on them gets an error rather than a silent no-op.
    presence_penalty: Optional[float] = Field(None, ge=0, le=0, description="Not supported: 0 only.")
    frequency_penalty: Optional[float] = Field(None, ge=0, le=0, description="Not supported: 0 only.")
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=0, description="Not supported: {} only.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        return _check_stop(value)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str]] = Field(
        ..., description="A prompt, or a list of prompts (at most --max-batch-size), each non-empty.")
    max_tokens: Optional[TokenCount] = Field(
        None, description="New tokens at most per prompt (default 16; at most the server's --max-tokens-limit).")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Int(ge=0, le=0)] = Field(None, description="Not supported: null or 0.")
    echo: Optional[Literal[False]] = Field(None, description="Not supported: false only.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
            raise ValueError("must be a string or a list of strings")
        if not items:
            raise ValueError("must not be an empty list")
        if any(p == "" for p in items):
            raise ValueError("must not be empty: give at least one token of text to continue")
        return value


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[TokenCount] = Field(
        None, description="New tokens at most (default: the rest of the context, up to --max-tokens-limit).")
    max_completion_tokens: Optional[TokenCount] = Field(None, description="Newer name of max_tokens.")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Literal[False]] = Field(None, description="Not supported: false only.")


class PredictRequest(_Sampling):
    """The old seed server's body: a prompt, and optionally the sampling fields."""

    prompt: str = Field(..., min_length=1)
    max_new_tokens: Optional[TokenCount] = Field(None, description="New tokens at most (default 64).")
    max_tokens: Optional[TokenCount] = Field(None, description="Alias of max_new_tokens.")


# ---------------------------------------------------------------------------------------------- responses
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    """Speculative statistics of this request's prompts; target_forward_calls and wall_time_s are its batch's."""

    draft_model: Optional[str] = None
    num_speculative_tokens: int
    acceptance_rate: float = Field(description="Accepted draft tokens / proposed draft tokens.")
    mean_accepted_length: float = Field(description="Tokens emitted per target verification and row.")
    proposed_tokens: int
    accepted_tokens: int
    verification_steps: int
    target_forward_calls: int
    batch_size: int = Field(description="Prompts in the engine batch (this request's and others').")
    wall_time_s: float


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    speculative: Optional[SpeculativeStats] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Optional[SpeculativeStats] = None


class PredictResponse(BaseModel):
    text: str
    finish_reason: Optional[str] = None
    stats: dict[str, Any] = Field(description="The engine's Stats.to_dict() for the batch, plus batch_size.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdecode"
    draft: Optional[str] = None
    num_speculative_tokens: int = 0
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    model: str
    queue_depth: int
    running: int

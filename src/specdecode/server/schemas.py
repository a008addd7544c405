"""Request and response bodies of the HTTP API (pydantic), shaped like OpenAI's where OpenAI has an equivalent.

Requests are validated strictly: a string where a number belongs, a float where an integer belongs, or a boolean
where an integer belongs is a 400, never silently coerced. Limits that depend on the server's settings
(max_tokens, n, num_speculative_tokens, the vocabulary) are checked by the app, which knows them; sampling values
and JSON schemas by the engine's request(), before the request is queued.

Parameters this server does not implement and that would change the output (best_of, echo, functions...)
are declared with their neutral value only (UNSUPPORTED): anything else is a 400 naming them, never a silent
no-op. Fields that no schema here declares are ignored and named in the response's X-Ignored-Fields header.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows (and what the engine computes at most)
SEED_MAX = 2**64 - 1  # numpy's SeedSequence, which mixes a row's stream, takes any integer >= 0

# Unsupported parameters -> the neutral value(s) they are accepted at (besides being left out or null).
UNSUPPORTED: dict[str, str] = {
    "best_of": "1", "echo": "false", "suffix": '""', "functions": "[]", "function_call": '"none"',
    "modalities": '["text"]', "audio": "null",
    # other servers' sampling extensions, refused rather than ignored for the same reason
    "min_tokens": "0", "stop_token_ids": "[]",
}
LOGPROBS_MEANING = ("The target model's log-probabilities under the distribution each token was actually drawn "
                    "from: after logit_bias, the penalties, temperature, top-k, top-p, min_p and the "
                    "response_format grammar (vLLM's "
                    "logprobs_mode \"processed_logprobs\"); for greedy requests (temperature 0) the log-softmax of "
                    "the logits the grammar allows. A token those settings exclude reads -9999.0 (JSON has no "
                    "-infinity).")


def _integral_float(value):
    """JSON Schema counts 1.0 as an integer: accept integral floats, still refuse 2.5, "2" and true."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def Int(ge: int | None = None, le: int | None = None):
    """An integer field type with bounds (documented as minimum/maximum) that also takes integral floats."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral_float)]


TokenCount = Int(ge=1)
TokenId = int  # the vocabulary's bounds are the app's to check (and to document), with a clear message


def _not_supported(neutral: str) -> str:
    return f"Not supported: {neutral} only (or leave it out)."


class _Request(BaseModel):
    # extra="allow": unknown fields are kept so that the app can name them in X-Ignored-Fields
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


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


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _integral_floats(value):
    """A list with its integral floats as integers (1.0 is an integer in JSON), nested lists too."""
    if not isinstance(value, list):
        return value
    return [_integral_floats(v) if isinstance(v, list) else _integral_float(v) for v in value]


def _check_prompt(value):
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, a list of token-id lists."""
    kinds = "a string, a list of strings, a list of token ids or a list of token-id lists"
    value = _integral_floats(value)
    if value == []:
        raise ValueError("must not be an empty list")
    items = [value] if isinstance(value, str) or _is_token_ids(value) else value
    if not isinstance(items, list):
        raise ValueError(f"must be {kinds}")
    if not (all(isinstance(p, str) for p in items) or all(_is_token_ids(p) for p in items)):
        raise ValueError(f"must be {kinds} (not a mix)")
    if any(len(p) == 0 for p in items):
        raise ValueError("must not be empty: give at least one token of text to continue")
    return value


class StreamOptions(_Request):
    include_usage: Optional[bool] = Field(False, description="Send a last chunk with usage and speculative "
                                                             "statistics before `data: [DONE]`.")


class SpecdecodeOptions(_Request):
    provenance: Optional[bool] = Field(
        False, description="With stream=true, every token gets a chunk of its own carrying a top-level "
                           "\"specdecode\" object: {\"tokens\": [{id, text, provenance, step, num_drafts}], "
                           "\"stats\": {acceptance_rate, mean_accepted_length, proposed_tokens, accepted_tokens, "
                           "verification_steps, new_tokens}} (provenance: accepted, resampled, bonus, "
                           "target or forced (the response_format grammar allowed this token alone); stats: the "
                           "prompt's running counters). Plain OpenAI clients ignore it.")
    strict_tool_calls: Optional[bool] = Field(
        False, description="With tools: calls only in the chat template's own form (e.g. <tool_call> blocks), not "
                           "the fenced or bare JSON at the start of an answer that small models write instead "
                           "(the server's --strict-tool-calls for every request).")


class JSONSchemaSpec(_Request):
    name: Optional[str] = Field(None, description="The schema's name (OpenAI's clients send one); not used.")
    description: Optional[str] = Field(None, description="Accepted and not used.")
    schema_: Optional[dict[str, Any]] = Field(
        None, alias="schema", description="The JSON Schema the answer follows; left out: any JSON object.")
    strict: Optional[bool] = Field(None, description="Accepted; the answer follows the schema whatever it says "
                                                     "(a grammar masks every token).")


class ResponseFormat(_Request):
    """OpenAI's response_format; with json_object or json_schema a grammar allows only the tokens that keep the answer
    valid JSON (of that schema), written compact (no whitespace between tokens) unless the schema asks otherwise
    with llguidance's key "x-guidance": {"whitespace_flexible": true}. An answer cut by max_tokens ends with
    finish_reason "length", unfinished."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaSpec] = Field(None, description='With type "json_schema": {"name", "schema", '
                                                                    '"strict"}.')
    schema_: Optional[dict[str, Any]] = Field(
        None, alias="schema", description='llama.cpp\'s form: with type "json_object", a JSON Schema to follow.')

    @model_validator(mode="after")
    def _parts_match_the_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object: {"name": ..., "schema": {...}}')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'"json_schema" goes with type "json_schema", not {self.type!r}')
        if self.type == "text" and self.schema_ is not None:
            raise ValueError('a "schema" needs type "json_object" or "json_schema", not "text"')
        return self


class _Sampling(_Request):
    """Fields shared by completions, chat completions and /predict."""

    model: Optional[str] = Field(None, description="A served model id (see /v1/models); may be left out.")
    temperature: Optional[float] = Field(1.0, ge=0.0, le=2.0, description="0 (or below 1e-5) is greedy.")
    top_p: Optional[float] = Field(1.0, gt=0.0, le=1.0)
    top_k: Optional[Int(ge=-1)] = Field(
        None, description="Extension: sample from the k likeliest tokens (0 or -1 disables).")
    seed: Optional[Int(ge=0, le=SEED_MAX)] = Field(
        None, description="Same seed, same output, whatever shares the batch.")
    stop: Optional[Union[str, list[str]]] = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} stop strings; the stop string is not returned.")
    num_speculative_tokens: Optional[Union[Int(ge=0), Literal["auto"]]] = Field(
        None, description="Extension: draft tokens per verification for this request, 0 for plain decoding (no "
                          "drafts); \"auto\" or left out: the server's -k.")
    timeout: Optional[float] = Field(
        None, gt=0.0, description="Extension (LiteLLM's name): a total deadline in seconds, from the request's arrival "
                                  "to the end of its response; past it the request is cancelled and answered 504 "
                                  "(an error event if streaming). Left out: none, unless the server sets "
                                  "--request-timeout; with both, the earlier applies.")
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = Field(None, description="Accepted and not used.")
    store: Optional[bool] = Field(None, description="Accepted and not used (nothing is stored).")
    service_tier: Optional[str] = Field(None, description="Accepted and not used.")

    n: Optional[Int(ge=1)] = Field(
        1, description="Choices per prompt, each sampled on its own random stream: prompt i's choice j is choice "
                       "i × n + j, and with a seed S it draws the stream (S, i × n + j), so choice 0 is the n = 1 "
                       "answer. n × prompts is at most --max-batch-size. Usage counts a prompt once.")
    ignore_eos: Optional[bool] = Field(False, description="Extension (vLLM's): keep generating past the end-of-"
                                                          "sequence token, up to max_tokens or a stop string.")

    # Options over the text so far and min_p: exact under speculation too (README, "Sampling options").
    presence_penalty: Optional[float] = Field(
        None, ge=-2.0, le=2.0, description="Subtracted once from the logit of each token the output holds (OpenAI).")
    frequency_penalty: Optional[float] = Field(
        None, ge=-2.0, le=2.0, description="Subtracted from a token's logit per occurrence in the output (OpenAI).")
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(
        None, description="Token id (as a string) -> a value in [-100, 100] added to its raw logit (OpenAI).")
    repetition_penalty: Optional[float] = Field(
        None, gt=0.0, description="Extension (vLLM's, transformers'): divides positive and multiplies negative "
                                  "logits of the tokens in prompt + output; 1 disables.")
    min_p: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="Extension (vLLM's): drop tokens below min_p x the top probability, "
                                          "after top-p (transformers' order); 0 disables.")
    min_tokens: Optional[Int(ge=0, le=0)] = Field(None, description=_not_supported("0"))
    stop_token_ids: Optional[list[int]] = Field(None, max_length=0, description=_not_supported("[]"))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        return _check_stop(value)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]] = Field(
        ..., description="A prompt, a list of prompts (at most --max-batch-size), a prompt as token ids, or a list "
                         "of those; each non-empty. Text prompts are tokenized with the model's special tokens.")
    max_tokens: Optional[TokenCount] = Field(
        None, description="New tokens at most per prompt (default 16; at most the server's --max-tokens-limit).")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    specdecode: Optional[SpecdecodeOptions] = Field(None, description="Extension: token provenance in streams.")
    logprobs: Optional[Int(ge=0, le=MAX_LOGPROBS)] = Field(
        None, description=f"Each token's log-probability and the N (0..{MAX_LOGPROBS}) likeliest tokens at its "
                          f"position (choices[].logprobs: tokens, token_logprobs, top_logprobs, text_offset, offsets "
                          f"into the choice's text); the sampled token is always listed, so a position may list N + 1. "
                          + LOGPROBS_MEANING)
    response_format: Optional[ResponseFormat] = Field(
        None, description='Extension (as vLLM and llama.cpp): {"type": "json_object"} or {"type": "json_schema", '
                          '"json_schema": {"name": ..., "schema": {...}}}, as in chat.')
    best_of: Optional[Int(ge=1, le=1)] = Field(None, description=_not_supported("1"))
    echo: Optional[Literal[False]] = Field(None, description=_not_supported("false"))
    suffix: Optional[str] = Field(None, max_length=0, description=_not_supported('""'))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        return _check_prompt(value)


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: Union[str, dict[str, Any]] = Field(
        ..., description="The arguments as JSON text (OpenAI's form; a JSON object is accepted too).")


class ToolCall(_Request):
    id: str = Field(..., min_length=1, description="The call's id; a later tool message answers it by this id.")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="An assistant message's tool calls.")
    tool_call_id: Optional[str] = Field(None, description="A tool message: the id of the call it answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(..., description="1 to 64 letters, digits, underscores or dashes; unique among the tools.")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(
        None, description="The JSON Schema of the arguments (an object); left out: no arguments. Every call's "
                          "arguments follow it (a grammar masks every token), whatever `strict` says.")
    strict: Optional[bool] = Field(None, description="Accepted; calls always follow the schema.")


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[TokenCount] = Field(
        None, description="New tokens at most (default: the rest of the context, up to --max-tokens-limit).")
    max_completion_tokens: Optional[TokenCount] = Field(None, description="Newer name of max_tokens.")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    specdecode: Optional[SpecdecodeOptions] = Field(None, description="Extension: token provenance in streams.")
    parallel_tool_calls: Optional[bool] = Field(
        None, description="With tools: several calls in one answer (the default, true), or one at most (false).")
    logprobs: Optional[bool] = Field(
        False, description="Each output token's log-probability (choices[].logprobs.content). " + LOGPROBS_MEANING)
    top_logprobs: Optional[Int(ge=0, le=MAX_LOGPROBS)] = Field(
        None, description=f"With logprobs: true, the 0..{MAX_LOGPROBS} likeliest tokens at each position too.")
    response_format: Optional[ResponseFormat] = Field(
        None, description='{"type": "text"} (the default), {"type": "json_object"} (any JSON object) or {"type": '
                          '"json_schema", "json_schema": {"name": ..., "schema": {...}}}.')
    tools: Optional[list[ToolDefinition]] = Field(
        None, description="Function tools the model may call, shown to it by its chat template (a template "
                          "without a tool format is a 400). Calls come back in message.tool_calls with "
                          "finish_reason \"tool_calls\"; a grammar allows only calls of these tools with arguments "
                          "valid under their parameters schema.")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description='"auto" (the default with tools): text, calls, or text then calls (content beside '
                          'tool_calls); "required": calls only; {"type": '
                          '"function", "function": {"name": ...}}: one call of that function; "none": text, and the '
                          'tools are not shown to the model.')
    functions: Optional[list[Any]] = Field(None, max_length=0, description=_not_supported("[]"))
    function_call: Optional[Literal["none"]] = Field(None, description=_not_supported('"none"'))
    modalities: Optional[list[Literal["text"]]] = Field(None, description=_not_supported('["text"]'))
    audio: None = Field(None, description=_not_supported("null"))


class PredictRequest(_Sampling):
    """The old seed server's body: a prompt, and optionally the sampling fields."""

    prompt: str = Field(..., min_length=1)
    n: Optional[Int(ge=1, le=1)] = Field(1, description="One answer per request here: use /v1/completions for more.")
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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class SpeculativeStats(BaseModel):
    """Speculative statistics of this request's prompts; target_forward_calls and wall_time_s are its batch's."""

    draft_model: Optional[str] = None
    num_speculative_tokens: int = Field(description="K asked for (a number, or auto's cap on a model's drafts).")
    copy_limit: int = Field(0, description="Tokens a step of free copies may verify at most (0: no copying drafter).")
    acceptance_rate: float = Field(description="Accepted draft tokens / proposed draft tokens.")
    mean_accepted_length: float = Field(description="Tokens emitted per target verification and row.")
    proposed_tokens: int
    accepted_tokens: int
    forced_tokens: int = Field(0, description="Tokens the response_format grammar forced (verified as certain "
                                              "drafts; not counted in proposed_tokens).")
    verification_steps: int
    target_forward_calls: int
    batch_size: int = Field(description="Prompts in the engine batch (this request's and others').")
    wall_time_s: float


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token, its text, log-probability, the likeliest tokens (text -> logprob,
    the sampled token included) and where its text begins in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    speculative: Optional[SpeculativeStats] = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Optional[list[ResponseToolCall]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = Field(description="The token's own bytes (a token may hold part of a character).")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
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
    num_speculative_tokens: Union[int, Literal["auto"]] = 0
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    model: str
    queue_depth: int
    running: int

"""Request to engine: one function, `translate`, turns a completions, chat or /predict body into an engine job
(prompt token ids, per-prompt token limits, choices per prompt, and the request's options as one GenerationParams:
sampling settings, stop strings, the response_format's or the tools' constraint, logprobs) and checks everything the
schema cannot know: the served model ids, the vocabulary, the context window, the server's limits. The options'
values are checked by GenerationParams (one place) when the job is made; compiling the constraint and what else
needs the model by the engine's `request()`, which the JobRunner calls before queueing. A new option of
GenerationParams is translated in `_sampling` (or named in NOT_OFFERED).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from ..text.chat import ChatTemplateError, NoChatTemplateError, encode_chat
from ..drafters.escaped_copies import escaped_texts
from ..engine.params import GenerationParams
from ..policy.speculation import Speculation
from ..structured.tool_calls import (ToolError, check_tool_messages, parse_tool_choice, parse_tools, rendered_call,
                          template_supports_tools, tool_format)
from ..structured.tool_dialects import ToolFormat
from ..structured.tool_patterns import FREE_LAYOUT
from .batcher import Job
from .errors import APIError, bad_request
from .resend import resender
from .settings import ServedModel, ServerSettings

Kind = Literal["completion", "chat", "predict"]

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI does
# GenerationParams' fields that no request body sets (the engine's defaults hold), and why; every other field is
# translated (tests/test_generation_params.py checks both, so a new field is one or the other).
NOT_OFFERED = {"regex": "no OpenAI field; a response_format or the tools make a request's constraint",
               "stop_token_ids": "the schema accepts it only empty: stop strings and the end of sequence end a row"}
UNKNOWN_CONTEXT_MAX_TOKENS = 2048  # a chat without max_tokens where neither the model nor --max-tokens-limit bounds it


@dataclass
class Generation:
    """A request translated: the engine's job and how to answer it."""

    kind: Kind
    model: str  # the model id the response names: the one requested, or the server's main one
    job: Job
    stream: bool = False
    timeout: float | None = None  # the request's own total deadline in seconds (its `timeout` field)
    include_usage: bool = False
    provenance: bool = False  # stream each token with its provenance (the "specdecode" extension)
    logprobs: int | None = None  # None: no logprobs; N: each token's and the N likeliest alternatives'
    tool_calls: ToolFormat | None = None  # the answer may hold tool calls in this format: parse them
    ignored: list[str] = field(default_factory=list)  # fields no schema declares, named in X-Ignored-Fields


def translate(body, kind: Kind, served: ServedModel, settings: ServerSettings) -> Generation:
    """The engine job of a request body, or an APIError (400/404) naming the offending field."""
    model = resolve_model(body.model, served)
    sampling = _sampling(body, served, settings)
    max_tokens, tokens_param = _requested_max_tokens(body, kind, settings)
    tools = _tools(body, served, settings) if kind == "chat" else None
    if kind == "chat":
        prompts, params = [_chat_ids(body, served, settings, tools)], ["messages"]
    else:
        prompts, params = _prompt_ids(body.prompt, served, settings)
    if max_tokens is None:  # chat without a limit: the rest of the context (vLLM's default too)
        _check_fits(prompts[0], 1, params[0], tokens_param, served.context_length)
        room = served.context_length - len(prompts[0]) if served.context_length else None
        caps = [cap for cap in (settings.max_tokens_limit, room) if cap]
        max_tokens = min(caps) if caps else UNKNOWN_CONTEXT_MAX_TOKENS
    for ids, param in zip(prompts, params):
        _check_fits(ids, max_tokens, param, tokens_param, served.context_length)
    n = _choices(body, len(prompts), settings)
    logprobs = _logprobs(body, kind)
    constraint = _response_format(body, settings) if tools is None else {"grammar": tools.grammar}
    params = _params(dict(max_new_tokens=max_tokens, logprobs=logprobs, **constraint, **sampling), tools)
    job = Job(prompts=prompts, max_tokens=[max_tokens] * len(prompts), n=n, params=params)
    if kind == "chat" and settings.escaped_copies and job.constrained:  # JSON answers, tool calls included
        job.copy_texts = escaped_texts((m.role, m.text()) for m in body.messages)  # JSON copies what they say
    if kind == "chat":  # what the next turn will re-send of the answer, for the prefix cache (server/resend.py)
        job.resend = resender(_conversation(body.messages, served), served.tokenizer, tools)
    options = getattr(body, "stream_options", None)
    extension = getattr(body, "specdecode", None)
    return Generation(kind, model, job, stream=bool(getattr(body, "stream", False)), timeout=body.timeout,
                      include_usage=bool(options and options.include_usage),
                      provenance=bool(extension and extension.provenance), logprobs=logprobs,
                      tool_calls=tools.format if tools is not None else None, ignored=ignored_fields(body))


def resolve_model(requested: str | None, served: ServedModel) -> str:
    if requested in (None, ""):
        return served.name
    if requested not in served.names:
        listed = ", ".join(repr(n) for n in served.names)
        raise APIError(404, f"the model {requested!r} does not exist: this server serves {listed} (GET /v1/models)",
                       "not_found_error", "model", "model_not_found")
    return requested


def text_size(body) -> int:
    """Characters of text to tokenize in a body (long ones are tokenized off the event loop)."""
    if hasattr(body, "messages"):
        return sum(len(m.text()) for m in body.messages)
    prompt = body.prompt
    return len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str))


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Paths of the non-null fields that no schema declares, nested ones included (messages[0].refusal)."""
    names = [prefix + name for name, value in (model.model_extra or {}).items() if value is not None]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                path = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                names += ignored_fields(item, path)
    return names


# ---------------------------------------------------------------------------------------------- prompts
def _prompt_ids(prompt, served: ServedModel, settings: ServerSettings) -> tuple[list[list[int]], list[str]]:
    """Token ids and field names of a completion's prompts: a string, strings, token ids or token-id lists."""
    single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    items = [prompt] if single else list(prompt)
    if len(items) > settings.max_batch_size:
        raise bad_request(f"{len(items)} prompts in one request; at most {settings.max_batch_size} "
                          f"(--max-batch-size)", "prompt")
    params = ["prompt"] if single else [f"prompt[{i}]" for i in range(len(items))]
    ids = []
    for item, param in zip(items, params):
        if isinstance(item, str):
            _check_chars(len(item), param, settings)
            try:
                item = served.tokenizer(item)["input_ids"]  # with the model's special tokens, as the engine does
            except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
                raise bad_request(f"{param} could not be tokenized: {type(exc).__name__}", param) from None
        ids.append(_check_ids(list(item), param, served))
    return ids, params


def _chat_ids(body, served: ServedModel, settings: ServerSettings, tools: "Tools | None") -> list[int]:
    _check_chars(text_size(body), "messages", settings)
    conversation = _conversation(body.messages, served)
    try:
        ids = encode_chat(served.tokenizer, conversation, tools.shown if tools is not None else None)
    except NoChatTemplateError:
        raise bad_request(f"the model {served.name!r} has no chat template: use /v1/completions", "messages",
                          "no_chat_template") from None
    except ChatTemplateError as exc:
        raise bad_request(f"messages: {exc}", "messages") from None
    except Exception as exc:  # e.g. lone surrogates the tokenizer cannot encode
        raise bad_request(f"messages could not be tokenized: {type(exc).__name__}", "messages") from None
    return _check_ids(ids, "messages", served)


def _conversation(messages, served: ServedModel) -> list[dict]:
    """The messages as the chat template takes them: tool calls with their arguments as JSON values, tool results
    with the id of the call they answer (which must be an earlier call's)."""
    conversation = []
    for i, m in enumerate(messages):
        # "developer" is OpenAI's newer name of "system"; templates know only the latter
        item = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}] has tool_calls, which only assistant messages carry",
                                  f"messages[{i}].tool_calls")
            item["tool_calls"] = [_rendered_call(call, f"messages[{i}].tool_calls[{j}]")
                                  for j, call in enumerate(m.tool_calls)]
        if m.role == "tool":
            item["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                item["name"] = m.name
        conversation.append(item)
    if any(m.tool_calls or m.role == "tool" for m in messages):
        try:
            check_tool_messages(conversation)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None
        if not template_supports_tools(served.tokenizer):
            raise bad_request(f"the messages hold tool calls or tool results, and the chat template of the model "
                              f"{served.name!r} has no tool format to show them in", "messages", "tools_not_supported")
    return conversation


def _rendered_call(call, param: str) -> dict:
    try:
        return rendered_call(call.model_dump())
    except ToolError as exc:
        raise bad_request(f"{param}.function.arguments: {exc}; send the arguments as JSON text",
                          f"{param}.function.arguments") from None


@dataclass
class Tools:
    """A request's tools as the engine and the responder use them."""

    shown: list[dict]  # the tools as the chat template shows them to the model
    choice: str  # "auto", "required" or the one tool's name
    grammar: str  # the Lark grammar of the answer
    format: ToolFormat  # the dialect the answer's calls are written in, and their parser


def _tools(body, served: ServedModel, settings: ServerSettings) -> Tools | None:
    """The request's tools and tool_choice, checked; None when the answer is plain text (no tools, or "none")."""
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
    try:
        tools = parse_tools([t.model_dump(exclude_none=True) for t in body.tools]) if body.tools else None
        choice = parse_tool_choice(choice, tools)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None
    if choice in (None, "none"):
        return None
    if not template_supports_tools(served.tokenizer):
        raise bad_request(f"the chat template of the model {served.name!r} has no tool format (it does not show "
                          f"tools to the model, or writes calls in none of the known dialects: Hermes/Qwen2.5 "
                          f"<tool_call>, Qwen3, Mistral [TOOL_CALLS], Llama 3 JSON): leave tools out, or serve a "
                          f"model whose template has one", "tools", "tools_not_supported")
    extension = getattr(body, "specdecode", None)
    strict = settings.strict_tool_calls or bool(extension and extension.strict_tool_calls)
    answer = _response_format(body)  # an agent's typed output: an answer that is no call follows it
    answer = {"type": "object"} if answer.get("json_object") else answer.get("json_schema")
    try:
        fmt = tool_format(served.tokenizer, tools, choice, body.parallel_tool_calls is not False,
                          settings.max_tool_calls or None, strict, answer)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None
    return Tools([t.rendered() for t in tools], choice, fmt.grammar(), fmt)


def _check_chars(chars: int, param: str, settings: ServerSettings) -> None:
    if chars > settings.max_prompt_chars:
        raise bad_request(f"{param} is longer than {settings.max_prompt_chars} characters", param,
                          "context_length_exceeded")


def _check_ids(ids: list[int], param: str, served: ServedModel) -> list[int]:
    if not ids:
        raise bad_request(f"{param} is empty after tokenization: give at least one token of text", param)
    vocab = served.vocab_size
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise bad_request(f"{param} holds the token id {bad}, outside the model's vocabulary [0, {vocab})", param,
                          "invalid_token_id")
    return ids


def _check_fits(ids: list[int], max_tokens: int, prompt_param: str, tokens_param: str, context: int | None) -> None:
    if context is None:
        return
    if len(ids) >= context:
        raise bad_request(f"{prompt_param} has {len(ids)} tokens, and the model's context is {context} tokens: "
                          f"shorten it", prompt_param, "context_length_exceeded")
    if len(ids) + max_tokens > context:
        raise bad_request(f"{prompt_param} has {len(ids)} tokens; with {tokens_param}={max_tokens} that exceeds the "
                          f"model's context of {context} tokens: lower {tokens_param} to at most "
                          f"{context - len(ids)}", tokens_param, "context_length_exceeded")


# ---------------------------------------------------------------------------------------------- limits, sampling
def _requested_max_tokens(body, kind: Kind, settings: ServerSettings) -> tuple[int | None, str]:
    """(max new tokens per prompt, the field that set it); None: chat's default, the rest of the context."""
    limit = settings.max_tokens_limit  # 0: none of the server's own (the context bounds it: _check_fits)
    if kind == "chat":
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        value = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    elif kind == "predict":
        param = "max_tokens" if body.max_new_tokens is None and body.max_tokens is not None else "max_new_tokens"
        value = body.max_new_tokens if body.max_new_tokens is not None else body.max_tokens
        if value is None:
            value = min(settings.default_predict_tokens, limit or settings.default_predict_tokens)
    else:
        param, value = "max_tokens", body.max_tokens
        if value is None:
            value = min(OPENAI_DEFAULT_MAX_TOKENS, limit or OPENAI_DEFAULT_MAX_TOKENS)
    if value is not None and limit and value > limit:
        raise bad_request(f"{param} is {value}; this server allows at most {limit} (--max-tokens-limit)", param)
    return value, param


def _sampling(body, served: ServedModel, settings: ServerSettings) -> dict:
    """The GenerationParams fields of the body's sampling settings: temperature, top-k, top-p, seed, stop strings,
    draft length, ignore_eos, min_p, the penalties, logit_bias (their values are checked by GenerationParams)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return dict(temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k if body.top_k is not None and body.top_k > 0 else 0,
                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, stop=stop,
                num_speculative_tokens=_speculative_tokens(body.num_speculative_tokens, served, settings),
                ignore_eos=bool(body.ignore_eos), **_options(body, served))


def _params(values: dict, tools: "Tools | None") -> GenerationParams:
    """The job's GenerationParams of these fields, checked there: a bad value is a 400 (a bad constraint's names the
    field that made it)."""
    try:
        return GenerationParams(**values)
    except ValueError as exc:
        from ..structured.constraints import ConstraintError  # the grammar engine's module: only when needed

        if isinstance(exc, ConstraintError):
            param = "tools" if tools is not None else "response_format"
            raise bad_request(f"{param}: {exc}", param) from None
        raise bad_request(str(exc)) from None


def _options(body, served: ServedModel) -> dict:
    """The request's min_p, penalties and logit_bias as GenerationParams takes them (left out: neutral);
    logit_bias's keys must be token ids of this vocabulary."""
    names = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    options = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if body.logit_bias:
        vocab, bias = served.vocab_size, {}
        for key, value in body.logit_bias.items():
            token = int(key) if key.isascii() and key.isdigit() else None
            if token is None or (vocab is not None and token >= vocab):
                raise bad_request(f"logit_bias has the key {key!r}: keys are token ids of this model's vocabulary, "
                                  f"integers in [0, {vocab})", "logit_bias")
            bias[token] = value
        options["logit_bias"] = bias
    return options


def _speculative_tokens(value, served: ServedModel, settings: ServerSettings) -> int | None:
    """The request's fixed K (0: plain decoding, a race's baseline), or None for the server's policy."""
    if value is None:
        return None
    try:
        k = Speculation.parse(value).k
    except ValueError as exc:
        raise bad_request(str(exc), "num_speculative_tokens") from None
    if not served.has_draft:
        if k not in (None, 0):
            raise bad_request("num_speculative_tokens needs a draft model, and this server runs without one "
                              "(only 0 or \"auto\" is accepted)", "num_speculative_tokens")
        return None
    if k is not None and k > settings.max_speculative_tokens:
        raise bad_request(f"num_speculative_tokens is {k}; this server allows at most "
                          f"{settings.max_speculative_tokens}", "num_speculative_tokens")
    return k


def _choices(body, prompts: int, settings: ServerSettings) -> int:
    """n, the choices per prompt: every choice is a row, and a request's rows share one batch."""
    n = body.n or 1
    if prompts * n > settings.max_batch_size:
        of = f"each of {prompts} prompts" if prompts > 1 else "the prompt"
        raise bad_request(f"n is {n}: {n} choices of {of} make {prompts * n} rows, and this server runs at most "
                          f"{settings.max_batch_size} at once (--max-batch-size): lower n", "n")
    return n


def _logprobs(body, kind: Kind) -> int | None:
    """How many alternatives per token the request's logprobs ask for (0: the sampled token's only); None: off."""
    if kind == "completion":
        return body.logprobs
    if kind != "chat":
        return None
    if not body.logprobs:
        if body.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return body.top_logprobs or 0


LAYOUT_KEYS = {"whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator"}  # llguidance's


def _response_format(body, settings: ServerSettings | None = None) -> dict:
    """The Job's constraint fields of a response_format: a JSON Schema to follow, or any JSON object (the engine's
    request() compiles them, and names what is wrong with a schema). With settings.json_layout "model" the JSON
    may be laid out as the model writes it (bounded whitespace between tokens), unless the schema's own
    "x-guidance" says otherwise."""
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return {}
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else fmt.schema_
    if settings is not None and settings.json_layout == "model":
        schema = dict(schema if schema is not None else {"type": "object"})
        guidance = schema.get("x-guidance")
        # a schema that sets any layout of its own keeps it; anything but an object is the schema's error to report
        if guidance is None or isinstance(guidance, dict) and not LAYOUT_KEYS & guidance.keys():
            schema["x-guidance"] = {**FREE_LAYOUT, **(guidance or {})}
        return dict(json_schema=schema, json_object=False)
    return dict(json_schema=schema, json_object=schema is None)

"""Tool calls on the real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B, llama.cpp) through the server: under
"auto" the weather prompt is a valid call (the 1.5B writes it as a fenced ```json block, one of the start forms),
the same greedy call with speculation on and off, streamed as whole; under "required" with parallel calls a
held-out prompt ends with finish_reason "tool_calls" well within 128 tokens, nothing of a call in the content.
Run with `pytest -m real_models`; skipped when the weights' packages are not installed."""

from __future__ import annotations

import json

import pytest

from test_server_helpers import openai_client

pytestmark = pytest.mark.real_models

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
SEARCH = {"type": "object", "properties": {"pattern": {"type": "string", "description": "A glob pattern"}},
          "required": ["pattern"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search_files", "description": "Find the repository's files "
                                           "whose path matches a glob pattern.", "parameters": SEARCH}}]


@pytest.fixture(scope="module")
def client():
    from specdecode import SpeculativeGenerator, load_model
    from specdecode.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdecode.models import catalog
    from specdecode.server import ServerSettings, create_app
    from test_server_helpers import LiveServer

    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        info = catalog.get_model_info(name)
        if not info.installed and not info.cached:
            pytest.skip(f"{name} is not installed; install its weights with: {info.pip_command}")
    generator = SpeculativeGenerator(load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT), num_speculative_tokens=4)
    app = create_app(generator, DEFAULT_TARGET, settings=ServerSettings(max_tokens_limit=128, request_timeout=900))
    with LiveServer(app) as srv:
        yield openai_client(srv.url, timeout=900)


def _ask(client, prompt: str, **kwargs):
    return client.chat.completions.create(model="specdecode", messages=[{"role": "user", "content": prompt}],
                                          tools=TOOLS, temperature=0, max_tokens=128, **kwargs)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_calls_the_tool_the_same_with_speculation_on_and_off_and_streamed(client):
    """The whole answer with speculation against the answer streamed without it (num_speculative_tokens 0): the
    same greedy call, and the stream's pieces assemble to it."""
    prompt = "What's the weather in Paris right now, in celsius?"
    res = _ask(client, prompt, tool_choice="auto")
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    assert _calls(choice.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert res.speculative["proposed_tokens"] > 0
    streamed, content, finish = {}, "", None
    for chunk in _ask(client, prompt, tool_choice="auto", stream=True, extra_body={"num_speculative_tokens": 0}):
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, arguments = streamed.get(piece.index, (piece.function.name, ""))
            streamed[piece.index] = (name, arguments + (piece.function.arguments or ""))
        content += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls" and content == ""
    assert list(streamed.values()) == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_with_parallel_calls_ends(client):
    res = _ask(client, "I need every Python test file in the repository.", tool_choice="required")
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    calls = _calls(choice.message)
    assert calls and all(name == "search_files" for name, _ in calls), calls
    assert res.usage.completion_tokens < 128

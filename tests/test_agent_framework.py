"""A real agent framework from PyPI (pydantic-ai, the `[test]` extra) runs a tool-using session against a live
`specdecode` server, unchanged, as its users run it: tools in `tool_choice: "auto"`, the framework's own OpenAI
client, its own tool execution and history. The tiny models are scripted so that the call really happens: each adds
a large logit to the next token of a fixed answer (a `<tool_call>` of get_weather for Paris while the prompt holds
no tool result, then a sentence that uses the result), on top of their random logits, target and draft alike; the
server's grammar, parser, speculation and prefix cache run as they do for any model. Under auto mode nothing forces
the call: the model's own tokens start it."""

from __future__ import annotations

import pytest
import torch

from scripted_models import call, scripted_pair, tool_tokenizer
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, serve

pytest.importorskip("pydantic_ai", reason="the agent-framework test needs pydantic-ai-slim[openai] (the [test] extra)")

ANSWER = "It is 21 C in Paris."


def weather_script(prompt: str) -> str:
    return ANSWER if "<tool_response>" in prompt else call("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def server(tokenizer):
    tok = tool_tokenizer(tokenizer)
    srv = serve(scripted_pair(tok, weather_script), tok, k=3, max_tokens_limit=200, request_timeout=120)
    yield srv
    srv.stop()


def test_pydantic_ai_calls_the_tool_and_answers_with_its_result(server):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    import json

    import httpx
    from openai import AsyncOpenAI

    sent = []

    async def capture(request):
        sent.append(json.loads(request.content))

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                         http_client=httpx.AsyncClient(event_hooks={"request": [capture]}))
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, model_settings={"temperature": 0.0, "max_tokens": 80})
    cities = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        cities.append(city)
        return "21 C"

    torch.manual_seed(0)
    result = agent.run_sync("What is the weather in Paris?")
    assert cities == ["Paris"]  # the framework parsed our tool_calls and ran its tool
    assert result.output == ANSWER  # the model's second turn saw the tool's result and answered in text
    parts = [part for message in result.all_messages() for part in message.parts]
    [call] = [p for p in parts if isinstance(p, ToolCallPart)]
    [returned] = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert call.tool_name == "get_weather" and call.args_as_dict() == {"city": "Paris"}
    assert returned.tool_call_id == call.tool_call_id and returned.content == "21 C"
    assert result.usage.requests == 2 and result.usage.input_tokens > 0
    assert len(sent) == 2 and all(body.get("tool_choice", "auto") == "auto" and body["tools"] for body in sent)

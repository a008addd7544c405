"""More real agent frameworks from PyPI (the `[test]` extra) against a live `specdecode` server, as their users run
them: the OpenAI Agents SDK (its chat-completions model, run and streamed), LangGraph's prebuilt ReAct agent over
LangChain's ChatOpenAI, and each one's typed outputs (the Agents SDK's output_type, LangChain's with_structured_output
by function calling and by JSON schema, pydantic-ai's output tool); then scripts/agent_frameworks_check.py end to end.
The tiny models are scripted as in test_agent_framework.py (scripted_models.py): a get_weather call for Paris while
the prompt holds no tool result, then a sentence that quotes the result, so the answer shows that the framework sent
the result back; under auto mode the model's own tokens start the call. Each test checks what the framework sent
(captured by httpx hooks on its own client) and, where it can, that the server's grammar shaped the answer (forced
tokens), so a server that dropped a field would fail here.

Each test gets a fresh server on the module's models: the scripted models know a prompt only from the tokens they
were fed, and a prefix-cache hit on an older prompt, after another prompt overwrote those positions, would show them
the wrong prompt. Within a test, a conversation's second turn hits its own first turn's prefix as in real use."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import warnings
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from scripted_models import call, scripted_pair, tool_tokenizer
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, serve

openai = pytest.importorskip("openai", reason="the agent-framework tests need openai (the [test] extra)")

WEATHER = "What is the weather in Paris?"
WEATHER_AS_JSON = "What is the weather in Paris? Answer as JSON."
TYPED = "Paris is 21 degrees celsius today."  # the check script's typed prompt holds it too
TYPED_VALUE = {"city": "Paris", "temperature_c": 21.0}
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "agent_frameworks_check.py"


class Weather(BaseModel):
    city: str
    temperature_c: float


def need(module: str, package: str):
    return pytest.importorskip(module, reason=f"this test needs {package} (the [test] extra)")


def compact(value: dict) -> str:
    """JSON in the layout of the server's JSON-schema grammar (no spaces), which the script must follow."""
    return json.dumps(value, separators=(",", ":"))


def weather_script(prompt: str) -> str:
    """Extract TYPED's value (as a call of the one tool offered, or as JSON); else call get_weather until a result is
    in the prompt, then answer with it (as JSON where asked)."""
    if "Paris is 21" in prompt:
        if "<tools>" not in prompt:
            return compact(TYPED_VALUE)
        return call(re.search(r'"name": "(\w+)"', prompt.rsplit("<tools>", 1)[1]).group(1), TYPED_VALUE)
    found = re.search(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
    if found is None:  # the check script's tool has a unit too (which the Agents SDK's strict schema requires)
        return call("get_weather", {"city": "Paris", **({"unit": "celsius"} if '"unit"' in prompt else {})})
    if "as JSON" in prompt:
        return compact({"city": "Paris", "temperature_c": float(found.group(1).split()[0])})
    return f"It is {found.group(1)} in Paris."


@pytest.fixture(scope="module")
def scripted(tokenizer):
    tok = tool_tokenizer(tokenizer)
    return scripted_pair(tok, weather_script), tok


def fresh_server(scripted):
    pair, tok = scripted
    for model in pair:
        model.seen.clear()
    return serve(pair, tok, k=3, max_tokens_limit=200, request_timeout=120)


@pytest.fixture
def server(scripted):
    srv = fresh_server(scripted)
    yield srv
    srv.stop()


class Traffic:
    """The request bodies a framework's client sent and the (whole, not streamed) responses it got."""

    def __init__(self):
        self.sent: list[dict] = []
        self.got: list[dict] = []

    def _request(self, request):
        self.sent.append(json.loads(request.content))

    def _response(self, response):
        if response.headers.get("content-type", "").startswith("application/json"):
            response.read()
            self.got.append(response.json())

    async def _arequest(self, request):
        self._request(request)

    async def _aresponse(self, response):
        if response.headers.get("content-type", "").startswith("application/json"):
            await response.aread()
            self.got.append(response.json())

    def openai_client(self, server):
        hooks = {"request": [self._arequest], "response": [self._aresponse]}
        return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                  http_client=httpx.AsyncClient(event_hooks=hooks))

    def chat_openai(self, server):
        from langchain_openai import ChatOpenAI

        hooks = {"request": [self._request], "response": [self._response]}
        return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                          http_client=httpx.Client(event_hooks=hooks))


def tools_of(body: dict) -> list[str]:
    return [tool["function"]["name"] for tool in body.get("tools", [])]


def sent_back(body: dict) -> tuple[dict, dict]:
    """The assistant turn with the call and the tool turn with its result, as a framework's second request holds
    them."""
    [asked] = [m for m in body["messages"] if m["role"] == "assistant"]
    [answered] = [m for m in body["messages"] if m["role"] == "tool"]
    return asked, answered


def check_sent_back(body: dict, result: str) -> None:
    asked, answered = sent_back(body)
    [called] = asked["tool_calls"]
    assert called["function"]["name"] == "get_weather" and json.loads(called["function"]["arguments"]) == {
        "city": "Paris"}
    assert answered["tool_call_id"] == called["id"] and answered["content"] == result


def agents_sdk():
    need("agents", "openai-agents")
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # the SDK sends its traces to OpenAI's servers otherwise
    import agents

    return agents


def agents_weather_tool(cities: list, result: str):
    from agents import function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        cities.append(city)
        return result

    return get_weather


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
def test_openai_agents_sdk_calls_the_tool_and_answers_with_its_result(server, streamed):
    agents = agents_sdk()
    traffic, cities = Traffic(), []
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=traffic.openai_client(server))
    agent = agents.Agent(name="weather", model=model, tools=[agents_weather_tool(cities, "17 C")])

    async def run_streamed():
        run = agents.Runner.run_streamed(agent, WEATHER)
        kinds = [event.type async for event in run.stream_events()]
        assert "raw_response_event" in kinds  # it really read our stream
        return run

    result = asyncio.run(run_streamed()) if streamed else agents.Runner.run_sync(agent, WEATHER)
    assert cities == ["Paris"]  # the SDK parsed our tool_calls (whole or from the stream's deltas) and ran its tool
    assert result.final_output == "It is 17 C in Paris."  # the second turn saw the result and answered in text
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                        "message_output_item"]
    assert len(traffic.sent) == 2
    for body in traffic.sent:  # auto mode: the SDK sets no tool_choice, no parallel_tool_calls, no max_tokens
        assert body.get("tool_choice", "auto") == "auto" and tools_of(body) == ["get_weather"]
        assert body["tools"][0]["function"]["strict"] is True and body.get("stream", False) is streamed
    check_sent_back(traffic.sent[1], "17 C")
    if not streamed:
        assert [r["choices"][0]["finish_reason"] for r in traffic.got] == ["tool_calls", "stop"]
        assert traffic.got[0]["speculative"]["forced_tokens"] > 0  # the call's grammar ran


def test_openai_agents_sdk_typed_output(server):
    agents = agents_sdk()
    traffic = Traffic()
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=traffic.openai_client(server))
    agent = agents.Agent(name="extractor", model=model, output_type=Weather)
    result = agents.Runner.run_sync(agent, TYPED)
    assert result.final_output == Weather(**TYPED_VALUE)
    [body] = traffic.sent
    assert "tools" not in body and "max_tokens" not in body
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["required"] == ["city", "temperature_c"]
    [got] = traffic.got
    assert got["choices"][0]["finish_reason"] == "stop" and json.loads(got["choices"][0]["message"]["content"]) == \
        TYPED_VALUE
    assert got["speculative"]["forced_tokens"] > 0  # the schema's grammar wrote the keys


def test_openai_agents_sdk_tools_with_a_typed_output(server):
    agents = agents_sdk()
    traffic, cities = Traffic(), []
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=traffic.openai_client(server))
    agent = agents.Agent(name="weather", model=model, tools=[agents_weather_tool(cities, "17 C")],
                         output_type=Weather)
    result = agents.Runner.run_sync(agent, WEATHER_AS_JSON)
    assert cities == ["Paris"]
    assert result.final_output == Weather(city="Paris", temperature_c=17.0)
    assert len(traffic.sent) == 2
    for body in traffic.sent:  # the typed agent's usual request: tools in auto mode beside a response_format
        assert tools_of(body) == ["get_weather"] and body.get("tool_choice", "auto") == "auto"
        assert body["response_format"]["type"] == "json_schema"
    first, second = (r["choices"][0] for r in traffic.got)
    assert first["finish_reason"] == "tool_calls" and first["message"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"
    assert second["finish_reason"] == "stop" and json.loads(second["message"]["content"]) == \
        {"city": "Paris", "temperature_c": 17.0}


def test_langgraph_react_agent_calls_the_tool_and_answers_with_its_result(server):
    need("langchain_openai", "langchain-openai")
    need("langgraph.prebuilt", "langgraph")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    traffic, cities = Traffic(), []

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        cities.append(city)
        return "23 C"

    with warnings.catch_warnings():  # moved to langchain.agents.create_agent in LangGraph 1.0, still shipped
        warnings.simplefilter("ignore")
        agent = create_react_agent(traffic.chat_openai(server), [get_weather])
    messages = agent.invoke({"messages": [("user", WEATHER)]})["messages"]
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    [called] = messages[1].tool_calls
    assert called["name"] == "get_weather" and called["args"] == {"city": "Paris"}
    assert messages[2].tool_call_id == called["id"] and messages[2].content == "23 C"
    assert cities == ["Paris"]
    assert messages[3].content == "It is 23 C in Paris." and not messages[3].tool_calls
    assert len(traffic.sent) == 2
    for body in traffic.sent:  # auto mode: ChatOpenAI sets no tool_choice, no parallel_tool_calls, no max_tokens
        assert body.get("tool_choice", "auto") == "auto" and tools_of(body) == ["get_weather"]
        assert body["stream"] is False and "max_tokens" not in body and "max_completion_tokens" not in body
    check_sent_back(traffic.sent[1], "23 C")
    assert [r["choices"][0]["finish_reason"] for r in traffic.got] == ["tool_calls", "stop"]
    assert traffic.got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # turn 2 reused turn 1's prefix


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(server, method):
    need("langchain_openai", "langchain-openai")
    traffic = Traffic()
    out = traffic.chat_openai(server).with_structured_output(Weather, method=method).invoke(TYPED)
    assert out == Weather(**TYPED_VALUE)
    [body], [got] = traffic.sent, traffic.got
    if method == "function_calling":  # one named call, parallel calls off
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
        assert body["parallel_tool_calls"] is False and tools_of(body) == ["Weather"]
        assert "response_format" not in body
        assert got["choices"][0]["finish_reason"] == "tool_calls"
        [called] = got["choices"][0]["message"]["tool_calls"]
        assert json.loads(called["function"]["arguments"]) == TYPED_VALUE
    else:
        assert "tools" not in body and body["response_format"]["json_schema"]["strict"] is True
        assert body["response_format"]["json_schema"]["name"] == "Weather"
        assert json.loads(got["choices"][0]["message"]["content"]) == TYPED_VALUE
    assert got["speculative"]["forced_tokens"] > 0


def test_pydantic_ai_typed_output_through_its_output_tool(server):
    need("pydantic_ai", "pydantic-ai-slim[openai]")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    traffic = Traffic()
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=traffic.openai_client(server)))
    result = Agent(model, output_type=Weather).run_sync(TYPED)
    assert result.output == Weather(**TYPED_VALUE)
    [body], [got] = traffic.sent, traffic.got
    # its output is a call of its own tool, "required", with no max_tokens: the answer must end after the call
    assert body["tool_choice"] == "required" and tools_of(body) == ["final_result"] and "max_tokens" not in body
    assert got["choices"][0]["finish_reason"] == "tool_calls" and len(got["choices"][0]["message"]["tool_calls"]) == 1


def test_the_check_script_on_a_scripted_server(scripted, tmp_path):
    for module, package in [("pydantic_ai", "pydantic-ai-slim[openai]"), ("agents", "openai-agents"),
                            ("langchain_openai", "langchain-openai"), ("langgraph.prebuilt", "langgraph")]:
        need(module, package)
    spec = importlib.util.spec_from_file_location("agent_frameworks_check", SCRIPT)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert TYPED == check.TYPED_PROMPT
    rows = []
    for framework in check.FRAMEWORKS:  # a server each: see the module's docstring
        with fresh_server(scripted) as server:
            out = tmp_path / f"{framework}.json"
            rows += check.main(["--url", server.url, "--frameworks", framework, "--json", str(out)])
            saved = json.loads(out.read_text())
            assert saved["model"] == MODEL and saved["results"] == rows[-2:]
    assert [(r["framework"], r["check"]) for r in rows] == [
        (f, c) for f in ("pydantic-ai", "openai-agents", "langgraph") for c in ("tool", "typed")]
    assert all(r["ok"] and "error" not in r for r in rows), rows
    for row in rows:
        if row["check"] == "tool":
            assert row["tool_calls"] == [{"city": "Paris", "unit": "celsius"}]
            assert row["output"] == f"It is {check.WEATHER_RESULT} in Paris."
            assert len(row["sent"]) == 2 and all(s["tools"] == ["get_weather"] for s in row["sent"])
        else:
            assert row["output"] == TYPED_VALUE and len(row["sent"]) == 1

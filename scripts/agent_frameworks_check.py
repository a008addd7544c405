"""Real agent frameworks from PyPI against a running `specdecode serve` (issue 42), each run as its users run it:
pydantic-ai, the OpenAI Agents SDK, and LangGraph's prebuilt ReAct agent over LangChain's ChatOpenAI (the [test]
extra installs all three). Per framework two checks:
  tool   the weather tool in auto mode: the model must call get_weather for Paris by its own tokens, the framework
         runs the tool (a fixed result) and sends it back, and the final answer must use that result;
  typed  a typed output (a pydantic model) extracted from a sentence by the framework's own typed-output path
         (pydantic-ai: an output tool under tool_choice "required"; Agents SDK and LangChain: response_format).
Printed per check: the calls made, whether the result was used or the typed value is right, seconds, and the fields
of each request that matter to the server (tool_choice, parallel_tool_calls, response_format, max_tokens, stream...).
Exit status 1 when a check fails.

    specdecode serve --port 8000 &        # the default pair, in another shell
    python scripts/agent_frameworks_check.py --url http://127.0.0.1:8000 --json agent_frameworks.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Literal

import httpx
from pydantic import BaseModel

WEATHER_PROMPT = "What's the weather in Paris right now, in celsius?"
WEATHER_RESULT = "Paris: 18 degrees celsius, light rain"
USED = "18"  # in the final answer only when the tool's result reached the model
TYPED_PROMPT = "Paris is 21 degrees celsius today."
FRAMEWORKS = ("pydantic-ai", "openai-agents", "langgraph")
SENT_FIELDS = ("tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens", "temperature", "stream")


class Weather(BaseModel):
    city: str
    temperature_c: float


class Recorder:
    """The request bodies a framework sent (through httpx hooks on its own client) and the tool calls it ran."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.calls: list[dict] = []

    def _keep(self, request) -> None:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))

    async def _keep_async(self, request) -> None:
        self._keep(request)

    def client(self, timeout: float, asynchronous: bool = False):
        if asynchronous:
            return httpx.AsyncClient(timeout=timeout, event_hooks={"request": [self._keep_async]})
        return httpx.Client(timeout=timeout, event_hooks={"request": [self._keep]})

    def tool(self):
        calls = self.calls

        def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
            """Get the current weather in a city.

            Args:
                city: The city's name.
                unit: The temperature unit.
            """
            calls.append({"city": city, "unit": unit})
            return WEATHER_RESULT

        return get_weather

    def sent(self) -> list[dict]:
        """Per request, the fields that matter to the server (those the framework set)."""
        rows = []
        for body in self.bodies:
            row = {k: body[k] for k in SENT_FIELDS if k in body}
            fmt = body.get("response_format")
            if fmt:
                row["response_format"] = fmt["type"] + (":strict" if fmt.get("json_schema", {}).get("strict") else "")
            row["tools"] = [t["function"]["name"] for t in body.get("tools", [])]
            rows.append(row)
        return rows


def openai_client(base: str, rec: Recorder, timeout: float):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base, api_key="none", max_retries=0, http_client=rec.client(timeout, True))


def run_pydantic_ai(base: str, model: str, rec: Recorder, typed: bool, opts) -> object:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    llm = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=openai_client(base, rec, opts.timeout)))
    settings = {"temperature": opts.temperature, **({"max_tokens": opts.max_tokens} if opts.max_tokens else {})}
    if typed:
        return Agent(llm, output_type=Weather, model_settings=settings).run_sync(TYPED_PROMPT).output
    return Agent(llm, tools=[rec.tool()], model_settings=settings).run_sync(WEATHER_PROMPT).output


def run_openai_agents(base: str, model: str, rec: Recorder, typed: bool, opts) -> object:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # its traces go to OpenAI's servers otherwise
    llm = OpenAIChatCompletionsModel(model=model, openai_client=openai_client(base, rec, opts.timeout))
    settings = ModelSettings(temperature=opts.temperature, max_tokens=opts.max_tokens)
    if typed:
        agent = Agent(name="extractor", model=llm, output_type=Weather, model_settings=settings)
        return Runner.run_sync(agent, TYPED_PROMPT).final_output
    agent = Agent(name="weather", model=llm, tools=[function_tool(rec.tool())], model_settings=settings)
    return Runner.run_sync(agent, WEATHER_PROMPT).final_output


def run_langgraph(base: str, model: str, rec: Recorder, typed: bool, opts) -> object:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(model=model, base_url=base, api_key="none", temperature=opts.temperature,
                     max_tokens=opts.max_tokens, max_retries=0, http_client=rec.client(opts.timeout))
    if typed:  # the default method (json_schema in langchain-openai 1.x)
        return llm.with_structured_output(Weather).invoke(TYPED_PROMPT)
    with warnings.catch_warnings():  # moved to langchain.agents.create_agent in LangGraph 1.0, still shipped
        warnings.simplefilter("ignore")
        agent = create_react_agent(llm, [tool(rec.tool())])
    return agent.invoke({"messages": [("user", WEATHER_PROMPT)]})["messages"][-1].content


RUNNERS = {"pydantic-ai": run_pydantic_ai, "openai-agents": run_openai_agents, "langgraph": run_langgraph}


def check(framework: str, typed: bool, base: str, model: str, opts) -> dict:
    rec = Recorder()
    row = {"framework": framework, "check": "typed" if typed else "tool"}
    start = time.perf_counter()
    try:
        out = RUNNERS[framework](base, model, rec, typed, opts)
    except Exception as exc:  # a failing framework is a result of the check; the others still run
        out, row["error"] = None, f"{type(exc).__name__}: {exc}"[:500]
    row["seconds"] = round(time.perf_counter() - start, 2)
    row["tool_calls"] = rec.calls
    if typed:
        row["output"] = out.model_dump() if isinstance(out, BaseModel) else out
        row["ok"] = isinstance(out, Weather) and "paris" in out.city.lower() and out.temperature_c == 21
    else:
        row["output"] = out if isinstance(out, str) or out is None else str(out)
        row["called"] = any("paris" in str(c["city"]).lower() for c in rec.calls)
        row["result_used"] = isinstance(out, str) and USED in out
        row["ok"] = row["called"] and row["result_used"]
    row["sent"] = rec.sent()
    return row


def report(row: dict) -> str:
    head = f"{row['framework']:<14} {row['check']:<6} {'ok' if row['ok'] else 'FAIL':<4} {row['seconds']:>7.1f} s"
    if row["check"] == "tool":
        calls = ", ".join(f"get_weather({json.dumps(c)})" for c in row["tool_calls"]) or "no tool call"
        detail = f"{calls}; result used: {'yes' if row['result_used'] else 'no'}; answer: {row['output']!r}"
    else:
        detail = f"typed output: {row['output']!r}"
    lines = [f"{head}  {detail}"] + [f"    sent: {json.dumps(s)}" for s in row["sent"]]
    return "\n".join(lines + ([f"    error: {row['error']}"] if "error" in row else []))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", help="the model id to ask for (default: the server's first)")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, help="sent by every framework (default: each one's own)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", metavar="OUT", help="write the results here")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    opts = parse_args(argv)
    url = opts.url.rstrip("/")
    model = opts.model or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    rows = []
    for framework in opts.frameworks:
        for typed in (False, True):
            rows.append(check(framework, typed, f"{url}/v1", model, opts))
            print(report(rows[-1]), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"url": url, "model": model, "results": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(row["ok"] for row in main()) else 1)

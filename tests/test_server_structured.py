"""Structured outputs on a live server: response_format json_schema and json_object on /v1/completions and
/v1/chat/completions, whole and streamed, give JSON that parses (and validates against its schema); constrained and
free rows share a batch and each gets its solo answer; a bad schema is a 400 that says what is wrong; an answer cut
by max_tokens ends with finish_reason "length"."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import openai_client
from test_server_helpers import MODEL, LiveServer, error_shape, make_generator, serve

from specdecode.server import ServerSettings, create_app

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Pick a colour."}]
# Small enough for tiny random-weight models to finish: the grammar forces the keys and punctuation.
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    srv = serve(tiny_pair, tokenizer, max_tokens_limit=256, max_batch_size=8, request_timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    return make_generator(tiny_pair, tokenizer)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


def _valid(text: str, schema: dict | None = None):
    value = json.loads(text)
    if schema is not None:
        jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_answers_validate_on_both_endpoints(client, seed):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=0.9, seed=seed,
                                          response_format=JSON_SCHEMA)
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    _valid(chat.choices[0].message.content, SCHEMA)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=0.9, seed=seed,
                                           extra_body={"response_format": JSON_SCHEMA})
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].text
    _valid(completion.choices[0].text, SCHEMA)


def test_json_object_answers_are_json_objects(client):
    finished = 0
    for seed in range(8):
        if finished >= 2:
            break
        res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.8,
                                             seed=seed, response_format={"type": "json_object"})
        text, reason = res.choices[0].message.content, res.choices[0].finish_reason
        if reason == "stop":
            finished += 1
            assert isinstance(_valid(text), dict), text
        else:  # cut by max_tokens: an unfinished object
            assert reason == "length" and text.lstrip().startswith("{"), text
    assert finished >= 1  # tiny random models write long strings: some answers run out of tokens
    # llama.cpp's form: a schema inside {"type": "json_object"}
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=0.9, seed=5,
                                    extra_body={"response_format": {"type": "json_object", "schema": SCHEMA}})
    assert res.choices[0].finish_reason == "stop"
    _valid(res.choices[0].text, SCHEMA)


def test_streamed_json_equals_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=96, temperature=1.0, seed=8, response_format=JSON_SCHEMA)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    _valid(whole, SCHEMA)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=1.0, seed=8,
                  extra_body={"response_format": JSON_SCHEMA})
    completion = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion
    _valid(completion, SCHEMA)


def test_constrained_and_free_rows_share_a_batch_and_each_equals_its_solo_answer(server):
    bodies = [
        {"prompt": PROMPT, "max_tokens": 64, "temperature": 0.9, "seed": 1, "response_format": JSON_SCHEMA},
        {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "seed": 1},
        {"prompt": "import numpy", "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_object"}},
        {"prompt": "import numpy", "max_tokens": 24, "temperature": 0},
        {"prompt": "The quick", "max_tokens": 64, "temperature": 0.7, "seed": 4, "n": 2, "logprobs": 2,
         "response_format": JSON_SCHEMA},
        {"prompt": "class Model", "max_tokens": 24, "temperature": 0.6, "top_k": 20, "seed": 9, "stop": ["\n"]},
    ]

    async def send(http, body):
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            solo = [await send(http, body) for body in bodies]  # one at a time: each alone in the batch
            together = await asyncio.gather(*(send(http, body) for body in bodies))
            return solo, together

    solo, together = asyncio.run(run())
    assert max(r["speculative"]["batch_size"] for r in together) > 1
    for body, alone, shared in zip(bodies, solo, together):
        assert alone["speculative"]["batch_size"] == body.get("n", 1)
        assert [c["text"] for c in shared["choices"]] == [c["text"] for c in alone["choices"]], body
        for a, b in zip(alone["choices"], shared["choices"]):
            assert (a["logprobs"] is None) == (b["logprobs"] is None) == ("logprobs" not in body)
            if a["logprobs"] is not None:
                assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
                assert b["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-4)
        if "response_format" in body:
            for choice in shared["choices"]:
                if choice["finish_reason"] == "stop":
                    _valid(choice["text"], SCHEMA if body["response_format"] is JSON_SCHEMA else None)


def test_an_answer_cut_by_max_tokens_ends_with_length(client):
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                         response_format=JSON_SCHEMA)
    choice = res.choices[0]
    assert choice.finish_reason == "length" and res.usage.completion_tokens == 3
    assert choice.message.content.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_schema_is_a_400_naming_the_problem(server, engine, stream):
    from specdecode.structured.constraints import ConstraintError

    with pytest.raises(ConstraintError) as info:
        engine.request([1, 2], constraint=engine.constraint(json_schema=BAD_SCHEMA))
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}
    for endpoint, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "a"})):
        r = httpx.post(f"{server.url}{endpoint}", json={**body, "response_format": bad, "stream": stream}, timeout=60)
        error = error_shape(r)
        assert r.status_code == 400 and error["param"] == "response_format", r.text
        assert error["type"] == "invalid_request_error" and str(info.value) in error["message"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_the_grammar_engine_is_built_at_start_up(tiny_pair, tokenizer):
    """Before any request: the first structured request's time to its first token does not pay for it."""
    generator = make_generator(tiny_pair, tokenizer)
    assert generator.grammar_cache() is None
    srv = LiveServer(create_app(generator, MODEL, tokenizer, ServerSettings())).start()
    try:
        assert generator.grammar_cache() is not None  # the compiler (shared by the tokenizer's generators) is there
        chat = openai_client(srv.url, timeout=120).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=96, temperature=0, response_format=JSON_SCHEMA)
        _valid(chat.choices[0].message.content, SCHEMA)
    finally:
        srv.stop()

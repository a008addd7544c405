"""min_p, logit_bias and the penalties through the HTTP API on a live server (tiny models): the official OpenAI client
sends each field (OpenAI's own ones as arguments, vLLM's min_p and repetition_penalty in extra_body) and gets what
the engine gives for the same options, greedy or seeded; bad values are 400s naming the field and its range."""

from __future__ import annotations

import httpx
import pytest

from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, chat_ids, make_generator, openai_client, serve

PROMPT = "def quicksort(arr):"
MESSAGES = [{"role": "user", "content": "Sort a list."}]
OPENAI = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"17": 3, "40": -100})  # the client's own
EXTRA = dict(min_p=0.05, repetition_penalty=1.3)  # vLLM's, in the body
ENGINE = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={17: 3, 40: -100}, **EXTRA)


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    srv = serve(tiny_pair, tokenizer, max_tokens_limit=64, max_batch_size=8, request_timeout=60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    return make_generator(tiny_pair, tokenizer)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 21)])
def test_the_openai_client_sends_each_option_and_gets_the_engines_answer(client, engine, tokenizer, temperature,
                                                                         seed):
    kwargs = dict(model=MODEL, max_tokens=24, temperature=temperature, seed=seed, **OPENAI, extra_body=EXTRA)
    text = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    expected = engine.generate(PROMPT, max_new_tokens=24, temperature=temperature, seed=seed, **ENGINE)
    assert text == expected.texts[0]
    chat = client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.content
    ids = chat_ids(tokenizer, MESSAGES)
    assert chat == engine.generate([ids], max_new_tokens=24, temperature=temperature, seed=seed, **ENGINE).texts[0]
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=temperature, seed=seed)
    assert free.choices[0].text != text  # the options changed the answer


def test_each_field_alone_reaches_the_engine(client, engine):
    """One field at a time, greedy: each gives the engine's answer with that option alone."""
    for name, value, engine_value in [("presence_penalty", 1.5, 1.5), ("frequency_penalty", 1.0, 1.0),
                                      ("logit_bias", {"17": 5}, {17: 5}), ("repetition_penalty", 1.5, 1.5),
                                      ("min_p", 0.2, 0.2)]:
        body = {name: value}
        extra = body if name in EXTRA else {}
        sent = {} if extra else body
        text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0, **sent,
                                         extra_body=extra).choices[0].text
        assert text == engine.generate(PROMPT, max_new_tokens=16, temperature=0.0, **{name: engine_value}).texts[0]


def test_a_stream_with_the_options_is_the_same_answer(client, engine):
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
                                       **OPENAI, extra_body=EXTRA)
    assert "".join(c.choices[0].text for c in chunks) == engine.generate(
        PROMPT, max_new_tokens=24, temperature=0.0, **ENGINE).texts[0]


BAD = [  # (field, value, what the message must say)
    ("presence_penalty", 2.5, "less than or equal to 2"),
    ("presence_penalty", -2.01, "greater than or equal to -2"),
    ("frequency_penalty", 3, "less than or equal to 2"),
    ("frequency_penalty", "1", "valid number"),
    ("repetition_penalty", 0, "greater than 0"),
    ("repetition_penalty", -1.2, "greater than 0"),
    ("min_p", -0.1, "greater than or equal to 0"),
    ("min_p", 1.5, "less than or equal to 1"),
    ("logit_bias", {"5": 101}, "less than or equal to 100"),
    ("logit_bias", {"5": -100.5}, "greater than or equal to -100"),
    ("logit_bias", {"five": 1}, "keys are token ids of this model's vocabulary, integers in [0, 320)"),
    ("logit_bias", {"-1": 1}, "keys are token ids of this model's vocabulary"),
    ("logit_bias", {"320": 1}, "logit_bias has the key '320'"),
    ("logit_bias", [5, 1], "valid dictionary"),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, message", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_bad_values_are_400s_naming_the_field(server, endpoint, field, value, message):
    body = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(f"{server.url}{endpoint}", json={**body, "max_tokens": 2, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert message in error["message"], error["message"]


def test_the_limits_themselves_are_accepted(server):
    body = {"prompt": PROMPT, "max_tokens": 2, "presence_penalty": -2, "frequency_penalty": 2, "min_p": 1,
            "repetition_penalty": 0.01, "logit_bias": {"0": -100, "319": 100}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- the playground
PLAYGROUND_HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const values = JSON.parse(process.argv[1]);  // node -e: argv[1] is the first argument
const element = (id) => ({ value: values[id] ?? "", textContent: "", innerHTML: "", className: "", style: {},
  dataset: {}, disabled: false, addEventListener() {}, appendChild() {}, replaceChildren() {}, setAttribute() {},
  querySelectorAll: () => [], classList: { add() {}, remove() {}, toggle() {} } });
const elements = {};
const document = { getElementById: (id) => (elements[id] ??= element(id)), body: { dataset: {} },
  querySelector: () => ({ value: values.mode || "completion" }), querySelectorAll: () => [],
  createElement: () => element(""), createElementNS: () => element("") };
const context = { document, window: { addEventListener() {} }, location: { origin: "http://test" }, console,
  fetch: () => new Promise(() => {}), performance: { now: () => 0 }, setTimeout, clearTimeout };
vm.createContext(context);
vm.runInContext(fs.readFileSync(process.argv[2], "utf8") +
  "\n;globalThis.build = () => buildRequest(readSettings(), 'default');", context);
try { console.log(JSON.stringify(context.build())); } catch (e) { console.log(JSON.stringify({ error: e.message })); }
"""


def playground_request(fields: dict) -> dict:
    """The request the playground's page builds from these settings fields (its own script, run by node with a
    stand-in for the page)."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    import specdecode.server

    node = shutil.which("node")
    if node is None:
        pytest.skip("the playground's settings check runs its script with node")
    script = Path(specdecode.server.__file__).parent / "static" / "playground.js"
    out = subprocess.run([node, "-e", PLAYGROUND_HARNESS, json.dumps(fields), str(script)], capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_playground_sends_the_options_it_is_given(server, engine):
    fields = {"prompt": PROMPT, "max-tokens": "16", "temperature": "0", "min-p": "0.05", "presence-penalty": "1.2",
              "frequency-penalty": "0.6", "repetition-penalty": "1.3", "logit-bias": "17:3, 40:-100"}
    request = playground_request(fields)
    assert request["path"] == "/v1/completions"
    body = request["body"]
    assert {k: body[k] for k in ENGINE} == {**OPENAI, **EXTRA}
    assert "min_p" not in playground_request({"prompt": PROMPT})["body"]  # unset: left out
    assert playground_request({"prompt": PROMPT, "logit-bias": '{"17": 2}'})["body"]["logit_bias"] == {"17": 2}
    for bad in ("17=3", "x:1", "17:", "17:1:2"):
        assert "logit bias takes token id:value pairs" in playground_request({"prompt": PROMPT, "logit-bias": bad})[
            "error"]
    answer = httpx.post(f"{server.url}{request['path']}", json={**body, "stream": False}, timeout=60).json()
    assert answer["choices"][0]["text"] == engine.generate(PROMPT, max_new_tokens=16, temperature=0.0,
                                                           **ENGINE).texts[0]

"""The playground page (GET /) in a real headless Chromium against a live server on the tiny models, and the
"specdecode" streaming extension it relies on (token provenance and running statistics), over plain HTTP."""

from __future__ import annotations

import json
import shutil
import tempfile

import httpx
import pytest

from specdecode.server import ServerSettings, create_app
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer, make_generator

PROMPT = "def quicksort(arr):"
PROVENANCES = {"accepted", "resampled", "bonus", "target"}
STATS = {"acceptance_rate", "mean_accepted_length", "proposed_tokens", "accepted_tokens", "verification_steps",
         "new_tokens"}
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    app = create_app(make_generator(tiny_pair, tokenizer, k=4), MODEL, tokenizer,
                     ServerSettings(max_tokens_limit=256, request_timeout=60))
    with LiveServer(app) as srv:
        yield srv


def sse_chunks(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request, up to [DONE] (which must come)."""
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def extension_tokens(chunks: list[dict]) -> list[tuple[dict, dict]]:
    return [(token, c["specdecode"]["stats"]) for c in chunks if "specdecode" in c for token in
            c["specdecode"]["tokens"]]


# ---------------------------------------------------------------------------------------------- the extension (HTTP)
def test_completion_stream_carries_provenance_and_running_stats(server):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "num_speculative_tokens": 3}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    chunks = sse_chunks(server.url, "/v1/completions", {**body, "stream": True, "stream_options":
                                                       {"include_usage": True}, "specdecode": {"provenance": True}})
    tokens = extension_tokens(chunks)
    assert len(tokens) == whole["usage"]["completion_tokens"]  # one entry per generated token
    for token, stats in tokens:
        assert set(token) == {"id", "text", "provenance", "step", "num_drafts"} and set(stats) == STATS
        assert token["provenance"] in PROVENANCES and 0 <= token["num_drafts"] <= 3
    assert "".join(t["text"] for t, _ in tokens) == whole["choices"][0]["text"]
    # the text of each chunk is its token's text: a plain OpenAI client reads the same answer
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    kinds = [t["provenance"] for t, _ in tokens]
    assert kinds[0] == "target" and {"accepted", "resampled"} & set(kinds)  # the prefill's token, then drafts
    last = tokens[-1][1]
    assert last["new_tokens"] == len(tokens)
    assert last["accepted_tokens"] == kinds.count("accepted")
    final = chunks[-1]["speculative"]  # the usage chunk's exact per-request statistics
    assert last["verification_steps"] == final["verification_steps"]
    assert last["mean_accepted_length"] == pytest.approx(final["mean_accepted_length"])
    assert last["proposed_tokens"] == final["proposed_tokens"]
    steps = [t["step"] for t, _ in tokens]
    assert steps == sorted(steps)  # tokens come in step order


def test_plain_request_and_chat_stream(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    plain = sse_chunks(server.url, "/v1/completions", {**body, "num_speculative_tokens": 0,
                                                      "specdecode": {"provenance": True}})
    tokens = extension_tokens(plain)
    assert tokens and {t["provenance"] for t, _ in tokens} == {"target"}  # K = 0: no drafts at all
    assert {t["num_drafts"] for t, _ in tokens} == {0} and tokens[-1][1]["proposed_tokens"] == 0
    assert tokens[-1][1]["mean_accepted_length"] == 1.0
    without = sse_chunks(server.url, "/v1/completions", body)
    assert all("specdecode" not in c for c in without)  # only on request
    assert "".join(c["choices"][0]["text"] for c in without) == "".join(t["text"] for t, _ in tokens)
    chat = sse_chunks(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 8, "temperature": 0, "stream": True,
                                                           "specdecode": {"provenance": True}})
    chat_tokens = extension_tokens(chat)
    assert chat_tokens and "".join(t["text"] for t, _ in chat_tokens) == \
        "".join(c["choices"][0]["delta"].get("content", "") for c in chat if c["choices"])
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "specdecode": {"provenance": "yes"}})
    assert bad.status_code == 400
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert "provenance" in schema["SpecdecodeOptions"]["properties"]
    k = next(b for b in schema["CompletionRequest"]["properties"]["num_speculative_tokens"]["anyOf"]
             if b.get("type") == "integer")
    assert k["minimum"] == 0


def test_page_and_static_files_are_served(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/playground.js" in page.text and "://" not in page.text  # nothing fetched from elsewhere
    for name, kind in (("playground.js", "javascript"), ("playground.css", "css")):
        response = httpx.get(f"{server.url}/static/{name}")
        assert response.status_code == 200 and kind in response.headers["content-type"]
    assert httpx.get(f"{server.url}/static/..%2Fapp.py").status_code == 404
    assert httpx.get(f"{server.url}/static/app.py").status_code == 404


# ---------------------------------------------------------------------------------------------- the page (browser)
@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("the playground browser test needs Chromium and chromedriver (apt install chromium "
                    "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="specdecode-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver, predicate, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate(d))


def set_field(driver, element_id: str, value: str) -> None:
    """Set an input's value as typing would (select-all, then the new text)."""
    element = driver.find_element("id", element_id)
    element.clear()
    if value:
        element.send_keys(value)


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def run_and_wait(driver, button_id: str) -> str:
    driver.find_element("id", button_id).click()
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.state") == "idle"
             and text_of(d, "status") in ("done", "error", "stopped"))
    return text_of(driver, "status")


def test_playground_in_a_browser(server, browser):
    driver = browser
    driver.get(f"{server.url}/")
    wait_for(driver, lambda d: text_of(d, "target-name") == MODEL)
    assert text_of(driver, "health") == "ready" and text_of(driver, "server-k") == "4"
    # the K choices come after the server's OpenAPI schema (its largest K), a request after the model's name
    k_choices = "return [...document.querySelectorAll('#k option')].map(o => o.value)"
    wait_for(driver, lambda d: len(d.execute_script(k_choices)) > 2)
    options = driver.execute_script(k_choices)
    assert options[:2] == ["default", "auto"] and "0" in options and "3" in options

    # a greedy generation, streamed, each token coloured by provenance
    set_field(driver, "prompt", PROMPT)
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", "40")
    driver.find_element("css selector", '#k option[value="3"]').click()
    assert run_and_wait(driver, "generate") == "done", text_of(driver, "error")
    kinds = driver.execute_script(
        "return [...document.querySelectorAll('#output .tok')].map(s => s.classList[1])")
    assert kinds and set(kinds) <= PROVENANCES and {"accepted", "resampled"} & set(kinds)
    title = driver.find_element("css selector", "#output .tok").get_attribute("title")
    assert "token id" in title and "step" in title
    expected = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40,
                                                                "temperature": 0}, timeout=60).json()
    assert text_of(driver, "output") == expected["choices"][0]["text"]
    counters = {name: text_of(driver, f"c-{name}") for name in ("tps", "acceptance", "mal", "k", "tokens", "steps")}
    assert float(counters["tps"]) > 0 and 0 <= float(counters["acceptance"].rstrip("%")) <= 100, counters
    assert float(counters["mal"]) >= 1 and 0 <= int(counters["k"]) <= 3, counters
    assert int(counters["tokens"]) == expected["usage"]["completion_tokens"] and int(counters["steps"]) > 0
    assert driver.execute_script("return document.querySelectorAll('#chart rect').length") == int(counters["steps"])
    assert not driver.find_element("id", "error").is_displayed()

    # race: plain then speculative, both shown, a speedup, and the greedy outputs compared
    assert run_and_wait(driver, "race") == "done", text_of(driver, "error")
    plain, spec = text_of(driver, "race-plain"), text_of(driver, "race-spec")
    assert plain == spec == expected["choices"][0]["text"]
    assert set(driver.execute_script(
        "return [...document.querySelectorAll('#race-plain .tok')].map(s => s.classList[1])")) == {"target"}
    assert "speedup" in text_of(driver, "race-speedup") and "×" in text_of(driver, "race-speedup")
    assert "identical" in text_of(driver, "race-identical")

    # a bad setting: the server's 400 is shown in the page
    set_field(driver, "top-p", "0")
    set_field(driver, "temperature", "0.8")
    assert run_and_wait(driver, "generate") == "error"
    error = driver.find_element("id", "error")
    assert error.is_displayed() and "Bad settings" in error.text and "top_p" in error.text, error.text

    # chat mode streams through /v1/chat/completions
    set_field(driver, "top-p", "1")
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", "8")
    driver.find_element("css selector", 'input[name="mode"][value="chat"]').click()
    assert run_and_wait(driver, "generate") == "done", text_of(driver, "error")
    assert driver.execute_script("return document.querySelectorAll('#output .tok').length") > 0
    assert not driver.find_element("id", "error").is_displayed()


def test_playground_shows_a_server_that_went_away(tiny_pair, tokenizer, browser):
    app = create_app(make_generator(tiny_pair, tokenizer), MODEL, tokenizer, ServerSettings())
    srv = LiveServer(app).start()
    browser.get(f"{srv.url}/")
    wait_for(browser, lambda d: text_of(d, "target-name") == MODEL)
    srv.stop()
    assert run_and_wait(browser, "generate") == "error"
    assert "Cannot reach the server" in browser.find_element("id", "error").text

"""The speculation policy's one-line explanation where users meet it: `generate -v`, `compare`, the server's
/metrics (gauges and an info metric), and the playground's reading of it (its own parser, run by Node)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources

import httpx
import pytest

from specdecode.server import ServerSettings, create_app
from test_cli import FAST, json_lines, ok
from test_playground import browser  # noqa: F401  (a fixture: headless Chromium, skipped without it)
from test_server_helpers import one_torch_thread  # noqa: F401  (an autouse fixture)
from test_server_helpers import MODEL, LiveServer, make_generator, metric, metric_values

PROMPT = "def quicksort(arr):"
LINE = re.compile(r"^(plain decoding on \d+ of \d+ steps( \(\d+ probes?\))?|speculating on \d+ of \d+ steps \(mean K [\d.]+\)|"
                  r"fixed K=\d+ on \d+ steps)(; no draft can pay at these costs even if all were kept, so nothing is "
                  r"drafted or probed)?: draft step [\d.]+ of a target step( \(not yet timed\))?, "
                  r"verifying \d+ tokens [\d.]+ steps( \(not yet timed\))?; at the measured \d+ % acceptance"
                  r"( \(\d+ drafts? so far\))? K=\d+ (gives|would give) [\d.]+×")


@pytest.fixture(scope="module")
def pair(tiny_model_dirs):
    return ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], *FAST]


def _policy_lines(text: str) -> list[str]:
    return [line[len("policy: "):] for line in text.splitlines() if line.startswith("policy: ")]


@pytest.mark.parametrize("k", ["auto", "3"])
def test_generate_verbose_prints_what_stats_carry(pair, k):
    result = ok("generate", PROMPT, *pair, "-n", 24, "--ignore-eos", "-k", k, "-v", "--json")
    [record] = json_lines(result)
    summary = record["stats"]["policy_summary"]
    [line] = _policy_lines(result.stderr)
    assert line == summary["explanation"] and LINE.match(line), line
    assert line.startswith("fixed K=3") if k == "3" else not line.startswith("fixed")
    for key in ("draft_step_cost", "verify_cost", "acceptance_rate", "best_k", "expected_speedup",
                "speedup_by_k", "batch_size"):
        assert key in summary
    assert f"draft step {summary['draft_step_cost']:.2f} of a target step" in line
    assert f"{100 * summary['acceptance_rate']:.0f} % acceptance" in line


def test_generate_without_a_draft_says_nothing_of_a_policy(tiny_model_dirs):
    result = ok("generate", PROMPT, "--target", tiny_model_dirs["target"], "--draft", "none", "-n", 6, "-v")
    assert not _policy_lines(result.stderr)


def test_compare_prints_the_line(pair):
    result = ok("compare", PROMPT, *pair, "-n", 16, "--ignore-eos", "--no-warmup")
    [line] = _policy_lines(result.stdout)
    assert LINE.match(line), line


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    app = create_app(make_generator(tiny_pair, tokenizer, k="auto"), MODEL, tokenizer,
                     ServerSettings(max_tokens_limit=256, request_timeout=60))
    with LiveServer(app) as srv:
        yield srv


def test_metrics_carry_the_policy(server):
    before = httpx.get(f"{server.url}/metrics").text
    assert 'specdecode_policy_info{explanation="no steps yet",policy="adaptive"} 1.0' in before
    assert "specdecode_policy_expected_speedup" not in before  # priors are not measurements
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    values = metric_values(server.url)
    [info] = [labels for (name, labels) in values if name == "specdecode_policy_info"]
    explanation = dict(info)["explanation"]
    assert LINE.match(explanation), explanation
    best = metric(values, "specdecode_policy_best_k")
    assert 1 <= best <= 8 and f"K={best:.0f} " in explanation
    assert metric(values, "specdecode_policy_verify_cost", tokens="1") == 1.0
    assert metric(values, "specdecode_policy_draft_step_cost") > 0
    assert 0 <= metric(values, "specdecode_policy_acceptance_rate") <= 1
    assert metric(values, "specdecode_policy_target_step_seconds") > 0
    steps = sum(v for (name, _), v in values.items() if name == "specdecode_policy_steps")
    assert steps >= 1 and f" of {steps:.0f} steps" in explanation


@pytest.mark.skipif(shutil.which("node") is None, reason="runs the playground's parser in Node (apt install nodejs)")
def test_the_playground_reads_the_explanation_from_metrics(server):
    """The page's own policyExplanation(), taken from playground.js, on the server's real /metrics text."""
    httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
               timeout=60)
    text = httpx.get(f"{server.url}/metrics").text
    source = resources.files("specdecode.server").joinpath("static/playground.js").read_text(encoding="utf-8")
    start = source.index("function policyExplanation(")
    function = source[start:source.index("\n}\n", start) + 2]
    script = f"{function}\nprocess.stdout.write(JSON.stringify(policyExplanation({json.dumps(text)})));"
    shown = json.loads(subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True).stdout)
    [info] = [labels for (name, labels) in metric_values(server.url) if name == "specdecode_policy_info"]
    assert shown == dict(info)["explanation"] and LINE.match(shown)
    tricky = 'specdecode_policy_info{explanation="a \\"quoted\\" word, a \\\\ and\\na line",policy="x"} 1.0\n'
    script = f"{function}\nprocess.stdout.write(JSON.stringify(policyExplanation({json.dumps(tricky)})));"
    assert json.loads(subprocess.run(["node", "-e", script], capture_output=True, text=True,
                                     check=True).stdout) == 'a "quoted" word, a \\ and\na line'


def test_the_playground_shows_the_explanation(server, browser):
    """After a generation the page shows the server's policy line under the chart (Chromium; skipped without it)."""
    from test_playground import run_and_wait, set_field, text_of, wait_for

    browser.get(f"{server.url}/")
    wait_for(browser, lambda d: text_of(d, "target-name") == MODEL)
    assert not browser.find_element("id", "policy").is_displayed()
    set_field(browser, "prompt", PROMPT)
    set_field(browser, "max-tokens", "24")
    assert run_and_wait(browser, "generate") == "done", text_of(browser, "error")
    assert browser.find_element("id", "policy").is_displayed()
    shown = text_of(browser, "policy-line")
    [info] = [labels for (name, labels) in metric_values(server.url) if name == "specdecode_policy_info"]
    assert shown == dict(info)["explanation"] and LINE.match(shown), shown

"""Same request, same answer (issue 78): on a CPU the CLI's and server's policy keeps its prior's costs (fixed costs),
so K, and with it the size of every forward (which changes how llama.cpp rounds a logit), is a function of the tokens
alone, never of the clock. Run after run, process after process, a greedy or seeded request gives one text."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from specdecode.policy.choose import AdaptivePolicy, Outcome, Outlook
from specdecode.policy.estimates import CostPrior
from test_server_helpers import CLIServer, free_port

# A text that repeats itself: copies of several lengths, so the policy has K to choose all along
COPY_PROMPT = ("def area(width, height):\n    return width * height\n\n" * 3 +
               "def volume(width, height, depth):\n    return area(width, height) * depth\n\n" * 2 +
               "Write both functions again, then a third one, perimeter(width, height), in the same style.\n")


def _run_policy(fixed: bool, clock_seed: int) -> list[int]:
    """The Ks a policy picks over a fixed stream of outcomes (copies of varying class and acceptance), its step
    timings drawn from a noisy clock of its own."""
    noise = random.Random(clock_seed)
    tokens = random.Random(0)  # the text: the same for every clock
    policy = AdaptivePolicy(8, prior=CostPrior.cpu(), max_copy_k=64, fixed_costs=fixed)
    rows, ks = [policy.new_row()], []
    for _ in range(300):
        cls = tokens.randrange(8)
        k = policy.decide(Outlook(rows, [tokens.choice((2, 8, 30, 64))], free=True, classes=[cls],
                                  behind=[0], probe_behind=[0], remaining=[10_000])).k
        kept = min(k, tokens.randrange(k + 1) if cls < 5 else k)
        seconds = 0.05 * (1 + 0.4 * k) * noise.uniform(0.5, 2.0)  # another process, the page cache, a GC...
        policy.learn(Outcome(rows, k, [kept], [k], 1, 0.0 if k else None, seconds, free=True))
        ks.append(k)
    return ks


def test_fixed_costs_make_k_a_function_of_the_tokens_alone():
    assert _run_policy(True, 1) == _run_policy(True, 2) == _run_policy(True, 3)
    # the clock reaches K where costs are timed (so the check above can fail)
    assert len({tuple(_run_policy(False, seed)) for seed in (1, 2, 3)}) > 1


def test_fixed_costs_are_the_priors_and_never_read_as_seconds():
    policy = AdaptivePolicy(8, prior=CostPrior.measured({2: 1.5, 3: 2.0, 9: 5.0}), fixed_costs=True)
    row = policy.new_row()
    policy.decide(Outlook([row], [8]))
    policy.learn(Outcome([row], 2, [2], [2], 1, 123.0, 456.0, catch_up_tokens=10, catch_up_s=7.0))
    assert policy.verify_cost(3, 1) == 2.0  # v(3) of the prior, not the 456 s the clock said
    assert policy.figures()["target_step_s"] is None  # no seconds were measured


@pytest.fixture(scope="module")
def smol_serve(smol_path, tmp_path_factory):
    """`specdecode serve` on SmolLM2 (llama.cpp) with copies drafted (suffix), one thread, a fresh process per call."""
    def start() -> CLIServer:
        port = free_port()
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        return CLIServer(["--target", smol_path, "--draft", "suffix", "--threads", "1", "--port", str(port),
                          "--max-batch-size", "1"], log, port)
    return start


def _ask(url: str, **extra) -> tuple[str, int]:
    body = {"model": "x", "prompt": COPY_PROMPT, "max_tokens": 300, "ignore_eos": True, **extra}
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=300).json()
    return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]


def test_fresh_servers_give_one_text_for_the_same_request(smol_serve):
    """Three fresh processes, the same greedy and the same seeded request: one text each (time.sleep between
    starts and a busy clock do not enter)."""
    greedy, seeded = set(), set()
    for _ in range(3):
        with smol_serve() as server:
            greedy.add(_ask(server.url, temperature=0))
            seeded.add(_ask(server.url, temperature=0.8, seed=7))
        time.sleep(0.1)
    assert len(greedy) == 1 and len(seeded) == 1
    (text, n), = greedy
    assert n == 300 and text.strip()

"""`specdecode advise`: its arithmetic on hand-made numbers, and its report on the tiny fixture models (the numbers
it prints must be the ones its own formula gives from the costs and acceptance it reports)."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.advise import (MARGIN, DraftCost, acceptance_of, predicted_speedup, recommend, roofline,
                                     speedup_at_length, step_time)
from test_cli import FAST, ok

SHORT = ["--nb-prompts", 2, "-n", 16, "--cost-repeats", 1, "--threads", 1]


# ---------------------------------------------------------------------------------------------- the arithmetic
def test_a_drafter_that_always_drafts_follows_leviathan():
    """P_j = 1, a constant acceptance a, c2 = c: (1 - a^(K+1)) / ((1 - a)(K c + v(K+1)))."""
    a, c = 0.8, 0.2
    verify = {n: 1 + 0.3 * (n - 1) for n in range(1, 10)}
    for k in range(1, 9):
        closed = (1 - a ** (k + 1)) / ((1 - a) * (k * c + verify[k + 1]))
        assert predicted_speedup([a] * 8, [1.0] * 8, k, DraftCost(c, c), verify) == pytest.approx(closed)


def test_the_draft_pays_for_two_tokens_after_a_full_acceptance_and_for_its_prompt():
    a, c, c2 = 0.9, 0.3, 0.5
    verify = {n: 1 + 0.2 * (n - 1) for n in range(1, 10)}
    draft = DraftCost(c, c2, prefill=6.0)
    for k in (1, 3):
        steady = 3 * c + verify[4] + (c2 - c) * a ** 3 if k == 3 else c2 * a + c * (1 - a) + verify[2]
        assert step_time([a] * 8, [1.0] * 8, k, draft, verify) == pytest.approx(steady)
        tokens = sum(a ** j for j in range(k + 1))
        assert speedup_at_length([a] * 8, [1.0] * 8, k, draft, verify, 40) == \
            pytest.approx(40 / (40 / tokens * steady + 6.0))


def test_a_drafter_with_nothing_to_offer_costs_a_plain_step():
    verify = {n: float(n) for n in range(1, 10)}
    free = DraftCost()
    assert step_time([0.0] * 8, [0.0] * 8, 5, free, verify) == 1.0
    assert predicted_speedup([0.0] * 8, [0.0] * 8, 5, free, verify) == 1.0
    # half the steps offer 2 drafts, the rest none: half the forwards are of 3 tokens, half of 1
    assert step_time([0.5, 0.5, 0.0], [0.5, 0.5, 0.0], 3, free, verify) == pytest.approx(0.5 * 1 + 0.5 * 3)


def test_acceptance_per_position_from_counts():
    """Of 10 steps, draft 1 was kept in 8, drafts 1-2 in 6, 1-3 in 3: a = 0.8, 0.75, 0.5, and 0 after a position
    never kept."""
    assert acceptance_of([8, 6, 3, 0, 0], 10) == pytest.approx([0.8, 0.75, 0.5, 0.0, 0.0])
    assert acceptance_of([0, 0], 0) == [0.0, 0.0]


def test_plain_decoding_where_no_draft_can_pay():
    verify = {n: float(n) for n in range(1, 10)}  # a forward of n tokens costs n steps
    roof = roofline(verify, 8)
    assert roof == {"k": 0, "speedup": 1.0}
    report = {"name": "model", "best_k": 1, "best_speedup": 0.8, "acceptance": [0.9], "proposal": [1.0],
              "draft_step_cost": 0.3}
    advice = recommend([report], roof, verify)
    assert advice["drafter"] is None and advice["k"] == 0
    assert advice["text"].startswith("plain decoding: no draft can pay on this machine")
    assert "a forward of 2 tokens costs 2.00 target steps" in advice["text"]


def test_recommends_the_best_drafter_beyond_the_noise():
    verify = {n: 1 + 0.1 * (n - 1) for n in range(1, 10)}
    roof = roofline(verify, 8)
    assert roof["k"] == 8 and roof["speedup"] == pytest.approx(9 / 1.8)
    model = {"name": "model", "best_k": 3, "best_speedup": 1.6, "acceptance": [0.9], "proposal": [1.0],
             "draft_step_cost": 0.1}
    lookup = {"name": "prompt-lookup", "best_k": 4, "best_speedup": 1.9, "acceptance": [0.3], "proposal": [0.4],
              "draft_step_cost": 0.0}
    advice = recommend([model, lookup], roof, verify)
    assert (advice["drafter"], advice["k"], advice["expected_speedup"]) == ("prompt-lookup", 4, 1.9)
    assert "--draft prompt-lookup -k 4" in advice["text"]
    close = dict(model, best_speedup=1 + MARGIN / 2)  # within the noise: not worth a second model
    advice = recommend([close], roof, verify)
    assert advice["drafter"] is None and "model at K=3, would give 1.02×" in advice["text"]
    assert "90 % of first drafts kept, a draft step costs 0.10 target steps" in advice["text"]


# ---------------------------------------------------------------------------------------------- the command
def _recomputed(drafter: dict, k: int, verify: dict[int, float], new_tokens: int) -> tuple[float, float]:
    """(E(K) / time(K), the speedup over new_tokens with the draft's prompt), written out again from the report's
    own fields."""
    a, offered, c, c2 = drafter["acceptance"], drafter["proposal"], drafter["draft_step_cost"], \
        drafter["draft_pair_cost"]
    tokens, run = 1.0, 1.0
    for j in range(k):
        run *= a[j]
        tokens += run
    at_least = [1.0] + offered[:k] + [0.0]  # P(min(K, L) >= n), n = 0..K+1
    seconds = c * sum(offered[:k]) + (c2 - c) * run + \
        sum((at_least[n] - at_least[n + 1]) * verify[n + 1] for n in range(k + 1))
    return tokens / seconds, new_tokens / (new_tokens / tokens * seconds + drafter["draft_prefill_cost"])


def test_advise_json_is_consistent(tiny_model_dirs):
    pair = ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], *FAST]
    report = json.loads(ok("advise", *pair, *SHORT, "-k", 4, "--json").stdout)
    verify = {int(n): v for n, v in report["costs"]["v"].items()}
    assert sorted(verify) == [1, 2, 3, 4, 5] and verify[1] == 1.0
    assert report["costs"]["verify_ms"]["5"] / report["costs"]["target_step_ms"] == pytest.approx(verify[5])
    assert [d["name"] for d in report["drafters"]] == ["model", "prompt-lookup", "suffix"]
    assert "suffix" not in report["skipped"]
    assert report["plain"]["decode_tokens_per_second"] > 0
    for drafter in report["drafters"]:
        steps = drafter["steps"]
        assert steps > 0 and len(drafter["acceptance"]) == len(drafter["proposal"]) == 4
        survival = 1.0
        for j, a in enumerate(drafter["acceptance"]):  # prod a_i = S_j, from the counts reported
            survival *= a
            assert survival == pytest.approx(drafter["accepted_per_position"][j] / steps)
            assert drafter["proposal"][j] == pytest.approx(drafter["proposed_per_position"][j] / steps)
        for row in drafter["by_k"]:
            steady, at_length = _recomputed(drafter, row["k"], verify, 15)  # -n 16: 15 after the prefill's
            assert row["speedup"] == pytest.approx(steady) and row["speedup_at_length"] == pytest.approx(at_length)
            assert row["speedup"] == pytest.approx(row["expected_tokens"] / row["step_time"])
        best = max(drafter["by_k"], key=lambda r: r["speedup_at_length"])
        assert (drafter["best_k"], drafter["best_speedup"]) == (best["k"], best["speedup_at_length"])
        measured = {row["k"] for row in drafter["by_k"] if row["measured_speedup"] is not None}
        assert measured == {4, drafter["best_k"]}  # the run at the largest K, and the best K's own run
        plain = report["plain"]
        for row in drafter["by_k"]:  # the target's prefill as measured, decoding at the predicted speed
            whole = (plain["prefill_time_s"] + plain["decode_time_s"]) / \
                (plain["prefill_time_s"] + plain["decode_time_s"] / row["speedup_at_length"])
            assert row["expected_end_to_end_speedup"] == pytest.approx(whole)
    model, lookup, suffix = report["drafters"]
    draft = report["costs"]["draft"]
    assert (model["draft_step_cost"], model["draft_pair_cost"], model["draft_prefill_cost"]) == \
        (draft["step"], draft["pair"], draft["prefill"]) and draft["step"] > 0 and draft["prefill"] > 0
    assert draft["step"] == pytest.approx(draft["step_ms"] / report["costs"]["target_step_ms"])
    for free in (lookup, suffix):
        assert (free["draft_step_cost"], free["draft_pair_cost"], free["draft_prefill_cost"]) == (0, 0, 0)
    assert model["proposal"][0] > 0.8  # a draft model drafts every step but a row's last
    roof = max((k + 1) / verify[k + 1] for k in range(5))
    assert report["roofline"]["speedup"] == pytest.approx(roof)
    advice = report["recommendation"]
    top = max(report["drafters"], key=lambda d: d["best_speedup"])
    if advice["drafter"] is None:
        assert top["best_speedup"] < 1 + MARGIN and advice["text"].startswith("plain decoding: ")
    else:
        assert (advice["drafter"], advice["k"]) == (top["name"], top["best_k"])


def test_advise_tables_without_a_draft_model(tiny_model_dirs):
    target_only = ["--target", tiny_model_dirs["target"], "--draft", "none"]
    result = ok("advise", *target_only, *SHORT, "-k", 3, "--measure", "none")
    text = result.stdout
    assert "specdecode advise" in text and "target step" in text and "v(4)=" in text and "v(5)=" not in text
    assert "draft model:" not in text and "15 tokens after the prefill" in text
    assert "K=3" in text and "K=4" not in text
    rows = [line for line in text.splitlines() if "prompt-lookup" in line]
    assert rows and "×" in rows[0] and "[" not in rows[0]  # --measure none: predictions only
    assert "model: left out (no draft model (--draft none))" in text
    assert "roofline (every draft kept, drafts free)" in text and "recommendation: " in text

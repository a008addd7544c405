"""`--draft suffix+MODEL` in `specdecode bench` and `specdecode advise`, on the tiny fixture models: the bench runs
ours with the pair and the peers that take a draft model with MODEL; advise tries MODEL alone and the pair."""

from __future__ import annotations

import json

import pytest
import torch

from test_cli import FAST, ok


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_bench_accepts_suffix_plus_model(tiny_model_dirs, tmp_path, one_thread):
    draft = "suffix+" + tiny_model_dirs["draft"]
    path = tmp_path / "bench.json"
    methods = "specdecode-plain,specdecode,specdecode-suffix,hf-plain,hf-assisted"
    ok("bench", "--target", tiny_model_dirs["target"], "--draft", draft, *FAST, "--threads", 1, "-k", 2,
       "--nb-prompts", 1, "-n", 6, "--runs", 1, "--warmup", 0, "--cost-repeats", 1, "--methods", methods,
       "--json", path)
    report = json.loads(path.read_text())
    assert report["config"]["draft"] == draft and list(report["methods"]) == methods.split(",")
    spec = report["methods"]["specdecode"]
    assert spec["stats"]["proposed_tokens"] > 0 and spec["new_tokens_per_prompt"] == [6]
    # transformers' assisted generation has no suffix drafter: it drafts with MODEL (a stock copy of it)
    assert report["methods"]["hf-assisted"]["draft_forward_calls"] > 0


def test_advise_accepts_suffix_plus_model(tiny_model_dirs):
    draft = "suffix+" + tiny_model_dirs["draft"]
    report = json.loads(ok("advise", "--target", tiny_model_dirs["target"], "--draft", draft, *FAST, "--threads", 1,
                           "--nb-prompts", 1, "-n", 12, "--cost-repeats", 1, "-k", 3, "--measure", "none",
                           "--json").stdout)
    assert report["config"]["draft"] == draft
    drafters = {d["name"]: d for d in report["drafters"]}
    assert list(drafters) == ["model", "prompt-lookup", "suffix", "suffix+model"] and not report["skipped"]
    costs = report["costs"]["draft"]
    model, pair = drafters["model"], drafters["suffix+model"]
    assert model["draft_step_cost"] == costs["step"] and model["model_step_share"] is None
    # the pair runs MODEL only on the steps where some row does not copy: its draft steps cost that share
    assert 0 <= pair["model_step_share"] <= 1 and pair["draft_prefill_cost"] == costs["prefill"]
    assert pair["draft_step_cost"] == pytest.approx(costs["step"] * pair["model_step_share"])
    assert pair["steps"] > 0 and len(pair["by_k"]) == 3

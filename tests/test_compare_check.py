"""`specdecode compare` checks that greedy speculative output is the target's own: exit 0 where it is, 1 where it is
not, with the token where the two runs first part."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdecode.cli import compare as compare_cmd
from specdecode.cli.app import app
from specdecode.pairing.pair import make_generator

ARGS = ["compare", "def quicksort(arr):", "-n", "12", "--ignore-eos", "--no-warmup", "--draft-quantize", "none"]


@pytest.fixture
def pair(tiny_model_dirs):
    return ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"]]


def run(*args):
    result = CliRunner().invoke(app, [*ARGS, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize("json_out", [True, False])
def test_identical_greedy_outputs_exit_0(pair, json_out):
    result = run(*pair, *(["--json"] if json_out else []))
    assert result.exit_code == 0, result.output
    if json_out:
        assert json.loads(result.stdout)["identical"]
    else:
        assert "greedy outputs are identical" in result.output


@pytest.fixture
def speculation_broken(monkeypatch):
    """The 'speculative' run decodes the draft model alone: greedy text that is not the target's."""
    monkeypatch.setattr(compare_cmd, "generator_of", lambda opts, target, draft: make_generator(draft, None))


@pytest.mark.parametrize("json_out", [True, False])
def test_differing_greedy_outputs_exit_1_and_say_where(pair, speculation_broken, json_out):
    result = run(*pair, "--json")
    assert result.exit_code == 1, result.output
    record = json.loads(result.stdout)
    assert not record["identical"] and record["first_difference"] is not None
    i = record["first_difference"]
    plain, spec = record["plain"]["token_ids"], record["speculative"]["token_ids"]
    assert plain[:i] == spec[:i] and plain[i] != spec[i]
    if not json_out:
        result = run(*pair)
        assert result.exit_code == 1
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("error: greedy outputs differ from token") and f"token {i} on" in error
    assert f"plain: id {plain[i]}" in error and f"speculative: id {spec[i]}" in error
    assert "--exact-greedy" in error  # what to do on llama.cpp, where a near-tie may flip


def test_sampled_outputs_may_differ_and_exit_0(pair, speculation_broken):
    result = run(*pair, "--temperature", "1.0", "--seed", "3")
    assert result.exit_code == 0, result.output

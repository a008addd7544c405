"""`generate --json-schema FILE / --grammar FILE / --regex R / --logprobs N` on the tiny fixture models.

The engine's structured outputs are tested for exactness in test_structured.py; here: the options reach it, the
output follows the constraint, greedy text is the same with speculation on and off, logprobs come out where asked,
and bad values fail with one clear line before any model loads.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from test_cli import invoke, pair, target_only  # noqa: F401  (the tiny models' options, as fixtures)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def record(*args) -> dict:
    result = invoke("generate", *args, "--json")
    assert result.exit_code == 0, result.output
    [line] = result.stdout.splitlines()
    return json.loads(line)


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


@pytest.mark.parametrize("k", ["3", "auto"])
def test_json_schema_file_gives_valid_json_and_the_targets_greedy_text(pair, target_only, schema_file, k):
    args = ["generate", "Answer:", "-n", 40, "--json-schema", schema_file]
    spec = record(*args[1:], *pair, "-k", k)
    plain = record(*args[1:], *target_only)
    jsonschema.validate(json.loads(spec["text"]), SCHEMA)
    assert spec["finish_reason"] == "stop"  # the grammar ended the row, not the length
    assert spec["token_ids"] == plain["token_ids"]


def test_json_schema_sampled_output_is_valid(pair, schema_file):
    for seed in range(3):
        out = record("Answer:", *pair, "-n", 40, "--json-schema", schema_file, "--temperature", 1.0, "--seed", seed)
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_regex(pair):
    out = record("Code:", *pair, "-n", 20, "--regex", "(ab|cd)e(f|gh)ij", "--temperature", 1.0, "--seed", 3)
    assert re.fullmatch("(ab|cd)e(f|gh)ij", out["text"]), out["text"]
    assert "forced" in out["provenance"]  # the grammar's single-choice stretches rode as certain drafts


def test_grammar_file(pair, tmp_path):
    grammar = tmp_path / "yesno.lark"
    grammar.write_text('start: answer "."\nanswer: "yes" | "no"\n')
    out = record("Is it?", *pair, "-n", 10, "--grammar", grammar, "--temperature", 1.0, "--seed", 1)
    assert out["text"] in ("yes.", "no."), out["text"]


def test_logprobs_in_json(pair, target_only):
    out = record("The quick brown fox", *pair, "-n", 6, "--ignore-eos", "--logprobs", 3)
    assert len(out["logprobs"]) == len(out["token_ids"]) == 6
    for token, lp, top in zip(out["token_ids"], out["logprobs"], out["top_logprobs"]):
        assert lp <= 0 and len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        # greedy: the drawn token is the most likely one, and its logprob is the top entry's
        assert top[0]["token_id"] == token and math.isclose(top[0]["logprob"], lp, abs_tol=1e-5)
        assert isinstance(top[0]["token"], str)
    plain = record("The quick brown fox", *target_only, "-n", 6, "--ignore-eos", "--logprobs", 3)
    assert plain["token_ids"] == out["token_ids"]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(plain["logprobs"], out["logprobs"]))
    assert "logprobs" not in record("The quick brown fox", *pair, "-n", 2)  # not asked, not there


def test_logprobs_table_on_stderr(pair):
    result = invoke("generate", "The quick brown fox", *pair, "-n", 4, "--ignore-eos", "--logprobs", 2)
    assert result.exit_code == 0, result.output
    assert "logprobs, prompt 1" in result.stderr and "top alternatives" in result.stderr


@pytest.mark.parametrize("flags,message", [
    (["--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json: no such file"),
    (["--grammar", "/nonexistent/g.lark"], "--grammar /nonexistent/g.lark: no such file"),
    (["--regex", "a+", "--grammar", "x.lark"], "--grammar and --regex were both given"),
    (["--logprobs", "21"], "--logprobs must be 0..20"),
    (["--logprobs", "-1"], "--logprobs must be 0..20"),
])
def test_bad_values_fail_before_loading(flags, message):
    # --target names no real model: the check must fail before loading is tried
    result = invoke("generate", "x", "--target", "/nonexistent/model", *flags)
    assert result.exit_code != 0
    assert message in " ".join(result.output.split()), result.output


def test_a_file_that_is_not_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{'type': 'object'}")
    result = invoke("generate", "x", "--target", "/nonexistent/model", "--json-schema", bad)
    assert result.exit_code != 0 and "not JSON" in result.output


def test_an_invalid_schema_is_named(target_only, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    result = invoke("generate", "x", *target_only, "--json-schema", bad, "-n", 4)
    assert result.exit_code != 0 and "error:" in result.output and "Traceback" not in result.output

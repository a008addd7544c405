"""The bench's table of methods, its interleave loop, and the JSON-schema workload: the built-in json set, the
validity check, our methods under schemas on the tiny models, and llama-cpp-python's JSON-schema peer on the small
real GGUF SmolLM2-135M (skipped when its package is absent)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdecode.bench.methods import DEFAULT_METHODS, METHODS, METHOD_CLASSES, BenchMethod, default_methods, plain_of
from specdecode.bench.prompts import BUILTIN_SETS, load_builtin, parse_prompts
from specdecode.bench.units import Unit
from specdecode.bench.validity import minimal_error, output_error, validity

SMOL = "smollm2-135m-instruct"
TINY_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "price", "owner"],
          "properties": {"id": {"type": "integer"}, "price": {"type": "number", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
                         "owner": {"type": ["string", "null"], "pattern": "^[a-z]+$"}}}


# ------------------------------------------------------------------------------------ the methods' table
def test_the_table_lists_each_method_once_with_its_traits():
    assert METHODS == tuple(METHOD_CLASSES) and len(set(METHODS)) == len(METHODS)
    for name, cls in METHOD_CLASSES.items():
        assert issubclass(cls, BenchMethod) and cls.name == name
        assert cls.plain is None or cls.plain in METHOD_CLASSES
        assert cls.runs_on in ("ours", "transformers", "llama.cpp")
    assert METHODS[:2] == ("specdecode-plain", "specdecode")  # the report's order: ours first
    assert "llama-speculative" not in DEFAULT_METHODS  # joins when --llama-speculative names its binary
    assert DEFAULT_METHODS == default_methods(False) and "llamacpp-json-schema" not in DEFAULT_METHODS
    assert default_methods(True) == ("specdecode-plain", "specdecode", "llamacpp-json-schema")
    assert plain_of("specdecode") == "specdecode-plain" and plain_of("hf-assisted") == "hf-plain"
    assert plain_of("llama-speculative-dmax4") == "llamacpp-plain" and plain_of("specdecode-plain") is None


def test_methods_left_out_by_the_workload():
    from specdecode.bench.methods.base import BenchContext
    from specdecode.bench.settings import BenchSettings

    def context(schemas):
        return BenchContext(BenchSettings(), [[1, 2]], plain=None, spec={}, has_draft=True, lookup=False,
                            schemas=schemas)

    free, structured = context(None), context([TINY_SCHEMA])
    assert METHOD_CLASSES["llamacpp-json-schema"].left_out(free).startswith("runs only on a workload with JSON schemas")
    assert METHOD_CLASSES["hf-plain"].left_out(structured).startswith("does not constrain its output")
    assert METHOD_CLASSES["specdecode"].left_out(structured) is None
    # then each method's own reasons: no transformers model, no GGUF file here
    assert "transformers target" in METHOD_CLASSES["hf-plain"].left_out(free)
    assert "GGUF target" in METHOD_CLASSES["llamacpp-json-schema"].left_out(structured)


def test_interleave_warms_up_then_alternates_the_units():
    from specdecode.bench.interleave import interleave

    calls, labels = [], []
    measured = interleave(["A", "B"], warm=lambda u, w: calls.append(("warm", u, w)),
                          timed=lambda u, r: calls.append(("run", u, r)) or f"{u}{r}", warmups=1, rounds=2,
                          progress=labels.append, label=str.lower)
    assert calls == [("warm", "A", 0), ("warm", "B", 0), ("run", "A", 0), ("run", "B", 0), ("run", "A", 1),
                     ("run", "B", 1)]
    assert measured == {"A": ["A0", "A1"], "B": ["B0", "B1"]}
    assert labels == ["warm-up a", "warm-up b", "run 1/2 a", "run 1/2 b", "run 2/2 a", "run 2/2 b"]


# ------------------------------------------------------------------------------------------ the json set
def test_json_prompt_set_is_a_set_of_requests_with_valid_schemas():
    import jsonschema

    assert "json" in BUILTIN_SETS
    prompts = load_builtin("json")
    assert len(prompts) >= 50
    assert len({p.id for p in prompts}) == len(prompts) and len({p.text for p in prompts}) == len(prompts)
    for p in prompts:
        assert len(p.text) > 40 and "JSON" in p.text, p.id  # a chat-style request that asks for JSON
        assert isinstance(p.schema, dict) and p.schema["type"] == "object", p.id
        jsonschema.validators.validator_for(p.schema).check_schema(p.schema)
    # varied: nested objects, arrays of objects, enums, integers, numbers, booleans, nullable fields
    text = json.dumps([p.schema for p in prompts])
    for keyword in ('"enum"', '"integer"', '"number"', '"boolean"', '"null"', '"minItems"', '"maximum"'):
        assert text.count(keyword) >= 3, keyword
    assert sum('"items": {"type": "object"' in json.dumps(p.schema) for p in prompts) >= 10


def test_json_set_compiles_for_our_grammar_engine_and_llama_cpp(tokenizer):
    from specdecode.structured.constraints import ConstraintSpec, GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    prompts = load_builtin("json")
    for p in prompts:
        compiler.compile(ConstraintSpec.of(json_schema=p.schema))
    llama_grammar = pytest.importorskip("llama_cpp.llama_grammar")
    for p in prompts:
        assert "root ::=" in llama_grammar.json_schema_to_gbnf(json.dumps(p.schema)), p.id


def test_prompt_files_carry_schemas():
    [p] = parse_prompts(json.dumps({"prompt": "Is it ok?", "schema": TINY_SCHEMA}) + "\n", "mine.jsonl", jsonl=True)
    assert p.schema == TINY_SCHEMA and p.id == "mine-0"
    assert parse_prompts('{"prompt": "free"}\n', "x.jsonl", jsonl=True)[0].schema is None
    with pytest.raises(ValueError, match='line 1: "schema" must be a JSON object'):
        parse_prompts('{"prompt": "x", "schema": "object"}\n', "bad.jsonl", jsonl=True)


# ------------------------------------------------------------------------------------------ validity
@pytest.mark.parametrize("validator", ["jsonschema", "minimal"])
def test_validity_of_outputs(validator):
    good = '{"id": 3, "tags": ["a"], "price": 2.5, "owner": null}'
    assert output_error(good, NESTED, validator) is None
    assert output_error('{"id": 3, "tags": [], "price": 0, "owner": "bob"}', NESTED, validator) is None
    bad = ['{"id": 3, "tags": ["a"], "price": 2.5}',  # missing owner
           '{"id": 3.5, "tags": ["a"], "price": 2.5, "owner": null}',  # not an integer
           '{"id": 3, "tags": ["c"], "price": 2.5, "owner": null}',  # not in the enum
           '{"id": 3, "tags": ["a", "b", "a"], "price": 2.5, "owner": null}',  # too many items
           '{"id": 3, "tags": [], "price": -1, "owner": null}',  # under the minimum
           '{"id": 3, "tags": [], "price": 1, "owner": "Bob"}',  # does not match the pattern
           '{"id": 3, "tags": [], "price": 1, "owner": null, "x": 1}',  # no additional properties
           '{"id": true, "tags": [], "price": 1, "owner": null}']  # a boolean is not an integer
    for text in bad:
        assert output_error(text, NESTED, validator) is not None, text
    assert output_error('{"id": 3, "tags": [', NESTED, validator).startswith("not JSON")
    report = validity([good, bad[0], "{"], [NESTED] * 3, validator)
    assert (report["outputs"], report["parsed"], report["valid"]) == (3, 2, 1)
    assert report["validity_rate"] == pytest.approx(1 / 3) and report["validator"] == validator
    assert [f["row"] for f in report["failures"]] == [1, 2]
    assert minimal_error(7, {"type": "integer", "maximum": 5}) == "$: 7 > maximum 5"


# ------------------------------------------------------------------------------------------ ours under schemas
def test_bench_runs_ours_under_each_prompts_schema(tiny_model_dirs):
    from specdecode.bench.runner import Bench, BenchSettings
    from specdecode.bench.workload import encode_prompts
    from specdecode.pairing.loading import load_model

    target = load_model(tiny_model_dirs["target"], threads=1, progress=False)
    draft = load_model(tiny_model_dirs["draft"], threads=1, progress=False)
    prompt_ids = encode_prompts(target.tokenizer, ["Is it ok? Answer in JSON.", "Describe the item as JSON."], True)
    settings = BenchSettings(ks=[2], max_new_tokens=40, runs=2, warmup=1, cost_repeats=1, batch_size=2)
    runner = Bench(target, draft, prompt_ids, settings, schemas=[TINY_SCHEMA, NESTED])
    assert runner.methods == ("specdecode-plain", "specdecode")
    assert runner.skipped["hf-plain"].startswith("does not constrain") and "llamacpp-json-schema" in runner.skipped
    report = runner.run()
    assert report["config"]["workload"] == "json_schema"
    for name, block in report["methods"].items():
        assert block["json"]["outputs"] == 2 * 2  # every row of every run is checked
        src, stats = block["token_sources"], block["stats"]
        assert src["forced"] + src["drafted"] + src["sampled"] == stats["new_tokens"]
        assert src["forced"] == stats["forced_tokens"] > 0  # `{"ok":` is forced: no model decides it
        assert all(n <= 40 for n in block["new_tokens_per_prompt"])
        # the one-key schema ends within a few tokens: a grammar-constrained output that parses and follows it
        assert block["new_tokens_per_prompt"][0] < 40 and not any(
            f["row"] % 2 == 0 for f in block["json"]["failures"]), name
    assert report["methods"]["specdecode"]["token_sources"]["proposed"] > 0


def test_bench_runs_ours_unconstrained_on_the_json_prompts_when_asked(tiny_model_dirs):
    """The baseline of "ours under the schema vs ours without it": the same prompts decoded as free text until the
    end-of-generation token (not a fixed length), their texts checked like the others; only when named."""
    from specdecode.bench.runner import Bench, BenchSettings
    from specdecode.bench.workload import encode_prompts
    from specdecode.pairing.loading import load_model

    assert "specdecode-unconstrained" not in default_methods(True)
    assert plain_of("specdecode-unconstrained") == "specdecode-plain-unconstrained"
    target = load_model(tiny_model_dirs["target"], threads=1, progress=False)
    draft = load_model(tiny_model_dirs["draft"], threads=1, progress=False)
    prompt_ids = encode_prompts(target.tokenizer, ["Is it ok? Answer in JSON."], True)
    methods = ("specdecode", "specdecode-plain-unconstrained", "specdecode-unconstrained")
    settings = BenchSettings(ks=[2], max_new_tokens=12, runs=1, warmup=0, cost_repeats=1, methods=methods)
    free = BenchSettings(ks=[2], max_new_tokens=12, runs=1, warmup=0, cost_repeats=1,
                         methods=("specdecode", "specdecode-unconstrained"))  # named, on a workload without schemas
    runner = Bench(target, draft, prompt_ids, settings, schemas=[TINY_SCHEMA])
    assert runner.methods == ("specdecode", "specdecode-plain-unconstrained", "specdecode-unconstrained")
    assert "runs only on a workload with JSON schemas" in Bench(target, draft, prompt_ids, free).skipped[
        "specdecode-unconstrained"]
    report = runner.run()
    blocks = report["methods"]
    for name in methods[1:]:
        block = blocks[name]
        assert block["token_sources"]["forced"] == 0 and block["json"]["outputs"] == 1
        assert "specdecode" in block["speedup_vs"]
    ours = blocks["specdecode"]  # against ours without the schemas: also after the prefill, from the same stats
    decode = ours["decode_speedup_vs"]["specdecode-unconstrained"]
    assert decode == ours["decode_tokens_per_second"] / blocks["specdecode-unconstrained"]["decode_tokens_per_second"]
    unconstrained = runner.runners["specdecode-unconstrained"].run(Unit("specdecode-unconstrained", 0.0, 2),
                                                                     runner.batches, 0)
    expected = runner.ctx.spec[2].generate(prompt_ids, max_new_tokens=12, temperature=0.0, seed=0)
    assert unconstrained.texts == expected.texts and unconstrained.per_prompt_tokens == [len(expected.token_ids[0])]


def test_bench_command_on_the_json_set_runs_the_structured_methods(tiny_model_dirs, tmp_path):
    from specdecode.cli import app

    path = tmp_path / "json.json"
    result = CliRunner().invoke(app, [
        "bench", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "--draft-quantize",
        "none", "--threads", "1", "-k", "2", "--prompts", "json", "--nb-prompts", "2", "-n", "8", "--runs", "1",
        "--warmup", "0", "--cost-repeats", "1", "--json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "llamacpp-json-schema left out" in result.stderr and "hf-plain" not in result.stderr
    assert "valid JSON" in result.stdout and "forced / drafted / sampled" in result.stdout
    report = json.loads(path.read_text())
    assert report["config"]["methods"] == ["specdecode-plain", "specdecode"]
    assert report["methods"]["specdecode"]["json"]["outputs"] == 2
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "a", "schema": TINY_SCHEMA}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    bad = CliRunner().invoke(app, ["bench", "--target", tiny_model_dirs["target"], "--prompts-file", str(mixed)])
    assert bad.exit_code == 1 and "give every prompt a JSON schema, or none" in bad.stderr


# ------------------------------------------------------------------------------------------ llama.cpp's peer
@pytest.fixture(scope="module")
def smol_gguf():
    pytest.importorskip("llama_cpp")
    from specdecode.models import catalog, prepare

    info = catalog.get_model_info(SMOL)
    if not info.installed:
        pytest.skip(f"needs the SmolLM2 GGUF package: {info.pip_command}")
    return str(prepare.prepare_gguf(SMOL, progress=False)[0])


def test_llama_cpp_json_schema_peer_follows_the_schema(smol_gguf):
    from specdecode.bench.llamacpp_peers import LlamaCppPeers

    peers = LlamaCppPeers(smol_gguf, threads=1, n_ctx=256)
    try:
        llm = peers._llama(None)
        ids = llm.tokenize(b"<|im_start|>user\nIs the sky blue? Answer in JSON.<|im_end|>\n<|im_start|>assistant\n",
                          special=True)
        outputs = [peers.complete_json(ids, TINY_SCHEMA, 32, temperature, 0, 1.0, seed)
                   for temperature, seed in ((0.0, 0), (0.0, 5), (1.0, 1), (1.0, 2))]
        for n, seconds, text in outputs:
            assert output_error(text, TINY_SCHEMA) is None, text
            assert seconds > 0 and 3 <= n < 32  # `{"ok":true}` and its end token, not cut
        assert outputs[0][0] == outputs[1][0] and outputs[0][2] == outputs[1][2]  # greedy: a fresh prefill each time
        n, _, text = peers.complete_json(ids, NESTED, 3, 0.0, 0, 1.0, 0)
        assert n == 3 and output_error(text, NESTED).startswith("not JSON")  # cut at max_new_tokens
    finally:
        peers.close()


def test_bench_json_workload_against_llama_cpp_on_smollm2(smol_gguf, tmp_path):
    from specdecode.cli import app

    prompts = tmp_path / "tiny.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": text, "schema": TINY_SCHEMA}) + "\n"
                               for i, text in enumerate(["Is water wet? Answer in JSON.", "Is fire cold? JSON."])))
    path = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "--target", SMOL, "--draft", SMOL, "--backend", "llamacpp", "--threads", "1", "-k", "2",
        "--prompts-file", str(prompts), "-n", "24", "--runs", "1", "--warmup", "0", "--cost-repeats", "1",
        "--json", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    methods = report["methods"]
    assert set(methods) == {"specdecode-plain", "specdecode", "llamacpp-json-schema"}
    assert report["config"]["llamacpp"]["target_gguf"] == smol_gguf
    for name, block in methods.items():
        assert block["json"]["validity_rate"] == 1.0, (name, block["json"])
        assert block["lengths_match"] and block["tokens_per_second"] > 0
    assert "token_sources" in methods["specdecode"] and "token_sources" not in methods["llamacpp-json-schema"]

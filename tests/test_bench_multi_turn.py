"""`specdecode bench --prompts multi-turn`: the sessions, the turns built from the reference's answers (the same
prompts for every method), the suffix history emptied before every run, the per-turn report and its ratios, the
command end to end on the tiny models, and llama.cpp's methods on the small real GGUF SmolLM2-135M (skipped when
its package or llama-cpp-python is absent)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from specdecode.bench.sessions import (BUILTIN, REGENERATE, Session, TurnPlan, build_turns, is_sessions,
                                       load_sessions, parse_sessions)
from specdecode.bench.turns_report import turns_report
from specdecode.bench.units import Measurement, Unit

SMOL = "smollm2-135m-instruct"
# Short enough for the tiny models' 512 positions: an edit, a regenerate and an agent turn that re-reads its tool.
TINY_SESSIONS = "\n".join(json.dumps(s) for s in [
    {"id": "e", "kind": "edit", "context": "def f(x):\n    return x", "turns": ["Edit:\n{context}", "Again."]},
    {"id": "r", "kind": "regenerate", "turns": ["def quicksort(arr):", {"regenerate": True}]},
    {"id": "a", "kind": "agent", "context": "import numpy as np", "turns": ["Tool: {context} ?", "Tool: {context} !"]},
]) + "\n"


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dirs):
    from specdecode.pairing.loading import load_model

    return load_model(tiny_model_dirs["target"], threads=1, progress=False)


@pytest.fixture(scope="module")
def tiny_plan(tiny_target):
    from specdecode.engine.generators import AutoregressiveGenerator

    return build_turns(AutoregressiveGenerator(tiny_target), parse_sessions(TINY_SESSIONS, "tiny"), 12)


# ------------------------------------------------------------------------------------------ the sessions
def test_built_in_sessions_alternate_edit_regenerate_and_agent():
    sessions = load_sessions(BUILTIN)
    kinds = [s.kind for s in sessions]
    assert kinds == ["edit", "regenerate", "agent"] * (len(sessions) // 3) and 2 <= len(sessions) // 3 <= 4
    assert [s.kind for s in load_sessions(BUILTIN, 3)] == ["edit", "regenerate", "agent"]  # --nb-prompts 3
    assert len({s.id for s in sessions}) == len(sessions) and is_sessions(BUILTIN) and not is_sessions("edit")
    for s in sessions:
        if s.kind == "regenerate":
            assert s.turns[1:] == (REGENERATE,) * (len(s.turns) - 1)
        else:
            assert len(s.turns) >= 2 and all(isinstance(t, str) for t in s.turns)
        if s.kind == "edit":  # the file in turn 1, the answer in the history after it
            assert "{context}" in s.turns[0] and s.context in s.message(0)
        if s.kind == "agent":  # the tool's output again in every turn
            assert all(s.context in s.message(t) for t in range(len(s.turns)))


def test_session_files_and_their_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(TINY_SESSIONS)
    assert is_sessions(str(path)) and [s.id for s in load_sessions(str(path), 2)] == ["e", "r"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert not is_sessions(str(prompts))
    assert parse_sessions('{"turns": ["hi"]}\n', "x.jsonl")[0] == Session("x-0", "session", ("hi",))
    for line, error in [('{"turns": []}', "non-empty list"), ('{"turns": [{"regenerate": true}]}', "first turn"),
                        ('{"turns": ["hi", 3]}', "turn 2"), ('{"turns": ["a"], "context": 1}', "context"),
                        ("nope", "not valid JSON")]:
        with pytest.raises(ValueError, match=error):
            parse_sessions(line + "\n", "bad.jsonl")
    with pytest.raises(ValueError, match="--nb-prompts"):
        load_sessions(str(path), 0)


def test_later_turns_are_built_from_the_reference_answers(tiny_target, tiny_plan):
    """Turn 2 sends the history with the reference's (ours plain, greedy) answer; a regenerate sends turn 1's
    request again; every answer is the target's greedy one, stopped at its end of generation or max_new_tokens."""
    from specdecode.text.chat import encode_chat
    from specdecode.engine.generators import AutoregressiveGenerator

    plan, tok = tiny_plan, tiny_target.tokenizer
    assert plan.rows == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    first, answer = "Edit:\ndef f(x):\n    return x", plan.reference_texts[0]
    assert plan.prompt_ids[0] == encode_chat(tok, [{"role": "user", "content": first}])
    assert plan.prompt_ids[1] == encode_chat(tok, [{"role": "user", "content": first},
                                                   {"role": "assistant", "content": answer},
                                                   {"role": "user", "content": "Again."}])
    assert plan.prompt_ids[3] == plan.prompt_ids[2] and plan.reference_ids[3] == plan.reference_ids[2]
    assert tok.decode(plan.prompt_ids[5]).count("import numpy as np") == 2  # the tool's output re-read
    plain = AutoregressiveGenerator(tiny_target)
    for ids, reference in zip(plan.prompt_ids, plan.reference_ids):
        assert 0 < len(reference) <= 12
        assert plain.generate([ids], max_new_tokens=12, temperature=0.0).token_ids[0] == reference


# ------------------------------------------------------------------------------------------ the bench
def _bench(target, draft, plan, methods, runs=2, warmup=1, ks=("auto",)):
    from specdecode.bench.runner import Bench, BenchSettings

    settings = BenchSettings(ks=list(ks), max_new_tokens=12, runs=runs, warmup=warmup, cost_repeats=1,
                             methods=methods)
    return Bench(target, draft, plan.prompt_ids, settings, turns=plan)


def _suffix_model(dirs):
    """What --draft suffix+MODEL loads: a SuffixModelDrafter around MODEL."""
    from specdecode.pairing.loading import load_model
    from specdecode.pairing.pair import ModelOptions, with_suffix

    return with_suffix(ModelOptions(draft="suffix+" + dirs["draft"]), load_model(dirs["draft"], threads=1,
                                                                                   progress=False))


def test_every_method_decodes_the_same_turns_and_gives_the_reference_answers(tiny_model_dirs, tiny_target,
                                                                            tiny_plan, one_thread):
    draft = _suffix_model(tiny_model_dirs)
    methods = ("specdecode-plain", "specdecode", "specdecode-prompt-lookup", "specdecode-suffix", "hf-plain")
    runner = _bench(tiny_target, draft, tiny_plan, methods, ks=(4,))  # a fixed K: no timing in what is drafted
    assert runner.methods == methods[:4] and "end of generation" in runner.skipped["hf-plain"]
    report = runner.run()
    assert report["config"]["workload"] == "multi_turn" and report["config"]["num_prompts"] == 6
    turns = report["multi_turn"]
    assert [g["turn"] for g in turns["by_turn"]] == [1, 2] and not turns["mismatches"]
    assert [(g["kind"], g["turn"]) for g in turns["by_kind_turn"]] == [
        ("edit", 1), ("edit", 2), ("regenerate", 1), ("regenerate", 2), ("agent", 1), ("agent", 2)]
    for name, block in report["methods"].items():
        assert block["lengths_match"] and block["new_tokens_per_prompt"] == tiny_plan.reference_lengths, name
    for group in turns["by_turn"]:
        indices = [i for i, (_, t) in enumerate(tiny_plan.rows) if t == group["turn"]]
        plain = group["methods"]["specdecode-plain"]
        for label, block in group["methods"].items():
            assert block["same_text"] == {"identical": 2 * 3, "answers": 2 * 3}, label  # 2 runs x 3 sessions
            runs = report["methods"][block["method"]]["runs"]
            rates = [sum(r["per_prompt_tokens"][i] for i in indices) / sum(r["per_prompt_seconds"][i] for i in indices)
                     for r in runs]
            assert block["tokens_per_second_runs"] == pytest.approx(rates)
            if label != "specdecode-plain":
                assert block["speedup_vs"]["specdecode-plain"] == pytest.approx(
                    block["tokens_per_second"] / plain["tokens_per_second"])
                assert 0 <= block.get("acceptance_rate", 0) <= 1
    # a regenerate's second turn is in the suffix history: its copy is kept whole
    regenerate = turns["by_kind_turn"][3]["methods"]["specdecode-suffix K=4"]
    assert regenerate["acceptance_rate"] == 1.0


@pytest.mark.parametrize("draft", ["suffix", "suffix+model"])
def test_the_suffix_history_is_emptied_before_every_run(draft, tiny_model_dirs, tiny_target, tiny_plan, one_thread):
    """Run 2 must not copy run 1's answers: each turn drafts the same in both runs. The same generator run again
    without emptying its history does copy them (so this test would see a leak)."""
    from specdecode.bench.methods.specdecode_plain import run_ours
    from specdecode.drafters import SuffixDrafter

    drafter = SuffixDrafter() if draft == "suffix" else _suffix_model(tiny_model_dirs)
    runner = _bench(tiny_target, drafter, tiny_plan, ("specdecode-plain", "specdecode", "specdecode-suffix"), ks=(4,))
    for name in ("specdecode", "specdecode-suffix"):
        unit = Unit(name, 0.0, 4)
        first, second = (runner.runners[name].run(unit, runner.batches, 0) for _ in range(2))
        kept = [[s.accepted_tokens for s in m.call_stats] for m in (first, second)]
        assert kept[0] == kept[1] and first.token_ids == second.token_ids == tiny_plan.reference_ids, name
        leaky = run_ours(runner.runners[name].generators[4], runner.batches, 12, 0.0, 0, 1.0, 0, until_eos=True)
        assert leaky.call_stats[0].accepted_tokens > kept[0][0]  # turn 1 copies the last run's answer
        assert leaky.token_ids == tiny_plan.reference_ids  # exact all the same: only the speed would lie


def test_multi_turn_is_greedy_one_turn_at_a_time(tiny_target, tiny_plan):
    from specdecode.bench.runner import Bench, BenchSettings

    for settings, error in [(BenchSettings(temperatures=[0.7]), "greedy"), (BenchSettings(batch_size=2), "one turn")]:
        with pytest.raises(ValueError, match=error):
            Bench(tiny_target, None, tiny_plan.prompt_ids, settings, turns=tiny_plan)
    with pytest.raises(ValueError, match="prompts are its turns"):
        Bench(tiny_target, None, tiny_plan.prompt_ids[:2], BenchSettings(), turns=tiny_plan)


def test_per_turn_ratios_against_llamacpp_and_the_mismatches():
    """Ratios of each group's tokens over its seconds (median over runs) to llama.cpp's plain and prompt-lookup
    runs of the same turns; an answer that differs from the reference's is listed where it first differs."""
    plan = TurnPlan([Session("s", "edit", ("a", "b"))], prompt_ids=[[9], [9, 1]], rows=[(0, 1), (0, 2)],
                    reference_ids=[[1, 2, 0], [3, 4, 0]])

    def run(seconds, ids=([1, 2, 0], [3, 4, 0])):
        return Measurement(6, sum(seconds), [3, 3], list(seconds), token_ids=[list(t) for t in ids])

    measured = {Unit("specdecode-plain", 0.0): [run((1.0, 1.0)), run((1.0, 1.0))],
                Unit("specdecode-suffix", 0.0, "auto"): [run((0.5, 0.25)), run((0.5, 0.25), ([1, 2, 0], [3, 5]))],
                Unit("llamacpp-plain", 0.0): [run((0.75, 1.5)), run((0.75, 1.5))],
                Unit("llamacpp-prompt-lookup", 0.0, "auto"): [run((1.5, 0.5)), run((1.5, 0.5))]}
    bench = SimpleNamespace(turns=plan, settings=SimpleNamespace(temperatures=[0.0]), units=lambda t: list(measured))
    report = turns_report(bench, measured)
    turn2 = report["by_turn"][1]["methods"]
    suffix = turn2["specdecode-suffix K=auto"]
    assert suffix["tokens_per_second"] == pytest.approx(12.0)
    assert suffix["speedup_vs"] == pytest.approx({"llamacpp-plain": 12.0 / 2.0, "llamacpp-prompt-lookup": 12.0 / 6.0,
                                                  "specdecode-plain": 12.0 / 3.0})
    assert turn2["llamacpp-plain"]["speedup_vs"]["llamacpp-prompt-lookup"] == pytest.approx(2.0 / 6.0)
    assert "llamacpp-plain" not in turn2["llamacpp-plain"]["speedup_vs"]
    assert report["by_turn"][0]["methods"]["specdecode-suffix K=auto"]["speedup_vs"]["llamacpp-plain"] == \
        pytest.approx(1.5)
    assert suffix["same_text"] == {"identical": 1, "answers": 2}
    assert report["mismatches"] == [{"method": "specdecode-suffix K=auto", "session": "s", "kind": "edit", "turn": 2,
                                     "runs": [1], "first_difference": 1, "tokens": 2, "reference_tokens": 3}]


# ------------------------------------------------------------------------------------------ the command
def _cli(*args):
    from specdecode.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_bench_command_multi_turn_on_the_tiny_models(tiny_model_dirs, tmp_path, one_thread):
    sessions = tmp_path / "sessions.jsonl"
    sessions.write_text(TINY_SESSIONS)
    path = tmp_path / "turns.json"
    common = ["bench", "--target", tiny_model_dirs["target"], "--draft-quantize", "none", "--threads", 1,
              "--prompts", sessions, "-n", 6, "--cost-repeats", 1]
    result = _cli(*common, "--draft", "suffix+" + tiny_model_dirs["draft"], "-k", 3, "--runs", 1, "--warmup", 0,
                  "--json", path)  # a fixed K: what is drafted (and verified) does not depend on timing
    assert result.exit_code == 0, result.output
    assert "multi-turn, per turn" in result.stdout and "per kind and turn" in result.stdout
    assert "llamacpp-plain left out" in result.stderr  # no GGUF target here
    report = json.loads(path.read_text())
    assert report["config"]["draft"] == "suffix+" + tiny_model_dirs["draft"]
    assert report["config"]["methods"] == ["specdecode-plain", "specdecode", "specdecode-prompt-lookup",
                                           "specdecode-suffix"]
    assert len(report["multi_turn"]["prompts"]) == 6 and not report["multi_turn"]["mismatches"]
    for flags, error in [(["--temperature", "0.7"], "greedy"), (["--batch-size", 2], "one turn at a time")]:
        bad = _cli(*common, "--draft", "none", *flags)
        assert bad.exit_code == 1 and error in bad.stderr


# ------------------------------------------------------------------------------------------ llama.cpp
@pytest.fixture(scope="module")
def smol_gguf():
    pytest.importorskip("llama_cpp")
    from specdecode.models import catalog, prepare

    if not catalog.get_model_info(SMOL).installed:
        pytest.skip(f"needs the SmolLM2 GGUF package: {catalog.get_model_info(SMOL).pip_command}")
    return str(prepare.prepare_gguf(SMOL, progress=False)[0])


def test_llama_cpp_python_stops_at_the_given_tokens(smol_gguf):
    from specdecode.bench.llamacpp_peers import LlamaCppPeers

    peers = LlamaCppPeers(smol_gguf, threads=1, n_ctx=256)
    ids = peers._llama(None).tokenize(b"def add(a, b):")
    tokens, _ = peers.generate_ids(ids, 6, 0.0, 0, 1.0, seed=0)
    stop = next(i for i, t in enumerate(tokens) if i > 0 and t not in tokens[:i])  # a token not seen before it
    for lookup in (None, 3):
        assert peers.generate_ids(ids, 6, 0.0, 0, 1.0, 0, lookup, {tokens[stop]})[0] == tokens[:stop + 1]
    assert peers.generate(ids, 6, 0.0, 0, 1.0, seed=0)[0] == 6
    peers.close()


def test_bench_multi_turn_against_llama_cpp(smol_gguf, tmp_path):
    """A session of each kind, ours with the suffix draft against llama-cpp-python's plain and prompt-lookup
    generation, interleaved: per-turn ratios to both, and every answer checked against the reference's. (The
    built-in sessions work the same, with prompts of up to ~1000 tokens: a few minutes here.)"""
    sessions, path = tmp_path / "sessions.jsonl", tmp_path / "smol.json"
    sessions.write_text(TINY_SESSIONS)
    result = _cli("bench", "--target", SMOL, "--draft", "suffix", "--backend", "llamacpp", "--threads", 1,
                  "--prompts", sessions, "-n", 4, "--runs", 1, "--warmup", 0, "--cost-repeats", 1, "--json", path)
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    assert report["config"]["methods"] == ["specdecode-plain", "specdecode", "specdecode-prompt-lookup",
                                           "specdecode-suffix", "llamacpp-plain", "llamacpp-prompt-lookup"]
    turns = report["multi_turn"]
    assert [s["kind"] for s in turns["sessions"]] == ["edit", "regenerate", "agent"]
    lengths = [p["reference_tokens"] for p in turns["prompts"]]
    assert len(lengths) == 6 and all(0 < n <= 4 for n in lengths)
    assert list(turns["by_turn"][0]["methods"]) == ["specdecode-plain", "specdecode K=auto",
                                                     "specdecode-prompt-lookup K=auto", "specdecode-suffix K=auto",
                                                     "llamacpp-plain", "llamacpp-prompt-lookup K=auto"]
    for group in turns["by_turn"]:
        blocks = group["methods"]
        for label in ("specdecode K=auto", "specdecode-suffix K=auto", "specdecode-plain"):
            assert set(blocks[label]["speedup_vs"]) == {"llamacpp-plain", "llamacpp-prompt-lookup",
                                                        "specdecode-plain"} - {label}
        assert blocks["llamacpp-plain"]["same_text"]["answers"] == group["prompts"]
        assert blocks["specdecode-plain"]["same_text"]["identical"] == group["prompts"]
    assert report["methods"]["llamacpp-plain"]["new_tokens_per_prompt"] == lengths or turns["mismatches"]

"""`specdecode bench`: its statistics, prompt sets, JSON report and plot, on the tiny fixture models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specdecode.bench import stats as st
from specdecode.bench.prompts import BUILTIN_SETS, load_builtin, load_file, load_prompts, parse_prompts
from specdecode.engine.results import Stats

METHODS = ("specdecode-plain", "specdecode", "hf-plain", "hf-assisted")


@pytest.fixture
def one_thread():
    """Tiny models run much faster (and steadier on a loaded machine) on one thread; restore the setting after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cli(args):
    from specdecode.cli import app

    result = CliRunner().invoke(app, args, catch_exceptions=False)
    return result


def _models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--draft-quantize", "none", "--threads", "1"]


# ------------------------------------------------------------------------------------------ statistics
def test_wilson_interval_known_values():
    # statsmodels.stats.proportion.proportion_confint(8, 10, method="wilson") = (0.49016, 0.94332)
    low, high = st.wilson_interval(8, 10)
    assert low == pytest.approx(0.490162, abs=1e-5) and high == pytest.approx(0.943318, abs=1e-5)
    # 0 successes: the lower bound is 0, the upper z²/(n+z²) = 3.8415/13.8415
    low, high = st.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.277533, abs=1e-5)
    low, high = st.wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(1 - 0.277533, abs=1e-5)
    # by hand at 90 %: z = 1.644854, p = 0.3, n = 50
    z, p, n = 1.6448536, 0.3, 50
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert st.wilson_interval(15, 50, 0.90) == pytest.approx((center - half, center + half), abs=1e-6)
    assert st.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        st.wilson_interval(11, 10)


def test_two_proportion_ztest():
    # pooled p = 0.525, se = sqrt(0.525 * 0.475 * (2/100)) = 0.0706222, z = -0.15 / se
    z, p = st.two_proportion_ztest(45, 100, 60, 100)
    assert z == pytest.approx(-2.12398, abs=1e-4)
    assert p == pytest.approx(0.033668, abs=1e-4)
    z2, p2 = st.two_proportion_ztest(60, 100, 45, 100)
    assert z2 == pytest.approx(-z) and p2 == pytest.approx(p)
    assert st.two_proportion_ztest(30, 60, 30, 60) == (0.0, 1.0)
    assert st.two_proportion_ztest(0, 10, 0, 20) == (0.0, 1.0)  # no variance: no evidence


def test_expected_speedup_formula():
    # (1 − 0.8^5) / ((1 − 0.8)(4·0.1 + 1)) = 0.67232 / 0.28
    assert st.expected_speedup(0.8, 4, 0.1) == pytest.approx(0.67232 / 0.28)
    assert st.expected_speedup(0.8, 4, 0.1, v=2.0) == pytest.approx(0.67232 / (0.2 * 2.4))
    assert st.expected_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)  # limit α → 1: (K+1)/(Kc+1)
    assert st.expected_speedup(0.0, 3, 0.2) == pytest.approx(1 / 1.6)  # nothing accepted: pure overhead
    assert st.expected_speedup(0.9, 3, 0.0) == pytest.approx(st.expected_tokens_per_step(0.9, 3))
    assert st.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    for alpha in (0.1, 0.5, 0.93):
        assert st.solve_alpha(st.expected_tokens_per_step(alpha, 4), 4) == pytest.approx(alpha, abs=1e-9)
    with pytest.raises(ValueError):
        st.expected_speedup(1.2, 4, 0.1)


def test_tv_distance_and_summary():
    assert st.tv_distance({"a": 0.5, "b": 0.5}, {"a": 1.0}) == pytest.approx(0.5)
    assert st.tv_distance([0.2, 0.8], [0.2, 0.8]) == 0.0
    assert st.tv_distance([1, 0, 0], [0, 0, 1]) == 1.0
    s = st.summarize([1.0, 2.0, 3.0, 10.0])
    assert s["median"] == 2.5 and s["mean"] == 4.0 and s["std"] == pytest.approx(np.std([1, 2, 3, 10], ddof=1))
    assert st.summarize([5.0])["std"] == 0.0


def test_chisquare_matches_scipy_and_pools_small_cells():
    from scipy.stats import chisquare

    observed, probs = [18, 22, 40, 20], [0.2, 0.2, 0.4, 0.2]
    ours = st.chisquare_gof(observed, probs)
    ref = chisquare(observed, [20, 20, 40, 20])
    assert ours["p_value"] == pytest.approx(ref.pvalue) and ours["dof"] == 3
    # cells with expected count < 5 are pooled into one
    obs, exp = st.pool_small_cells([50, 45, 2, 1, 2], [48.0, 47.0, 2.0, 1.5, 1.5])
    assert obs == [50, 45, 5] and exp == [48.0, 47.0, 5.0]
    # a pooled cell still below 5 joins the smallest big cell
    obs, exp = st.pool_small_cells([50, 45, 3], [48.0, 47.0, 3.0])
    assert obs == [50, 48] and exp == [48.0, 50.0]
    # a sample where the exact probability is ~0 is decisive
    assert st.chisquare_gof([99, 1], [1.0, 0.0])["p_value"] == 0.0
    assert st.chisquare_gof([100], [1.0])["p_value"] == 1.0


def test_tv_threshold_holds_for_exact_samples():
    probs = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    rng = np.random.default_rng(0)
    n = 500
    threshold = st.tv_threshold(probs, n, 1e-3)
    tvs = [st.tv_distance(rng.multinomial(n, probs) / n, probs) for _ in range(200)]
    assert max(tvs) < threshold  # exact samples stay under the level-1e-3 bound
    assert st.tv_threshold(probs, 4 * n, 1e-3) < threshold  # and it shrinks with n
    skewed = np.array([0.4, 0.25, 0.15, 0.1, 0.1])  # TV 0.1 from probs
    assert st.tv_distance(rng.multinomial(20000, skewed) / 20000, probs) > st.tv_threshold(probs, 20000, 1e-3)


def test_merge_stats_sums_counters():
    a = Stats(num_rows=1, new_tokens=10, proposed_tokens=8, accepted_tokens=6, num_speculative_tokens=2,
              accepted_per_position=[4, 2], proposed_per_position=[4, 4], wall_time_s=1.0, verification_steps=4,
              num_rows_with_first_token=1)
    b = Stats(num_rows=1, new_tokens=10, proposed_tokens=4, accepted_tokens=1, num_speculative_tokens=3,
              accepted_per_position=[1, 0, 0], proposed_per_position=[2, 2, 1], wall_time_s=3.0,
              verification_steps=2, num_rows_with_first_token=1)
    m = st.merge_stats([a, b])
    assert (m.new_tokens, m.proposed_tokens, m.accepted_tokens, m.num_speculative_tokens) == (20, 12, 7, 3)
    assert m.accepted_per_position == [5, 2, 0] and m.proposed_per_position == [6, 6, 1]
    assert m.tokens_per_second == pytest.approx(5.0) and m.acceptance_rate == pytest.approx(7 / 12)
    assert st.merge_stats([]) == Stats() and st.merge_stats([a]) == a


def test_merge_stats_of_real_calls(tiny_pair, tokenizer):
    """Whatever fields the engine's Stats carries (counts by K, the policy's report), merging two calls gives the
    counts of both and keeps what is not a count."""
    from specdecode.engine.generators import SpeculativeGenerator

    gen = SpeculativeGenerator(tiny_pair[0], tiny_pair[1], num_speculative_tokens=2, tokenizer=tokenizer)
    calls = [gen.generate("def quicksort(arr):", max_new_tokens=n, temperature=0, ignore_eos=True).stats
             for n in (5, 7)]
    m = st.merge_stats(calls)
    assert m.new_tokens == 12 and m.num_rows == 2 and m.num_speculative_tokens == 2
    assert m.target_forward_calls == sum(s.target_forward_calls for s in calls)
    assert m.wall_time_s == pytest.approx(sum(s.wall_time_s for s in calls))
    histograms = [getattr(s, "k_histogram", None) for s in calls]
    if histograms[0] is not None:  # verification steps counted by K
        assert sum(m.k_histogram.values()) == sum(sum(h.values()) for h in histograms)
        assert m.policy == calls[-1].policy


# ------------------------------------------------------------------------------------------ prompt sets
def test_builtin_prompt_sets_load_and_are_distinct():
    seen = set()
    for name in BUILTIN_SETS:
        prompts = load_builtin(name)
        assert 6 <= len(prompts) <= 12 or name == "json", name  # json: a workload of its own (test_bench_json.py)
        texts = [p.text for p in prompts]
        assert all(len(t.strip()) > 20 for t in texts), name
        assert len(set(texts)) == len(texts), f"duplicate prompt in {name}"
        assert len({p.id for p in prompts}) == len(prompts)
        assert not seen & set(texts), f"{name} repeats a prompt of another set"
        seen |= set(texts)
        assert load_prompts(name) == prompts
    assert any("count" in p.text for p in load_builtin("edit"))  # the rename task: output repeats the input


def test_prompt_files(tmp_path):
    (tmp_path / "a.txt").write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in load_file(tmp_path / "a.txt")] == ["first prompt", "second prompt"]
    (tmp_path / "b.txt").write_text("def f():\n    pass\n---\nline one\nline two\n---\n")
    assert [p.text for p in load_file(tmp_path / "b.txt")] == ["def f():\n    pass", "line one\nline two"]
    (tmp_path / "c.jsonl").write_text('{"prompt": "x = 1", "id": "one"}\n"just a string"\n')
    prompts = load_file(tmp_path / "c.jsonl")
    assert [(p.id, p.text) for p in prompts] == [("one", "x = 1"), ("c-1", "just a string")]
    assert load_prompts(str(tmp_path / "c.jsonl")) == prompts
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_file(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text('"x"\n{"prompt": "  "}\n')
    with pytest.raises(ValueError, match="line 2: the prompt is empty"):
        load_file(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="holds no prompts"):
        parse_prompts("\n \n---\n", "stdin")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_file(tmp_path / "missing.txt")
    with pytest.raises(ValueError):
        load_prompts("no-such-set")


# ------------------------------------------------------------------------------------------ transformers settings
def test_assistant_settings_are_set_and_restored(tiny_pair):
    from specdecode.bench.methods.hf import assistant_settings, generation_config

    _, draft = tiny_pair
    config = draft.generation_config
    before = (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)
    with assistant_settings(draft, 3):
        assert config.num_assistant_tokens == 3
        assert config.num_assistant_tokens_schedule == "constant"
        assert config.assistant_confidence_threshold == 0.0
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule,
            config.assistant_confidence_threshold) == before
    gen = generation_config(draft, None, 7, 0.7, 0, 1.0)
    assert gen.do_sample and gen.top_k == 0 and gen.temperature == 0.7 and gen.repetition_penalty == 1.0
    assert gen.min_new_tokens == gen.max_new_tokens == 7
    assert not generation_config(draft, None, 7, 0.0, 0, 1.0).do_sample


# ------------------------------------------------------------------------------------------ the command
def _check_block(block, runs, speculative):
    assert block["tokens_per_second"] > 0 and block["ms_per_token"] > 0
    assert len(block["tokens_per_second_runs"]) == runs and len(block["runs"]) == runs
    assert block["tokens_per_second"] == pytest.approx(float(np.median(block["tokens_per_second_runs"])))
    assert block["lengths_match"]
    if speculative:
        assert 0.0 <= block["acceptance_rate"] <= 1.0
        assert block["mean_accepted_length"] >= 1.0


def test_bench_json_schema_and_plot(tiny_model_dirs, tmp_path, one_thread):
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = _cli(["bench", *_models(tiny_model_dirs), "-k", "1,2", "--temperature", "0,1", "--prompts", "edit",
                   "--nb-prompts", "2", "--max-new-tokens", "4", "--runs", "2", "--warmup", "0",
                   "--cost-repeats", "1", "--json", str(report_path), "--plot", str(plot_path)])
    assert result.exit_code == 0, result.output
    assert "throughput" in result.stdout and "recommended" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["schema"] == "specdecode.bench/1"
    assert set(report["methods"]) == set(METHODS)
    for name, block in report["methods"].items():
        _check_block(block, 2, name in ("specdecode", "hf-assisted"))
        assert block["new_tokens_per_prompt"] == [4, 4]
    spec = report["methods"]["specdecode"]
    assert len(spec["per_position_acceptance"]) == report["k"]
    assert spec["speedup_vs"]["specdecode-plain"] == pytest.approx(
        spec["tokens_per_second"] / report["methods"]["specdecode-plain"]["tokens_per_second"])
    assert {(c["k"], c["temperature"]) for c in report["sweep"]} == {(1, 0.0), (2, 0.0), (1, 1.0), (2, 1.0)}
    for config in report["sweep"]:
        assert set(config["methods"]) == set(METHODS)
        theory = config["theory"]
        assert theory["expected_speedup"] == pytest.approx(
            st.expected_speedup(theory["alpha"], config["k"], report["costs"]["c"]))
        assert theory["expected_speedup_refined"] == pytest.approx(
            st.expected_speedup(theory["alpha"], config["k"], report["costs"]["c"], theory["v"]))
    greedy = [c for c in report["sweep"] if c["temperature"] == 0.0]
    # plain methods are measured once per temperature and shared by every K
    assert greedy[0]["methods"]["hf-plain"]["tokens_per_second_runs"] == \
        greedy[1]["methods"]["hf-plain"]["tokens_per_second_runs"]
    assert report["recommended"]["k"] in (1, 2) and report["k"] == report["recommended"]["k"]
    assert report["costs"]["c"] > 0 and set(report["costs"]["v"]) >= {"1", "2"}
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sanity_draft_equals_target(tiny_model_dirs, tmp_path, one_thread):
    report_path = tmp_path / "sanity.json"
    result = _cli(["bench", "--sanity", *_models(tiny_model_dirs), "-k", "3", "--nb-prompts", "2",
                   "--max-new-tokens", "6", "--runs", "1", "--warmup", "0", "--cost-repeats", "1",
                   "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    assert "SANITY PASS" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["sanity"]["pass"] and set(report["methods"]) == {"specdecode-plain", "specdecode"}
    assert report["methods"]["specdecode"]["acceptance_rate"] == 1.0


def test_bench_plain_only_and_bad_arguments(tiny_model_dirs, one_thread):
    result = _cli(["bench", "--target", tiny_model_dirs["target"], "--draft", "none", "--threads", "1",
                   "--methods", "specdecode-plain,hf-plain", "--nb-prompts", "1", "--max-new-tokens", "3",
                   "--runs", "1", "--warmup", "0", "--cost-repeats", "1", "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["methods"]) == {"specdecode-plain", "hf-plain"} and report["theory"] is None
    bad = _cli(["bench", *_models(tiny_model_dirs), "--methods", "vllm"])
    assert bad.exit_code == 1 and "unknown --methods" in bad.stderr
    bad = _cli(["bench", *_models(tiny_model_dirs), "-k", "0,2"])
    assert bad.exit_code == 1 and "-k" in bad.stderr


def test_bench_latency(tiny_model_dirs, tmp_path, one_thread):
    path = tmp_path / "latency.json"
    result = _cli(["bench", "latency", *_models(tiny_model_dirs), "-k", "1,2", "--max-new-tokens", "4",
                   "--runs", "1", "--cost-repeats", "1", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "target alone" in result.stdout
    report = json.loads(path.read_text())
    assert report["target_alone"]["ms_per_token"] > 0 and report["target_alone"]["step_ms"] > 0
    assert [row["k"] for row in report["with_draft"]] == [1, 2]
    assert all(row["ms_per_token"] > 0 and row["draft_step_ms"] > 0 for row in report["with_draft"])
    result = _cli(["bench", "latency", *_models(tiny_model_dirs), "--max-new-tokens", "4", "--runs", "1",
                   "--cost-repeats", "1", "--json", "-"])
    assert result.exit_code == 0, result.output
    [auto] = json.loads(result.stdout)["with_draft"]
    assert auto["k"] == "auto" and auto["verify_ms"] is None and auto["mean_k"] is not None


def test_bench_k_auto(tiny_model_dirs, tmp_path, one_thread):
    """-k auto (the default) next to a fixed K: the engine's adaptive K, transformers' own dynamic setting, no
    fixed-K theory for auto, and a plot that places auto off the K axis."""
    report_path, plot_path = tmp_path / "auto.json", tmp_path / "auto.png"
    result = _cli(["bench", *_models(tiny_model_dirs), "-k", "auto,1", "--nb-prompts", "1", "--max-new-tokens",
                   "4", "--runs", "1", "--warmup", "0", "--cost-repeats", "1", "--json", str(report_path),
                   "--plot", str(plot_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["config"]["ks"] == ["auto", 1]
    auto, one = (next(c for c in report["sweep"] if c["k"] == k) for k in ("auto", 1))
    assert set(auto["methods"]) == set(METHODS) and auto["theory"] is None and one["theory"] is not None
    spec = auto["methods"]["specdecode"]
    assert spec["stats"]["policy"] == "auto" and spec["mean_k"] == spec["stats"]["mean_k"]
    assert set(report["costs"]["v"]) == {str(k) for k in range(1, 9)}  # auto may pick any K up to 8
    assert "auto" in result.stdout and plot_path.read_bytes()[:4] == b"\x89PNG"
    sanity = _cli(["bench", "--sanity", *_models(tiny_model_dirs)])
    assert sanity.exit_code == 1 and "--sanity needs a fixed -k" in sanity.stderr


def test_bench_with_prompt_lookup_compares_with_transformers_prompt_lookup(tiny_model_dirs, tmp_path):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    out = tmp_path / "lookup.json"
    result = CliRunner().invoke(app, ["bench", "--target", tiny_model_dirs["target"], "--draft", "prompt-lookup",
                                      "--prompts", "edit", "--nb-prompts", "1", "-n", "8", "--runs", "1",
                                      "--warmup", "0", "-k", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) >= {"specdecode", "specdecode-plain", "hf-plain", "hf-assisted"}
    assert methods["specdecode"]["tokens_per_second"] > 0 and methods["hf-assisted"]["tokens_per_second"] > 0


def test_bench_runs_transformers_on_stock_models_by_default(tiny_model_dirs, tmp_path):
    """Peers run on the models as transformers loads them; --peer-models same runs them on ours."""
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    base = ["bench", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "--prompts", "code",
            "--nb-prompts", "1", "-n", "6", "--runs", "1", "--warmup", "0", "-k", "2"]
    for peers in ("stock", "same"):
        out = tmp_path / f"{peers}.json"
        result = CliRunner().invoke(app, base + ["--peer-models", peers, "--json", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["config"]["peer_models"] == peers
        assert report["methods"]["hf-assisted"]["tokens_per_second"] > 0
    result = CliRunner().invoke(app, base + ["--peer-models", "borrowed"])
    assert result.exit_code != 0 and "--peer-models" in result.output

"""The device check (scripts/device_check.sh) cannot rot while no GPU is lent: its dry run runs every section on
this CPU with tiny shapes and must write every section with measured numbers; the carried wheel set must cover
every requirement the machine's image lacks; the drafter of known acceptance keeps the rate it is given."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from conftest import tiny_qwen
from specdecode import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.backends.hf import HFBackend
from specdecode.drafters.model import ModelDrafter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/: the project's own tools, run from the checkout (not installed)
from benchmarks import device_check as dc  # noqa: E402
from benchmarks import device_sections as sections  # noqa: E402
from benchmarks import device_wheels as wheels  # noqa: E402
from benchmarks.replay_drafter import ReplayDrafter  # noqa: E402


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    done = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--dry-run", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "device_check.json").read_text()), (out / "device_check.md").read_text()


def test_the_dry_run_writes_every_section(dry_run):
    report, markdown = dry_run
    assert report["schema"] == dc.SCHEMA and report["dry_run"] is True
    assert list(report["sections"]) == list(dc.SECTIONS)
    for name, entry in report["sections"].items():
        assert entry["ok"], f"{name}: {entry.get('error')}\n{entry.get('traceback', '')}"
    for title in ("## Environment", "## Carried wheels", "## GPU tests", "## v(n)", "## Engine overhead",
                  "## llama.cpp", "## Compiled step", "## A draft of another tokenizer"):
        assert title in markdown
    assert "failed**" not in markdown


def test_the_dry_run_ran_the_device_tests(dry_run):
    tests = dry_run[0]["sections"]["gpu_tests"]["result"]
    assert tests["exit_code"] == 0 and tests["failed"] == 0
    assert tests["passed"] >= 10  # tests/test_device_paths.py on the CPU
    assert any("cuda" in name for name in tests["skipped_tests"])  # the CUDA-graph tests: skipped, not absent


def test_the_dry_run_measured_v_and_c(dry_run):
    plan, costs = sections.Plan.dry(), dry_run[0]["sections"]["costs"]["result"]
    assert costs["complete"]
    seen = {(r["size"], r["backend"], r["batch"]) for r in costs["rows"]}
    assert seen == {(s, b, n) for s in plan.sizes for b in ("static", "transformers") for n in plan.batches}
    for row in costs["rows"]:
        assert set(row["v"]) == {str(n) for n in range(1, plan.max_n + 1)}
        assert row["v"]["1"] == 1.0 and all(_finite(v) for v in row["v"].values()) and _finite(row["step_ms"])
    assert len(costs["c"]) == 2 * len(plan.batches) and all(_finite(x["c"]) for x in costs["c"])


def test_the_dry_run_measured_the_engine_against_the_prediction(dry_run):
    plan, over = sections.Plan.dry(), dry_run[0]["sections"]["overhead"]["result"]
    assert {(r["alpha"], r["k"]) for r in over["rows"]} == {(a, k) for a in plan.alphas for k in (plan.fixed_k, "auto")}
    for row in over["rows"]:
        assert row["same_as_plain"] and row["off_record_tokens"] == 0  # greedy: the target's own tokens
        for key in ("tokens_per_s", "plain_tokens_per_s", "speedup", "predicted_speedup", "ratio", "c"):
            assert _finite(row[key]), (key, row)
    assert {a["method"] for a in over["assisted"]} == {"transformers", "ours (transformers backend)"}
    assert all(_finite(a["ratio"]) and a["same_as_plain"] for a in over["assisted"])


def test_the_dry_run_measured_the_step_against_its_floor_after_a_warm_up(dry_run):
    plan, result = sections.Plan.dry(), dry_run[0]["sections"]["compiled"]["result"]
    assert result["complete"] and _finite(result["bandwidth"]["measured_copy"])
    assert [(r["size"], r["variant"]) for r in result["rows"]] == [(s, v) for s in plan.sizes
                                                                   for v in plan.step_variants]
    for row in result["rows"]:
        for key in ("warm_up_s", "step_ms", "verify_ms", "floor_ms_measured_copy", "x_floor", "bandwidth_share"):
            assert _finite(row[key]), (key, row)
        assert row["warmed_shapes"] > 0 and row["cold_after_warm_up"] == 0
        assert row["bytes_per_step"]["total"] > row["bytes_per_step"]["weights"] > 0
    assert [(x["draft"], x["target"]) for x in result["c"]] == [(plan.sizes[0], s) for s in plan.sizes[1:]
                                                                for _ in plan.step_variants]
    assert all(_finite(x["c"]) for x in result["c"])


def test_bytes_per_step_count_each_weight_once_and_the_attended_cache():
    from benchmarks.device_compiled import bytes_per_step, nominal_bandwidth

    model = tiny_qwen(64, seed=0)  # untied: the input embedding reads one row a token, the output layer all of it
    params = sum(p.numel() for p in model.parameters())
    config = model.config
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // 4) * 128 * 4
    assert bytes_per_step(model, 128) == {"weights": 4 * (params - 64 * config.hidden_size), "kv": kv,
                                          "total": 4 * (params - 64 * config.hidden_size) + kv}
    assert nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and nominal_bandwidth("NVIDIA H100 PCIe") == 2e12
    assert nominal_bandwidth("NVIDIA H200") == 4.8e12 and nominal_bandwidth(None) is None


def test_the_dry_run_measured_llamacpp_or_says_why_not(dry_run):
    llama = dry_run[0]["sections"]["llamacpp"]["result"]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert "prepare" in llama["skipped"]
        return
    assert llama["quantization"] == "Q4_K_M" and llama["target_gguf"]["bytes"] > 0
    assert llama["v"]["1"] == 1.0 and all(_finite(v) for v in llama["v"].values()) and _finite(llama["c"])
    prediction = llama["prediction"]
    assert "llamacpp-code.json" in prediction["source"] and 0 < prediction["alpha"] <= 1
    assert _finite(prediction["predicted_speedup"])


def _installed(*names) -> bool:
    from specdecode.models import catalog

    return all(catalog.get_model_info(name).installed for name in names)


def test_the_dry_run_measured_a_cross_family_draft_and_predicted_its_speedup(dry_run):
    from benchmarks import device_cross_vocab as cv
    from benchmarks.device_tokenizers import NAMES

    plan, result = sections.Plan.dry(), dry_run[0]["sections"]["cross_vocab"]["result"]
    device = [r for r in result["steps"] if r["setting"] == "device"]
    assert {(r["model"], r["size"], r["batch"]) for r in device} == {
        (m, s, b) for m, s in (("target", plan.cross_target), ("draft", plan.cross_draft)) for b in plan.cross_batches}
    for row in result["steps"]:
        assert _finite(row["step_ms"]) and all(_finite(x) for x in row["ms"].values())
    try:
        import llama_cpp  # noqa: F401
        assert {(r["model"], r["size"]) for r in result["steps"] if r["setting"] == "cores"} == {
            ("target", plan.cross_llama_target), ("draft", plan.cross_llama_draft)}
    except ImportError:
        assert "prepare" in result["cores_skipped"]
    if (REPO / ".device_wheels" / "tokenizers").is_dir() or _installed(*NAMES):
        assert {(b["device"], b["method"], b["batch"], b["error_rate"]) for b in result["bridge"]} == {
            ("cpu", m, n, e) for m in cv.METHODS for n in plan.cross_batches for e in plan.cross_error_rates}
        for b in result["bridge"]:
            assert _finite(b["host_ms_per_token"]) and _finite(b["forwards_per_token"]) and b["proposed_tokens"] > 0
        exact = next(b for b in result["bridge"] if b["method"] == "slem" and b["error_rate"] == 0)
        assert exact["first_draft_acceptance"] > 0.9  # the draft writes the target's own text: kept
    else:
        assert "tokenizer" in result["bridge_skipped"] and result["bridge"] == []
    sources = result["acceptance"]["rows"]
    settings = {r["setting"] for r in result["steps"]}
    assert len(result["predictions"]) == len(sources) * len(settings)
    for p in result["predictions"]:
        for key in ("c", "c_forwards", "c_effective", "predicted_speedup", "speedup_without_bridge"):
            assert _finite(p[key]), (key, p)
        assert p["c_bridge"] is None or _finite(p["c_bridge"])
    # one row by hand: c_eff from the measured steps and bridge, then E(K) / (K c_eff + v(K + 1))
    p = result["predictions"][-1]
    steps = {r["model"]: r["ms"] for r in result["steps"] if r["setting"] == p["setting"] and r["batch"] == p["batch"]}
    t1 = steps["target"]["1"]
    assert p["c"] == pytest.approx(steps["draft"]["1"] / t1)
    run = [b for b in result["bridge"] if b["method"] == p["method"] and b["batch"] == p["batch"]
           and b["error_rate"] == p["bridge_error_rate"]]
    if run:  # per drafted position: one draft of each of the batch's rows
        positions = run[0]["proposed_tokens"] / run[0]["batch"]
        forwards = sum(n * steps["draft"][w] for w, n in run[0]["widths"].items()) / positions / t1
        assert p["c_forwards"] == pytest.approx(forwards)
        assert p["c_effective"] == pytest.approx(forwards + run[0]["host_ms_per_token"] * run[0]["batch"] / t1)
    k, c = p["best_k"], p["c_effective"]
    v = {int(n): x for n, x in p["v"].items()}
    if "alpha" in sources[0]:
        a = p["first_acceptance"]
        expected = sum(a ** i for i in range(k + 1)) / (k * c + steps["target"][str(k + 1)] / t1)
        assert p["predicted_speedup"] == pytest.approx(expected)
        assert p["predicted_speedup"] == pytest.approx(sections.leviathan(a, k, c, v))
        assert all(sections.leviathan(a, j, c, v) <= expected + 1e-12 for j in range(1, max(v)))


def test_a_measured_acceptance_file_is_read_per_position_and_predicted_from(tmp_path):
    """docs/results/cross-vocab-drafts.json (scripts/cross_vocab_acceptance.py) gives P(drafts 1..i kept) per
    position at a fixed K; the prediction takes each draft's acceptance given the ones before."""
    from benchmarks import device_cross_vocab as cv
    from benchmarks.device_journal import Journal

    path = tmp_path / "cross-vocab-drafts.json"
    run = {"method": "slem", "prompts": "code", "temperature": 0.0, "acceptance_per_position": [0.8, 0.6, 0.3, 0.15]}
    path.write_text(json.dumps({"target": "qwen2.5-coder-1.5b-instruct", "k": 4, "backend": "llamacpp", "drafts": {
        "smollm2-135m-instruct": {"runs": [run, {**run, "method": "same"}]}}}))
    source = cv.acceptance_sources(path)
    assert [r["label"] for r in source["rows"]] == ["slem code T=0.0"] and "cross-vocab-drafts.json" in source["source"]
    assert source["rows"][0]["acceptance"] == pytest.approx([0.8, 0.75, 0.5, 0.5])
    steps = [{"setting": "device", "model": "target", "batch": 1, "ms": {n: 10.0 + n for n in range(1, 10)}},
             {"setting": "device", "model": "draft", "batch": 1, "ms": {n: 2.0 + 0.1 * n for n in range(1, 17)}}]
    bridge = [{"method": "slem", "batch": 1, "error_rate": 0.0, "first_draft_acceptance": 0.9, "proposed_tokens": 100,
               "widths": {1: 120, 2: 10}, "host_ms_per_token": 0.5, "device": "cpu"},
              {"method": "slem", "batch": 1, "error_rate": 0.0, "first_draft_acceptance": 0.9, "proposed_tokens": 100,
               "widths": {1: 500}, "host_ms_per_token": 5.0, "device": "cuda"}]  # another device's: not taken
    [p] = cv.predictions(steps, "device", 1, bridge, source, Journal(None, "cross_vocab"))
    t1 = 11.0
    c = (120 * 2.1 + 10 * 2.2) / 100 / t1 + 0.5 / t1
    assert p["c_effective"] == pytest.approx(c) and p["c"] == pytest.approx(2.1 / t1)
    by_k = {k: (1 + sum(math.prod([0.8, 0.75, 0.5, 0.5][:j]) for j in range(1, k + 1))) / (k * c + (10 + k + 1) / t1)
            for k in range(1, 5)}
    assert (p["best_k"], p["predicted_speedup"]) == (max(by_k, key=by_k.get), pytest.approx(max(by_k.values())))


def test_the_tokenizer_preparation_writes_loadable_tokenizers(tmp_path):
    """scripts/device_check.sh --prepare saves the real tokenizers (no weights) gzip-compressed for the machine;
    what it saved loads and tokenizes as the installed one does, and the bridge reads it."""
    from benchmarks.device_tokenizers import FILES, NAMES, load_tokenizer, prepare_tokenizers
    from cross_tokenizers import real_tokenizer
    from specdecode.text.token_bridge import TokenText

    if not _installed(*NAMES):
        pytest.skip(f"the GGUF packages of {', '.join(NAMES)} are not installed")
    report = prepare_tokenizers(tmp_path)
    text = "def quicksort(arr):\n    pivot = arr[len(arr) // 2]  # café 😀\n"
    for name in NAMES:
        entry = report[name]
        folder = tmp_path / "tokenizers" / name
        assert entry["loads"] and "tokenizer.json.gz" in entry["files"] and entry["bytes"] < entry["unpacked_bytes"] / 3
        assert {p.name.removesuffix(".gz") for p in folder.iterdir()} <= set(FILES)  # tokenizer files only
        tokenizer, where = load_tokenizer(name, tmp_path)
        assert where.startswith("carried") and len(tokenizer) == len(real_tokenizer(name))
        assert tokenizer(text)["input_ids"] == real_tokenizer(name)(text)["input_ids"]
        assert TokenText(tokenizer).spell(tokenizer(text, add_special_tokens=False)["input_ids"]) == text.encode()
    assert sum(report[n]["bytes"] for n in NAMES) < 4 * 2**20  # beside the wheels in the 64 MiB carried


def test_the_carried_wheels_cover_what_the_machine_lacks(tmp_path):
    missing = wheels.missing_on_device(wheels.required_packages())
    # every direct requirement of the project is on the machine or carried
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for line in project:
        name = wheels.normalize(line.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip())
        assert name in wheels.DEVICE_PACKAGES or name in missing, name
    assert {"gguf", "llguidance", "llama-cpp-python", "diskcache"} <= set(missing)  # and their own needs
    assert not set(missing) & wheels.DEVICE_PACKAGES
    # the completeness check sees a wheel that is not there
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in missing:
        (folder / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").write_bytes(b"")
    assert wheels.wheel_report(folder)["complete"]
    (folder / "gguf-1.0-py3-none-any.whl").unlink()
    report = wheels.wheel_report(folder)
    assert not report["complete"] and report["absent"] == ["gguf"]
    if wheels.WHEELS.is_dir():  # prepared here (scripts/device_check.sh --prepare): it must be complete
        assert wheels.wheel_report()["absent"] == []


@pytest.fixture(scope="module")
def copying_pair():
    target = tiny_qwen(64, seed=0, eos_token_id=0)
    return target, tiny_qwen(64, seed=1, eos_token_id=0)


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0])
def test_the_replay_drafter_keeps_drafts_at_the_rate_it_is_given(copying_pair, alpha):
    target, draft = copying_pair
    prompts = [[5, 9, 3, 12], [7, 1, 30]]
    record = AutoregressiveGenerator(HFBackend(target)).generate(prompts, max_new_tokens=40, temperature=0.0,
                                                                  ignore_eos=True).token_ids
    drafter = ReplayDrafter(record, alpha, 64, seed=1, model=ModelDrafter(HFBackend(draft)))
    result = SpeculativeGenerator(HFBackend(target), drafter, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=40, temperature=0.0, ignore_eos=True)
    assert result.token_ids == record and drafter.off_record == 0
    stats = result.stats
    first = stats.accepted_per_position[0] / stats.proposed_per_position[0]
    assert first == alpha if alpha in (0.0, 1.0) else 0.45 < first < 0.95
    assert drafter.forward_calls > 0  # the draft model paid its forwards


def test_replay_errors_are_a_function_of_the_position_at_the_given_rate():
    drafter = ReplayDrafter([[4] * 10], 0.8, 1000, seed=3)
    tokens = [drafter.draft_token(0, j) for j in range(4000)]
    assert tokens == [drafter.draft_token(0, j) for j in range(4000)]
    assert 0.77 < sum(t == 4 for t in tokens) / len(tokens) < 0.83


def test_a_wheel_retagged_for_any_cpython_keeps_a_valid_record(tmp_path):
    import base64
    import hashlib
    import zipfile

    path = tmp_path / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("llama_cpp/__init__.py", "x = 1\n")
        whl.writestr("llama_cpp_python-0.3.36.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: cp311-cp311-linux_x86_64\n")
        whl.writestr("llama_cpp_python-0.3.36.dist-info/RECORD",
                     "llama_cpp/__init__.py,sha256=abc,6\nllama_cpp_python-0.3.36.dist-info/WHEEL,sha256=old,40\n"
                     "llama_cpp_python-0.3.36.dist-info/RECORD,,\n")
    new = wheels.retag_py3_none(path)
    assert new.name == "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl" and not path.exists()
    with zipfile.ZipFile(new) as whl:
        wheel = whl.read("llama_cpp_python-0.3.36.dist-info/WHEEL")
        assert wheel.decode().splitlines()[-1] == "Tag: py3-none-linux_x86_64" and b"cp311" not in wheel
        digest = base64.urlsafe_b64encode(hashlib.sha256(wheel).digest()).rstrip(b"=").decode()
        record = whl.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode()
        assert f"llama_cpp_python-0.3.36.dist-info/WHEEL,sha256={digest},{len(wheel)}" in record
        assert whl.read("llama_cpp/__init__.py") == b"x = 1\n"
    assert wheels.retag_py3_none(new) == new  # already py3-none: left as it is


def test_a_killed_sections_journal_is_read_back_and_shown(tmp_path):
    """What a section journals as it goes (rows.jsonl, progress.log) is what the report shows when the section is
    killed before its result: its rows, its last steps; a line torn by the kill is skipped."""
    from benchmarks import device_journal, device_report

    journal = device_journal.Journal(tmp_path, "compiled")
    journal.put("bandwidth", {"nominal": None, "measured_copy": 2e12})
    journal.log("built 0.5B in 3.0 s")
    row = {"size": "0.5B", "variant": "static", "warm_up_s": 0.5, "warmed_shapes": 2, "left_cold": 0, "compiles": 0,
           "step_ms": 1.5, "verify_ms": 1.6, "bytes_per_step": {"total": 1e9}, "floor_ms_measured_copy": 0.5,
           "x_floor": 3.0, "bandwidth_share": 0.33}
    journal.add("rows", row)
    journal.log("0.5B compiled: shape (1, 1, 256, False, False): compiling")
    device_journal.Journal(tmp_path, "costs").add("rows", {"other": "section"})
    with open(tmp_path / device_journal.ROWS, "a") as f:
        f.write('{"section": "compiled", "add": "rows", "it')  # killed mid-line
    partial = device_journal.read(tmp_path, "compiled")
    assert partial == {"bandwidth": {"nominal": None, "measured_copy": 2e12}, "rows": [row]}
    last = device_journal.tail(tmp_path, "compiled")
    assert len(last) == 2 and last[-1].endswith("[compiled] 0.5B compiled: shape (1, 1, 256, False, False): compiling")
    report = {"dry_run": False, "created": "now", "elapsed_s": 250.0,
              "sections": {"compiled": {"ok": False, "error": "killed after 250 s", "partial": partial,
                                        "last_steps": last}}}
    markdown = device_report.render_markdown(report)
    assert "**compiled failed**: killed after 250 s" in markdown and "compiling" in markdown
    assert "| 0.5B | static | 0.5 (0) | 2 (0) | 1.50 |" in markdown
    device_journal.clear(tmp_path)
    assert device_journal.read(tmp_path, "compiled") == {} and device_journal.tail(tmp_path, "compiled") == []


def test_plan_overrides_change_a_field_and_refuse_an_unknown_one():
    plan = dc.make_plan(True, ['step_variants=["static", "compiled"]', "full_warm_up=false", "context=32"])
    assert plan.step_variants == ("static", "compiled") and plan.full_warm_up is False and plan.context == 32
    with pytest.raises(SystemExit, match="not a plan field"):
        dc.make_plan(True, ["nonsense=1"])

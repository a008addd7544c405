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
from specdecode.bench import device_check as dc
from specdecode.bench import device_sections as sections
from specdecode.bench import device_wheels as wheels
from specdecode.bench.replay_drafter import ReplayDrafter
from specdecode.drafters.model import ModelDrafter

REPO = Path(__file__).resolve().parents[1]


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
                  "## llama.cpp", "## Compiled step"):
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
    from specdecode.bench.device_compiled import bytes_per_step, nominal_bandwidth

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

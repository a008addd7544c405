"""The device check: one command that measures a lent GPU machine (an H100 or H200 with 16 CPU cores) in a few
minutes, and its --dry-run, every step on the CPU with tiny shapes, which CI runs so the check cannot rot before a
machine is lent. scripts/device_check.sh drives it (installing the project and carried wheels on the machine
first; this folder runs from the checkout). This file is the driver; the sections and their plan are
device_sections.py and device_compiled.py, the markdown device_report.py, the carried wheels device_wheels.py.

Sections, each a subprocess of its own with a time budget, so that a crash or a hang is recorded, not fatal. Each
journals its rows and a timestamped line per step as it goes (device_journal.py: rows.jsonl, progress.log in the
output folder), and the report takes a killed section's rows from there:
  environment  the machine, torch, the GPU;
  wheels       the project's requirements missing from the machine's image, and whether the carried wheels cover
               them (scripts/device_check.sh --prepare downloads and builds them into .device_wheels/);
  gpu_tests    the suite's device paths (tests/test_device_paths.py with SPECDECODE_TEST_DEVICE, and the CUDA-graph
               tests of tests/test_static_backend.py): pass/fail per test;
  costs        v(n) = an n-token forward / a 1-token one, n = 1..16, batch 1, 4, 16, for random-weight Qwen2.5
               0.5B, 1.5B and 7B shapes in bf16, on the static backend (CUDA graphs) and transformers, and the
               draft cost ratio c of each smaller shape against each larger one;
  overhead     the engine at a known acceptance (replay_drafter.py: the target's own greedy continuation with
               errors at rate 1 - alpha, a 0.5B-shape draft model paying real draft costs), K fixed and auto,
               against plain decoding and against Leviathan's prediction from v(n) and c measured just before;
               transformers' assisted generation beside ours at acceptance 1;
  llamacpp     llama.cpp v(n) with 16 threads on a random-weight GGUF of the 1.5B shape quantized to Q4_K_M by
               llama.cpp's own quantize, c of the 0.5B shape, and the speedup predicted there at the default pair's
               acceptance (read from docs/results/llamacpp-code.json);
  compiled     the static backend's step, with CUDA graphs for every shape first, then compiled (torch.compile),
               against the bandwidth floor of the 0.5B, 1.5B and 7B shapes, each compile timed and counted, c of
               the 0.5B shape against the others, and a full warm-up's time last (device_compiled.py);
  cross_vocab  a draft of another family and tokenizer: the SmolLM2-135M shape (llama) against the 7B shape on the
               GPU and against the 1.5B shape with llama.cpp on the cores, the drafter's host cost between the real
               tokenizers (carried in .device_wheels/tokenizers/), and Leviathan's speedup at SmolLM2's measured
               acceptance with that cost in c (device_cross_vocab.py).

    python -m benchmarks.device_check --out DIR [--dry-run] [--budget SECONDS] [--sections A,B] [--set KEY=VALUE]
    python -m benchmarks.device_check --prepare [--wheels .device_wheels]   (the wheels, and the tokenizers)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, fields, replace
from pathlib import Path

from . import device_compiled, device_cross_vocab, device_journal, device_overhead
from .device_report import render_markdown
from .device_sections import SECTION_FUNCTIONS, Deadline, Plan
from .device_tokenizers import prepare_tokenizers
from .device_wheels import REPO, WHEELS, prepare

SCHEMA = "specdecode.device_check/1"
SECTIONS = ("environment", "wheels", "gpu_tests", "costs", "overhead", "llamacpp", "compiled", "cross_vocab")
SECTION_FUNCTIONS = {**SECTION_FUNCTIONS, "overhead": device_overhead.section_overhead,
                     "compiled": device_compiled.section_compiled,
                     "cross_vocab": device_cross_vocab.section_cross_vocab}


def make_plan(dry_run: bool, overrides: list[str] = ()) -> Plan:
    """The full or dry plan with KEY=VALUE overrides (VALUE read as JSON where it parses, lists as tuples), so a
    second call on the same machine can change what it measures without a code change."""
    plan = Plan.dry() if dry_run else Plan.full()
    known = {f.name for f in fields(Plan)}
    changes = {}
    for item in overrides:
        key, _, text = item.partition("=")
        if key not in known:
            raise SystemExit(f"--set {item}: {key!r} is not a plan field ({', '.join(sorted(known))})")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        changes[key] = tuple(value) if isinstance(value, list) else value
    return replace(plan, **changes)


# ---------------------------------------------------------------------------------------------- driver
def run_section(name: str, plan: Plan, result_file: Path, seconds: float | None = None,
                journal_dir: Path | None = None) -> None:
    """Child process: one section, its result (or its error) written as JSON; seconds: its time (default: the
    plan's budget for it); its journal in journal_dir."""
    start = time.perf_counter()
    journal = device_journal.Journal(journal_dir, name)
    journal.log(f"started, {seconds or plan.budgets[name]:.0f} s to run")
    if plan.torch_threads:
        import torch

        torch.set_num_threads(plan.torch_threads)  # tiny shapes: one thread is fastest, and spares a shared CPU
    try:
        result = {"ok": True, "result": SECTION_FUNCTIONS[name](plan, Deadline(seconds or plan.budgets[name]),
                                                                journal)}
    except Exception as exc:  # noqa: BLE001 - a failed step is a result of the check, not its end
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - start
    journal.log(f"{'finished' if result['ok'] else 'failed: ' + result['error'][:200]} "
                f"({result['seconds']:.1f} s)")
    result_file.write_text(json.dumps(result, indent=1, default=str))


def run_check(out: Path, dry_run: bool, sections=SECTIONS, budget: float = 480.0, overrides: list[str] = ()) -> dict:
    """Every section in turn, none past the total budget (seconds): a section that would start too late is
    recorded as skipped, and one that runs over its own budget is killed and recorded with what its journal
    holds."""
    plan = make_plan(dry_run, overrides)
    out.mkdir(parents=True, exist_ok=True)
    device_journal.clear(out)
    report = {"schema": SCHEMA, "dry_run": dry_run, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "plan": asdict(plan), "overrides": list(overrides), "budget_s": budget, "sections": {}}
    start = time.perf_counter()
    for name in sections:
        part = out / f"section-{name}.json"
        part.unlink(missing_ok=True)
        command = [sys.executable, "-m", "benchmarks.device_check", "--section", name, "--result", str(part),
                   "--journal", str(out)] + [f"--set={item}" for item in overrides]
        command += ["--dry-run"] if dry_run else []
        began = time.perf_counter()
        left = budget - (began - start)
        if left < 20:
            report["sections"][name] = {"ok": False, "error": f"skipped: {budget - left:.0f} s of the {budget:.0f} s "
                                                              f"budget were spent", "wall_s": 0.0}
            continue
        timeout = min(plan.budgets[name] + 10, left)
        command += ["--seconds", str(timeout - 10)]
        try:
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            tail = (done.stdout[-1500:] + done.stderr[-2500:]).strip()
            if part.exists():
                entry = json.loads(part.read_text())
            else:
                entry = {"ok": False, "error": f"the section's process exited with {done.returncode} and wrote "
                                               f"nothing", "output_tail": tail}
        except subprocess.TimeoutExpired:
            entry = {"ok": False, "error": f"killed after {timeout:.0f} s (its budget: {plan.budgets[name]} s)"}
            device_journal.Journal(out, name, elapsed=timeout).log(f"killed by the driver after {timeout:.0f} s")
        entry["wall_s"] = time.perf_counter() - began
        if not entry["ok"]:  # what it measured before it stopped, and where it was
            entry["partial"] = device_journal.read(out, name)
            entry["last_steps"] = device_journal.tail(out, name)
        part.unlink(missing_ok=True)
        report["sections"][name] = entry
        print(f"[device check] {name}: {'ok' if entry['ok'] else 'FAILED: ' + entry['error']} "
              f"({entry['wall_s']:.0f} s)", flush=True)
    report["elapsed_s"] = time.perf_counter() - start
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    markdown = render_markdown(report)
    (out / "device_check.md").write_text(markdown)
    print(markdown, flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for device_check.json and device_check.md")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS)
                    + ", run in the order given")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all sections together")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a plan field (device_sections.Plan), e.g. --set overhead_variants='[\"static\"]'")
    ap.add_argument("--prepare", action="store_true", help="download and build the carried wheels, and save the "
                    "cross_vocab section's tokenizers")
    ap.add_argument("--wheels", default=str(WHEELS))
    ap.add_argument("--no-llama-build", action="store_true", help="--prepare without building llama-cpp-python")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--journal", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:
        run_section(args.section, make_plan(args.dry_run, args.set), Path(args.result), args.seconds,
                    Path(args.journal) if args.journal else None)
        return 0
    if args.prepare:
        report = prepare(Path(args.wheels), build_llama=not args.no_llama_build)
        report["tokenizers"] = prepare_tokenizers(Path(args.wheels))  # optional: skipped ones are said, not fatal
        print(json.dumps(report, indent=1))
        return 0 if report["complete"] else 1
    if not args.out:
        ap.error("--out DIR is needed (scripts/device_check.sh picks $OUT)")
    sections = tuple(x for x in args.sections.split(",") if x)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    run_check(Path(args.out), args.dry_run, sections, args.budget, args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The device check: one command that measures a lent GPU machine (an H100 with 16 CPU cores) in under 8 minutes,
and its --dry-run, every step on the CPU with tiny shapes, which CI runs so the check cannot rot before a machine
is lent. scripts/device_check.sh drives it (installing the project and carried wheels on the machine first).
This file is the driver and the report; the sections and their plan are device_sections.py, the carried wheels
device_wheels.py.

Sections, each a subprocess of its own with a time budget, so that a crash or a hang is recorded, not fatal:
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
  compiled     the static backend's step, plain and compiled (torch.compile), each warmed up at load, against the
               bandwidth floor of the 0.5B, 1.5B and 7B shapes, c of the 0.5B shape against the others, and the
               warm-up's time (device_compiled.py).

    python -m specdecode.bench.device_check --out DIR [--dry-run] [--budget SECONDS]
    python -m specdecode.bench.device_check --prepare [--wheels .device_wheels]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from . import device_compiled
from .device_sections import SECTION_FUNCTIONS, Deadline, Plan
from .device_wheels import REPO, WHEELS, prepare

SCHEMA = "specdecode.device_check/1"
SECTIONS = ("environment", "wheels", "gpu_tests", "costs", "overhead", "llamacpp", "compiled")
SECTION_FUNCTIONS = {**SECTION_FUNCTIONS, "compiled": device_compiled.section_compiled}


# ---------------------------------------------------------------------------------------------- driver
def run_section(name: str, plan: Plan, result_file: Path, seconds: float | None = None) -> None:
    """Child process: one section, its result (or its error) written as JSON; seconds: its time (default: the
    plan's budget for it)."""
    start = time.perf_counter()
    if plan.torch_threads:
        import torch

        torch.set_num_threads(plan.torch_threads)  # tiny shapes: one thread is fastest, and spares a shared CPU
    try:
        result = {"ok": True, "result": SECTION_FUNCTIONS[name](plan, Deadline(seconds or plan.budgets[name]))}
    except Exception as exc:  # noqa: BLE001 - a failed step is a result of the check, not its end
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - start
    result_file.write_text(json.dumps(result, indent=1, default=str))


def run_check(out: Path, dry_run: bool, sections=SECTIONS, budget: float = 480.0) -> dict:
    """Every section in turn, none past the total budget (seconds): a section that would start too late is
    recorded as skipped, and one that runs over its own budget is killed and recorded."""
    plan = Plan.dry() if dry_run else Plan.full()
    out.mkdir(parents=True, exist_ok=True)
    report = {"schema": SCHEMA, "dry_run": dry_run, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "plan": asdict(plan), "sections": {}}
    start = time.perf_counter()
    for name in sections:
        part = out / f"section-{name}.json"
        part.unlink(missing_ok=True)
        command = [sys.executable, "-m", "specdecode.bench.device_check", "--section", name, "--result", str(part)]
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
        entry["wall_s"] = time.perf_counter() - began
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


# ---------------------------------------------------------------------------------------------- markdown
def _f(x, digits=2) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(_f(x) for x in row) + " |" for row in rows]


def render_markdown(report: dict) -> str:
    s = report["sections"]
    lines = [f"# Device check{' (dry run: CPU, tiny shapes)' if report['dry_run'] else ''}", "",
             f"{report['created']}, {report['elapsed_s']:.0f} s.", ""]

    def body(name):
        entry = s.get(name, {})
        if not entry.get("ok"):
            lines.extend([f"**{name} failed**: {entry.get('error', 'not run')}", ""])
            return None
        return entry["result"]

    lines.append("## Environment")
    env = body("environment")
    if env:
        lines += _table(["key", "value"], [[k, v] for k, v in env.items()]) + [""]
    lines.append("## Carried wheels")
    wheels = body("wheels")
    if wheels:
        lines += [f"Missing on the machine: {', '.join(wheels['missing_on_device']) or 'none'}. Carried "
                  f"({wheels['folder']}): {len(wheels['carried'])} wheels; absent: "
                  f"{', '.join(wheels['absent']) or 'none'}; complete: {wheels['complete']}.", ""]
    lines.append("## GPU tests")
    tests = body("gpu_tests")
    if tests:
        lines += [f"On {tests['device']}: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} "
                  f"skipped (pytest exit {tests['exit_code']}).", ""]
        lines += [f"- FAILED {t['name']}: {t['message']}" for t in tests["failures"]] + [""]
    lines.append("## v(n): an n-token forward over a 1-token one")
    costs = body("costs")
    if costs:
        n_max = max((max(r["v"], key=int) for r in costs["rows"]), default=1, key=int)
        ns = list(range(1, int(n_max) + 1))
        lines += _table(["shape", "backend", "batch", "step ms"] + [f"v({n})" for n in ns],
                        [[r["size"], r["backend"], r["batch"], r["step_ms"]] + [r["v"].get(n, r["v"].get(str(n)))
                                                                               for n in ns] for r in costs["rows"]])
        lines += ["", "Draft cost ratio c (draft step / target step):", ""]
        lines += _table(["draft", "target", "backend", "batch", "c"],
                        [[x["draft"], x["target"], x["backend"], x["batch"], x["c"]] for x in costs["c"]]) + [""]
    lines.append("## Engine overhead at known acceptance")
    over = body("overhead")
    if over:
        lines += [f"Target {over['target']}, draft {over['draft']} (random weights, {over['dtype']}, static "
                  f"backend), {over['new_tokens']} new tokens; {over['goal']}.", ""]
        lines += _table(["batch", "alpha", "K", "first-draft acceptance", "tok/s", "plain tok/s", "× plain", "predicted ×",
                         "ratio", "same tokens"],
                        [[r["batch"], r["alpha"], r["k"] if r["k"] != "auto" else f"auto (best {r['predicted_best_k']})",
                          r["first_draft_acceptance"], r["tokens_per_s"], r["plain_tokens_per_s"], r["speedup"],
                          r["predicted_speedup"], r["ratio"], r["same_as_plain"]] for r in over["rows"]]) + [""]
        if over["assisted"]:
            lines += _table(["acceptance 1, batch 1", "K", "tok/s", "plain tok/s", "× plain", "predicted ×", "ratio"],
                            [[a["method"], a["k"], a["tokens_per_s"], a["plain_tokens_per_s"], a["speedup"],
                              a["predicted_speedup"], a["ratio"]] for a in over["assisted"]]) + [""]
    lines.append("## llama.cpp on the CPU cores")
    llama = body("llamacpp")
    if llama and "skipped" in llama:
        lines += [f"Skipped: {llama['skipped']}", ""]
    elif llama:
        ns = sorted(llama["v"], key=int)
        lines += [f"{llama['threads']} threads, Q4_K_M, context {llama['context'] // 2}: step "
                  f"{llama['step_ms']:.1f} ms, draft step {llama['draft_step_ms']:.1f} ms, c = {llama['c']:.3f}.", ""]
        lines += _table([f"v({n})" for n in ns], [[llama["v"][n] for n in ns]]) + [""]
        pred = llama["prediction"]
        if "error" in pred:
            lines += [f"Prediction failed: {pred['error']}", ""]
        else:
            lines += [f"Predicted speedup at alpha = {pred['alpha']:.3f} ({pred['source']}): "
                      f"{pred['predicted_speedup']:.2f}× at K = {pred['best_k']}.", ""]
    lines.append("## Compiled step against the bandwidth floor")
    compiled = body("compiled")
    if compiled:
        lines += device_compiled.render(compiled, _table)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for device_check.json and device_check.md")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny shapes")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all sections together")
    ap.add_argument("--prepare", action="store_true", help="download and build the carried wheels")
    ap.add_argument("--wheels", default=str(WHEELS))
    ap.add_argument("--no-llama-build", action="store_true", help="--prepare without building llama-cpp-python")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:
        run_section(args.section, Plan.dry() if args.dry_run else Plan.full(), Path(args.result), args.seconds)
        return 0
    if args.prepare:
        report = prepare(Path(args.wheels), build_llama=not args.no_llama_build)
        print(json.dumps(report, indent=1))
        return 0 if report["complete"] else 1
    if not args.out:
        ap.error("--out DIR is needed (scripts/device_check.sh picks $OUT)")
    sections = tuple(x for x in args.sections.split(",") if x)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    run_check(Path(args.out), args.dry_run, sections, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())

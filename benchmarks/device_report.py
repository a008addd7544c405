"""The device check's markdown report (device_check.md): one part per section. A section that was killed or
failed shows its error, its last progress lines and whatever its journal holds (device_journal.py), so every
renderer here reads its result with .get: a partial result lacks the keys its section writes last."""

from __future__ import annotations

from . import device_compiled, device_cross_vocab


def _f(x, digits=2) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(_f(x) for x in row) + " |" for row in rows]


def _environment(env: dict) -> list[str]:
    return table(["key", "value"], [[k, v] for k, v in env.items()]) + [""]


def _wheels(w: dict) -> list[str]:
    absent = ", ".join(w.get("absent", [])) or "none"
    return [f"Missing on the machine: {', '.join(w.get('missing_on_device', [])) or 'none'}. Carried "
            f"({w.get('folder')}): {len(w.get('carried', []))} wheels; absent: {absent}; "
            f"complete: {w.get('complete')}.", ""]


def _gpu_tests(t: dict) -> list[str]:
    if "passed" not in t:  # killed: the outcomes streamed so far
        done = t.get("tests", [])
        lines = [f"{len(done)} tests reported before the stop: {sum(x['outcome'] == 'passed' for x in done)} passed, "
                 f"{sum(x['outcome'] == 'failed' for x in done)} failed.", ""]
        return lines + [f"- {x['outcome'].upper()} {x['name']}" for x in done if x["outcome"] != "passed"] + [""]
    timed_out = f" Stopped at its budget after {t['seconds']:.0f} s." if t.get("timed_out") else ""
    lines = [f"On {t['device']}: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped (pytest exit "
             f"{t['exit_code']}).{timed_out}", ""]
    return lines + [f"- FAILED {x['name']}: {x['message']}" for x in t.get("failures", [])] + [""]


def _costs(costs: dict) -> list[str]:
    rows = costs.get("rows", [])
    if not rows:
        return []
    n_max = max((max(r["v"], key=int) for r in rows), default=1, key=int)
    ns = list(range(1, int(n_max) + 1))
    lines = table(["shape", "backend", "batch", "step ms"] + [f"v({n})" for n in ns],
                  [[r["size"], r["backend"], r["batch"], r["step_ms"]] + [r["v"].get(n, r["v"].get(str(n)))
                                                                         for n in ns] for r in rows])
    if costs.get("c"):
        lines += ["", "Draft cost ratio c (draft step / target step):", ""]
        lines += table(["draft", "target", "backend", "batch", "c"],
                       [[x["draft"], x["target"], x["backend"], x["batch"], x["c"]] for x in costs["c"]])
    return lines + [""]


def _overhead(over: dict) -> list[str]:
    lines = [f"Target {over.get('target')}, draft {over.get('draft')} (random weights, {over.get('dtype')}, static "
             f"backend), {over.get('new_tokens')} new tokens; {over.get('goal', '')}.", ""]
    for w in over.get("warm_ups", []):
        lines.append(f"- warm-up of the {w.get('variant', 'compiled')} {w['model']}: {w['warmed']} shapes in "
                     f"{w['seconds']:.1f} s, {w['left_cold']} left cold, {w.get('compiles', '—')} compiles")
    lines += [""] if over.get("warm_ups") else []
    lines += table(["variant", "batch", "alpha", "K", "first-draft acceptance", "tok/s", "plain tok/s", "× plain",
                    "predicted ×", "ratio", "same tokens"],
                   [[r.get("variant", "static"), r["batch"], r["alpha"],
                     r["k"] if r["k"] != "auto" else f"auto (best {r['predicted_best_k']})",
                     r["first_draft_acceptance"], r["tokens_per_s"], r["plain_tokens_per_s"], r["speedup"],
                     r["predicted_speedup"], r["ratio"], r["same_as_plain"]] for r in over.get("rows", [])]) + [""]
    if over.get("assisted"):
        lines += table(["acceptance 1, batch 1", "K", "tok/s", "plain tok/s", "× plain", "predicted ×", "ratio"],
                       [[a["method"], a["k"], a["tokens_per_s"], a["plain_tokens_per_s"], a["speedup"],
                         a["predicted_speedup"], a["ratio"]] for a in over["assisted"]]) + [""]
    return lines


def _llamacpp(llama: dict) -> list[str]:
    if "skipped" in llama:
        return [f"Skipped: {llama['skipped']}", ""]
    if "v" not in llama:
        return [f"Measured before the stop: {', '.join(sorted(llama))}.", ""]
    ns = sorted(llama["v"], key=int)
    lines = [f"{llama['threads']} threads, Q4_K_M, context {llama['context'] // 2}: step {llama['step_ms']:.1f} ms, "
             f"draft step {llama['draft_step_ms']:.1f} ms, c = {llama['c']:.3f}.", ""]
    lines += table([f"v({n})" for n in ns], [[llama["v"][n] for n in ns]]) + [""]
    pred = llama.get("prediction", {})
    if "error" in pred:
        lines += [f"Prediction failed: {pred['error']}", ""]
    elif pred:
        lines += [f"Predicted speedup at alpha = {pred['alpha']:.3f} ({pred['source']}): "
                  f"{pred['predicted_speedup']:.2f}× at K = {pred['best_k']}.", ""]
    return lines


PARTS = (("environment", "## Environment", _environment), ("wheels", "## Carried wheels", _wheels),
         ("gpu_tests", "## GPU tests", _gpu_tests),
         ("costs", "## v(n): an n-token forward over a 1-token one", _costs),
         ("overhead", "## Engine overhead at known acceptance", _overhead),
         ("llamacpp", "## llama.cpp on the CPU cores", _llamacpp),
         ("compiled", "## Compiled step against the bandwidth floor", lambda r: device_compiled.render(r, table)),
         ("cross_vocab", "## A draft of another tokenizer (SmolLM2-135M shape)",
          lambda r: device_cross_vocab.render(r, table)))


def render_markdown(report: dict) -> str:
    s = report["sections"]
    lines = [f"# Device check{' (dry run: CPU, tiny shapes)' if report['dry_run'] else ''}", "",
             f"{report['created']}, {report['elapsed_s']:.0f} s.", ""]
    for name, title, render in PARTS:
        lines.append(title)
        entry = s.get(name, {})
        if entry.get("ok"):
            lines += render(entry["result"])
            continue
        lines += [f"**{name} failed**: {entry.get('error', 'not run')}", ""]
        if entry.get("last_steps"):
            lines += ["Its last steps (progress.log):", "", "```", *entry["last_steps"], "```", ""]
        if entry.get("partial"):
            lines += ["What it measured before it stopped (rows.jsonl):", ""]
            try:
                lines += render(entry["partial"])
            except (KeyError, TypeError, ValueError) as exc:  # a partial result the renderer cannot read
                lines += [f"(not rendered: {type(exc).__name__}: {exc}; see device_check.json)", ""]
    return "\n".join(lines)

"""`specdecode advise`: measure what speculation can give on this machine, and say what to use.

Presentation only: the measurement and the arithmetic are in specdecode.bench.advise.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys

import typer

from .app import app
from .common import CLIError, backend_name, err, load_pair, out, user_errors
from .options import AUTO, ModelOptions, model_options


@app.command()
@model_options(k_default=AUTO)
def advise(
    prompts: str = typer.Option("code", "--prompts", help="Prompt set: code, prose, edit (built in), or a file "
                                "(.jsonl of {\"prompt\": ...}, or text: prompts separated by '---' lines, else one "
                                "per line)."),
    nb_prompts: int = typer.Option(3, "--nb-prompts", help="Use only the first N prompts of the set."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n", help="New tokens per prompt and run."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (acceptance is then "
                                      "lower, and the prediction holds in expectation)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampled runs."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap prompts in the tokenizer's chat template (when it "
                              "has one), as `specdecode bench` does, or feed them raw."),
    measure: str = typer.Option("best", "--measure", help="best: decode each drafter's best K beside plain "
                                "decoding, to check the prediction; all: every K (slow); none: predictions only."),
    cost_repeats: int = typer.Option(3, "--cost-repeats", help="Forwards timed per step-cost measurement."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as one JSON object instead of tables."),
    opts: ModelOptions = None,
) -> None:
    """Measure this machine's costs and each drafter's acceptance; predict the speedup of every K; recommend.

    Times the target's step, v(n) = a forward of n tokens / a forward of 1 (n = 1..9) and the draft model's
    forwards (1 and 2 tokens, its prompt); counts, for each drafter (the draft model, prompt lookup, the suffix
    drafter, and with --draft suffix+MODEL both MODEL alone and suffix+MODEL), how often each draft position is kept
    on the prompts (one run at the largest K).
    Then prints the speedup Leviathan's formula gives for K = 1..8 (-k N: up to N), the measured speedup of each
    drafter's best K, the roofline (drafts always kept and free) and the recommendation. About a minute on the
    default pair with 2 threads (docs/ADVISE.md).
    """
    with user_errors():
        from ..bench.advise import MEASURE, advise as run_advise
        from ..bench.prompts import load_prompts
        from ..bench.workload import encode_prompts
        from ..exact.sampling import SamplingParams

        max_k = 8 if opts.num_speculative_tokens == AUTO else int(opts.num_speculative_tokens)
        if measure not in MEASURE:
            raise CLIError(f"--measure must be one of {', '.join(MEASURE)}, got {measure!r}")
        if nb_prompts < 1 or max_new_tokens < 2 or cost_repeats < 1:
            raise CLIError("--nb-prompts and --cost-repeats must be >= 1, --max-new-tokens >= 2")
        SamplingParams(temperature, 0, 1.0)
        texts = [p.text for p in load_prompts(prompts)][:nb_prompts]
        target_model, draft_model = load_pair(opts, quiet=json_out and not err.is_terminal)
        prompt_ids = encode_prompts(target_model.tokenizer, texts, chat)
        with _status(not json_out) as progress:
            report = run_advise(target_model, draft_model, prompt_ids, max_new_tokens, max_k, temperature, seed,
                                opts.method, measure, cost_repeats, progress)
        report["config"].update(target=opts.target, draft=opts.draft if opts.has_draft else None, prompts=prompts,
                                chat=chat, backend=backend_name(target_model), threads=opts.threads)
        _record_auto_costs(opts, report.get("draft_auto"))
        if json_out:
            sys.stdout.write(json.dumps(_clean(report), ensure_ascii=False) + "\n")
        else:
            _print(report)


def _record_auto_costs(opts: ModelOptions, auto: dict | None) -> None:
    """The draft model's measured costs become --draft auto's record for this pair on this machine, so generate,
    serve and bench decide as advise says."""
    from ..pairing.draft_choice import DraftCosts, save_costs
    from ..pairing.pair import auto_cost_key

    if auto is not None and opts.draft_model is not None:
        save_costs(auto_cost_key(opts, opts.draft_model), DraftCosts.from_dict(auto["costs"]))
        auto["text"] = auto["text"].replace("MODEL", opts.draft_model)
        auto["draft"] = auto["draft"].replace("MODEL", opts.draft_model)


@contextlib.contextmanager
def _status(enabled: bool):
    """A progress callback: a status line on a terminal, nothing elsewhere."""
    if not (enabled and err.is_terminal):
        yield lambda _label: None
        return
    with err.status("advise: timing the step costs") as status:
        yield lambda label: status.update(f"advise: {label} done, measuring on")


def _clean(obj):
    """Strict JSON: NaN and infinities become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _print(report: dict) -> None:
    from rich.table import Table

    config, costs = report["config"], report["costs"]
    out.print(f"[bold]specdecode advise[/]  target [cyan]{config['target']}[/]"
              + (f"  draft [cyan]{config['draft']}[/]" if config.get("draft") else "")
              + f"  {config['backend']} backend"
              + (f", {config['threads']} thread{'s' * (config['threads'] != 1)}" if config.get("threads") else "")
              + f"  prompts {config['prompts']} ({config['num_prompts']}), {config['max_new_tokens']} new tokens, "
              f"T={config['temperature']:g}")
    line = f"target step {costs['target_step_ms']:.1f} ms"
    draft = costs.get("draft")
    if draft is not None:
        line += (f"; draft model: 1 token {draft['step_ms']:.1f} ms (c = {draft['step']:.2f} target steps), 2 tokens "
                 f"{draft['pair_ms']:.1f} ms ({draft['pair']:.2f}), its prompt {draft['prefill_ms']:.0f} ms "
                 f"({draft['prefill']:.1f})")
    out.print(line)
    out.print("v(n) = forward of n tokens / forward of 1: "
              + "  ".join(f"v({n})={v:.2f}" for n, v in costs["v"].items()))
    table = Table(title=f"expected speedup over plain decoding, {config['decode_tokens']} tokens after the prefill "
                        f"\\[measured]", title_justify="left")
    table.add_column("drafter", no_wrap=True)
    table.add_column("acceptance per position", no_wrap=True)
    for k in range(1, config["max_k"] + 1):
        table.add_column(f"K={k}", justify="right", no_wrap=True)
    for drafter in report["drafters"]:
        cells = []
        for row in drafter["by_k"]:
            cell = f"{row['speedup_at_length']:.2f}×"
            if row["measured_speedup"] is not None:
                cell += f" [{row['measured_speedup']:.2f}×]"
            cells.append(f"[bold]{cell}[/]" if row["k"] == drafter["best_k"] else cell)
        table.add_row(drafter["name"], " ".join(f"{a:.0%}" for a in drafter["acceptance"]), *cells)
    out.print(table, soft_wrap=False)
    out.print("expected: Leviathan's E(K) / time(K) with the measured costs and acceptance per position, time(K) = "
              "K c + v(K+1) (+ c2 - c after a step that kept every draft; for drafters that offer fewer than K drafts, "
              "the forwards they cause), and the draft model reading each prompt; measured: decode tokens/s over "
              "plain decoding's on the same prompts", soft_wrap=True, markup=False)
    for drafter in report["drafters"]:
        row = drafter["by_k"][drafter["best_k"] - 1]
        longest = max(drafter["by_k"], key=lambda r: r["speedup"])
        line = f"{drafter['name']}: on long generations {longest['speedup']:.2f}× at K={longest['k']}"
        if row["expected_end_to_end_speedup"] is not None:
            measured = row["measured_end_to_end_speedup"]
            line += (f"; at K={row['k']} end to end (the target's prefill counted, as `specdecode bench` reports "
                     f"tokens/s) {row['expected_end_to_end_speedup']:.2f}× expected"
                     + (f", {measured:.2f}× measured" if measured is not None else ""))
        out.print(line, markup=False)
    for name, why in report["skipped"].items():
        out.print(f"{name}: left out ({why})", markup=False)
    roof = report["roofline"]
    out.print(f"roofline (every draft kept, drafts free): {roof['speedup']:.2f}× at K={roof['k']}")
    out.print(f"[bold]recommendation[/]: {report['recommendation']['text']}", soft_wrap=True)
    if report.get("draft_auto"):
        from rich.markup import escape

        auto = report["draft_auto"]
        out.print(f"[bold]--draft auto[/] here: {escape(auto['draft'])} ({escape(auto['text'])})", soft_wrap=True)

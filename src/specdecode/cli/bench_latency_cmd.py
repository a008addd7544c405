"""`specdecode bench latency`: ms/token of the target alone and with the draft, for one prompt.

Presentation only: the measurement is specdecode.bench.latency. The function is registered by the bench command
group (`bench_app.command("latency")(latency)`).
"""

from __future__ import annotations

from typing import Optional

import typer

from ..backends import huge_pages
from .bench_output import fmt, load_prompt_set, quiet, write_json
from .common import CLIError, load_pair, out, progress_bar, user_errors
from .options import ModelOptions, model_options


@model_options(k_default="auto", k_list=True)
def latency(
    prompts: str = typer.Option("code", "--prompts", help="Prompt set or file; its first prompt is used."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Use this text as the prompt instead."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="New tokens per timed decode."),
    runs: int = typer.Option(3, "--runs", help="Timed decodes of each configuration."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    seed: int = typer.Option(0, "--seed"),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the chat template."),
    cost_repeats: int = typer.Option(3, "--cost-repeats", help="Forwards timed per step-cost measurement."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the numbers to this JSON file ('-' = stdout)."),
    opts: ModelOptions = None,
) -> None:
    """ms/token of the target alone and with the draft.

    Forward costs on a warm cache (1-token target and draft steps, (K+1)-token
    verification), then end-to-end decoding of one prompt.
    """
    with user_errors():
        from ..bench.latency import measure_latency
        from ..bench.workload import encode_prompts
        from ..exact.sampling import SamplingParams

        ks = opts.k_values
        SamplingParams(temperature, 0, 1.0)
        if max_new_tokens < 1 or runs < 1:
            raise CLIError("--max-new-tokens and --runs must be >= 1")
        texts = [prompt] if prompt else [p.text for p in load_prompt_set(prompts, None, 1)[0]]
        target_model, draft_model = load_pair(opts, quiet=quiet(json_path))
        huge_pages.wait_for(target_model, draft_model)  # time the steady state
        [ids] = encode_prompts(target_model.tokenizer, texts[:1], chat)
        units = 1 + len(ks) if draft_model is not None else 1
        with progress_bar(1 + (1 + runs) * units, "latency") as advance:
            report = measure_latency(target_model, draft_model, ids, ks, max_new_tokens, runs, temperature, seed,
                                     cost_repeats, opts.method, progress=advance)
        report.update(target=opts.target, draft=opts.draft if opts.has_draft else None)
        if json_path != "-":
            _print_latency(report)
        write_json(report, json_path)


def _print_latency(report: dict) -> None:
    from rich.table import Table

    costs = report["costs"]
    table = Table(title=f"latency: {report['target']}"
                  + (f" + draft {report['draft']}" if report.get("draft") else "")
                  + f", {report['max_new_tokens']} tokens, {report['prompt_tokens']}-token prompt",
                  title_justify="left")
    for name in ("configuration", "ms/token (end to end)", "ms/token (decode)", "forward costs", "acceptance",
                 "tok/step", "speedup"):
        table.add_column(name, justify="left" if name in ("configuration", "forward costs") else "right")
    alone = report["target_alone"]
    table.add_row("target alone", f"{alone['ms_per_token']:.1f} ± {alone['ms_per_token_std']:.1f}",
                  fmt(alone["decode_ms_per_token"], ".1f"), f"1-token step {alone['step_ms']:.1f} ms", "", "", "1.00×")
    for row in report["with_draft"]:
        table.add_row(f"with draft, K={row['k']}", f"{row['ms_per_token']:.1f} ± {row['ms_per_token_std']:.1f}",
                      fmt(row["decode_ms_per_token"], ".1f"),
                      _row_costs(row, costs), f"{row['acceptance_rate']:.1%}",
                      f"{row['mean_accepted_length']:.2f}", fmt(row["speedup"], ".2f") + "×")
    out.print(table, soft_wrap=False)
    if costs.get("c") is not None:
        out.print(f"cost ratio c = draft step / target step = {costs['c']:.3f}")


def _row_costs(row: dict, costs: dict) -> str:
    """The draft step and the (K+1)-token verification of a row; auto has no single K to cost."""
    parts = []
    if row["draft_step_ms"] is not None:
        parts.append(f"draft step {row['draft_step_ms']:.1f} ms")
    if row["verify_ms"] is not None:
        parts.append(f"verify {row['verify_ms']:.1f} ms (v={costs['v'][str(row['k'])]:.2f})")
    if row.get("mean_k") is not None and row["k"] == "auto":
        parts.append(f"mean K {row['mean_k']:.2f}")
    return ", ".join(parts)

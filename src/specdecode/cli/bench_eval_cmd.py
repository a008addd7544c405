"""`specdecode eval multiplication`: accuracy of plain vs speculative sampling on a × b, with Wilson intervals and
a two-proportion z-test.

Presentation only: the evaluation is specdecode.evals.multiplication.
"""

from __future__ import annotations

from typing import Optional

import typer

from .app import app
from .bench_output import fmt, quiet, write_json
from .common import CLIError, generator_of, load_pair, make_generator, out, progress_bar, user_errors
from .options import ModelOptions, model_options

eval_app = typer.Typer(help="Task evaluations of speculative vs plain sampling.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


@eval_app.callback()
def _eval_group() -> None:
    """Task evaluations of speculative vs plain sampling."""


@eval_app.command("multiplication")
@model_options(k_default="4")
def multiplication(
    nb_prompts: int = typer.Option(100, "--nb-prompts", help="Problems per seed."),
    seed: str = typer.Option("0", "--seed", help="Seed of the problems; a comma list (0,1,2) pools several."),
    temperature: float = typer.Option(0.7, "--temperature", help="Sampling temperature of both runs (0 = greedy)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p (1.0 = off)."),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", "-n", help="Most new tokens per answer (both runs)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per generate() call."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write results to this JSON file ('-' = stdout)."),
    opts: ModelOptions = None,
) -> None:
    """Accuracy on a × b: plain vs speculative sampling, Wilson CIs, z-test.

    a and b are drawn from 1..99; the target answers each prompt by plain and
    by speculative sampling.

    Both runs sample the target's own distribution (speculative decoding is
    lossless), so their accuracies should agree up to sampling noise. The
    answer is the first integer the model writes.
    """
    with user_errors():
        from ..evals.multiplication import evaluate, make_problems
        from ..exact.sampling import SamplingParams

        seeds = _seed_list(seed)
        SamplingParams(temperature, top_k, top_p)
        k = opts.num_speculative_tokens
        if batch_size < 1 or max_new_tokens < 1:
            raise CLIError("--batch-size and --max-new-tokens must be >= 1")
        problems = make_problems(nb_prompts, seeds)
        if not opts.has_draft:
            raise CLIError("eval multiplication compares plain with speculative sampling: give a --draft")
        target_model, draft_model = load_pair(opts, quiet=quiet(json_path))
        plain = make_generator(target_model, None, k, opts.method)
        spec = generator_of(opts, target_model, draft_model)  # what generate runs, its policy's costs included
        with progress_bar(2 * len(problems), "eval multiplication") as advance:
            result = evaluate(plain, spec, problems, max_new_tokens, temperature, top_k, top_p, batch_size,
                              seed=seeds[0], progress=advance)
        result.update(target=opts.target, draft=opts.draft, k=k, seeds=seeds, nb_prompts=nb_prompts)
        if json_path != "-":
            _print_multiplication(result)
        write_json(result, json_path)


def _seed_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--seed must be an integer or a comma list of integers, got {text!r}") from None
    if not values:
        raise CLIError("--seed needs at least one integer")
    return list(dict.fromkeys(values))


def _print_multiplication(result: dict) -> None:
    from rich.table import Table

    s = result["sampling"]
    table = Table(title=f"eval multiplication: {result['n']} problems (seeds {','.join(map(str, result['seeds']))}),"
                  f" T={s['temperature']:g}, {result['max_new_tokens']} new tokens max", title_justify="left")
    for name in ("sampling", "correct", "accuracy", "95% Wilson CI", "unparsed", "tok/s", "acceptance"):
        table.add_column(name, justify="left" if name == "sampling" else "right")
    for name, m in result["methods"].items():
        label = "plain (target alone)" if name == "plain" else f"speculative (K={result['k']})"
        table.add_row(label, f"{m['correct']}/{m['n']}", f"{m['accuracy']:.1%}",
                      f"[{m['ci95'][0]:.1%}, {m['ci95'][1]:.1%}]", str(m["unparsed"]), f"{m['tokens_per_second']:.1f}",
                      fmt(m["acceptance_rate"], ".1%", ""))
    out.print(table, soft_wrap=False)
    c = result["comparison"]
    verdict = ("[green]consistent[/]: no evidence that the accuracies differ" if c["consistent"] else
               "[bold red]INCONSISTENT[/]: the accuracies differ more than sampling noise explains (p < 0.05)")
    out.print(f"difference (speculative − plain) {c['difference'] * 100:+.1f} points; two-proportion z = {c['z']:.2f},"
              f" p = {c['p_value']:.3f}: {verdict}")

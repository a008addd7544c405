"""`specdecode verify`: check on the user's pair that speculative sampling is lossless.

Presentation only: the check is specdecode.evals.verify.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from .app import app
from .bench_output import fmt, quiet, write_json
from .common import CLIError, load_pair, make_generator, out, progress_bar, user_errors
from .options import OPTIONS, ModelOptions, SamplingOptions, model_options, sampling_options


@app.command("verify")
@model_options(k_default="4")
@sampling_options(temperature=1.0, top_k=3, only=("temperature", "top_k", "top_p", *OPTIONS), help={
    "temperature": "Sampling temperature (0 = greedy: every sample must equal the greedy continuation).",
    "top_k": "Top-k (0 = off). A small top-k keeps the joint distribution enumerable and the test sharp."})
def verify(
    samples: int = typer.Option(2000, "--samples", "-N", help="Speculative samples per prompt."),
    positions: int = typer.Option(4, "--positions", "-P", help="Tokens per sample whose joint distribution is "
                                  "checked. Steps draft at most P−2 tokens: use P >= K+2 to exercise full steps."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Prompt set (code, prose, edit) or file; "
                                          "default: two short built-in prompts."),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="A prompt text (repeatable)."),
    nb_prompts: int = typer.Option(2, "--nb-prompts", help="Use the first N prompts of --prompts."),
    batch_size: int = typer.Option(100, "--batch-size", help="Copies of the prompt per generate() call."),
    seed: int = typer.Option(0, "--seed", help="Base seed of the sampling."),
    alpha: float = typer.Option(1e-3, "--alpha", help="Overall false-alarm rate for an exact sampler "
                                "(Bonferroni-split over all tests)."),
    max_nodes: int = typer.Option(512, "--max-nodes", help="Most prefixes the target is run on per prompt to "
                                  "compute the exact distribution."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the full report to this JSON file ('-' = "
                                            "stdout)."),
    sampling: SamplingOptions = None,
    opts: ModelOptions = None,
) -> None:
    """Check on your pair that speculative sampling is lossless.

    For each prompt, the target's exact distribution of the first P tokens
    (joint and per position, after the same sampling options) is
    computed by running the target alone on every likely prefix; N
    speculative samples are compared with it by total-variation distance and
    chi-square tests. PASS means no deviation was detected at this sample
    size (the report says which TV distance could have been detected); it
    covers only these prompts and positions. Exit code 1 on FAIL.
    """
    with user_errors():
        from ..bench.prompts import load_prompts
        from ..evals.verify import DEFAULT_PROMPTS, verify_pair
        params = sampling.params
        k = opts.num_speculative_tokens
        for name, value, low in (("--samples", samples, 1), ("--positions", positions, 1),
                                 ("--batch-size", batch_size, 1), ("--nb-prompts", nb_prompts, 1),
                                 ("--max-nodes", max_nodes, 1)):
            if value < low:
                raise CLIError(f"{name} must be >= {low}, got {value}")
        if not 0 < alpha < 1:
            raise CLIError(f"--alpha must be in (0, 1), got {alpha}")
        if prompt:
            texts = list(prompt)
        elif prompts:
            texts = [p.text for p in load_prompts(prompts)][:nb_prompts]
        else:
            texts = list(DEFAULT_PROMPTS)[:nb_prompts]
        if not opts.has_draft:
            raise CLIError("verify checks speculative decoding: give a --draft")
        target_model, draft_model = load_pair(opts, quiet=quiet(json_path))
        gen = make_generator(target_model, draft_model, k, opts.method)
        if gen.tokenizer is None:
            raise CLIError("verify needs the target's tokenizer to encode its prompts")
        prompt_ids = [gen.tokenizer(t)["input_ids"] for t in texts]
        if any(not ids for ids in prompt_ids):
            raise CLIError("a prompt encodes to no tokens")
        with progress_bar(samples * len(prompt_ids), "verify") as advance:
            report = verify_pair(gen, prompt_ids, params, positions, samples, batch_size, seed, alpha, max_nodes,
                                 progress=advance)
        report.update(target=opts.target, draft=opts.draft, method=opts.method, prompt_texts=texts)
        if json_path != "-":
            _print_verify(report, gen.tokenizer)
        write_json(report, json_path)
        if not report["pass"]:
            raise typer.Exit(1)


def _full_steps(report: dict) -> bool:
    """Whether some step drafted all K tokens (under auto, K is the engine's choice: any step that drafted)."""
    k = report["k"]
    return report["max_drafts_per_step_exercised"] >= (1 if k == "auto" else k)


def _options_text(sampling: dict) -> str:
    """The options set beyond temperature, top-k and top-p, as ", min_p 0.1, repetition_penalty 1.3" (or "")."""
    neutral = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    parts = [f"{name} {sampling[name]:g}" for name, off in neutral.items() if sampling.get(name, off) != off]
    if sampling.get("logit_bias"):
        parts.append(f"logit_bias on {len(sampling['logit_bias'])} token(s)")
    return "".join(", " + p for p in parts)


def _print_verify(report: dict, tokenizer) -> None:
    from rich.markup import escape
    from rich.table import Table

    s = report["sampling"]
    out.print(f"[bold]specdecode verify[/]: {report['target']} with draft {report['draft']}, K={report['k']}, "
              f"{report['method']}; T={s['temperature']:g}, top-k {s['top_k'] or 'off'}, top-p {s['top_p']:g}"
              f"{_options_text(s)}; "
              f"{report['samples_per_prompt']} samples × {report['positions']} tokens per prompt; "
              f"{report['num_tests']} tests at level {report['level_per_test']:.1e} each (α = {report['alpha']:g}).")
    for r, text in zip(report["prompts"], report["prompt_texts"]):
        short = text if len(text) <= 60 else text[:57] + "..."
        table = Table(title=f"prompt {r['prompt_index'] + 1}: {escape(repr(short))}", title_justify="left")
        for name in ("test", "cells", "TV", "TV bound", "chi²", "dof", "p-value", "result"):
            table.add_column(name, justify="left" if name in ("test", "result") else "right")
        for t in r["tests"]:
            result = "[green]pass[/]" if t["pass"] else "[bold red]FAIL[/] " + escape("; ".join(t["reasons"]))
            table.add_row(t["name"], f"{t['pooled_cells']}/{t['cells']}", f"{t['tv']:.4f}", f"{t['tv_threshold']:.4f}",
                          fmt(t["chi2"], ".1f", "inf"), str(t["dof"]), f"{t['p_value']:.3g}", result)
        out.print(table, soft_wrap=False)
        prov = ", ".join(f"{k} {v}" for k, v in sorted(r["provenance"].items()))
        out.print(f"  tokens sampled by provenance: {prov}; draft acceptance {r['acceptance_rate']:.1%} "
                  f"({r['accepted_tokens']}/{r['proposed_tokens']}); exact reference from {r['exact_forward_rows']} "
                  f"target rows")
    if not report["speculative_path_exercised"]:
        out.print("[yellow]warning:[/] no draft token was proposed (P too small?): only the target's own sampling "
                  "was checked")
    out.print(f"What this checks: the first {report['positions']} sampled tokens follow the target's exact "
              f"distribution (after the same warping), per position and jointly; steps drafted at most "
              f"{report['max_drafts_per_step_exercised']} token(s) (K={report['k']}, P={report['positions']}"
              f"{'' if _full_steps(report) else '; use P >= K+2 for full steps'}"
              f"). "
              f"A PASS means no deviation larger than about TV {report['prompts'][0]['detectable_tv']:.3f} "
              f"(joint) was detected; it is evidence, not proof, and covers only these prompts and positions.")
    out.print("[bold green]PASS[/]: the speculative samples are consistent with the target's distribution"
              if report["pass"] else
              "[bold red]FAIL[/]: the speculative samples do not follow the target's distribution")

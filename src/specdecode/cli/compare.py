"""`specdecode compare`: the target alone, then speculative decoding, on the same prompt; timings and speedup."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer
from rich.markup import escape

from .app import app
from .common import (CLIError, PROVENANCE_STYLES, check_generation_args, chat_ids, err, fail, generator_of, legend,
                     load_pair, make_generator, max_drafts, out, read_prompts, user_errors)
from .options import ModelOptions, SamplingOptions, model_options, sampling_options


@app.command()
@model_options(k_default="auto")
@sampling_options(temperature=0.0, help={"temperature": "0 = greedy (the outputs must then be identical); > 0 "
                                                        "samples.", "seed": "Seed for sampling (both runs use it)."})
def compare(
    prompt: str = typer.Argument(..., help="Text to continue (or, with --chat, the user's message); '-' reads "
                                 "stdin."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most new tokens of each run."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop when this text appears (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the end-of-sequence token, so "
                                    "both runs make exactly --max-new-tokens tokens."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run both models on a few tokens first, so "
                                "one-time start-up costs do not count against either run."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object with both runs, the speedup and "
                                  "whether the outputs are identical, instead of panels."),
    sampling: SamplingOptions = None,
    opts: ModelOptions = None,
) -> None:
    """Decode the prompt with the target alone, then speculatively; show both with their speed and the speedup.

    With greedy decoding (the default) the two outputs must be identical token for token: this is checked, and the
    exit code is 1 where they differ (the message says at which token).
    """
    with user_errors():
        check_generation_args(max_new_tokens, stop=stop)
        if not opts.has_draft:
            raise CLIError("compare needs a draft model to compare against: give --draft NAME|PATH, not none")
        [text] = read_prompts(prompt, None)
        target_model, draft_model = load_pair(opts, quiet=json_out and not err.is_terminal)
        k = opts.num_speculative_tokens
        plain = make_generator(target_model, None, k, opts.method)
        spec = generator_of(opts, target_model, draft_model)  # what generate runs, its policy's costs included
        inputs = [chat_ids(spec.tokenizer, text)] if chat else text
        params = sampling.generation_params(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=stop or ())
        if warmup:
            with (err.status("warming up") if err.is_terminal else _nothing()):
                for gen in (plain, spec):
                    gen.generate(inputs, params, max_new_tokens=min(max_new_tokens, max_drafts(spec) + 2), stop=())
        show = not json_out
        if show:
            out.print(legend(), soft_wrap=True)
        runs = {}
        for key, gen, title in (("plain", plain, f"target alone: {_short(opts.target)}"),
                                ("speculative", spec, f"speculative: k={k}, {opts.method}, {_short(opts.target)} + "
                                                      f"draft {_short(opts.draft)}")):
            runs[key] = _run(gen, inputs, params, title, show)
        p, s = runs["plain"], runs["speculative"]
        speedup = p.stats.wall_time_s / s.stats.wall_time_s if s.stats.wall_time_s > 0 else 0.0
        identical = p.token_ids[0] == s.token_ids[0]
        first_difference = None if identical else next(
            (i for i, (a, b) in enumerate(zip(p.token_ids[0], s.token_ids[0])) if a != b),
            min(len(p.token_ids[0]), len(s.token_ids[0])))
        greedy = sampling.greedy
        if json_out:
            record = {"prompt": text, "greedy": greedy, "identical": identical, "first_difference": first_difference,
                      "speedup": speedup,
                      "plain": _run_record(p), "speculative": _run_record(s)}
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        else:
            _summary(p, s, speedup, identical, first_difference, greedy)
        if greedy and not identical:
            fail(escape(f"greedy outputs differ from token {first_difference} on "
                        f"({_tokens_at(p, s, first_difference, spec.tokenizer)}): speculative decoding must give the "
                        f"target's own greedy tokens; on llama.cpp, --exact-greedy verifies in forwards that compute "
                        f"the same numbers as plain decoding (its default mode can flip a near-tie)"))


def _run(gen, inputs, params, title: str, show: bool):
    """Stream one generation into a panel (live on a terminal, printed once at the end otherwise)."""
    import time

    from rich.live import Live
    from rich.text import Text

    body = Text()
    start = time.perf_counter()
    tokens = 0

    def panel(done: bool, stats=None):
        from rich.panel import Panel

        elapsed = stats.wall_time_s if stats is not None else time.perf_counter() - start
        rate = tokens / elapsed if elapsed > 0 else 0.0
        subtitle = f"{tokens} tokens · {elapsed:.2f} s · {rate:.1f} tokens/s" + ("" if done else " …")
        return Panel(body, title=title, title_align="left", subtitle=subtitle, subtitle_align="right",
                     border_style="green" if done else "blue")

    token_stream = gen.stream(inputs, params)
    live = Live(panel(False), console=out, refresh_per_second=8, transient=False) \
        if show and out.is_terminal else None
    try:
        if live is not None:
            live.start()
        for event in token_stream:
            tokens += 1
            if event.text:
                body.append(event.text, style=PROVENANCE_STYLES.get(event.provenance))
            if live is not None:
                live.update(panel(False))
    finally:
        token_stream.close()
        result = token_stream.result
        if live is not None:
            if result is not None:
                live.update(panel(True, result.stats))
            live.stop()
    if show and live is None:
        out.print(panel(True, result.stats), soft_wrap=False)
    return result


def _tokens_at(p, s, i: int, tokenizer) -> str:
    """What each run made at token i: its id and text, or that the run had ended."""
    def token(result) -> str:
        ids = result.token_ids[0]
        if i >= len(ids):
            return f"ended after {len(ids)} tokens"
        text = tokenizer.decode([ids[i]]) if tokenizer is not None else None
        return f"id {ids[i]}" + (f" {text!r}" if text is not None else "")

    return f"plain: {token(p)}; speculative: {token(s)}"


def _short(name: str) -> str:
    """A model's display name: the last component of a path, the name itself otherwise."""
    import os

    path = os.path.expanduser(name)
    return os.path.basename(os.path.normpath(path)) if os.path.exists(path) else name


def _run_record(result) -> dict:
    return {"text": result.texts[0] if result.texts is not None else None, "token_ids": result.token_ids[0],
            "finish_reason": result.finish_reasons[0], "provenance": result.provenance[0],
            "stats": result.stats.to_dict()}


def _summary(p, s, speedup: float, identical: bool, first_difference, greedy: bool) -> None:
    from rich.table import Table

    table = Table(title="plain vs speculative", title_justify="left")
    table.add_column("")
    table.add_column("target alone", justify="right")
    table.add_column("speculative", justify="right")
    ps, ss = p.stats, s.stats
    table.add_row("new tokens", str(ps.new_tokens), str(ss.new_tokens))
    table.add_row("wall time", f"{ps.wall_time_s:.2f} s", f"{ss.wall_time_s:.2f} s")
    table.add_row("tokens/s", f"{ps.tokens_per_second:.1f}", f"{ss.tokens_per_second:.1f}")
    table.add_row("target forward calls", str(ps.target_forward_calls), str(ss.target_forward_calls))
    table.add_row("draft forward calls", "-", str(ss.draft_forward_calls))
    table.add_row("acceptance rate", "-", f"{ss.acceptance_rate:.1%}")
    table.add_row("mean accepted length", "1.00", f"{ss.mean_accepted_length:.2f}")
    out.print(table, soft_wrap=False)
    colour = "green" if speedup >= 1 else "yellow"
    out.print(f"speedup: [bold {colour}]{speedup:.2f}x[/]", soft_wrap=True)
    explanation = ss.policy_summary.get("explanation")
    if explanation:  # why the speculative run chose what it did, from the costs and acceptance it measured
        out.print(f"policy: {explanation}", markup=False, soft_wrap=True)
    if identical:
        note = "greedy outputs are identical token for token" if greedy else "outputs are identical"
        out.print(f"[bold green]✓[/] {note}", soft_wrap=True)
    elif greedy:
        out.print(f"[bold red]✗ greedy outputs differ[/] from token {first_difference} on: speculative decoding "
                  f"should reproduce the target's greedy output (only a near-tie flipped by floating-point "
                  f"round-off can excuse this)", soft_wrap=True)
    else:
        out.print(f"outputs differ from token {first_difference} on, as expected when sampling: both follow the "
                  f"target's distribution, not the same random draws", soft_wrap=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

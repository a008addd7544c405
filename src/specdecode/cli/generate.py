"""`specdecode generate`: stream a completion (or many) with speculative decoding, or plain decoding of the target."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from .app import app
from .applies import GREEDY_IDLE, refuse_ignored, refuse_sampling_at_greedy
from .common import (PROVENANCE_STYLES, CLIError, check_generation_args, chat_ids, err, generator_of, legend,
                     load_pair, progress_bar, read_prompts, stats_table, use_color, user_errors)
from .structure import check_logprobs, logprobs_table, read_structure, token_text
from .options import AUTO_DRAFT, ModelOptions, SamplingOptions, model_options, sampling_options


def _sgr(style: str):
    """A function wrapping text in the ANSI codes of a rich style (used for raw stdout writes)."""
    from rich.color import ColorSystem
    from rich.style import Style

    parsed = Style.parse(style)
    return lambda text: parsed.render(text, color_system=ColorSystem.STANDARD)


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining again at exit.
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        raise typer.Exit(1) from None


class _OrderedPrinter:
    """Writes the completions of many rows to stdout in prompt order while they are generated in a batch.

    The first unfinished row streams live; later rows are buffered and written when their turn comes.
    """

    def __init__(self, prompts: list[str], echo: bool, colour: bool, provenance_colours: bool, live: bool):
        self.prompts = prompts
        self.echo = echo
        self.live = live
        self.styles = {k: _sgr(v) for k, v in PROVENANCE_STYLES.items()} if provenance_colours else {}
        self.prompt_style = _sgr("bold") if colour else (lambda t: t)
        self.buffers: dict[int, list[str]] = {}
        self.finished: set[int] = set()
        self.ended_with_newline: dict[int, bool] = {}
        self.current = 0
        self.started = -1

    def _start(self, index: int) -> None:
        if self.started >= index:
            return
        self.started = index
        if len(self.prompts) > 1:
            err.rule(f"prompt {index + 1}/{len(self.prompts)}", style="dim")
        if self.echo:
            _write(self.prompt_style(self.prompts[index]))

    def _piece(self, text: str, provenance: str) -> str:
        style = self.styles.get(provenance)
        if style is None:
            return text
        # Colour each line separately so a newline never carries an open colour into the next line.
        return "\n".join(style(part) if part else part for part in text.split("\n"))

    def event(self, index: int, text: str | None, provenance: str, finished: bool) -> None:
        if text:
            piece = self._piece(text, provenance)
            self.ended_with_newline[index] = text.endswith("\n")
            if index == self.current and self.live:
                self._start(index)
                _write(piece)
            else:
                self.buffers.setdefault(index, []).append(piece)
        if finished:
            self.finished.add(index)
            self._advance()

    def _advance(self) -> None:
        while self.current < len(self.prompts):
            index = self.current
            self._start(index)
            pending = self.buffers.pop(index, [])
            if pending:
                _write("".join(pending))
            if index not in self.finished:
                return
            if not self.ended_with_newline.get(index, False):
                _write("\n")
            self.current += 1


@app.command()
@model_options(k_default="auto", draft_default=AUTO_DRAFT)
@sampling_options(temperature=0.0, help={"seed": "Seed for sampling; prompt i of --prompts-file draws the "
                                                 "stream (seed, i), whatever the batch size."})
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Text to continue (or, with --chat, the user's message); "
                                           "'-' reads it from stdin."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most new tokens per prompt."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template as a user "
                              "message."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts-file", "-f", help="Many prompts: one per line "
                                               "(or blocks separated by '---' lines), or a .jsonl file of "
                                               "{\"prompt\": ...}; '-' reads stdin."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Prompts of --prompts-file decoded together "
                                   "in one batch."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop when this text appears (repeatable); "
                                             "the stop text is not output."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the end-of-sequence token."),
    echo: Optional[bool] = typer.Option(None, "--echo/--no-echo", help="Print the prompt before its completion "
                                        "(default: on, off with --chat)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Colour tokens by provenance (on a terminal), "
                                 "with a legend; print the backends and the statistics on stderr."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Print text as it is decided, or all at "
                                "the end."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per prompt and line: prompt, text, "
                                  "token_ids, finish_reason, provenance, batch, stats (and logprobs with "
                                  "--logprobs). stats are those of the batch call the prompt was decoded in "
                                  "(summed over its rows)."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="A JSON schema file: the output is "
                                              "JSON valid under it (masks on target and draft, exact)."),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="A Lark grammar file (as llguidance reads "
                                          "it): the output follows it."),
    regex: Optional[str] = typer.Option(None, "--regex", help="A regular expression the whole output matches."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Report each new token's log-probability "
                                           "and the N most likely tokens at its position (0..20): a table on "
                                           "stderr, or logprobs/top_logprobs in --json."),
    sampling: SamplingOptions = None,
    opts: ModelOptions = None,
) -> None:
    """Generate text with speculative decoding: exactly the target model's output distribution, faster.

    Text streams to stdout as it is decided; status, progress and statistics go to stderr.
    """
    with user_errors():
        check_generation_args(max_new_tokens, stop=stop, batch_size=batch_size)
        structure = read_structure(json_schema, grammar, regex)
        check_logprobs(logprobs)
        params = sampling.generation_params(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=stop or (),
                                            logprobs=logprobs, **structure)  # checked here, before any model loads
        prompts = read_prompts(prompt, prompts_file)
        refuse_ignored(opts)
        _refuse_ignored(getattr(opts, "given", ()), prompts_file, batch_size, json_out)
        refuse_sampling_at_greedy(getattr(opts, "given", ()), {name: getattr(sampling, name) for name in GREEDY_IDLE},
                                  sampling.temperatures)
        target_model, draft_model = load_pair(opts, quiet=json_out and not err.is_terminal,
                                              announce=verbose or None, first_run_waits=False)
        gen = generator_of(opts, target_model, draft_model)
        inputs = [chat_ids(gen.tokenizer, p) for p in prompts] if chat else prompts
        live = stream and not json_out
        colour = use_color() and not json_out
        echo = (not chat) if echo is None else echo
        printer = None if json_out else _OrderedPrinter(prompts, echo, colour, colour and verbose, live)
        if verbose and not json_out:
            err.print(legend(), soft_wrap=True)
        seed = sampling.seed
        results = []
        with progress_bar(len(prompts), "generating", enabled=not live and len(prompts) > 1) as advance:
            for b, start in enumerate(range(0, len(prompts), batch_size)):
                # Prompt i is row i of one request seeded `seed` (its own stream), in any batch.
                rows = len(inputs[start:start + batch_size])
                result = _decode(gen, inputs[start:start + batch_size], start, printer, advance, params,
                                 seed=None if seed is None else [(seed, start + j) for j in range(rows)])
                results.append(result)
                for row in range(len(result.token_ids)):
                    if json_out:
                        _write(json.dumps(_record(prompts[start + row], start + row, b, result, row, gen.tokenizer),
                                          ensure_ascii=False) + "\n")
                    elif logprobs is not None:
                        err.print(logprobs_table(result, row, gen.tokenizer, title=f"logprobs, prompt {start + row + 1}"))
        if verbose:
            from ..bench.stats import merge_stats

            total = merge_stats([r.stats for r in results])
            mode = (f"speculative, k={opts.num_speculative_tokens}, {opts.method}" if draft_model is not None
                    else "plain decoding of the target")
            provenance = [kind for r in results for row in r.provenance for kind in row]
            err.print(stats_table(total, title=f"statistics ({mode})", provenance=provenance))
            explanation = total.policy_summary.get("explanation")
            if draft_model is not None and explanation:  # what the policy measured and decided, in its own words
                chosen = f"draft {opts.draft_choice.line()}; " if opts.draft_choice is not None else ""
                err.print(f"policy: {chosen}{explanation}", markup=False, soft_wrap=True)


def _refuse_ignored(given, prompts_file: Optional[str], batch_size: int, json_out: bool) -> None:
    """generate's own flags where they would do nothing (the model options': cli/applies.py)."""
    if "batch_size" in given and batch_size > 1 and prompts_file is None:
        raise CLIError(f"--batch-size {batch_size} does nothing with one PROMPT: it decodes the prompts of "
                       f"--prompts-file together; give those, or leave it out")
    for option in ("echo", "stream"):
        if option in given and json_out:
            raise CLIError(f"--{option}/--no-{option} does nothing with --json, whose records hold the prompt and "
                           f"the whole text apart, each written when done: leave it out")


def _decode(gen, batch: list, start: int, printer: _OrderedPrinter | None, advance, params, **overrides):
    """One batch through the engine's stream, its text to the printer as it is decided; returns the result."""
    token_stream = gen.stream(batch, params, **overrides)
    try:
        for event in token_stream:
            if printer is not None:
                printer.event(start + event.row, event.text, event.provenance, event.finished)
            if event.finished:
                advance()
    finally:
        token_stream.close()
    return token_stream.result


def _record(prompt: str, index: int, batch: int, result, row: int, tokenizer=None) -> dict:
    record = {
        "index": index,
        "prompt": prompt,
        "text": result.texts[row] if result.texts is not None else None,
        "token_ids": result.token_ids[row],
        "finish_reason": result.finish_reasons[row],
        "provenance": result.provenance[row],
        "batch": batch,
        "stats": result.stats.to_dict(),
    }
    if result.logprobs is not None and result.logprobs[row] is not None:
        record["logprobs"] = result.logprobs[row]
        record["top_logprobs"] = [[{"token_id": t, "token": token_text(tokenizer, t), "logprob": lp} for t, lp in top]
                                  for top in result.top_logprobs[row]]
    return record

"""What every command shares: the consoles, error reporting, loading the pair, prompts, progress, statistics."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional

from rich.markup import escape

from ..pairing.pair import generator_of, make_generator  # noqa: F401  (where the commands find them)
from .console import WIDE, CLIError, err, fail, flag, flagged, one_line, out, user_errors  # noqa: F401
from .options import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: F401  (where scripts and tests have found them)
from .options import AUTO, ModelOptions


def fit_width() -> None:
    """Give output that goes to a pipe or a file a wide page.

    Without a terminal rich (and Typer's help, drawn with rich) assumes 80 columns and cuts what is longer
    ("--num-speculative-t…"). A terminal keeps its own width; so does an explicit COLUMNS.
    """
    if "COLUMNS" in os.environ:
        return
    if not sys.stdout.isatty():
        os.environ.setdefault("TERMINAL_WIDTH", str(WIDE))  # Typer's help; it reads this when it first draws
        out.width = WIDE
    if not sys.stderr.isatty():
        err.width = WIDE


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True):
    """A progress bar on stderr, drawn only on a terminal: a pipe or a log gets no carriage returns.

    Yields advance(label="", n=1, description=None); a description replaces the bar's own.
    """
    if not (enabled and err.is_terminal and total > 0):
        yield lambda label="", n=1, description=None: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[label]}"), console=err, transient=True) as progress:
        task = progress.add_task(description, total=total, label="")

        def advance(label: str = "", n: int = 1, description: Optional[str] = None) -> None:
            fields = {} if description is None else {"description": description}
            progress.update(task, advance=n, label=label, **fields)

        yield advance


@contextlib.contextmanager
def prepare_progress(enabled: bool = True):
    """A progress callback (description, done, total) for the library's model preparation (models/prepare.py),
    drawn with progress_bar. A call whose total differs, or whose done goes back, starts the next task's bar."""
    bars = contextlib.ExitStack()
    state = {"total": None, "done": 0, "advance": None}

    def report(description: str, done: int, total: int) -> None:
        if total != state["total"] or done < state["done"]:
            bars.close()
            advance = bars.enter_context(progress_bar(total, escape(description), enabled))
            state.update(total=total, done=0, advance=advance)
        state["advance"](n=done - state["done"], description=escape(description))
        state["done"] = done

    with bars:
        yield report


# ---------------------------------------------------------------------------------------------- early checks
# Checked before any model is loaded, so a typo costs nothing. Each raises CLIError with one line. Sampling
# options, -k and the model options are checked by the library (see options.py and specdecode.pairing.pair).

def check_generation_args(max_new_tokens: int, stop: Optional[list] = None, batch_size: Optional[int] = None) -> None:
    if max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if stop and any(not s for s in stop):
        raise CLIError("--stop strings must be non-empty")
    if batch_size is not None and batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {batch_size}")


# ---------------------------------------------------------------------------------------------- loading
def quiet_transformers() -> None:
    """transformers' own progress bars ("Loading weights") would tear the CLI's display and write carriage
    returns into logs; the CLI shows its own status. Switched off with transformers' own switch where it is
    imported already, else with huggingface_hub's, which transformers reads when it is imported: importing it here
    would cost its seconds before the load, where a llama.cpp load imports it in a thread beside its own."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def load_pair(opts: ModelOptions, quiet: bool = False, announce: Optional[bool] = None, rows: int = 1,
              first_run_waits: bool = True):
    """specdecode.pairing.pair.load_pair with the CLI's display: (target, draft or None).

    A spinner shows on a terminal while each model loads, with a bar for preparing a built-in model; announce
    (default: on a terminal) prints the backend each model runs on. quiet: neither, and no progress either.
    rows: rows decoded at once (a server's --max-batch-size). first_run_waits: resolve_auto_draft's (False for
    `generate`: a first run does not wait for timing --draft auto's model; the next one times it).
    """
    from ..pairing.pair import (LOOKUP_DRAFTS, check_options, draft_prepared_alongside, load_draft, load_draft_model,
                        load_target, resolve_auto_draft, with_suffix)

    check_options(opts)
    quiet_transformers()
    announce = (err.is_terminal if announce is None else announce) and not quiet
    status = err.status if not quiet and err.is_terminal else _no_status
    if opts.compile and not quiet:  # said before the wait it explains
        err.print("--compile: each model's step shapes are compiled (torch.compile) and run once while it loads, "
                  "before the first request", markup=False, soft_wrap=True)
    start = time.perf_counter()
    with (status(f"loading target {opts.target}"), prepare_progress(not quiet) as progress,
          draft_prepared_alongside(opts)):
        target = load_target(opts, rows, progress)
    if announce:
        _announce("target", opts.target, target, time.perf_counter() - start)
    if opts.compile and not quiet:
        _warm_up_line("target", target)
    with prepare_progress(not quiet) as progress:
        choice, model = resolve_auto_draft(opts, target, rows, progress, measuring=lambda: status(
            "--draft auto: timing whether a draft model can pay here, once on this machine"),
            first_run_waits=first_run_waits)
    if choice is not None and not quiet:  # the first output names what auto chose, and why
        err.print(f"draft: {choice.line()}", markup=False, soft_wrap=True)
        if choice.uses_model and opts.tree_width > 1:  # known only now: said, not ignored
            err.print(f"--tree-width {opts.tree_width}: --draft auto chose the draft model, which drafts chains "
                      f"(token trees are the suffix draft's: --draft suffix)", markup=False, soft_wrap=True)
    if model is not None:
        if opts.compile and not quiet:
            _warm_up_line("draft", model)
        return target, with_suffix(opts, model)
    if not opts.has_draft or opts.draft_is_lookup:  # nothing to load
        draft = load_draft(opts, rows)
        if announce and draft is not None and choice is None:
            err.print(f"draft: {LOOKUP_DRAFTS[opts.draft.lower()]}", markup=False)
        return target, draft
    start = time.perf_counter()
    with status(f"loading draft {opts.draft_model}"), prepare_progress(not quiet) as progress:
        draft = load_draft_model(opts, rows, progress)
    if announce:
        _announce("draft", opts.draft, draft, time.perf_counter() - start)
    if opts.compile and not quiet:
        _warm_up_line("draft", draft)
    if not quiet:
        _another_tokenizer_line(opts, target, draft)
    return target, with_suffix(opts, draft)  # suffix+MODEL: the drafter around MODEL


def _another_tokenizer_line(opts, target, draft) -> None:
    """One line where the draft model's tokenizer is not the target's: it drafts through its text."""
    from ..text.vocab import VocabularyMismatchError, check_same_tokenizer

    mine, theirs = getattr(draft, "tokenizer", None), getattr(target, "tokenizer", None)
    if mine is None or theirs is None:
        return
    try:
        check_same_tokenizer(theirs, mine)
    except VocabularyMismatchError:
        err.print(f"draft: {opts.draft_model} has another tokenizer than the target: it drafts through its text "
                  f"(its new text as the target's tokens, SLEM), exactly; -k auto decodes plainly where that "
                  f"cannot pay", markup=False, soft_wrap=True)


def backend_name(loaded) -> str:
    """The backend a loaded model runs on (transformers unless the loader says otherwise)."""
    return getattr(loaded, "backend", None) or "transformers"


def _announce(role: str, name: str, loaded, seconds: float) -> None:
    err.print(f"{role}: {name} on the {backend_name(loaded)} backend (loaded in {seconds:.1f} s)", markup=False,
              soft_wrap=True)


def _warm_up_line(role: str, loaded) -> None:
    """--compile: what the model's warm-up at load did (StaticBackend.warm_up_report)."""
    from ..backends.warmup import DEFAULT_SECONDS  # the bound pairing's compile_options leaves at its default

    report = getattr(getattr(loaded, "model", None), "warm_up_report", None)
    if report is not None:
        err.print(f"{role}: {report.summary(DEFAULT_SECONDS)}", markup=False, soft_wrap=True)


@contextlib.contextmanager
def _no_status(_message):
    yield


def max_drafts(generator) -> int:
    """The most drafts a step of this generator can propose (a fixed K, or the cap of "auto")."""
    k = generator.num_speculative_tokens
    return generator.max_speculative_tokens if k == AUTO else int(k)


# ---------------------------------------------------------------------------------------------- prompts
def read_prompts(prompt: Optional[str], prompts_file: Optional[str]) -> list[str]:
    """The prompts of a command: the argument ('-' reads stdin), or a prompt file (the rules of
    bench.prompts.parse_prompts; '-' reads stdin). Raises CLIError or ValueError when none is usable."""
    from ..bench.prompts import load_file, parse_prompts

    if (prompt is None) == (prompts_file is None):
        raise CLIError("give either a PROMPT argument or --prompts-file, not both" if prompt is not None
                       else "no prompt: give a PROMPT argument or --prompts-file FILE")
    if prompt is not None:
        text = sys.stdin.read() if prompt == "-" else prompt
        if not text.strip():
            raise CLIError("the prompt is empty: give some text for the model to continue")
        return [text]
    items = parse_prompts(sys.stdin.read(), "stdin") if prompts_file == "-" else load_file(prompts_file)
    return [p.text for p in items]


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a single-turn chat (--chat), through the tokenizer's template."""
    from ..text.chat import NoChatTemplateError, encode_chat

    try:
        return encode_chat(tokenizer, text)
    except NoChatTemplateError as e:
        raise CLIError(f"--chat: {e}") from None


# ---------------------------------------------------------------------------------------------- presentation
# Rich styles of each token provenance (see results.TokenEvent).
PROVENANCE_STYLES = {"accepted": "green", "resampled": "yellow", "bonus": "cyan", "target": "magenta"}
PROVENANCE_HELP = {"accepted": "draft token the target kept", "resampled": "target's correction of a rejected draft",
                   "bonus": "target's extra token after all drafts were kept", "target": "target alone"}


def use_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def legend():
    """A one-line rich Text naming each provenance in its colour."""
    from rich.text import Text

    text = Text("legend: ")
    for i, (kind, style) in enumerate(PROVENANCE_STYLES.items()):
        text.append(("  " if i else "") + f"■ {kind}", style=style)
        text.append(f" ({PROVENANCE_HELP[kind]})", style="dim")
    return text


def _k_row(stats) -> str:
    k, copies = stats.num_speculative_tokens, getattr(stats, "copy_limit", 0)
    # the copy limit apart from K: the mean counts free copies too, and may pass a model's K
    limit = f"at most {k}" + (f" from a model, {copies} copied" if copies > k else "")
    if getattr(stats, "policy", "fixed") == "auto":
        plain = getattr(stats, "plain_steps", 0)
        return (f"auto: {getattr(stats, 'mean_k', 0.0):.2f} on average, {limit}"
                + (f" ({plain} plain steps)" if plain else ""))
    return f"{k}"


def _per_position(stats) -> str:
    """Acceptance of draft 1, 2, ... over the steps that proposed it (positions never proposed are left out)."""
    pairs = zip(stats.accepted_per_position, stats.proposed_per_position)
    return " ".join(f"{a / p:.0%}" for a, p in pairs if p) or "–"


def stats_table(stats, title: str = "statistics", provenance: Optional[list] = None):
    """A rich Table of a Stats: acceptance, mean accepted length, forward calls, throughput, timings."""
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    speculative = stats.num_speculative_tokens > 0
    rows = [("new tokens", f"{stats.new_tokens}"), ("prompts", f"{stats.num_rows}")]
    if speculative:
        rows += [("draft tokens per step (k)", _k_row(stats)),
                 ("acceptance rate", f"{stats.acceptance_rate:.1%}  ({stats.accepted_tokens}/{stats.proposed_tokens})"),
                 ("mean accepted length", f"{stats.mean_accepted_length:.2f} tokens per target call"),
                 ("per-position acceptance", _per_position(stats))]
    rows += [("target forward calls", f"{stats.target_forward_calls}"),
             ("draft forward calls", f"{stats.draft_forward_calls}")]
    if provenance:
        counts = {kind: 0 for kind in PROVENANCE_STYLES}
        for kind in provenance:
            counts[kind] = counts.get(kind, 0) + 1
        rows.append(("tokens by provenance", "  ".join(f"[{PROVENANCE_STYLES.get(k, '')}]{k} {n}[/]"
                                                         for k, n in counts.items() if n)))
    rows += [("wall time", f"{stats.wall_time_s:.2f} s (prefill {stats.prefill_time_s:.2f}, draft "
                           f"{stats.draft_time_s:.2f}, verify {stats.verify_time_s:.2f})"),
             ("tokens/s", f"{stats.tokens_per_second:.1f}  (decode only: {stats.decode_tokens_per_second:.1f})")]
    for name, value in rows:
        table.add_row(name, value)
    return table

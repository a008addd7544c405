"""The `specdecode` command line. Presentation only: all the work is in the engine and the model loaders."""

from __future__ import annotations

import os

from .app import app
from . import generate, models_cmd, compare, bench_cmd, serve_cmd, advise_cmd  # noqa: F401,E402  (each registers its commands)
from .common import fit_width


def main() -> None:
    fit_width()  # before Typer's eager --help; the app's callback does it again for every command
    # Libraries' own tqdm bars (transformers' GGUF dequantization among them) would write carriage returns into
    # pipes and logs, and tear the CLI's display on a terminal, where the CLI draws its own progress. tqdm's own
    # switch; it is read when tqdm is first imported, which is later (the heavy imports wait for a command).
    os.environ.setdefault("TQDM_DISABLE", "1")
    app()

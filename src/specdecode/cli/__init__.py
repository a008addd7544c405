"""The `specdecode` command line. Presentation only: all the work is in the engine and the model loaders."""

from __future__ import annotations

from .app import app
from . import generate, models_cmd, compare, bench_cmd, serve_cmd  # noqa: F401,E402  (each registers its commands)


def main() -> None:
    app()

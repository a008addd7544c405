"""The consoles every command writes to and how a user's mistake is reported: one line, a non-zero exit, never a
traceback. Below both cli/options.py and cli/common.py, which import it."""

from __future__ import annotations

import contextlib
import os

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import OptionError

# Progress bars and status lines go to stderr so stdout stays clean for text and --json.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)
WIDE = 200  # columns for output that goes to a pipe or a file


class CLIError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


FLAGS = {"k": "-k", "served_model_names": "--served-model-name"}  # the flags not spelled like their option


def flag(option: str) -> str:
    """The flag of a library option name (an OptionError's option): k -> -k, top_p -> --top-p."""
    return FLAGS.get(option) or "--" + option.replace("_", "-")


def fail(message: str, code: int = 1) -> None:
    # soft_wrap: one line whatever the width.
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors():
    """Turn the library's expected errors into one clear line and a non-zero exit, never a traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except OptionError as e:  # the library names its option: the user typed a flag
        fail(escape(one_line(flagged(e))))
    except (CLIError, ValueError, FileNotFoundError, RuntimeError, ImportError, OSError) as e:
        fail(escape(one_line(str(e))) if str(e).strip() else type(e).__name__)
    except Exception as e:  # a bug, not bad input: still one line, with the way to the traceback
        if os.environ.get("SPECDECODE_DEBUG"):
            raise
        fail(escape(f"internal error ({type(e).__name__}: {one_line(str(e))}); set SPECDECODE_DEBUG=1 for the "
                    f"traceback and please report it"))


def flagged(error: OptionError) -> str:
    """The library's message in the CLI's words: "max_batch_size must be ..." -> "--max-batch-size must be ..."."""
    message = str(error)
    if message.startswith(error.option):
        return flag(error.option) + message[len(error.option):]
    return f"{flag(error.option)}: {message}"


def one_line(message: str) -> str:
    """A multi-line message as one line: later lines (e.g. the pip command of ModelNotInstalledError) are kept."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())

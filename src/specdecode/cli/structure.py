"""`generate`'s structured-output and logprob options: read and checked before any model loads; the logprobs table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from .options import CLIError

MAX_LOGPROBS = 20  # as the engine's limit (engine.MAX_LOGPROBS; not imported here: the CLI is built without torch)


def read_structure(json_schema: Optional[str], grammar: Optional[str], regex: Optional[str]) -> dict:
    """The engine's keyword for the one constraint asked for: {"json_schema": dict} | {"grammar": text} |
    {"regex": text} | {} for free text."""
    given = [name for name, value in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex))
             if value is not None]
    if len(given) > 1:
        raise CLIError(f"{' and '.join(given)} were both given: an output follows one constraint; pick one")
    if json_schema is not None:
        text = _read(json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise CLIError(f"--json-schema {json_schema}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})")
        if not isinstance(schema, (dict, bool)):
            raise CLIError(f"--json-schema {json_schema}: a JSON schema is an object (or true/false), got "
                           f"{type(schema).__name__}")
        return {"json_schema": schema}
    if grammar is not None:
        text = _read(grammar, "--grammar")
        if not text.strip():
            raise CLIError(f"--grammar {grammar}: the file is empty; write a Lark grammar with a 'start' rule")
        return {"grammar": text}
    if regex is not None:
        if not regex:
            raise CLIError("--regex is empty: give the pattern the whole output must match")
        return {"regex": regex}
    return {}


def check_logprobs(logprobs: Optional[int]) -> None:
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise CLIError(f"--logprobs must be 0..{MAX_LOGPROBS} (how many top alternatives per token), got {logprobs}")


def _read(path: str, option: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise CLIError(f"{option} {path}: no such file")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"{option} {path}: cannot be read as UTF-8 text ({e})")


def token_text(tokenizer, token_id: int) -> Optional[str]:
    return None if tokenizer is None else tokenizer.decode([token_id])


def logprobs_table(result, row: int, tokenizer, title: str):
    """One line per new token: its text, log-probability (and probability), and the top alternatives."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("#", "token", "logprob", "p", "top alternatives"):
        table.add_column(column, justify="right" if column in ("#", "logprob", "p") else "left")
    tokens, logprobs = result.token_ids[row], result.logprobs[row] or []
    tops = result.top_logprobs[row] or [()] * len(tokens)
    for i, (token, lp, top) in enumerate(zip(tokens, logprobs, tops)):
        alternatives = ", ".join(f"{token_text(tokenizer, t)!r} {v:.2f}" for t, v in top)
        table.add_row(str(i), repr(token_text(tokenizer, token)), f"{lp:.3f}", f"{math.exp(lp):.3f}", alternatives)
    return table

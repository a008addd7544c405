"""Built-in prompt sets for `specdecode bench`, and the loader for the user's own prompt files.

Built-in sets (JSON lines, one {"id", "prompt"} object per line, shipped as package data):
- code:  code completion and small programming tasks (drafts are accepted often),
- prose: explanations, emails, stories (drafts are accepted less often),
- edit:  code-editing tasks whose answer repeats most of the input (the best case for speculation),
- json:  chat-style requests for JSON (extract an invoice, fill a form, ...), each with the JSON schema its answer
         must follow ({"id", "prompt", "schema"}): the workload of structured outputs.
multi_turn.jsonl holds sessions, not prompts: `--prompts multi-turn`, read by bench/sessions.py.

A user file (for bench, and for `generate --prompts-file`: one reader, parse_prompts) may be .jsonl (objects
with a "prompt" key and optionally a "schema" object, or JSON strings), or plain text: prompts separated by
lines holding only `---`, or, when there is no such line, one prompt per non-empty line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN_SETS = ("code", "prose", "edit", "json")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    schema: dict | None = None  # the JSON schema the answer must follow (None: free text)


def builtin_names() -> tuple[str, ...]:
    return BUILTIN_SETS


def load_builtin(name: str) -> list[Prompt]:
    if name not in BUILTIN_SETS:
        raise ValueError(f"unknown prompt set {name!r}: use one of {', '.join(BUILTIN_SETS)}, or a file path")
    text = resources.files(__package__).joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
    return parse_prompts(text, name, jsonl=True)


def load_file(path: str | Path) -> list[Prompt]:
    """The prompts of a file, by the rules of parse_prompts (.jsonl by its suffix)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"prompt file {path}: cannot read it ({e})") from None
    return parse_prompts(text, str(path), jsonl=path.suffix == ".jsonl")


def parse_prompts(text: str, name: str, jsonl: bool = False) -> list[Prompt]:
    """The one reader of prompt files (and of stdin): errors name `name` and the line.

    JSON lines: each non-blank line a JSON string or an object with a string "prompt" (and an optional "id", and
    an optional "schema": the JSON schema of the answer, an object).
    Text: prompts separated by lines holding only `---`, or, when there is no such line, one prompt per non-blank
    line (kept as it is).
    """
    stem = Path(name).stem
    if jsonl:
        prompts = _parse_jsonl(text, name, stem)
    else:
        lines = text.splitlines()
        if any(line.strip() == "---" for line in lines):
            blocks, current = [], []
            for line in lines + ["---"]:
                if line.strip() == "---":
                    blocks.append("\n".join(current).strip("\n"))
                    current = []
                else:
                    current.append(line)
            texts = [b for b in blocks if b.strip()]
        else:
            texts = [line for line in lines if line.strip()]
        prompts = [Prompt(f"{stem}-{i}", t) for i, t in enumerate(texts)]
    if not prompts:
        raise ValueError(f"{name} holds no prompts (one per line, blocks separated by '---' lines, or .jsonl of "
                         f"{{\"prompt\": ...}})")
    return prompts


def load_prompts(spec: str) -> list[Prompt]:
    """A built-in set name (code, prose, edit, json) or a path to a prompt file."""
    if spec in BUILTIN_SETS:
        return load_builtin(spec)
    if Path(spec).expanduser().exists():
        return load_file(spec)
    raise ValueError(f"--prompts {spec!r} is neither a built-in set ({', '.join(BUILTIN_SETS)}) nor an existing file")


def _parse_jsonl(text: str, name: str, stem: str) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} line {lineno}: not valid JSON ({e.msg})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            schema = item.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise ValueError(f'{name} line {lineno}: "schema" must be a JSON object (a JSON schema)')
            prompt = Prompt(str(item.get("id", f"{stem}-{len(prompts)}")), item["prompt"], schema)
        elif isinstance(item, str):
            prompt = Prompt(f"{stem}-{len(prompts)}", item)
        else:
            raise ValueError(f'{name} line {lineno}: expected an object with a string "prompt" field, or a JSON '
                             f'string')
        if not prompt.text.strip():
            raise ValueError(f"{name} line {lineno}: the prompt is empty")
        prompts.append(prompt)
    return prompts

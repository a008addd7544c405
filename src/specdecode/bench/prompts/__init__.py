"""Built-in prompt sets for `specdecode bench`, and the loader for the user's own prompt files.

Built-in sets (JSON lines, one {"id", "prompt"} object per line, shipped as package data):
- code:  code completion and small programming tasks (drafts are accepted often),
- prose: explanations, emails, stories (drafts are accepted less often),
- edit:  code-editing tasks whose answer repeats most of the input (the best case for speculation).

A user file may be .jsonl (objects with a "prompt" key, or JSON strings), or plain text: prompts separated by
lines holding only `---`, or, when there is no such line, one prompt per non-empty line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN_SETS = ("code", "prose", "edit")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def builtin_names() -> tuple[str, ...]:
    return BUILTIN_SETS


def load_builtin(name: str) -> list[Prompt]:
    if name not in BUILTIN_SETS:
        raise ValueError(f"unknown prompt set {name!r}: use one of {', '.join(BUILTIN_SETS)}, or a file path")
    text = resources.files(__package__).joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
    return _parse_jsonl(text, name)


def load_file(path: str | Path) -> list[Prompt]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        prompts = _parse_jsonl(text, path.stem)
    else:
        lines = text.splitlines()
        if any(line.strip() == "---" for line in lines):
            chunks, current = [], []
            for line in lines:
                if line.strip() == "---":
                    chunks.append("\n".join(current))
                    current = []
                else:
                    current.append(line)
            chunks.append("\n".join(current))
            texts = [c.strip("\n") for c in chunks if c.strip()]
        else:
            texts = [line for line in lines if line.strip()]
        prompts = [Prompt(f"{path.stem}-{i}", t) for i, t in enumerate(texts)]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def load_prompts(spec: str) -> list[Prompt]:
    """A built-in set name (code, prose, edit) or a path to a prompt file."""
    if spec in BUILTIN_SETS:
        return load_builtin(spec)
    if Path(spec).expanduser().exists():
        return load_file(spec)
    raise ValueError(f"--prompts {spec!r} is neither a built-in set ({', '.join(BUILTIN_SETS)}) nor an existing file")


def _parse_jsonl(text: str, stem: str) -> list[Prompt]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{stem}: line {lineno} is not valid JSON ({e.msg})") from None
        if isinstance(item, str):
            prompts.append(Prompt(f"{stem}-{len(prompts)}", item))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(Prompt(str(item.get("id", f"{stem}-{len(prompts)}")), item["prompt"]))
        else:
            raise ValueError(f"{stem}: line {lineno} must be a JSON string or an object with a \"prompt\" string")
    return [p for p in prompts if p.text.strip()]

"""What the bench, latency, eval and verify commands share: their list options, prompt sets, number formats and
JSON output."""

from __future__ import annotations

import json
import math
import sys
from typing import Optional

from .common import CLIError, err


def float_list(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{name} must be a number or a comma list of numbers (e.g. 0,0.7), got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise CLIError(f"{name} values must be finite and >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{name} must be an integer or a comma list of integers (e.g. 2,4), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CLIError(f"{name} values must be integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def load_prompt_set(prompts: str, prompts_file: Optional[str], nb_prompts: Optional[int]) -> tuple[list, str]:
    """The prompts (bench.prompts.Prompt) of a set or of the user's file, the first nb_prompts of them, and the
    set's name."""
    from ..bench.prompts import load_file, load_prompts

    items = load_file(prompts_file) if prompts_file else load_prompts(prompts)
    if nb_prompts is not None:
        if nb_prompts < 1:
            raise CLIError(f"--nb-prompts must be >= 1, got {nb_prompts}")
        items = items[:nb_prompts]
    return items, (prompts_file or prompts)


def clean(obj):
    """JSON-safe: NaN and infinities become null (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def write_json(report: dict, path: Optional[str]) -> None:
    if not path:
        return
    text = json.dumps(clean(report), indent=2, ensure_ascii=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    err.print(f"wrote {path}", markup=False)


def quiet(json_path: Optional[str]) -> bool:
    """Loading stays silent when the report goes to stdout and nobody watches stderr."""
    return json_path == "-" and not err.is_terminal


def rate(x) -> str:
    """A throughput with sensible digits: 1234, 123.4, 12.3, 1.23, 0.273."""
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "0"
    return f"{x:.0f}" if x >= 1000 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def fmt(x, spec: str = ".2f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)

"""The device check's journal: what a section has measured and where its time went, written as it happens.

A section runs in a process of its own that the driver kills at its budget; its result file is written only at
its end. On 2026-11-28 an H200 run lost three sections whole that way (docs/results/device-check-h200-compiled-
killed.json): 430 s of GPU time and not one number, nor a line saying which step had taken it. So every section
also appends, as it goes, to two files in the output folder (few: the device tool brings back at most 8 files):

  rows.jsonl    one JSON object per measured row or value ({"section", "add": key, "item"} appends to a list,
                {"section", "put": key, "value"} sets a value); read() folds them back into the section's result
                shape, which the report shows for a section that was killed or failed;
  progress.log  one timestamped line per step (model built, warm-up started and finished, each compile, each row),
                seconds since the section began, so a killed section's last line says where its time went.

Each line is written and flushed on its own: a kill loses at most the step in progress.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

ROWS, PROGRESS = "rows.jsonl", "progress.log"


class Journal:
    """A section's journal in folder `out` (None: nothing written, e.g. a section called from a test)."""

    def __init__(self, out: Path | str | None, section: str, clock=time.monotonic, elapsed: float = 0.0):
        """elapsed: seconds the section has already run (the driver writing about a section it stopped)."""
        self.out = Path(out) if out is not None else None
        self.section, self.clock, self.start = section, clock, clock() - elapsed

    def _append(self, name: str, text: str) -> None:
        if self.out is None:
            return
        with open(self.out / name, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()

    def log(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        self._append(PROGRESS, f"{stamp} +{self.clock() - self.start:7.1f}s [{self.section}] {message}\n")

    def add(self, key: str, item) -> None:
        """Appends item to the list `key` of the section's result."""
        self._append(ROWS, json.dumps({"section": self.section, "add": key, "item": item}, default=str) + "\n")

    def put(self, key: str, value) -> None:
        """Sets `key` of the section's result."""
        self._append(ROWS, json.dumps({"section": self.section, "put": key, "value": value}, default=str) + "\n")


def clear(out: Path) -> None:
    """A new run: the journal of an earlier one in the same folder would mix with it."""
    for name in (ROWS, PROGRESS):
        (out / name).unlink(missing_ok=True)


def read(out: Path, section: str) -> dict:
    """The section's result as journaled so far: lists of added items and the values put. A torn last line (the
    process killed mid-write) is skipped."""
    result: dict = {}
    path = out / ROWS
    if not path.exists():
        return result
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("section") != section:
            continue
        if "add" in entry:
            result.setdefault(entry["add"], []).append(entry["item"])
        elif "put" in entry:
            result[entry["put"]] = entry["value"]
    return result


def tail(out: Path, section: str, lines: int = 6) -> list[str]:
    """The section's last progress lines: where a killed section was."""
    path = out / PROGRESS
    if not path.exists():
        return []
    mine = [line for line in path.read_text(encoding="utf-8").splitlines() if f"[{section}]" in line]
    return mine[-lines:]

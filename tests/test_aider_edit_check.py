"""scripts/aider_edit_check.py's verdict on an edited file: the rename and the type hints are accepted exactly as
asked and nothing else (a file a coding assistant left half-edited, or with code changed beside the hints, fails)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "aider_edit_check.py"
spec = importlib.util.spec_from_file_location("aider_edit_check", SCRIPT)
aider_edit_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aider_edit_check)
check, original = aider_edit_check.check, aider_edit_check.original

HINTED = '''from typing import Callable, Optional
def f(a: list, x: int, lo: int = 0, hi: Optional[int] = None, *, key: Optional[Callable] = None) -> None:
    """Docs."""
    return g(a, x)
'''
PLAIN = '''def f(a, x, lo=0, hi=None, *, key=None):
    """Docs."""
    return g(a, x)
'''


def test_rename_exactly_as_asked():
    before = original()
    assert check("rename", before, before.replace("insort_right", "insert_right"))["as_asked"]
    assert not check("rename", before, before)["as_asked"]
    half = before.replace("def insort_right", "def insert_right", 1)
    assert not check("rename", before, half)["as_asked"]
    broken = check("rename", before, "def broken(:\n")
    assert not broken["parses"] and not broken["as_asked"] and broken["why"].startswith("line 1")


def test_type_hints_only_hints_added():
    assert check("type hints", PLAIN, HINTED)["as_asked"]
    assert not check("type hints", PLAIN, PLAIN)["as_asked"]  # nothing annotated
    unannotated_kw = HINTED.replace("key: Optional[Callable] = None", "key=None")
    verdict = check("type hints", PLAIN, unannotated_kw)
    assert not verdict["as_asked"] and "unannotated: f" in verdict["why"]
    changed = HINTED.replace("g(a, x)", "g(x, a)")
    verdict = check("type hints", PLAIN, changed)
    assert not verdict["as_asked"] and "code other than annotations changed" in verdict["why"]

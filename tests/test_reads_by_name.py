"""The decoding core reads nothing of another object by name: no getattr or hasattr on a backend, a drafter or a
policy in the engine or the verification. What a backend offers beyond its methods is one Capabilities value
(backends/base.py), read once when a session is built; a drafter's and a policy's options are declared on their base
classes. Read from the source, as tests/test_imports.py reads the imports (no module is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "specdecode"
# the engine's modules (its package __init__ only names them, lazily: a module's attribute, not an object's) and
# the verification
CORE = sorted(p for p in (SRC / "engine").rglob("*.py") if p.name != "__init__.py") + \
    [SRC / "exact" / "verification.py"]


def reads_by_name(source: str) -> list[str]:
    """`line: call` for each getattr or hasattr of anything but the object's own fields (its first argument `self`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Name) and first.id == "self"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_a_read_by_name():
    source = ("def f(backend, self=None):\n    tile = getattr(backend, 'prefill_tile', None)\n"
              "    return hasattr(backend.model, 'x') or getattr(self, 'own')\n")
    assert reads_by_name(source) == ["2: getattr(backend, 'prefill_tile', None)", "3: hasattr(backend.model, 'x')"]


def test_the_core_reads_no_object_by_name():
    assert {p.name for p in CORE} >= {"session.py", "generators.py", "admission.py", "verification.py"}
    found = {str(p.relative_to(SRC)): reads_by_name(p.read_text()) for p in CORE}
    assert {path: calls for path, calls in found.items() if calls} == {}

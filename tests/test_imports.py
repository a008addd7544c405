"""The package's import graph, read from the source (no module is imported): no module imports itself back through
others, when it runs or in its annotations (TYPE_CHECKING imports); the core never imports the CLI or the server; a
layer never imports the one above it. And no source file is over 500 lines (one screen's worth of reading)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specdecode"
MAX_LINES = 500


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's __init__)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _nodes(tree: ast.AST, type_checking: bool):
    """Every node; without type_checking, none under `if TYPE_CHECKING:` (imports for annotations, which never
    run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


@functools.lru_cache(maxsize=4)
def import_graph(root: Path = SRC, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at run time, at the top or inside a function (importing a.b.c runs
    a and a.b first; a module's own packages are already running, so they are not edges); with type_checking, its
    TYPE_CHECKING imports too."""
    modules = _modules(root)
    graph = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rsplit(".", 1)[0]
        running = _ancestors(name) | ({name} if package else set())
        edges = set()
        for node in _nodes(ast.parse(path.read_text()), type_checking):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules:
                    edges |= {m for m in {target} | _ancestors(target) if m in modules and m not in running}
        graph[name] = edges - {name}
    return graph


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Source files over `limit` lines: path under root -> lines."""
    lengths = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {path: n for path, n in sorted(lengths.items()) if n > limit}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_a_circle_through_annotations(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .b import B\n")
    (package / "b.py").write_text("from .a import TYPE_CHECKING\n\n\nclass B:\n    pass\n")
    assert cycles(import_graph(package)) == []  # at run time a never imports b
    assert cycles(import_graph(package, type_checking=True)) == [["pkg.a", "pkg.b"]]


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_no_import_circle_through_annotations():
    assert cycles(import_graph(type_checking=True)) == []


def test_the_length_check_finds_a_long_file(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path) == {"long.py": MAX_LINES + 1}


def test_no_source_file_is_over_500_lines():
    assert long_files(SRC) == {}


BENCHMARKS = SRC.parents[1] / "benchmarks"  # the project's own tools: run from the checkout, never installed


def test_the_checkouts_tools_stay_outside_the_package_and_short():
    """benchmarks/ (the device check, its random models, the replay drafter, probes) imports the package; the
    package, installed without it, never imports benchmarks/."""
    wrong = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(name.split(".")[0] == "benchmarks" for name in names):
                wrong.setdefault(str(path.relative_to(SRC)), []).extend(names)
    assert wrong == {}
    assert long_files(BENCHMARKS) == {}


def test_the_core_imports_neither_the_cli_nor_the_server():
    graph = import_graph()
    front = ("specdecode.cli", "specdecode.server", "specdecode.bench")
    entry = ("specdecode", "specdecode.__main__")  # the package's lazy names and `python -m specdecode`
    core = [m for m in graph if m not in entry and not m.startswith(front) and not m.startswith("specdecode.evals")]
    wrong = {m: sorted(d for d in graph[m] if d.startswith(("specdecode.cli", "specdecode.server"))) for m in core}
    assert {m: d for m, d in wrong.items() if d} == {}


# The package's layers, lowest first: a folder imports only itself and the layers below it (the front's folders,
# last, may also import each other: the CLI runs the server and the benchmarks). At the top level only the package's
# lazy names, `python -m specdecode` and the errors every layer raises.
LAYERS = (
    ("errors", "text", "exact"),  # tokens and text; the exact math
    ("structured", "models", "policy"),  # grammars and tools; finding a model; the choice of K
    ("backends",),  # running a model, its KV and parked prefixes
    ("drafters",),
    ("engine",),  # the generators, the session's step, rows, admission, results
    ("pairing",),  # loading a model with its backend, target + draft, --draft auto
    ("cli", "server", "bench", "evals"),
)
FRONT = LAYERS[-1]
TOP_LEVEL = {"__init__", "__main__", "errors"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _rank(folder: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if folder in names)


def test_the_top_level_holds_only_the_package_names_errors_and_folders():
    files = {p.stem for p in SRC.glob("*.py")}
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert files <= TOP_LEVEL, sorted(files - TOP_LEVEL)
    assert folders <= {name for names in LAYERS for name in names}, sorted(folders)


def test_every_layer_imports_only_itself_and_the_layers_below():
    graph = import_graph(type_checking=True)  # an annotation that names a layer above is an arrow up too
    wrong = {}
    for module, deps in graph.items():
        mine = _layer(module)
        if mine in (None, "__main__"):
            continue
        for dep in deps:
            theirs = _layer(dep)
            if theirs is None or theirs == mine or (mine in FRONT and theirs in FRONT):
                continue
            if _rank(theirs) >= _rank(mine):
                wrong.setdefault(module, []).append(dep)
    assert wrong == {}


def test_the_layer_check_finds_an_arrow_up(tmp_path):
    assert _rank("exact") < _rank("structured") < _rank("backends") < _rank("drafters") < _rank("engine")
    assert _rank("engine") < _rank("pairing") < _rank("server")


@pytest.mark.parametrize("lower, upper", [
    ("specdecode.models", ("specdecode.backends", "specdecode.pairing", "specdecode.engine", "specdecode.drafters")),
    ("specdecode.backends", ("specdecode.pairing", "specdecode.engine", "specdecode.drafters")),
    ("specdecode.drafters", ("specdecode.pairing", "specdecode.engine")),
    ("specdecode.exact", ("specdecode.structured", "specdecode.engine")),
])
def test_no_import_runs_back_up(lower, upper):
    """Finding a model (models/) is below the backends, which are below the loader that picks one (pairing/) and
    below the loop; drafters below the loop; the sampler below the grammars."""
    graph = import_graph(type_checking=True)  # an annotation that names the layer above is an arrow up too
    wrong = {m: sorted(d for d in graph[m] if d.startswith(upper)) for m in graph if m.startswith(lower)}
    assert {m: d for m, d in wrong.items() if d} == {}

"""`specdecode bench serve --workload corpus`: the tasks. Whole-file edits of real modules no one here wrote, read at
run time from this Python's standard library and site-packages, and chat questions of six kinds; run and reported by
corpus_run.py.

The modules are picked by a rule, never by name, so that no setting of ours can be tuned to them: every `.py` file
under the standard library and under site-packages (test folders, our own package and bisect.py left out: the
matrix's file, the one the copy drafter's constants were measured on) of 40 to 400 lines, at most 120 characters a
line, that parses and whose whole edited text fits the answer's max_tokens; ordered by the SHA-256 of its path below
its root (a spread over packages no alphabet gives), standard library and site-packages taken in turn; each edit kind
in turn takes the next module that admits it. Each edit is derived from the module's AST:

  rename      the module-level function called most often (at least twice) renamed everywhere;
  type hints  every signature annotated (the module has at least two functions lacking some annotation);
  docstrings  a docstring on every function lacking one (at least two lack one);
  delete      the first undecorated module-level function nothing in the module names, deleted;
  constant    the value of the module-level NAME = literal (int, float or short str) used most often (at least
              twice) changed.

Each answer's check compares ASTs: the answer's code with the edit undone (or annotations, docstrings taken out of
both) must be the original's. The check is recorded; the timings count whatever it says.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

EDIT_KINDS = ("rename", "type hints", "docstrings", "delete", "constant")
MIN_LINES, MAX_LINES, MAX_LINE_CHARS = 40, 400, 120
CHARS_PER_TOKEN = 2.5  # Qwen2.5's tokenizer on Python source: 2.5-5.3 characters a token (the fewest: numbers, tables)
GROWTH = 1.3  # type hints and docstrings lengthen a file by up to this much: the answer must still fit max_tokens
SKIP_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__", "site-packages", "dist-packages", "specdecode"}
SKIP_FILES = {"bisect.py", "conftest.py", "setup.py", "_virtualenv.py"}
TYPING_MODULES = {"typing", "typing_extensions", "__future__", "collections.abc", "_typeshed"}
EDIT_SYSTEM = ("You are a coding assistant. When asked to change a file, reply with the complete updated file in "
               "one fenced code block, and nothing else.")


@dataclass(frozen=True)
class Module:
    root: str  # "stdlib" or "site-packages"
    name: str  # the path below its root, e.g. "json/scanner.py"
    path: str
    text: str


@dataclass(frozen=True)
class EditTask:
    kind: str
    module: Module
    ask: str
    undo: Callable[[ast.Module], ast.Module] | None = None  # the answer's tree with the edit undone (rename, constant)
    expected: Callable[[ast.Module], ast.Module] | None = None  # the original's tree with the edit done (delete)
    details: dict = field(default_factory=dict)

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": EDIT_SYSTEM},
                {"role": "user", "content": f"Here is `{self.module.name}`:\n\n```python\n{self.module.text}```\n\n"
                                            f"{self.ask}"}]

    def check(self, answer: str) -> dict:
        return check_edit(self, answer)


# ------------------------------------------------------------------------------------------------ the modules
def roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    found = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        path = Path(paths[key])
        if path.is_dir() and all(path != p for _, p in found):
            found.append(("site-packages", path))
    return found


def _candidates(root: Path) -> list[tuple[str, Path]]:
    """(name below the root, path) of every module file the rule may pick, in SHA-256 order of the name."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".") and not d.endswith(".dist-info")
                   and not d.endswith(".egg-info")]
        for file in files:
            if (file.endswith(".py") and file not in SKIP_FILES and not file.startswith(("test_", "__editable__"))):
                path = Path(folder) / file
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found, key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())


def _readable(path: Path, max_tokens: int) -> str | None:
    """The module's text where the rule admits it: 40-400 lines, short lines, parses, its edit fits max_tokens."""
    try:
        if path.stat().st_size > MAX_LINES * MAX_LINE_CHARS:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    lines = text.splitlines()
    if not MIN_LINES <= len(lines) <= MAX_LINES or any(len(line) > MAX_LINE_CHARS for line in lines):
        return None
    if len(text) * GROWTH / CHARS_PER_TOKEN > max_tokens or not text.endswith("\n"):
        return None
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    return text


def pick_tasks(count: int, kinds: tuple[str, ...] = EDIT_KINDS, max_tokens: int = 2048) -> list[EditTask]:
    """`count` edits on `count` different modules, the kinds taken in turn, each the next module that admits it."""
    unknown = set(kinds) - set(EDIT_KINDS)
    if unknown or not kinds:
        raise ValueError(f"unknown edit kind(s) {sorted(unknown)}: use {', '.join(EDIT_KINDS)}")
    lists = [[(label, name, path) for name, path in _candidates(root)] for label, root in roots()]
    order = [item for group in _interleave(lists) for item in group]  # stdlib, site-packages, stdlib, ...
    tasks, used, position = [], set(), {kind: 0 for kind in kinds}
    texts: dict[str, str | None] = {}
    for i in range(count):
        kind = kinds[i % len(kinds)]
        while position[kind] < len(order):
            label, name, path = order[position[kind]]
            position[kind] += 1
            if str(path) in used:
                continue
            if str(path) not in texts:
                texts[str(path)] = _readable(path, max_tokens)
            text = texts[str(path)]
            task = text and TASKS[kind](Module(label, name, str(path), text), ast.parse(text))
            if task:
                tasks.append(task)
                used.add(str(path))
                break
        else:
            raise ValueError(f"only {len(tasks)} modules admit the edits asked for ({', '.join(kinds)}); "
                             f"{count} asked")
    return tasks


def _interleave(lists):
    longest = max((len(items) for items in lists), default=0)
    return [[items[i] for items in lists if i < len(items)] for i in range(longest)]


# -------------------------------------------------------------------------------------------- the edit kinds
def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _top_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _other_uses(tree: ast.Module, name: str) -> int:
    """Uses of `name` other than a module-level function's or constant's own: attributes, arguments, keywords,
    nested definitions, assignments, imports, globals (where they are, renaming or deleting it is ambiguous)."""
    count = 0
    top = {id(n) for n in tree.body}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == name or isinstance(n, ast.arg) and n.arg == name:
            count += 1
        elif isinstance(n, ast.keyword) and n.arg == name or isinstance(n, ast.alias) and name in (
                n.name, n.asname) or isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names:
            count += 1
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name \
                and id(n) not in top:
            count += 1
        elif isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load):
            count += 1
    return count


def _word(name: str) -> re.Pattern:
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")


def _rename(tree: ast.Module, old: str, new: str) -> ast.Module:
    """Every identifier `old` and every word `old` in a string made `new` (the tree is changed in place)."""
    word = _word(old)
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id == old:
            n.id = new
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == old:
            n.name = new
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            n.value = word.sub(new, n.value)
    return tree


def rename_task(module: Module, tree: ast.Module) -> EditTask | None:
    calls = Counter(n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
    names = [f.name for f in _top_functions(tree) if not f.name.startswith("__")]
    names = [n for n in names if calls[n] >= 2 and names.count(n) == 1 and not _other_uses(tree, n)]
    if not names:
        return None
    old = max(names, key=lambda n: calls[n])  # max keeps the first of equals: source order breaks ties
    new = next(n for n in (f"{old}_impl", f"{old}_impl2", f"{old}_renamed") if n not in module.text)
    return EditTask("rename", module, f"Rename the function `{old}` to `{new}` everywhere in the file, changing "
                    f"nothing else.", undo=lambda t: _rename(t, new, old), details={"old": old, "new": new,
                                                                                    "calls": calls[old]})


def _unannotated(f, method: bool) -> bool:
    args = [*f.args.posonlyargs, *f.args.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in f.decorator_list)
    if method and args and not static:  # self and cls go unannotated
        args = args[1:]
    args += [*f.args.kwonlyargs, *(a for a in (f.args.vararg, f.args.kwarg) if a is not None)]
    return any(a.annotation is None for a in args) or (f.returns is None and f.name != "__init__")


def _methods(tree: ast.AST) -> set[int]:
    return {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body}


def _lacking_hints(tree: ast.Module) -> list[str]:
    methods = _methods(tree)
    return [f.name for f in _functions(tree) if _unannotated(f, id(f) in methods)]


class _NoHints(ast.NodeTransformer):
    """A tree with its annotations taken out: what a type-hint edit must leave unchanged."""

    def visit_FunctionDef(self, node):
        node.returns = None
        node.type_comment = None
        for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
            if a is not None:
                a.annotation = a.type_comment = None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        return ast.Assign(targets=[node.target], value=self.visit(node.value), type_comment=None)

    def visit_Import(self, node):
        return None if all(a.name in TYPING_MODULES for a in node.names) else node

    def visit_ImportFrom(self, node):
        return None if node.module in TYPING_MODULES else node

    def visit_If(self, node):
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        return None if name == "TYPE_CHECKING" and not node.orelse else self.generic_visit(node)

    def visit_Assign(self, node):  # T = TypeVar("T") and the like, added with the hints
        call = node.value
        callee = call.func if isinstance(call, ast.Call) else None
        name = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) else ""
        return None if name in ("TypeVar", "ParamSpec", "TypeVarTuple", "NewType") else self.generic_visit(node)


def _without_hints(tree: ast.Module) -> str:
    return ast.dump(_NoHints().visit(tree))


def hints_task(module: Module, tree: ast.Module) -> EditTask | None:
    lacking = _lacking_hints(tree)
    if len(lacking) < 2:
        return None
    return EditTask("type hints", module, "Add type hints to every function and method signature (parameters and "
                    "return types), changing nothing else.", details={"lacking": len(lacking)})


class _NoDocstrings(ast.NodeTransformer):
    def generic_visit(self, node):
        node = super().generic_visit(node)
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            node.body = body[1:]
        return node


def _lacking_docstrings(tree: ast.Module) -> list[str]:
    return [f.name for f in _functions(tree) if ast.get_docstring(f, clean=False) is None]


def docstrings_task(module: Module, tree: ast.Module) -> EditTask | None:
    lacking = _lacking_docstrings(tree)
    if len(lacking) < 2:
        return None
    return EditTask("docstrings", module, "Add a docstring to every function and method that has none, changing "
                    "nothing else.", details={"lacking": len(lacking)})


def delete_task(module: Module, tree: ast.Module) -> EditTask | None:
    names = Counter(f.name for f in _top_functions(tree))
    for f in _top_functions(tree):
        used = any(isinstance(n, ast.Name) and n.id == f.name for n in ast.walk(tree))
        said = any(_word(f.name).search(s) for s in _strings(tree))
        if f.decorator_list or used or said or names[f.name] > 1 or _other_uses(tree, f.name) or \
                f.name.startswith("__"):
            continue
        name, line = f.name, f.lineno

        def expected(t, name=name, line=line):
            t.body = [n for n in t.body if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and
                                                n.name == name and n.lineno == line)]
            return t
        return EditTask("delete", module, f"Delete the function `{name}`, changing nothing else.",
                        expected=expected, details={"function": name, "lines": f.end_lineno - f.lineno + 1})
    return None


def _new_value(value):
    if isinstance(value, str):
        return value + "_v2"
    return value * 2 if abs(value) >= 2 else value + 2


def constant_task(module: Module, tree: ast.Module) -> EditTask | None:
    loads = Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    found = {}
    for n in tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and \
                isinstance(n.value, ast.Constant):
            name, value = n.targets[0].id, n.value.value
            if not re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name) or isinstance(value, bool) or name in found:
                continue
            if isinstance(value, (int, float)) or isinstance(value, str) and 0 < len(value) <= 40 and \
                    value.isprintable():
                found[name] = (value, n.lineno)
    stores = Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load))
    names = [name for name in found if loads[name] >= 2 and stores[name] == 1 and _other_uses(tree, name) == 1]
    if not names:
        return None
    name = max(names, key=lambda n: loads[n])
    old, line = found[name]
    new = _new_value(old)

    def undo(t):  # the answer's constant set back, where it is still the same statement
        for n in t.body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and \
                    n.targets[0].id == name and isinstance(n.value, ast.Constant) and n.value.value == new and \
                    type(n.value.value) is type(new):
                n.value.value = old
                return t
        return t
    return EditTask("constant", module, f"Change the value of the constant `{name}` from {old!r} to {new!r}, "
                    f"changing nothing else.", undo=undo,
                    details={"constant": name, "old": old, "new": new, "uses": loads[name], "line": line})


TASKS = {"rename": rename_task, "type hints": hints_task, "docstrings": docstrings_task, "delete": delete_task,
         "constant": constant_task}


# ------------------------------------------------------------------------------------------------ the checks
FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S)


def answer_code(answer: str) -> str:
    """The code of an answer: its longest fenced block, or the whole answer where it has none."""
    blocks = FENCE.findall(answer)
    return max(blocks, key=len) + "\n" if blocks else answer


def _identifiers(tree: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.name for n in ast.walk(tree)
            if isinstance(n, (ast.Name, ast.FunctionDef, ast.AsyncFunctionDef))}


def check_edit(task: EditTask, answer: str) -> dict:
    """Whether the answer is the whole file with the edit asked for and nothing else (ASTs compared)."""
    code = answer_code(answer)
    try:
        after = ast.parse(code)
    except (SyntaxError, ValueError) as e:
        return {"parses": False, "as_asked": False, "why": f"does not parse: {getattr(e, 'msg', e)}"}
    before = ast.parse(task.module.text)
    if task.kind == "type hints":
        lacking = _lacking_hints(after)
        same = _without_hints(after) == _without_hints(before)
        why = "; ".join(filter(None, [lacking and f"unannotated: {', '.join(sorted(set(lacking))[:5])}",
                                      not same and "code other than annotations changed"]))
    elif task.kind == "docstrings":
        lacking = _lacking_docstrings(after)
        same = ast.dump(_NoDocstrings().visit(after)) == ast.dump(_NoDocstrings().visit(before))
        why = "; ".join(filter(None, [lacking and f"no docstring: {', '.join(sorted(set(lacking))[:5])}",
                                      not same and "code other than docstrings changed"]))
    elif ast.dump(after) == ast.dump(before):
        why = "the file unchanged"
    elif task.kind == "rename" and task.details["old"] in _identifiers(after):
        why = f"`{task.details['old']}` left in the code"
    else:  # the answer with the edit undone is the original, or the original with it done is the answer
        got = ast.dump(task.undo(after)) if task.undo else ast.dump(after)
        want = ast.dump(task.expected(before)) if task.expected else ast.dump(before)
        why = "" if got == want else f"not exactly the {task.kind} asked for"
    return {"parses": True, "as_asked": not why, "why": why}

"""The agent workload's tasks: small repositories, the tools a session edits them with, and the check that says
whether a session did what its instruction asked.

A built-in task (prompts/agent.jsonl, one JSON object a line) is {"id", "kind", "instruction", "files", "check"}:
the kinds a coding agent is given (edit, rename, add a test, fix a bug from a failing test's output, add a
function, add input validation), files as {path: text}, and `check`, Python run after the session in a temporary
directory holding the repository as the session left it. The check passes when it exits 0: every .py file must
parse first (CHECK_PRELUDE), then the check imports the edited code and asserts that it does what the instruction
asked (and still does what it did). The model's code runs in a subprocess, in that directory, with a timeout.

The tools are the three a minimal coding agent has: list_files, read_file, write_file (the whole file: the rewrite
re-emits what the tool result just showed, the case copying drafts are for).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath

# The tools are named: without the names the 1.5B coder invents one ("add_docstrings") on some tasks.
SYSTEM = ("You are a coding agent working in a small repository. You can only see and change files through the "
          "tools list_files, read_file and write_file, one call at a time. To change a file, read it, then write "
          "the whole new content back with write_file. When the task is done, answer with one short sentence.")
TOOLS = [
    {"type": "function", "function": {
        "name": "list_files", "description": "List the files of the repository.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's whole content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

# Run before every check: the repository's Python files must parse, and `read` / `functions` help the checks.
CHECK_PRELUDE = """\
import ast, pathlib, sys
sys.path.insert(0, '.')
for _path in sorted(pathlib.Path('.').rglob('*.py')):
    ast.parse(_path.read_text(encoding='utf-8'), str(_path))
def read(path):
    return pathlib.Path(path).read_text(encoding='utf-8')
def functions(path):
    return [n for n in ast.walk(ast.parse(read(path))) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
"""
CHECK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class AgentTask:
    id: str
    instruction: str
    files: dict
    check: str = ""  # Python that exits 0 when the task is done (empty: no check, never counted as completed)
    kind: str = "edit"


@dataclass
class CheckResult:
    passed: bool
    detail: str  # "ok", or why not: the check's last line of error output
    changed: list = field(default_factory=list)  # the files the session wrote or changed


def builtin_tasks() -> list[AgentTask]:
    text = resources.files("specdecode.bench.prompts").joinpath("agent.jsonl").read_text(encoding="utf-8")
    return [AgentTask(**json.loads(line)) for line in text.splitlines() if line.strip()]


def load_tasks(path: str) -> list[AgentTask]:
    """A user's tasks: JSON lines of {"id", "instruction", "files": {path: text}, "check" (Python, optional),
    "kind" (optional)}; errors name the line."""
    tasks = []
    for lineno, line in enumerate(Path(path).expanduser().read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            tasks.append(_task(line, f"{path} line {lineno}", f"task-{len(tasks) + 1}"))
    if not tasks:
        raise ValueError(f"{path} holds no tasks (JSON lines of {{\"instruction\", \"files\", \"check\"}})")
    return tasks


def _task(line: str, where: str, default_id: str) -> AgentTask:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(item, dict) or not isinstance(item.get("instruction"), str) or not item["instruction"].strip():
        raise ValueError(f'{where}: expected an object with a non-empty string "instruction"')
    files = item.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f'{where}: "files" must be an object of file paths to their text')
    if any(safe_path(name) is None for name in files):
        raise ValueError(f'{where}: every path in "files" must be relative, inside the repository')
    if not isinstance(item.get("check", ""), str) or not isinstance(item.get("kind", "edit"), str):
        raise ValueError(f'{where}: "check" (Python) and "kind" must be strings')
    return AgentTask(str(item.get("id", default_id)), item["instruction"], files, item.get("check", ""),
                     item.get("kind", "edit"))


def safe_path(path) -> str | None:
    """The path as a repository-relative POSIX path, or None when it leaves the repository (absolute, '..')."""
    if not isinstance(path, str) or not path.strip():
        return None
    pure = PurePosixPath(path.strip())
    if pure.is_absolute() or ".." in pure.parts or str(pure) in ("", "."):
        return None
    return str(pure)


class Repository:
    """The task's files, changed by the session's write_file calls; what each tool answers."""

    def __init__(self, files: dict):
        self.files = dict(files)

    def run(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"error: the arguments are not JSON ({e.msg})"
        if name == "list_files":
            return "\n".join(sorted(self.files))
        raw = args.get("path") if isinstance(args, dict) else None
        path = safe_path(raw)
        if name in ("read_file", "write_file") and raw is not None and path is None:
            return f"error: {raw!r} is not a path inside the repository"
        if name == "read_file":
            if path not in self.files:
                return f"error: no file {raw!r}; the files are: {', '.join(sorted(self.files))}"
            return self.files[path]
        if name == "write_file" and path is not None and isinstance(args.get("content"), str):
            self.files[path] = args["content"]
            return f"wrote {len(args['content'].splitlines())} lines to {path}"
        return f"error: cannot run {name} with {arguments}"


def check_task(task: AgentTask, files: dict, timeout_s: float = CHECK_TIMEOUT_S) -> CheckResult:
    """Run the task's check on the repository as a session left it (files: {path: text})."""
    changed = sorted(p for p, text in files.items() if task.files.get(p) != text)
    if not task.check:
        return CheckResult(False, "the task has no check", changed)
    with tempfile.TemporaryDirectory(prefix="specdecode-agent-") as root:
        for name, text in files.items():
            path = safe_path(name)
            if path is None:
                return CheckResult(False, f"{name!r} is outside the repository", changed)
            target = Path(root, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        try:
            done = subprocess.run([sys.executable, "-B", "-c", CHECK_PRELUDE + task.check], cwd=root, env=env,
                                  capture_output=True, text=True, timeout=timeout_s, errors="replace")
        except subprocess.TimeoutExpired:
            return CheckResult(False, f"the check ran past {timeout_s:g} s", changed)
    if done.returncode == 0:
        return CheckResult(True, "ok", changed)
    lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
    return CheckResult(False, lines[-1] if lines else f"the check exited {done.returncode}", changed)


def invalid_call(call: dict) -> str | None:
    """Why a call is not a valid call of one of the tools (None: it is)."""
    import jsonschema

    schema = SCHEMAS.get(call["name"])
    if schema is None:
        return f"{call['name']}: no such tool"
    try:
        jsonschema.validate(json.loads(call["arguments"]), schema)
    except json.JSONDecodeError as e:
        return f"{call['name']}: arguments are not JSON ({e.msg})"
    except jsonschema.ValidationError as e:
        return f"{call['name']}: {e.message}"
    return None

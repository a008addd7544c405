"""A coding assistant editing a file through each server, as its users run it: aider (PyPI `aider-chat`, in a venv of
its own: it pins its own litellm and openai) with `--edit-format whole`, so the model answers with the whole file,
on a git repository holding a copy of the standard library's bisect.py. Per round and server (interleaved, the
order reversed every other round), one aider process per edit, timed from start to exit; the file it leaves is
checked:
  rename      `insort_right` renamed to `insert_right` everywhere, nothing else changed (the exact text expected);
  type hints  every signature annotated and nothing else changed (the module's AST with annotations and typing
              imports removed equals the original's).
Every server is started afresh for each round, so that no round's edit is copied from an earlier round's answer
(our suffix history, llama-server's prompt and n-gram caches): ours (`specdecode serve` with --serve-args) and
llama-server on the same GGUF and threads in each mode of --modes (plain and any `--spec-type`). Prints seconds per
edit, medians, ours against each peer, and whether each server's edited files were the same text as llama-server
plain's.

    python -m venv /tmp/aider-venv && /tmp/aider-venv/bin/pip install aider-chat==0.86.2
    python scripts/aider_edit_check.py --aider /tmp/aider-venv/bin/aider --serve-args "--threads 2" \
        --modes plain,ngram-mod,ngram-simple --rounds 2 --json aider.json
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdecode.cli.bench_serve_matrix import cpu_name
from specdecode.bench.llama_server import LlamaServer, find_binary
from specdecode.bench.llamacpp_peers import gguf_file
from specdecode.bench.peer_matrix import wait_quiet
from specdecode.bench.soak_server import SoakServer

EDITS = {
    "rename": "Rename the function `insort_right` to `insert_right` everywhere in bisect.py.",
    "type hints": "Add type hints to every function signature in bisect.py.",
}


def original() -> str:
    import bisect

    return inspect.getsource(bisect)


def _without_hints(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    arg.annotation = None
    tree.body = [n for n in tree.body if not (isinstance(n, ast.ImportFrom) and n.module in ("typing", "__future__"))
                 and not (isinstance(n, ast.Import) and all(a.name == "typing" for a in n.names))]
    return ast.dump(tree)


def check(edit: str, before: str, after: str) -> dict:
    """What the edited file says: whether it parses and whether it is the edit asked for, nothing else."""
    try:
        tree = ast.parse(after)
    except SyntaxError as e:
        return {"parses": False, "as_asked": False, "why": f"line {e.lineno}: {e.msg}"}
    if edit == "rename":
        ok = after.strip() == before.replace("insort_right", "insert_right").strip()
        return {"parses": True, "as_asked": ok, "why": "" if ok else "not exactly the rename"}
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    unannotated = [f.name for f in functions if f.returns is None or any(
        a.annotation is None for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs])]
    same_code = _without_hints(tree) == _without_hints(ast.parse(before))
    ok = bool(functions) and not unannotated and same_code
    why = "; ".join(filter(None, [unannotated and f"unannotated: {', '.join(unannotated)}",
                                  not same_code and "code other than annotations changed"]))
    return {"parses": True, "as_asked": ok, "why": why}


def run_aider(aider: str, url: str, edit: str, timeout_s: float) -> dict:
    before = original()
    with tempfile.TemporaryDirectory(prefix="aider-edit-") as repo:
        path = Path(repo) / "bisect.py"
        path.write_text(before)
        git = ["git", "-C", repo, "-c", "user.name=check", "-c", "user.email=check@localhost"]
        subprocess.run(["git", "init", "-q", repo], check=True)
        subprocess.run([*git, "add", "bisect.py"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "bisect.py"], check=True)
        env = {**os.environ, "HOME": repo, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": "none"}
        command = [aider, "--model", "openai/specdecode", "--openai-api-base", f"{url}/v1", "--edit-format", "whole",
                   "--map-tokens", "0", "--no-auto-commits", "--yes-always", "--no-check-update",
                   "--analytics-disable", "--no-show-model-warnings", "--no-pretty", "--no-fancy-input",
                   "--no-restore-chat-history", "--timeout", str(int(timeout_s)), "--message", EDITS[edit],
                   "bisect.py"]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        after = path.read_text()
    result = {"seconds": seconds, "returncode": done.returncode, "text": after, **check(edit, before, after)}
    if done.returncode != 0 or after == before:
        result["log_tail"] = (done.stdout + done.stderr)[-2000:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--aider", required=True, help="the aider executable (its own venv)")
    parser.add_argument("--serve-args", default="--threads 2", help="our server's flags (`specdecode serve ...`)")
    parser.add_argument("--modes", default="plain,ngram-mod,ngram-simple",
                        help="llama-server modes: plain and --spec-type names")
    parser.add_argument("--edits", default=",".join(EDITS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", help="write every run and the summary here")
    args = parser.parse_args()
    edits = args.edits.split(",")
    if unknown := set(edits) - set(EDITS):
        parser.error(f"unknown edits {sorted(unknown)}; choose from {sorted(EDITS)}")
    gguf, binary = str(gguf_file("qwen2.5-coder-1.5b-instruct")), find_binary()
    names = ["ours", *("llama-server" if m == "plain" else f"llama-server {m}" for m in args.modes.split(","))]
    runs = {(e, s): [] for e in edits for s in names}
    for r in range(args.rounds):
        with contextlib.ExitStack() as stack:
            servers = {"ours": stack.enter_context(SoakServer(args.serve_args)).url}
            for mode in args.modes.split(","):
                extra = () if mode == "plain" else ("--spec-type", mode)
                name = "llama-server" if mode == "plain" else f"llama-server {mode}"
                servers[name] = stack.enter_context(LlamaServer(binary, gguf, args.threads, 8192,
                                                                extra_args=extra)).url
            for edit in edits:
                for server in (names if r % 2 == 0 else names[::-1]):
                    asyncio.run(wait_quiet())
                    run = run_aider(args.aider, servers[server], edit, args.timeout_s)
                    runs[(edit, server)].append(run)
                    print(f"round {r} {edit} {server}: {run['seconds']:.1f} s, as asked: {run['as_asked']} "
                          f"{run['why']}", flush=True)
                    if "log_tail" in run:
                        print(run["log_tail"], file=sys.stderr)
    summary = []
    for edit in edits:
        median = {s: statistics.median(r["seconds"] for r in runs[(edit, s)]) for s in names}
        reference = {r["text"] for r in runs[(edit, "llama-server")]} if "llama-server" in names else set()
        for server in names:
            row = {"edit": edit, "server": server, "median_s": median[server],
                   "as_asked": sum(r["as_asked"] for r in runs[(edit, server)]), "runs": len(runs[(edit, server)]),
                   "same_text_as_llama_server_plain": all(r["text"] in reference for r in runs[(edit, server)]),
                   "ours_speedup": median[server] / median["ours"]}
            summary.append(row)
            print(f"{edit:10s} {server:26s} median {row['median_s']:6.1f} s  as asked {row['as_asked']}/{row['runs']}"
                  f"  same text as llama-server plain: {row['same_text_as_llama_server_plain']}"
                  f"  ours {row['ours_speedup']:.2f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"hardware": cpu_name(), "threads": args.threads, "serve_args": args.serve_args, "edits": EDITS,
                       "rounds": args.rounds, "client": "aider-chat --edit-format whole"},
            "runs": {f"{e} | {s}": v for (e, s), v in runs.items()}, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()

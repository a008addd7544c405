"""What the model can do without tools: each built-in agent task (bench/agent_tasks.py) asked in one message, the
repository's files inline and the instruction after them, the answer's code block written to the file the
instruction names, and the task's own check run on the result. Greedy, llama-cpp-python on a GGUF, its own chat
template. This is the ceiling the agent workload's "tasks completed" can reach with the same model: a task the model
cannot do with the file in front of it, it will not do through read_file and write_file either.

    python scripts/agent_ceiling.py --gguf ~/.cache/specdecode/gguf/qwen2.5-coder-1.5b-instruct.gguf --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import time

from specdecode.bench.agent_tasks import builtin_tasks, check_task

FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.S)


def target_file(task) -> str:
    """The file the instruction asks to change: the first of the task's .py files it names (after "in", "to",
    "fix the bug in" ...), tests only when the instruction is to add one."""
    named = [p for p in re.findall(r"[\w/]+\.py", task.instruction) if p in task.files]
    edits = [p for p in named if task.kind == "add a test" or not p.split("/")[-1].startswith("test_")]
    return (edits or named)[-1] if task.kind == "add a test" else (edits or named)[0]


def prompt(task, path: str) -> str:
    files = "\n\n".join(f"{name}:\n```\n{text}\n```" for name, text in sorted(task.files.items()))
    instruction = task.instruction.split(" First ")[0]  # the tool steps of the agent's instruction do not apply
    return f"{files}\n\n{instruction} Reply with the whole new {path} in one code block."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from llama_cpp import Llama

    llm = Llama(args.gguf, n_ctx=4096, n_threads=args.threads, verbose=False)
    rows = []
    for task in builtin_tasks():
        path = target_file(task)
        start = time.perf_counter()
        out = llm.create_chat_completion([{"role": "user", "content": prompt(task, path)}],
                                         max_tokens=args.max_tokens, temperature=0.0, top_k=1)
        text = out["choices"][0]["message"]["content"] or ""
        blocks = FENCE.findall(text)
        files = dict(task.files, **({path: blocks[0]} if blocks else {}))
        result = check_task(task, files) if blocks else None
        rows.append({"task": task.id, "kind": task.kind, "file": path, "completed": bool(result and result.passed),
                     "check": result.detail if result else "no code block in the answer",
                     "seconds": round(time.perf_counter() - start, 1), "answer": text})
        print(f"{task.id:14s} {path:16s} {'completed' if rows[-1]['completed'] else 'not: ' + rows[-1]['check']}",
              flush=True)
    done = sum(r["completed"] for r in rows)
    print(f"completed {done}/{len(rows)} with the files inline and no tools")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gguf": args.gguf, "greedy": True, "completed": done, "tasks": rows}, f, indent=1)


if __name__ == "__main__":
    main()

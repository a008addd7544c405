"""The same request sent to several freshly started `specdecode serve` processes, one at a time, with the defaults on
the default pair: does each give the same answer? Two requests per server, each alone: a whole-file edit at
temperature 0 (the corpus benchmark's rename in the first module that admits one, max_tokens 2048, ~1,200
tokens of answer) and a seeded sampled chat answer (temperature 0.8, top_p 0.95, seed 7, max_tokens 1000).

Prints and writes (JSON, to OUT) each server's answers' SHA-256, tokens, seconds to the last token and the server's
speculative statistics, then how many distinct answers each request got.

    python scripts/same_request_fresh_servers.py [SERVERS] [OUT] [SERVE ARGS, e.g. "--threads 2"]
"""
import hashlib
import json
import os
import sys
import time

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from specdecode.bench.corpus import pick_tasks  # noqa: E402
from specdecode.bench.soak_server import SoakServer  # noqa: E402

SERVERS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
OUT = sys.argv[2] if len(sys.argv) > 2 else "same_request_fresh_servers.json"
SERVE = sys.argv[3] if len(sys.argv) > 3 else "--threads 2"

edit = pick_tasks(1, ("rename",))[0]
REQUESTS = {
    "greedy edit": {"messages": edit.messages(), "temperature": 0, "max_tokens": 2048},
    "seeded chat": {"messages": [{"role": "user", "content": "Write a Python module for a small command-line todo "
                                                             "list kept in a JSON file, with a docstring per function."}],
                    "temperature": 0.8, "top_p": 0.95, "seed": 7, "max_tokens": 1000},
}

runs = []
for i in range(SERVERS):
    with SoakServer(SERVE) as server:
        for name, body in REQUESTS.items():
            start = time.perf_counter()
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                               timeout=1800).json()
            seconds = time.perf_counter() - start
            text = reply["choices"][0]["message"]["content"]
            run = {"server": i, "request": name, "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
                   "tokens": reply["usage"]["completion_tokens"], "seconds": round(seconds, 2),
                   "speculative": reply.get("speculative")}
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "speculative"}), flush=True)

distinct = {name: sorted({r["sha256"] for r in runs if r["request"] == name}) for name in REQUESTS}
report = {"module": edit.module.name, "serve": SERVE, "servers": SERVERS, "runs": runs,
          "distinct_answers": {name: len(shas) for name, shas in distinct.items()}}
with open(OUT, "w") as f:
    json.dump(report, f, indent=1)
print("distinct answers:", report["distinct_answers"])

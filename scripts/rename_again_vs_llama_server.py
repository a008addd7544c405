"""The corpus benchmark's rename (bench/corpus.py: the first module that admits one, greedy, max_tokens 2048), sent
twice, streamed, to each server started fresh and alone: ours (`specdecode serve --threads 2`, the defaults) and
llama-server plain and with `--spec-type ngram-mod` (the binary scripts/build_llama_server.sh builds, the same GGUF,
2 threads). The second request finds its answer in the server's history (a regenerate, a retry). Prints a JSON line
per request: seconds to the first token ("ttft") and to the last ("s"), and the content chunks streamed.

    python scripts/rename_again_vs_llama_server.py [ARMS, e.g. ours,plain,ngram-mod]
"""
import json
import os
import sys
import time

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from specdecode.bench.corpus import pick_tasks  # noqa: E402
from specdecode.bench.llama_server import LlamaServer, find_binary  # noqa: E402
from specdecode.bench.llamacpp_peers import gguf_file  # noqa: E402
from specdecode.bench.soak_server import SoakServer  # noqa: E402

BODY = {"messages": pick_tasks(1, ("rename",))[0].messages(), "temperature": 0, "max_tokens": 2048, "stream": True}


def send(url: str, name: str) -> None:
    start, first, chunks = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=BODY, timeout=1800) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices")
            if choices and choices[0].get("delta", {}).get("content"):
                first = first or time.perf_counter() - start
                chunks += 1
    print(json.dumps({"server": name, "ttft": round(first, 2), "s": round(time.perf_counter() - start, 2),
                      "chunks": chunks}), flush=True)


arms = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ours", "plain", "ngram-mod"]
binary = find_binary()
gguf = str(gguf_file("qwen2.5-coder-1.5b-instruct"))
for arm in arms:
    server = SoakServer("--threads 2") if arm == "ours" else LlamaServer(
        binary, gguf, 2, 4096, extra_args=() if arm == "plain" else ("--spec-type", arm))
    with server:
        send(server.url, f"{arm} first")
        send(server.url, f"{arm} again")

#!/usr/bin/env python3
"""A stand-in for llama.cpp's llama-server (no tests here): the same command line, /health (503 while "loading",
then 200), /v1/models, and streamed /v1/chat/completions in OpenAI's shape with llama-server's extras (usage with
prompt_tokens_details.cached_tokens, "timings" with cache_n). It calls list_files when the request has tools and
no tool result yet, and answers text otherwise; its "prompt cache" is the common prefix with its last prompt (4
characters a token). It lets the tests check the bench's process handling where the real binary is not built.

STANDIN_MODE=exit: print an error and exit 3 at once; STANDIN_MODE=hang: never healthy. STANDIN_ARGV=PATH: write
the command line there (JSON)."""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()
LAST = {"prompt": ""}


def option(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            ready = os.environ.get("STANDIN_MODE") != "hang" and time.monotonic() - STARTED > 0.3
            self._json(200 if ready else 503, {"status": "ok" if ready else "loading model"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": option("-m"), "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = json.dumps(body["messages"])
        common = len(os.path.commonprefix([prompt, LAST["prompt"]]))
        LAST["prompt"] = prompt
        usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": 3, "total_tokens": len(prompt) // 4 + 3,
                 "prompt_tokens_details": {"cached_tokens": common // 4}}
        timings = {"cache_n": common // 4, "prompt_n": (len(prompt) - common) // 4, "predicted_n": 3,
                   "predicted_ms": 20.0}
        calls = body.get("tools") and not any(m["role"] == "tool" for m in body["messages"])
        if calls:
            delta = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "list_files", "arguments": "{}"}}]}
        else:
            delta = {"content": "All"}
        # the answer in three chunks, a token each, as llama-server streams it (a decode rate needs two)
        more = [] if calls else [{"content": " done"}, {"content": "."}]
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", **delta}, "finish_reason": None}]},
                  *({"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in more),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else "stop"}]},
                  {"choices": [], "usage": usage, "timings": timings}]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in chunks:
            chunk.update(id="chatcmpl-standin", object="chat.completion.chunk", created=0, model=option("-m"))
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")


def install(directory) -> str:
    """The stand-in as an executable named llama-server in directory (a shell wrapper: this interpreter, this
    script); its path."""
    path = os.path.join(str(directory), "llama-server")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} {os.path.abspath(__file__)} \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def main() -> None:
    if os.environ.get("STANDIN_ARGV"):
        with open(os.environ["STANDIN_ARGV"], "w") as f:
            json.dump(sys.argv[1:], f)
    if os.environ.get("STANDIN_MODE") == "exit":
        print("error: failed to load model", flush=True)
        sys.exit(3)
    print("main: server is listening", flush=True)
    ThreadingHTTPServer((option("--host"), int(option("--port"))), Handler).serve_forever()


if __name__ == "__main__":
    main()

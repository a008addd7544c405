"""Our plain step against llama-server's, through each server's /v1/chat/completions, interleaved: the decode rate
after the first token of greedy answers of N tokens (ignore_eos) behind a short prompt and ~1k and ~3k tokens of
context (the built-in ~900-token system prompt repeated), on our server at URL (start it with --draft none) and on
llama-server plain, started here on the same GGUF and threads. Each context's first request warms both prompt
caches; medians of the rounds after it. The context "json" is the matrix's invoice under its json_schema, laid out
as the model writes it (the layout llama-server's json_schema allows): the same text on both, a grammar's step
against a grammar's step (the answer ends itself, ~172 tokens).

    python scripts/plain_step_vs_llama_server.py URL [ROUNDS] [TOKENS] [CONTEXTS, e.g. short,1k,3k,json]
"""

from __future__ import annotations

import asyncio
import copy
import statistics
import sys

from specdecode.bench.llama_server import LlamaServer, find_binary
from specdecode.bench.llamacpp_peers import gguf_file
from specdecode.bench.peer_matrix import decode_rate, wait_quiet, workloads
from specdecode.bench.serve import ClientSettings, RequestRecord, make_client, stream_request
from specdecode.bench.serve_chat import builtin_system_prompt
from specdecode.structured.tool_patterns import FREE_LAYOUT

QUESTION = "Write a Python function that merges two sorted lists, with a docstring and tests."


def messages(context: str) -> list[dict]:
    system = {"short": "You are a helpful coding assistant.", "1k": builtin_system_prompt(),
              "3k": "\n\n".join([builtin_system_prompt()] * 3)}[context]
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]


def json_body() -> dict:
    """The matrix's invoice and its json_schema, the layout the model's own (FREE_LAYOUT)."""
    invoice = workloads()["json schema"][0]
    extra = copy.deepcopy(invoice.extra)
    extra["response_format"]["json_schema"]["schema"]["x-guidance"] = FREE_LAYOUT
    return {"messages": invoice.messages([]), **extra}


async def one(url: str, context: str, tokens: int) -> float | None:
    body = {"max_tokens": tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **(json_body() if context == "json" else {"messages": messages(context), "ignore_eos": True})}
    await wait_quiet()  # our server prefills an answer once idle: the next request waits for a quiet machine
    async with make_client(ClientSettings(url=url, timeout_s=900), 1) as http:
        record = await stream_request(http, "/v1/chat/completions", body, RequestRecord(0, 0.0))
    return decode_rate(record)


def main() -> None:
    ours = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    contexts = sys.argv[4].split(",") if len(sys.argv) > 4 else ["short", "1k", "3k"]
    gguf = str(gguf_file("qwen2.5-coder-1.5b-instruct"))
    with LlamaServer(find_binary(), gguf, threads=2, context=8192) as peer:
        servers = {"ours": ours, "llama-server": peer.url}
        rates = {(c, s): [] for c in contexts for s in servers}
        for r in range(rounds + 1):
            for c in contexts:
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for s in order:
                    rate = asyncio.run(one(servers[s], c, tokens))
                    print(f"round {r} {c} {s}: {rate:.2f} tok/s" + (" (warm-up)" if r == 0 else ""), flush=True)
                    if r:
                        rates[(c, s)].append(rate)
        for c in contexts:
            mine, theirs = (statistics.median(rates[(c, s)]) for s in servers)
            ratios = [a / b for a, b in zip(rates[(c, "ours")], rates[(c, "llama-server")])]
            print(f"{c}: ours {mine:.2f} tok/s, llama-server {theirs:.2f} tok/s, ours / llama-server {mine / theirs:.3f}x "
                  f"(median of per-round ratios {statistics.median(ratios):.3f}x)")


if __name__ == "__main__":
    main()

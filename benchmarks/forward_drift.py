"""How far a llama.cpp verification's numbers move from token-by-token decoding on a real GGUF.

The default mode verifies K + 1 tokens in one forward; llama.cpp computes a forward of 4 or more tokens with other
kernels (repacked matrix products, flash-attention tiles), so its log-probabilities differ from the same positions
decoded one token at a time. This measures that difference along the target's own greedy continuation: the largest
|log p| change over the whole vocabulary and over each position's top token, the smallest top-2 margin seen, and
whether any argmax flipped. `--exact-greedy` (forwards of at most 3 tokens) is measured beside it.

    python -m benchmarks.forward_drift [--model qwen2.5-coder-1.5b-instruct] [--tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoTokenizer

from specdecode.backends.llamacpp import LlamaCppBackend
from specdecode.models.prepare import prepare_gguf

PROMPTS = {
    "json": "<|im_start|>user\nGive me a JSON object describing a user with fields id, name, email, age and "
            "a list of 3 tags.<|im_end|>\n<|im_start|>assistant\n",
    "code": "<|im_start|>user\nWrite a Python function that parses a CSV line with quoted fields."
            "<|im_end|>\n<|im_start|>assistant\n",
}


def logprobs_by_chunks(backend, prompt: list[int], continuation: list[int], chunk: int) -> torch.Tensor:
    """Log-probabilities after the prompt and after each continuation token, fed `chunk` tokens a forward."""
    backend.reset(1)
    rows = [backend.forward(torch.tensor([prompt]), last_only=True)[0, -1:]]
    feed = continuation[:-1]
    for start in range(0, len(feed), chunk):
        rows.append(backend.forward(torch.tensor([feed[start:start + chunk]]))[0])
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def greedy(backend, prompt: list[int], n: int) -> list[int]:
    backend.reset(1)
    logits, out = backend.forward(torch.tensor([prompt]), last_only=True)[0, -1], []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = backend.forward(torch.tensor([[out[-1]]]))[0, 0]
    return out


def drift(reference: torch.Tensor, other: torch.Tensor) -> dict:
    top = reference.argmax(-1)
    return {"max_abs_logprob": (other - reference).abs().max().item(),
            "max_abs_top_logprob": (other.gather(1, top[:, None]) - reference.gather(1, top[:, None])).abs().max().item(),
            "argmax_flips": int((other.argmax(-1) != top).sum())}


def measure(model: str, tokens: int, threads: int) -> dict:
    path, tokenizer_dir = prepare_gguf(model)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    backend = LlamaCppBackend(path, n_ctx=1024, n_threads=threads)
    report = {"model": model, "tokens": tokens}
    for name, text in PROMPTS.items():
        prompt = tokenizer(text)["input_ids"]
        continuation = greedy(backend, prompt, tokens)
        reference = logprobs_by_chunks(backend, prompt, continuation, 1)
        top2 = reference.topk(2, dim=-1).values
        row = {"min_top2_margin": (top2[:, 0] - top2[:, 1]).min().item()}
        for chunk in (3, 4, 9):
            row[f"chunks_of_{chunk}"] = drift(reference, logprobs_by_chunks(backend, prompt, continuation, chunk))
        report[name] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.tokens, args.threads), indent=1))


if __name__ == "__main__":
    main()

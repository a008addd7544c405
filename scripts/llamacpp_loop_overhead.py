"""Our plain loop against llama-cpp-python's own (`Llama.generate`) on the same GGUF, threads and prompt, greedy:
the time each spends in llama_decode per step and the time between two llama_decode calls (everything else: our
session, sampling, the backend's batch and logits; their sampler chain and loop). Interleaved repeats, medians.
    python scripts/llamacpp_loop_overhead.py --new 96 --repeats 5 [--draft suffix] [--prompts prose --nb-prompts 8]
--draft suffix adds ours with the suffix drafter and K = auto (what --draft auto picks where the model cannot pay).
"""
import argparse
import os
import statistics
import time

import llama_cpp

from specdecode import AutoregressiveGenerator, SpeculativeGenerator, load_model
from specdecode.bench.llamacpp_peers import LlamaCppPeers, gguf_file
from specdecode.bench.methods.specdecode import fresh_history
from specdecode.bench.prompts import load_prompts
from specdecode.drafters import SuffixDrafter

PROMPT = "Write a short essay about the history of the printing press and its effect on European society."


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draft", choices=["none", "suffix"], default="none")
    parser.add_argument("--prompts", default=None, help="a bench prompt set (prose, code, ...): each round decodes "
                        "each of its prompts with every method in turn, the order rotating (drift hits all alike)")
    parser.add_argument("--nb-prompts", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = load_model(args.target, backend="llamacpp", threads=args.threads)
    model.model.huge_pages.wait()  # the steady state: its weights in huge pages (backends/huge_pages.py)
    texts = [PROMPT] if args.prompts is None else [p.text for p in load_prompts(args.prompts)[:args.nb_prompts]]
    prompts = [model.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False) for t in texts]
    peers = LlamaCppPeers(gguf_file(args.target), args.threads, 512)
    ours = {"ours plain": AutoregressiveGenerator(model)}
    if args.draft == "suffix":
        ours["ours suffix, K auto"] = SpeculativeGenerator(model, SuffixDrafter(), num_speculative_tokens="auto")

    calls = []  # (start, end) of every llama_decode, ours and theirs alike
    decode = llama_cpp.llama_decode

    def timed(ctx, batch):
        start = time.perf_counter()
        code = decode(ctx, batch)
        calls.append((start, time.perf_counter()))
        return code

    llama_cpp.llama_decode = timed
    llama_cpp.llama.llama_cpp.llama_decode = timed

    def run_ours(generator, prompt, fresh):
        if fresh:  # a round starts with an empty history, as a bench run does
            fresh_history(generator.drafter)
        return generator.generate([prompt], max_new_tokens=args.new, temperature=0, ignore_eos=True).token_ids[0]

    runs = {name: (lambda prompt, fresh, g=g: run_ours(g, prompt, fresh)) for name, g in ours.items()}
    runs["llama-cpp-python"] = lambda prompt, fresh: peers.generate_ids(prompt, args.new, 0.0, 0, 1.0, 0)[0]
    names = list(runs)
    samples = {name: [] for name in runs}
    ratios = {name: [] for name in runs}  # per (round, prompt): tok/s over llama-cpp-python's
    same = {name: True for name in runs}  # whether its tokens equal llama-cpp-python's on every call
    for repeat in range(args.repeats + 1):
        for i, prompt in enumerate(prompts):
            order = names[(repeat + i) % len(names):] + names[:(repeat + i) % len(names)]
            seconds_of, tokens_of = {}, {}
            for name in order:
                calls.clear()
                start = time.perf_counter()
                tokens = runs[name](prompt, i == 0)
                seconds = time.perf_counter() - start
                seconds_of[name], tokens_of[name] = seconds, tokens
                if repeat:  # the first round warms up
                    steps = [end - begin for begin, end in calls[1:]]
                    gaps = [b[0] - a[1] for a, b in zip(calls, calls[1:])]
                    samples[name].append((seconds, statistics.median(steps), statistics.median(gaps), tokens,
                                          calls[0][1] - calls[0][0], sum(steps), sum(gaps)))
            if repeat:
                for name in names:
                    ratios[name].append(seconds_of["llama-cpp-python"] / seconds_of[name])
            for name in names:
                same[name] &= tokens_of[name] == tokens_of["llama-cpp-python"]
    for name, rows in samples.items():
        seconds, step, gap, prefill, steps, gaps = (statistics.median(r[i] for r in rows) for i in (0, 1, 2, 4, 5, 6))
        print(f"{name:22s} per call (median) {1e3 * seconds:7.1f} ms: prefill {1e3 * prefill:6.1f}, decodes "
              f"{1e3 * steps:7.1f}, between {1e3 * gaps:5.1f}, rest {1e3 * (seconds - prefill - steps - gaps):5.1f}")
        total = sum(len(r[3]) for r in rows) / sum(r[0] for r in rows)
        print(f"{name:22s} {total:6.2f} tok/s  llama_decode {1e3 * step:6.2f} ms/step  between decodes "
              f"{1e3 * gap:5.3f} ms  x llama-cpp-python: median {statistics.median(ratios[name]):.3f} over "
              f"{len(ratios[name])} calls")
    print("tokens equal llama-cpp-python's on every call: " + ", ".join(f"{n} {same[n]}" for n in names))

if __name__ == "__main__":
    main()

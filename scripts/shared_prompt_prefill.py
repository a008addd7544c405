"""n = 4 choices of one ~900-token prompt on the default pair (llama.cpp, 2 threads): time to every row's first
token and to 32 tokens each, with the prompt prefilled once (copied into the other rows) against four prefills.
Interleaved, median of 3.

    python scripts/shared_prompt_prefill.py
"""
import statistics
import time

from specdecode import AutoregressiveGenerator, load_model
from specdecode.bench.prompts import load_builtin

tgt = load_model("qwen2.5-coder-1.5b-instruct", threads=2, max_rows=4)
text = " ".join(p.text for p in load_builtin("code")) * 2
prompt = tgt.tokenizer.encode(text)[:900]
gen = AutoregressiveGenerator(tgt)


def run(share):
    s = gen.session(prefill_tokens_per_step=256)
    s.shares_prompts = s.shares_prompts and share
    for i in range(4):
        s.add(gen.request(prompt, max_new_tokens=32, temperature=0.8, seed=1, seed_index=i))
    t0 = time.perf_counter(); first = None
    while not s.idle:
        s.step()
        if first is None and s.running == 4:
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, s.result()


run(True)
res = {True: [], False: []}
for rep in range(3):
    for share in (True, False):
        f, t, r = run(share)
        res[share].append((f, t))
        print(share, round(f, 2), round(t, 2), r.stats.cached_prompt_tokens, flush=True)
for share in (True, False):
    print("share" if share else "separate", "first tokens", round(statistics.median(x[0] for x in res[share]), 2),
          "s; 32 tokens each", round(statistics.median(x[1] for x in res[share]), 2), "s")
print("ratio first", statistics.median(x[0] for x in res[True]) / statistics.median(x[0] for x in res[False]),
      "total", statistics.median(x[1] for x in res[True]) / statistics.median(x[1] for x in res[False]))

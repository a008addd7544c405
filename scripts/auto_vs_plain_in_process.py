"""In one process, on the same loaded models: plain decoding against -k auto with a draft of another tokenizer
(SmolLM2-135M for Qwen2.5-Coder-1.5B on llama.cpp), its policy started from this machine's recorded costs of the
target ("prior": what the CLI starts from, the recorded costs, or without a record a CPU's shape), from a CPU's shape
("cpu": v(n) = 1 + 0.5 (n - 1), CostPrior.cpu()) and from the default, a GPU's shape ("default"), greedy
tokens of a code and a prose prompt, the arms' order reversed every round (so a drift of the machine's speed does not
favour one arm). Prints each run's tokens/s (by wall clock and by the process's CPU time, which on a VM excludes the
time the host gave other guests: steal) and K histogram, then per arm the per-round ratios to the same round's plain
run and their medians, by both clocks.

    python scripts/auto_vs_plain_in_process.py [ROUNDS] [TOKENS] [ARMS, e.g. plain,prior or plain,cpu,default] [SET]

SET "short" (default): the two prompts as raw text (5-10 tokens); "chat": a code edit (the bench's first `edit`
prompt) and a prose request through the target's chat template (94 and 39 tokens, a chat client's prompt); "system":
the same after the bench's shared system prompt (~900 tokens: an agent's or a code assistant's).
"""
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from specdecode import AutoregressiveGenerator, SpeculativeGenerator, load_model  # noqa: E402
from specdecode.pairing.pair import ModelOptions, recorded_cost_prior  # noqa: E402
from specdecode.policy.choose import make_policy  # noqa: E402
from specdecode.policy.estimates import CostPrior  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 128
PROMPTS = {"code": "def quicksort(arr):", "prose": "Write a short story about a lighthouse keeper."}
target = load_model("qwen2.5-coder-1.5b-instruct", backend="llamacpp")
if len(sys.argv) > 4 and sys.argv[4] in ("chat", "system"):
    import json
    from pathlib import Path

    from specdecode.text.chat import encode_chat

    edit = Path(__file__).parent.parent / "src/specdecode/bench/prompts/edit.jsonl"
    system = (edit.parent / "shared_system.txt").read_text() if sys.argv[4] == "system" else None

    def chat(text: str) -> list[int]:
        turns = [{"role": "system", "content": system}] if system else []
        return encode_chat(target.tokenizer, turns + [{"role": "user", "content": text}])

    PROMPTS = {"code": chat(json.loads(edit.read_text().splitlines()[0])["prompt"]), "prose": chat(PROMPTS["prose"])}
    print("prompt tokens", {name: len(ids) for name, ids in PROMPTS.items()}, flush=True)
draft = load_model("smollm2-135m-instruct", backend="llamacpp")
prior = recorded_cost_prior(ModelOptions(draft="smollm2-135m-instruct"), target)
print("prior", prior, flush=True)
plain = AutoregressiveGenerator(target)
spec = SpeculativeGenerator(target, draft, num_speculative_tokens="auto")
ARMS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["plain", "prior", "default"]
rates = {(p, a): [] for p in PROMPTS for a in ARMS}
cpu_rates = {(p, a): [] for p in PROMPTS for a in ARMS}
for r in range(ROUNDS):
    for name, prompt in PROMPTS.items():
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            if arm == "plain":
                gen = plain
            else:
                spec.cost_prior = {"prior": prior, "cpu": CostPrior.cpu()}.get(arm)
                spec.policy = make_policy("auto", 8, spec.cost_prior)
                gen = spec
            start, cpu = time.perf_counter(), time.process_time()
            res = gen.generate([prompt], max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)
            rate, cpu_rate = TOKENS / (time.perf_counter() - start), TOKENS / (time.process_time() - cpu)
            rates[name, arm].append(rate)
            cpu_rates[name, arm].append(cpu_rate)
            print(r, name, arm, round(rate, 2), round(cpu_rate, 2), getattr(res.stats, "k_histogram", None), flush=True)
for clock, table in (("wall", rates), ("cpu", cpu_rates)):
    for name in PROMPTS:
        for arm in ARMS[1:]:
            ratios = [a / b for a, b in zip(table[name, arm], table[name, "plain"])]
            print(clock, name, arm, [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3),
                  flush=True)

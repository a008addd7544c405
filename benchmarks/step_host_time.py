"""Host time per speculative step on the static backend, batch 1 against batch 4, split by where it goes: the
session's phases, the drafter's verbs, the backend's wrapper around the model's step, and the model's step itself
(on a GPU a graph replay; on this CPU the eager model, which is why it is set apart). Everything but the model's step
is what a GPU step pays on the host beside its graphs: issue 53's batch-4 loss (0.77-0.88 of the prediction at
batch 4, 0.98 at batch 1) is sought there. Tiny random models, K fixed, greedy, widths padded to buckets as on a GPU.

    python -m benchmarks.step_host_time [--k 4] [--calls 7] [--tokens 48]

For a before/after comparison run it from two checkouts alternately (PYTHONPATH=<checkout>/src): the CPU is shared
and its load swings, so single runs are not comparable. Phases are timed exclusively (a phase's own time, less the
timed calls inside it) by wrapping the methods that exist; a renamed method is simply not shown.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

PHASES = ("_plan", "_propose", "_verify", "_commit", "_learn", "_emit_all", "_drop_finished", "admit", "_join")
DRAFTER = ("outlook", "propose", "observe", "relayout")


def instrument(times: dict) -> None:
    """Wraps the session's phases, the model drafter's verbs and the static backend's forward and step with
    exclusive timers adding into times[label]."""
    from specdecode.backends import static
    from specdecode.drafters import model
    from specdecode.engine import session

    stack = []

    def wrap(cls, name, label):
        inner = getattr(cls, name, None)
        if inner is None or getattr(inner, "_timed", False):
            return

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            stack.append([time.perf_counter(), 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                start, nested = stack.pop()
                took = time.perf_counter() - start
                times[label] = times.get(label, 0.0) + took - nested
                if stack:
                    stack[-1][1] += took

        timed._timed = True
        setattr(cls, name, timed)

    session_class = next(v for v in vars(session).values() if isinstance(v, type) and hasattr(v, "_decode_step"))
    for name in PHASES:
        wrap(session_class, name, f"session.{name}")
    wrap(session_class, "step", "session (rest of the step)")
    for name in DRAFTER:
        wrap(model.ModelDrafter, name, f"drafter.{name}")
    wrap(static.StaticBackend, "forward", "backend wrapper")
    wrap(static.StaticBackend, "_step", "model step")


def tiny(seed: int, vocab: int = 96):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(config).eval()


def measure(batch: int, k: int, calls: int, tokens: int, times: dict) -> dict:
    """Median milliseconds per step of each timed part over `calls` generations (after one warm-up)."""
    import copy

    import torch

    from specdecode import SpeculativeGenerator
    from specdecode.backends.static import BUCKETS, StaticBackend

    target = tiny(0)
    draft = copy.deepcopy(target)
    with torch.no_grad():  # a draft close to the target: most drafts kept, some not, as at a real acceptance
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05 * p.std().clamp(min=1e-3))
    backends = [StaticBackend(m, max_batch=4, max_len=tokens + 32) for m in (target, draft)]
    for backend in backends:
        backend._buckets = BUCKETS  # widths padded as where steps are captured (a GPU)
    gen = SpeculativeGenerator(backends[0], backends[1], num_speculative_tokens=k)
    prompts = [[5 + i, 17, 42, 9 + i, 7, 3][: 4 + i % 3] for i in range(batch)]
    new = dict(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    gen.generate(prompts, **new)
    runs = []
    for _ in range(calls):
        times.clear()
        result = gen.generate(prompts, **new)
        steps = sum(result.stats.k_histogram.values())
        runs.append({label: 1000 * seconds / steps for label, seconds in times.items()})
    return {label: statistics.median(run.get(label, 0.0) for run in runs) for label in runs[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    times: dict = {}
    instrument(times)
    results = {batch: measure(batch, args.k, args.calls, args.tokens, times) for batch in (1, 4)}
    print(f"{'ms per step':30s} {'batch 1':>9s} {'batch 4':>9s}")
    for label in sorted(results[4], key=lambda label: -results[4][label]):
        print(f"{label:30s} {results[1].get(label, 0.0):9.3f} {results[4][label]:9.3f}")
    host = {b: sum(v for label, v in r.items() if label != "model step") for b, r in results.items()}
    print(f"{'host: all but the model step':30s} {host[1]:9.3f} {host[4]:9.3f}")


if __name__ == "__main__":
    main()

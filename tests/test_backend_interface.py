"""bench, bench latency and verify on a backend that is not transformers: they must need only the ModelBackend
interface (reset, forward, trim, select_rows, fork, merge, lengths) and the generators' public properties.

The backend here is a real, tiny language model in pure torch: the logits of a token are a fixed random table's
row for that token plus another table's row for the token before it (a trigram-like model whose context lives in
the backend's own cache, so a wrong trim or a wrong row would change its output). It passes the backend
conformance suite (test_backend_conformance.py) like every backend.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.bench.runner import Bench, BenchSettings, measure_costs, measure_latency
from specdecode.engine.generators import AutoregressiveGenerator, SpeculativeGenerator
from specdecode.evals.verify import check_samples, exact_distribution, sample_speculative, verify_pair
from specdecode.exact.sampling import SamplingParams

VOCAB = 24
PROMPT = [3, 7, 1, 12, 5]


class TableBackend:
    """logits(token t after token s) = current[t] + previous[s]; the cache is each row's list of real tokens."""

    def __init__(self, current: torch.Tensor, previous: torch.Tensor):
        self.current, self.previous = current, previous  # [V, V] and [V + 1, V] (row V: no token before)
        self.vocab_size = current.shape[1]
        self.device = torch.device("cpu")
        self.max_positions = None
        self.forward_calls = 0
        self.reset(1)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]

    def reset(self, batch_size: int) -> None:
        self.rows = [[] for _ in range(batch_size)]

    def forward(self, input_ids, valid=None, last_only: bool = False):
        self.forward_calls += 1
        batch, n = input_ids.shape
        valid = torch.ones_like(input_ids, dtype=torch.bool) if valid is None else valid.bool()
        logits = torch.zeros(batch, n, self.vocab_size)
        last = [0] * batch
        for b in range(batch):
            for i in range(n):
                if not valid[b, i]:
                    continue  # padding: never seen, and its logits are never read
                token = int(input_ids[b, i])
                before = self.rows[b][-1] if self.rows[b] else self.vocab_size
                logits[b, i] = self.current[token] + self.previous[before]
                self.rows[b].append(token)
                last[b] = i
        if last_only:
            return logits[torch.arange(batch), torch.tensor(last)].unsqueeze(1)
        return logits

    def trim(self, lengths: list[int]) -> None:
        self.rows = [r[:n] for r, n in zip(self.rows, lengths)]

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def fork(self, batch_size: int) -> "TableBackend":
        other = TableBackend(self.current, self.previous)
        other.reset(batch_size)
        return other

    def merge(self, other: "TableBackend") -> None:
        self.rows += other.rows


def tables(seed: int, like=None, noise: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    if like is None:  # peaked rows, like a trained model's
        return 3.0 * torch.randn(VOCAB, VOCAB, generator=gen), 3.0 * torch.randn(VOCAB + 1, VOCAB, generator=gen)
    return tuple(t + noise * torch.randn(t.shape, generator=gen) for t in like)


@pytest.fixture
def pair():
    target = tables(0)
    return TableBackend(*target), TableBackend(*tables(1, like=target, noise=1.0))


def test_greedy_speculative_equals_plain_on_the_table_model(pair):
    target, draft = pair
    prompts = [PROMPT, [0, 5], [9, 2, 17, 4], [20], [6, 6]]
    plain = AutoregressiveGenerator(target).generate(prompts, max_new_tokens=12, temperature=0, ignore_eos=True)
    spec = SpeculativeGenerator(target, draft, num_speculative_tokens=3).generate(
        prompts, max_new_tokens=12, temperature=0, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.stats.accepted_tokens < spec.stats.proposed_tokens  # a draft that is right only sometimes


def test_step_costs_use_only_the_backends(pair):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    before = target.forward_calls
    costs = measure_costs(gen, PROMPT, [1, 2], repeats=2)
    assert target.forward_calls > before and target.lengths == [len(PROMPT)]  # trimmed back after every forward
    assert set(costs["v"]) == {"1", "2"} and costs["c"] > 0 and costs["draft_step_ms"] > 0


def test_bench_latency_on_a_new_backend(pair):
    target, draft = pair
    report = measure_latency(target, draft, PROMPT, [2, "auto"], max_new_tokens=6, runs=1, repeats=1)
    assert report["environment"]["backend"] == "TableBackend"
    assert report["target_alone"]["ms_per_token"] > 0
    fixed, auto = report["with_draft"]
    assert fixed["k"] == 2 and fixed["verify_ms"] > 0 and 0.0 <= fixed["acceptance_rate"] <= 1.0
    assert auto["k"] == "auto" and auto["verify_ms"] is None and auto["mean_k"] is not None


def test_bench_on_a_new_backend_runs_ours_and_leaves_transformers_out(pair):
    target, draft = pair
    settings = BenchSettings(ks=[1, "auto"], temperatures=[0.0, 1.0], max_new_tokens=5, runs=2, warmup=0,
                             cost_repeats=1)
    runner = Bench(target, draft, [PROMPT, PROMPT[:3]], settings)
    assert runner.methods == ("specdecode-plain", "specdecode")
    assert {"hf-plain", "hf-assisted", "llamacpp-plain"} <= set(runner.skipped)  # no transformers model, no GGUF
    report = runner.run()
    assert report["config"]["skipped"].keys() == set(runner.skipped)
    greedy = {c["k"]: c for c in report["sweep"] if c["temperature"] == 0.0}
    assert greedy[1]["methods"]["specdecode"]["new_tokens_per_prompt"] == [5, 5]
    assert greedy[1]["theory"] is not None and greedy["auto"]["theory"] is None
    with pytest.raises(ValueError, match="no method left"):
        Bench(target, draft, [PROMPT], BenchSettings(methods=("hf-plain",)))


def test_verify_on_a_new_backend(pair):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    params = SamplingParams(temperature=1.0, top_k=3)
    report = verify_pair(gen, [PROMPT], params, positions=4, samples=1200, batch_size=200, seed=3)
    assert report["pass"], [t for t in report["prompts"][0]["tests"] if not t["pass"]]
    assert report["speculative_path_exercised"] and report["max_drafts_per_step_exercised"] == 2
    assert report["prompts"][0]["provenance"].get("resampled", 0) > 0


def test_verify_fails_a_draft_sampled_as_if_it_were_the_target(pair):
    """The same check must catch a wrong sampler on this backend too: here the 'target' the generator samples is
    the draft, while the exact reference is the real target's."""
    target, draft = pair
    second_draft = TableBackend(*tables(2, like=(draft.current, draft.previous), noise=0.5))
    wrong = SpeculativeGenerator(draft, second_draft, num_speculative_tokens=2)
    params = SamplingParams(temperature=1.0, top_k=3)
    exact = exact_distribution(target, PROMPT, params, positions=3, n_samples=1200)
    drawn = sample_speculative(wrong, PROMPT, params, 3, 1200, batch_size=200, seed=4)
    assert not check_samples(exact, drawn.sequences)["pass"]

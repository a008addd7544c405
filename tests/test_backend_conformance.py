"""The ModelBackend conformance suite (backends/base.py): one module every backend passes.

A case is a backend on a small model and how exact it promises to be: transformers (HFBackend) and StaticBackend on
the tiny random model of conftest.py (equal to float rounding), llama.cpp on the SmolLM2-135M GGUF in its exact
mode (max_tokens_per_forward=3: every logit is llama.cpp's token-by-token decoding, bit for bit, so a row in any
batch equals the row alone), and the pure-torch table model of test_backend_interface.py (exact). What each case
must do: start empty caches; return [B, n, V] float32 logits ([B, 1, V] with last_only); give each row of a
left-padded ragged batch, or a right-padded ragged step, the logits it gets alone; forget trimmed tokens so that
what follows equals a cache that never saw them, per row; keep the right rows through select_rows; put a fork's
prefilled rows after the existing ones on merge. A new backend is one file plus one case here.

Also here: the registry is how load_model and the CLI find backends, so a backend registered from anywhere is
loadable by name, listed by the CLI, and chosen by "auto" when it claims a model.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_qwen
from specdecode.backends import pad as pad_rows
from test_backend_interface import TableBackend, tables

VOCAB = 24  # every token below is < VOCAB: valid for the table model, the tiny Qwen and SmolLM2 alike
PROMPTS = [[3, 7, 1, 12, 5, 9, 2], [11, 4], [6, 6, 20, 8, 17]]
LLAMA_ROWS = 4  # llama.cpp sequences: the most rows any test holds at once, forks included


def _hf(model):
    from specdecode.backends.hf import HFBackend

    return lambda: HFBackend(model)


def _static(model):
    from specdecode.backends.static import StaticBackend

    return lambda: StaticBackend(model, max_batch=4, max_len=64)


def _llamacpp():
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp import EXACT_TOKENS_PER_FORWARD, LlamaCppBackend
    from specdecode.models import catalog

    info = catalog.get_model_info("smollm2-135m-instruct")
    if not info.installed:
        pytest.skip(f"needs the SmolLM2 GGUF package: {info.pip_command}")
    path = catalog.part_path(info.parts[0], info)
    return lambda: LlamaCppBackend(path, n_ctx=128, n_threads=1, max_rows=LLAMA_ROWS,
                                   max_tokens_per_forward=EXACT_TOKENS_PER_FORWARD)


def _table():
    target = tables(0)
    return lambda: TableBackend(*target)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_qwen(320, seed=0)


@pytest.fixture(params=["transformers", "static", "llamacpp-exact", "table"])
def case(request, tiny_model):
    """(a factory of fresh backends on one model, whether its logits are exact across batch shapes)."""
    if request.param == "transformers":
        return _hf(tiny_model), False
    if request.param == "static":
        return _static(tiny_model), False
    if request.param == "llamacpp-exact":
        return _llamacpp(), True
    return _table(), True


def tensor(backend, rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, device=backend.device)


def pad(backend, rows: list[list[int]], side: str):
    return pad_rows(rows, backend.device, side=side)


def assert_same(got, expected, exact: bool):
    if exact:
        assert torch.equal(got, expected), (got - expected).abs().max()
    else:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def alone(backend, forwards: list[list[int]], last_only: bool = False) -> list[torch.Tensor]:
    """One row on a fresh cache: the logits [n, V] of each forward (the first with last_only as given)."""
    backend.reset(1)
    return [backend.forward(tensor(backend, [ids]), last_only=last_only and i == 0)[0]
            for i, ids in enumerate(forwards)]


# ---------------------------------------------------------------------------------------------- the suite
def test_reset_starts_empty_rows_and_lengths_count_real_tokens(case):
    make, _ = case
    backend = make()
    backend.reset(3)
    assert backend.lengths == [0, 0, 0]
    logits = backend.forward(tensor(backend, [[1, 2], [3, 4], [5, 6]]))
    assert logits.shape == (3, 2, backend.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.device == backend.device
    backend.forward(*pad(backend, [[7], [8, 9, 10], []], side="right"))  # padding is not counted
    assert backend.lengths == [3, 5, 2]
    backend.reset(1)
    assert backend.lengths == [0]


def test_left_padded_ragged_rows_get_their_logits_alone(case):
    make, exact = case
    backend = make()
    references = [alone(backend, [p])[0] for p in PROMPTS]
    ids, valid = pad(backend, PROMPTS, side="left")
    backend.reset(len(PROMPTS))
    logits = backend.forward(ids, valid)
    assert logits.shape == (3, ids.shape[1], backend.vocab_size)
    for b, prompt in enumerate(PROMPTS):
        assert_same(logits[b][valid[b]], references[b], exact)
    assert backend.lengths == [len(p) for p in PROMPTS]


def test_last_only_returns_each_rows_last_real_position(case):
    make, exact = case
    backend = make()
    references = [alone(backend, [p, [4, 5, 6][:b + 1]], last_only=True) for b, p in enumerate(PROMPTS)]
    backend.reset(len(PROMPTS))
    first = backend.forward(*pad(backend, PROMPTS, side="left"), last_only=True)
    assert first.shape == (3, 1, backend.vocab_size)
    step = backend.forward(*pad(backend, [[4], [4, 5], [4, 5, 6]], side="right"), last_only=True)
    assert step.shape == (3, 1, backend.vocab_size)
    for b, (prompt_logits, step_logits) in enumerate(references):
        assert_same(first[b, 0], prompt_logits[-1], exact)
        assert_same(step[b, 0], step_logits[-1], exact)


def test_trimmed_tokens_leave_no_trace_row_by_row(case):
    """Rows keep different numbers of drafts (holes, for a cache shared by the batch); the next forwards, one a
    right-padded ragged catch-up, equal each row's cache that never saw the rejected drafts."""
    make, exact = case
    backend = make()
    kept = [1, 3]
    prompts = PROMPTS[:2]
    drafts = [[13, 14, 15, 16], [17, 18, 19, 21]]
    catch_up = [[22], [2, 3]]
    then = [[5, 6], [7, 8]]
    references = [alone(backend, [p, d[:k], c, t]) for p, d, k, c, t in zip(prompts, drafts, kept, catch_up, then)]
    backend.reset(2)
    backend.forward(*pad(backend, prompts, side="left"))
    backend.forward(tensor(backend, drafts))
    backend.trim([len(p) + k for p, k in zip(prompts, kept)])
    assert backend.lengths == [len(p) + k for p, k in zip(prompts, kept)]
    ids, valid = pad(backend, catch_up, side="right")
    caught = backend.forward(ids, valid)
    after = backend.forward(tensor(backend, then))
    for b, reference in enumerate(references):
        assert_same(caught[b][valid[b]], reference[2], exact)
        assert_same(after[b], reference[3], exact)
    assert backend.lengths == [len(p) + k + len(c) + 2 for p, k, c in zip(prompts, kept, catch_up)]


def test_select_rows_keeps_the_right_rows(case):
    make, exact = case
    backend = make()
    steps = [[4], [9], [14]]
    references = [alone(backend, [p, s])[1] for p, s in zip(PROMPTS, steps)]
    backend.reset(3)
    backend.forward(*pad(backend, PROMPTS, side="left"))
    backend.select_rows([2, 0])
    assert backend.lengths == [len(PROMPTS[2]), len(PROMPTS[0])]
    logits = backend.forward(tensor(backend, [steps[2], steps[0]]))
    assert_same(logits[0], references[2], exact)
    assert_same(logits[1], references[0], exact)


def test_a_fork_prefills_beside_the_running_rows_and_merges_after_them(case):
    make, exact = case
    backend = make()
    steps = [[4], [9], [14]]
    references = [alone(backend, [p, [23], s]) if b == 0 else alone(backend, [p, s], last_only=True)
                  for b, (p, s) in enumerate(zip(PROMPTS, steps))]
    backend.reset(1)
    backend.forward(tensor(backend, [PROMPTS[0]]))
    backend.forward(tensor(backend, [[23]]))
    joining = backend.fork(2)
    assert joining.lengths == [0, 0] and backend.lengths == [len(PROMPTS[0]) + 1]
    prefill = joining.forward(*pad(backend, PROMPTS[1:], side="left"), last_only=True)
    for b in (1, 2):
        assert_same(prefill[b - 1, 0], references[b][0][-1], exact)
    backend.forward(tensor(backend, [steps[0]]))  # the running row keeps decoding meanwhile
    backend.merge(joining)
    assert backend.lengths == [len(PROMPTS[0]) + 2, len(PROMPTS[1]), len(PROMPTS[2])]
    logits = backend.forward(tensor(backend, [[1], steps[1], steps[2]]))
    reference_0 = alone(backend, [PROMPTS[0], [23], steps[0], [1]])[3]
    assert_same(logits[0], reference_0, exact)
    for b in (1, 2):
        assert_same(logits[b], references[b][1], exact)


# ---------------------------------------------------------------------------------------------- the registry
def test_a_registered_backend_is_loadable_listed_and_chosen_by_auto(monkeypatch):
    from specdecode import backends
    from specdecode.cli.options import _backend_help
    from specdecode.pairing.loading import load_model
    from specdecode.models.sources import LoadedModel

    backends.registered_backends()  # this package's backends registered in the real registry, before the copy
    monkeypatch.setattr(backends, "_registered", dict(backends._registered))
    loads = []

    def load(source, options):
        loads.append((source, options.threads))
        return LoadedModel(_table()(), None, str(source), "", backend="table")

    backends.register_backend("table", load, help="a trigram-like table, for tests",
                              claims=lambda source, options: str(source).endswith(".table"))
    assert "table (a trigram-like table, for tests)" in _backend_help()
    loaded = load_model("anything", backend="table", threads=2)
    assert loaded.backend == "table" and isinstance(loaded.model, TableBackend) and loads == [("anything", 2)]
    assert load_model("model.table").backend == "table"  # auto: the backend that claims the model
    with pytest.raises(ValueError, match="backend must be one of auto, transformers, llamacpp, static, table"):
        load_model("anything", backend="vllm")


def test_the_package_declares_its_backends_without_importing_them():
    import subprocess
    import sys

    code = ("import sys; from specdecode.backends import backend_help; names = list(backend_help()); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(names)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['transformers', 'llamacpp', 'static']"


def test_auto_imports_only_the_backends_that_can_claim_a_model(tmp_path):
    """A GGUF on the CPU is llama.cpp's: choosing it must not import transformers' backend (2 s of one core that
    a first run's llama.cpp load would wait for); a model no backend claims still falls back to transformers."""
    import subprocess
    import sys

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    code = ("import sys; from specdecode.pairing.loading import choose_backend; "
            "from specdecode.models.sources import LoadOptions; "
            f"entry = choose_backend({str(gguf)!r}, 'auto', LoadOptions()); "
            "print(entry.name, 'specdecode.backends.hf' in sys.modules, 'specdecode.backends.static' in sys.modules); "
            f"print(choose_backend({str(tmp_path)!r}, 'auto', LoadOptions()).name)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["llamacpp False False", "transformers"]

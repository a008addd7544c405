"""The lean copy of a GGUF draft (specdecode.models.lean_gguf): heavier matrices re-quantized to Q4_0, the rest byte
for byte, used only where it steps faster on this machine, made and timed once; and a draft that runs it keeps the
output exactly the target's (greedy: token for token)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from test_registry import write_tiny_gguf  # noqa: E402

from specdecode import AutoregressiveGenerator, SpeculativeGenerator  # noqa: E402
from specdecode.backends.llamacpp import LlamaCppBackend  # noqa: E402
from specdecode.models import cache, lean_gguf  # noqa: E402
from specdecode.models.gguf_header import gguf_tensors  # noqa: E402
from specdecode.pairing.loading import load_model  # noqa: E402
from specdecode.pairing.pair import ModelOptions, load_draft_model  # noqa: E402

MATRICES = {f"blk.{i}.{m}.weight" for i in range(2)
            for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")} | {"output.weight"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    """A tiny qwen2 GGUF in F32 whose rows are whole Q4_0 blocks (64 wide), so its matrices can be re-quantized."""
    return write_tiny_gguf(tmp_path_factory.mktemp("lean") / "wide.gguf", hidden=64, ffn=128)


def _reader(path):
    return gguf.GGUFReader(str(path))


def test_the_heavier_tensors_are_the_matrices_but_the_input_embedding(wide_gguf, tmp_path):
    assert set(lean_gguf.heavier_tensors(wide_gguf)) == MATRICES
    narrow = write_tiny_gguf(tmp_path / "narrow.gguf", ffn=16)  # rows of 16: not whole blocks, nothing to convert
    assert lean_gguf.heavier_tensors(narrow) == []
    header = {name: (dims, kind) for name, dims, kind in gguf_tensors(wide_gguf)}
    assert {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in _reader(wide_gguf).tensors} == header


def test_the_copy_has_q4_0_matrices_and_everything_else_byte_for_byte(wide_gguf, tmp_path):
    seen = []
    dest = lean_gguf.write_lean_copy(wide_gguf, tmp_path / "lean.gguf", lambda *report: seen.append(report))
    original, lean = _reader(wide_gguf), _reader(dest)
    assert [t.name for t in lean.tensors] == [t.name for t in original.tensors]
    for before, after in zip(original.tensors, lean.tensors):
        assert list(after.shape) == list(before.shape)
        if before.name in MATRICES:
            assert after.tensor_type.name == "Q4_0", before.name
        else:
            assert after.tensor_type == before.tensor_type and after.data.tobytes() == before.data.tobytes()
    fields = lambda r: {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}  # noqa
    assert fields(lean) == fields(original)
    assert os.path.getsize(dest) < os.path.getsize(wide_gguf) / 3  # F32 -> 4.5 bits a weight
    assert seen[-1][1:] == (len(original.tensors), len(original.tensors))
    assert not list(tmp_path.glob(".lean.gguf.partial-*"))  # written aside, then renamed
    assert lean_gguf.heavier_tensors(dest) == []  # every matrix now as light as Q4_0: a copy of it changes nothing


def test_the_copy_runs_on_llama_cpp_and_computes_nearly_the_originals_logits(wide_gguf, tmp_path):
    dest = lean_gguf.write_lean_copy(wide_gguf, tmp_path / "lean.gguf")
    prompt = [5, 80, 200, 17, 42, 99]
    logits = []
    for path in (wide_gguf, dest):
        llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
        llm.eval(prompt)
        logits.append(np.array(llm.scores[len(prompt) - 1]))
    assert not np.array_equal(logits[0], logits[1])  # it is another model...
    assert np.corrcoef(logits[0], logits[1])[0, 1] > 0.8  # ...close to the original (random weights: ~0.94)


class Timer:
    def __init__(self, original_ms: float, lean_ms: float):
        self.result, self.calls = (original_ms, lean_ms), []

    def __call__(self, paths, threads):
        self.calls.append(([p.name for p in paths], threads))
        return self.result


def test_the_copy_is_used_where_it_is_faster_made_and_timed_once_per_thread_count(wide_gguf, cache_dir):
    timer = Timer(10.0, 5.0)
    chosen = lean_gguf.lean_gguf(wide_gguf, 2, timer=timer)
    assert chosen == lean_gguf.lean_path(wide_gguf) and chosen.is_file() and chosen.parent.parent.parent == cache_dir
    assert timer.calls == [([wide_gguf.name, chosen.name], 2)]
    made = chosen.stat().st_mtime_ns
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == chosen and len(timer.calls) == 1  # the verdict is kept
    assert lean_gguf.lean_gguf(wide_gguf, 1, timer=timer) == chosen and len(timer.calls) == 2  # other threads: timed
    assert chosen.stat().st_mtime_ns == made  # ...but the copy is not made again
    verdicts = json.loads(chosen.with_suffix(".json").read_text())
    assert {v["lean"] for v in verdicts.values()} == {True} and len(verdicts) == 2
    assert {v["original_ms"] for v in verdicts.values()} == {10.0}
    chosen.unlink()  # removed from the cache: made again on the next use
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == chosen and chosen.is_file() and len(timer.calls) == 3


def test_the_original_is_used_where_the_copy_is_not_clearly_faster(wide_gguf, cache_dir):
    timer = Timer(10.0, 9.5)  # 0.95 of the original's step: not worth the acceptance it may lose
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == wide_gguf
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == wide_gguf and len(timer.calls) == 1


def test_a_file_with_nothing_heavier_is_used_as_it_is_and_nothing_is_written(tmp_path, cache_dir):
    narrow = write_tiny_gguf(tmp_path / "narrow.gguf", ffn=16)
    timer = Timer(10.0, 1.0)
    assert lean_gguf.lean_gguf(narrow, 2, timer=timer) == narrow and timer.calls == []
    assert not cache_dir.exists() or not list(cache_dir.rglob("*narrow*"))


def test_a_changed_source_gets_a_copy_of_its_own(wide_gguf, tmp_path, cache_dir):
    source = tmp_path / "draft.gguf"
    source.write_bytes(wide_gguf.read_bytes())
    first = lean_gguf.lean_path(source)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert lean_gguf.lean_path(source) != first and lean_gguf.lean_path(source).name.startswith("draft-")


def test_step_ms_times_each_file_on_llama_cpp(wide_gguf, tmp_path):
    dest = lean_gguf.write_lean_copy(wide_gguf, tmp_path / "lean.gguf")
    times = lean_gguf.step_ms([wide_gguf, dest], 1, rounds=1)
    assert len(times) == 2 and all(0 < t < 1000 for t in times)


def test_a_built_in_models_lean_copies_count_as_its_cache_files(cache_dir):
    gguf_file = cache_dir / "gguf" / "smollm2-135m-instruct.gguf"
    lean = cache_dir / "gguf" / "lean" / "smollm2-135m-instruct-0123456789ab.q4_0.gguf"
    lean.parent.mkdir(parents=True)
    lean.write_bytes(b"x" * 1000)
    (lean.parent / "smollm2-135m-instruct-extra-0123456789ab.q4_0.gguf").write_bytes(b"y")  # another name: not it
    assert lean in cache.cache_paths("smollm2-135m-instruct") and gguf_file in cache.cache_paths("smollm2-135m-instruct")
    assert cache.model_size("smollm2-135m-instruct") == 1000
    assert cache.remove_model("smollm2-135m-instruct") == 1000 and not lean.exists()


def test_a_draft_on_the_lean_copy_keeps_the_targets_greedy_output(wide_gguf, cache_dir, monkeypatch):
    monkeypatch.setattr(lean_gguf, "step_ms", Timer(10.0, 5.0))
    draft = load_model(str(wide_gguf), backend="llamacpp", threads=1, lean_gguf=True)
    assert lean_gguf.lean_path(wide_gguf).is_file()
    target = LlamaCppBackend(wide_gguf, n_ctx=128, n_threads=1, max_tokens_per_forward=3)
    prompt = [[5, 80, 200, 17, 42, 99]]
    expected = AutoregressiveGenerator(target).generate(prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    result = SpeculativeGenerator(target, draft.model, num_speculative_tokens=3).generate(
        prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    assert result.token_ids == expected.token_ids
    assert result.stats.accepted_tokens > 0  # it did draft, from the copy


@pytest.mark.parametrize("quantize, lean", [("auto", True), ("none", False)])
def test_the_pairs_draft_runs_the_copy_under_draft_quantize_auto_only(wide_gguf, cache_dir, monkeypatch,
                                                                      quantize, lean):
    monkeypatch.setattr(lean_gguf, "step_ms", Timer(10.0, 5.0))
    opts = ModelOptions(target=str(wide_gguf), draft=str(wide_gguf), draft_quantize=quantize, threads=1,
                        backend="llamacpp")
    load_draft_model(opts)
    assert lean_gguf.lean_path(wide_gguf).is_file() == lean


def test_the_lean_size_is_the_copys_size_read_from_the_header(wide_gguf, tmp_path):
    dest = lean_gguf.write_lean_copy(wide_gguf, tmp_path / "lean.gguf")
    assert lean_gguf.lean_size(wide_gguf) == pytest.approx(os.path.getsize(dest), abs=32 * 40)  # padding aside
    narrow = write_tiny_gguf(tmp_path / "narrow.gguf", ffn=16)
    assert lean_gguf.lean_size(narrow) == os.path.getsize(narrow)
    assert lean_gguf.lean_size(tmp_path / "missing.gguf") is None


def test_the_least_draft_step_counts_the_lean_copys_bytes_under_auto(wide_gguf, tmp_path):
    from types import SimpleNamespace

    from specdecode.pairing.draft_timing import FLOOR_SHARE, draft_step_floor

    target = write_tiny_gguf(tmp_path / "target.gguf", hidden=64, ffn=256)
    on_llama_cpp = SimpleNamespace(backend="llamacpp")
    share = FLOOR_SHARE / os.path.getsize(target)
    assert draft_step_floor(on_llama_cpp, str(target), str(wide_gguf)) == pytest.approx(
        share * os.path.getsize(wide_gguf))
    assert draft_step_floor(on_llama_cpp, str(target), str(wide_gguf), lean=True) == pytest.approx(
        share * lean_gguf.lean_size(wide_gguf))
    assert draft_step_floor(SimpleNamespace(backend="transformers"), str(target), str(wide_gguf), lean=True) is None


def test_a_type_gguf_py_does_not_know_is_left_as_it_is(wide_gguf, monkeypatch):
    header = gguf_tensors(wide_gguf)
    unknown = [(name, dims, 999 if name == "output.weight" else kind) for name, dims, kind in header]
    monkeypatch.setattr(lean_gguf, "gguf_tensors", lambda path: unknown)
    assert set(lean_gguf.heavier_tensors(wide_gguf)) == MATRICES - {"output.weight"}
    assert lean_gguf.lean_size(wide_gguf) > 0

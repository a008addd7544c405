"""The lean copy of a GGUF draft (specdecode.models.lean_gguf): heavier matrices re-quantized to Q4_0, the rest byte
for byte, used only where it steps faster on this machine, made and timed once; and a draft that runs it keeps the
output exactly the target's (greedy: token for token)."""

from __future__ import annotations

import errno
import json
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from test_registry import write_tiny_gguf  # noqa: E402

from specdecode import AutoregressiveGenerator, SpeculativeGenerator  # noqa: E402
from specdecode.backends.llamacpp import LlamaCppBackend  # noqa: E402
from specdecode.errors import OptionError  # noqa: E402
from specdecode.models import cache, lean_gguf  # noqa: E402
from specdecode.models.gguf_header import gguf_tensors  # noqa: E402
from specdecode.models.machine import usable_cores  # noqa: E402
from specdecode.pairing.loading import load_model  # noqa: E402
from specdecode.pairing.pair import ModelOptions, check_options, load_draft, load_draft_model  # noqa: E402

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
    verdicts = json.loads(chosen.with_suffix(".json").read_text())["verdicts"]
    assert {v["lean"] for v in verdicts.values()} == {True} and len(verdicts) == 2
    assert {v["original_ms"] for v in verdicts.values()} == {10.0}
    chosen.unlink()  # removed from the cache: made again on the next use
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == chosen and chosen.is_file() and len(timer.calls) == 3


def test_a_copy_that_does_not_pay_is_deleted_and_its_verdict_kept(wide_gguf, cache_dir):
    timer = Timer(10.0, 9.5)  # 0.95 of the original's step: not worth the acceptance it may lose
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == wide_gguf
    assert not lean_gguf.lean_path(wide_gguf).exists()  # 0 bytes of copy kept...
    record = json.loads(lean_gguf.record_path(wide_gguf).read_text())
    assert [v["lean"] for v in record["verdicts"].values()] == [False] and "copy_bytes" not in record
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=timer) == wide_gguf and len(timer.calls) == 1  # ...nor re-made
    assert sorted(p.name for p in lean_gguf.lean_dir().iterdir() if not p.name.startswith(".")) == [
        lean_gguf.record_path(wide_gguf).name]


def test_a_copy_that_pays_at_one_thread_count_stays_for_it(wide_gguf, cache_dir):
    assert lean_gguf.lean_gguf(wide_gguf, 1, timer=Timer(10.0, 5.0)) == lean_gguf.lean_path(wide_gguf)
    assert lean_gguf.lean_gguf(wide_gguf, 2, timer=Timer(10.0, 9.9)) == wide_gguf
    assert lean_gguf.lean_path(wide_gguf).is_file()  # still used at 1 thread
    timer = Timer(10.0, 5.0)
    assert lean_gguf.lean_gguf(wide_gguf, 1, timer=timer) == lean_gguf.lean_path(wide_gguf) and not timer.calls


def test_a_file_with_nothing_heavier_is_used_as_it_is_and_nothing_is_written(tmp_path, cache_dir):
    narrow = write_tiny_gguf(tmp_path / "narrow.gguf", ffn=16)
    timer = Timer(10.0, 1.0)
    assert lean_gguf.lean_gguf(narrow, 2, timer=timer) == narrow and timer.calls == []
    assert not cache_dir.exists() or not list(cache_dir.rglob("*narrow*"))


def test_a_changed_source_replaces_its_copy(wide_gguf, tmp_path, cache_dir):
    source = tmp_path / "draft.gguf"
    source.write_bytes(wide_gguf.read_bytes())
    timer = Timer(10.0, 5.0)
    first = lean_gguf.lean_gguf(source, 2, timer=timer)
    legacy = lean_gguf.lean_dir() / "draft-0123456789ab.q4_0.gguf"  # named by size and time, as before records
    legacy.write_bytes(b"x" * 100)
    legacy.with_suffix(".json").write_text(json.dumps({"cpu | threads=all": {"lean": True}}))
    for step in (1, 2):
        os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + step * 10**9))
        assert lean_gguf.lean_gguf(source, 2, timer=timer) == first and len(timer.calls) == 1 + step
    assert sorted(p.name for p in lean_gguf.lean_dir().iterdir() if not p.name.startswith(".")) == [
        first.name, first.with_suffix(".json").name]  # one copy, its record, nothing else
    assert json.loads(first.with_suffix(".json").read_text())["source_mtime_ns"] == source.stat().st_mtime_ns


def test_the_copy_of_a_source_that_is_gone_goes_when_another_copy_is_made(wide_gguf, tmp_path, cache_dir):
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(wide_gguf.read_bytes())
    lean_gguf.lean_gguf(gone, 2, timer=Timer(10.0, 5.0))
    gone.unlink()
    lean_gguf.lean_gguf(wide_gguf, 2, timer=Timer(10.0, 5.0))
    assert [c.source for c in lean_gguf.list_copies()] == [str(wide_gguf.resolve())]


def test_step_ms_times_each_file_on_llama_cpp(wide_gguf, tmp_path):
    dest = lean_gguf.write_lean_copy(wide_gguf, tmp_path / "lean.gguf")
    times = lean_gguf.step_ms([wide_gguf, dest], 1, rounds=1)
    assert len(times) == 2 and all(0 < t < 1000 for t in times)


def test_a_built_in_models_lean_copies_count_as_its_cache_files(wide_gguf, cache_dir):
    gguf_file = cache_dir / "gguf" / "smollm2-135m-instruct.gguf"
    gguf_file.parent.mkdir(parents=True)
    gguf_file.write_bytes(wide_gguf.read_bytes())
    lean = lean_gguf.lean_gguf(gguf_file, 2, timer=Timer(10.0, 5.0))
    legacy = lean.parent / "smollm2-135m-instruct-0123456789ab.q4_0.gguf"  # an earlier version's, never used
    legacy.write_bytes(b"x" * 1000)
    (lean.parent / "smollm2-135m-instruct-extra-0123456789ab.q4_0.gguf").write_bytes(b"y")  # another name: not it
    paths = cache.cache_paths("smollm2-135m-instruct")
    assert {lean, lean.with_suffix(".json"), legacy, gguf_file} <= set(paths)
    size = cache.model_size("smollm2-135m-instruct")
    assert size >= os.path.getsize(gguf_file) + os.path.getsize(lean) + 1000
    assert cache.remove_model("smollm2-135m-instruct") == size and not lean.exists() and not legacy.exists()
    assert not lean.with_suffix(".json").exists()


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


# ---------------------------------------------------------------------------------------------- failures fall back
def _lean_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "specdecode.lean_gguf" and r.levelno >= logging.WARNING]


@pytest.fixture
def unwritable_cache(tmp_path, monkeypatch):
    """A cache nothing can be written to: read-only, or under a plain file where permissions do not stop root."""
    root = tmp_path / "cache"
    if os.geteuid() == 0:
        (tmp_path / "a-file").write_text("")
        root = tmp_path / "a-file" / "cache"
    else:
        root.mkdir()
        root.chmod(0o555)
    monkeypatch.setenv("SPECDECODE_CACHE", str(root))
    yield root
    if root.is_dir():
        root.chmod(0o755)


def test_an_unwritable_cache_drafts_on_the_original_with_one_warning(wide_gguf, unwritable_cache, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(lean_gguf, "step_ms", Timer(10.0, 5.0))
    draft = load_model(str(wide_gguf), backend="llamacpp", threads=1, lean_gguf=True)
    assert draft.model.gguf_path == wide_gguf
    [warning] = _lean_warnings(caplog)
    assert f"runs {wide_gguf} as it is" in warning
    assert "Not a directory" in warning or "Permission denied" in warning or "Read-only" in warning


def _no_room(path):
    return SimpleNamespace(free=1000)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("failure, why", [("write", "No space left on device"), ("room", "MB needed for the copy"),
                                          ("type", "ggml type(s) 999 that gguf-py cannot read")])
def test_a_copy_that_cannot_be_made_leaves_the_original_and_no_file(wide_gguf, cache_dir, monkeypatch, caplog,
                                                                    failure, why):
    if failure == "write":  # the disk fills while the copy is written
        monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", _disk_full)
    elif failure == "room":
        monkeypatch.setattr(lean_gguf.shutil, "disk_usage", _no_room)
    else:  # a type a newer llama.cpp has: gguf-py cannot even read the file
        header = gguf_tensors(wide_gguf)
        monkeypatch.setattr(lean_gguf, "gguf_tensors", lambda path: [
            (name, dims, 999 if name == "output.weight" else kind) for name, dims, kind in header])
    timer = Timer(10.0, 5.0)
    monkeypatch.setattr(lean_gguf, "step_ms", timer)
    draft = load_model(str(wide_gguf), backend="llamacpp", threads=1, lean_gguf=True)
    assert draft.model.gguf_path == wide_gguf and timer.calls == []
    [warning] = _lean_warnings(caplog)
    assert why in warning
    left = lean_gguf.lean_dir()
    assert not left.exists() or [p.name for p in left.iterdir() if not p.name.endswith(".lock")] == []


def test_a_copy_llama_cpp_cannot_load_is_dropped_for_the_original(wide_gguf, cache_dir, monkeypatch, caplog):
    timer = Timer(10.0, 5.0)
    monkeypatch.setattr(lean_gguf, "step_ms", timer)
    copy = lean_gguf.lean_gguf(wide_gguf, 1)
    copy.write_bytes(b"\0" * copy.stat().st_size)  # its size as recorded: only loading tells
    draft = load_model(str(wide_gguf), backend="llamacpp", threads=1, lean_gguf=True)
    assert draft.model.gguf_path == wide_gguf and not copy.exists()
    [warning] = _lean_warnings(caplog)
    assert f"runs {wide_gguf} as it is" in warning
    again = load_model(str(wide_gguf), backend="llamacpp", threads=1, lean_gguf=True)
    assert again.model.gguf_path == wide_gguf and len(timer.calls) == 1 and len(_lean_warnings(caplog)) == 1


# ---------------------------------------------------------------------------------------------- threads, flags, bench
@pytest.mark.parametrize("threads", [None, 1])
def test_the_copy_is_timed_at_the_threads_the_draft_runs_with(wide_gguf, cache_dir, monkeypatch, threads):
    timer = Timer(10.0, 5.0)
    monkeypatch.setattr(lean_gguf, "step_ms", timer)
    draft = load_model(str(wide_gguf), backend="llamacpp", threads=threads, lean_gguf=True)
    assert draft.model.gguf_path == lean_gguf.lean_path(wide_gguf)
    assert [t for _, t in timer.calls] == [llama_cpp.llama_n_threads(draft.model._shared.ctx)]
    assert lean_gguf.lean_gguf(wide_gguf, None, timer=timer) and timer.calls[-1][1] == usable_cores()


def test_step_ms_runs_llama_cpp_at_the_threads_given(wide_gguf, tmp_path, monkeypatch):
    made = []

    class Recording(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            made.append((kwargs["n_threads"], kwargs["n_threads_batch"]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(llama_cpp, "Llama", Recording)
    lean_gguf.step_ms([wide_gguf, wide_gguf], 1, rounds=1)
    assert made == [(1, 1), (1, 1)]


@pytest.mark.parametrize("value", ["int8", "int4"])
@pytest.mark.parametrize("backend", ["llamacpp", "auto"])
def test_a_torch_quantization_of_a_gguf_draft_on_llama_cpp_is_refused(wide_gguf, value, backend):
    opts = ModelOptions(target=str(wide_gguf), draft=str(wide_gguf), draft_quantize=value, backend=backend)
    with pytest.raises(OptionError) as refused:
        check_options(opts)
    assert refused.value.option == "draft_quantize"
    assert str(refused.value).startswith(f"draft_quantize {value} ") and "llama.cpp backend" in str(refused.value)
    assert "use auto" in str(refused.value) and "none" in str(refused.value)
    check_options(ModelOptions(target=str(wide_gguf), draft=str(wide_gguf), draft_quantize=value,
                               backend="transformers"))  # torch quantizes it there


def test_the_cli_names_the_flag_it_refuses(wide_gguf):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    result = CliRunner().invoke(app, ["generate", "x", "--target", str(wide_gguf), "--draft", str(wide_gguf),
                                      "--draft-quantize", "int8", "--backend", "llamacpp"])
    assert result.exit_code != 0 and "--draft-quantize int8" in result.output and "llama.cpp" in result.output


@pytest.mark.parametrize("draft, quantize, lean", [("{}", "auto", True), ("suffix+{}", "auto", True),
                                                   ("{}", "none", False)])
def test_the_bench_peers_draft_on_the_file_ours_drafts_on(wide_gguf, cache_dir, monkeypatch, draft, quantize, lean):
    from specdecode.bench.methods.base import LLAMACPP
    from specdecode.bench.peers import file_run, llama_setup
    from specdecode.bench.report import llama_config

    monkeypatch.setattr(lean_gguf, "step_ms", Timer(10.0, 5.0))
    opts = ModelOptions(target=str(wide_gguf), draft=draft.format(wide_gguf), draft_quantize=quantize, threads=1,
                        backend="llamacpp")
    target, ours = load_model(str(wide_gguf), backend="llamacpp", threads=1), load_draft(opts)
    setup = llama_setup(opts, target, ours, ["llama-speculative"], None, sanity=False)
    assert setup.target_gguf == str(wide_gguf)
    assert setup.draft_gguf == str(file_run(ours)) == str(lean_gguf.lean_path(wide_gguf) if lean else wide_gguf)
    said = f"the lean Q4_0 copy of {wide_gguf.resolve()}" if lean else "the file ours drafts on"
    assert setup.draft_gguf_is.endswith(said)
    bench = SimpleNamespace(ctx=SimpleNamespace(llama=setup, llama_binary=None, llama_ctx=256),
                            runners={"llama-speculative": SimpleNamespace(runs_on=LLAMACPP)})
    report = llama_config(bench)
    assert report["draft_gguf"] == setup.draft_gguf and report["draft_gguf_is"] == setup.draft_gguf_is


# ---------------------------------------------------------------------------------------------- specdecode models
def test_models_list_and_remove_see_the_lean_copies_of_user_files(wide_gguf, tmp_path, cache_dir):
    from typer.testing import CliRunner

    from specdecode.cli.app import app

    paying, not_paying = tmp_path / "mine.gguf", tmp_path / "other.gguf"
    for path in (paying, not_paying):
        path.write_bytes(wide_gguf.read_bytes())
    lean_gguf.lean_gguf(paying, 2, timer=Timer(10.0, 5.0))
    lean_gguf.lean_gguf(not_paying, 2, timer=Timer(10.0, 9.9))

    def run(*args):
        return CliRunner().invoke(app, list(args), env={"SPECDECODE_CACHE": str(cache_dir)})

    listed = run("models", "list")
    assert listed.exit_code == 0, listed.output
    assert str(paying.resolve()) in listed.output and str(not_paying.resolve()) in listed.output
    assert "used at 2 threads (5.0 vs 10.0 ms a step)" in listed.output and "copy deleted" in listed.output
    records = {r["source"]: r for r in json.loads(run("models", "list", "--lean", "--json").stdout)}
    assert records[str(paying.resolve())]["copy_kept"] and not records[str(not_paying.resolve())]["copy_kept"]
    assert records[str(paying.resolve())]["bytes"] > os.path.getsize(lean_gguf.lean_path(paying))
    removed = run("models", "remove", "--lean", str(paying))
    assert removed.exit_code == 0 and "freed" in removed.output, removed.output
    assert not lean_gguf.lean_path(paying).exists() and not lean_gguf.record_path(paying).exists()
    assert lean_gguf.record_path(not_paying).exists() and paying.exists()  # another's record, the source: kept
    assert run("models", "remove", "--lean").exit_code == 0 and lean_gguf.list_copies() == []
    assert "no lean draft copy" in run("models", "remove", "--lean").output
    refused = run("models", "remove")
    assert refused.exit_code != 0 and "--lean" in refused.output

"""A built-in model's first use on llama.cpp (models/prepare.py preparing_gguf, models/gguf_header.py): the parts
are joined, then checked and the tokenizer built while the body (llama.cpp's load) runs; a file whose sha256 is
wrong is never kept, nor anything built from it; the tokenizer's fast path builds what transformers' own path
builds."""

from __future__ import annotations

import filecmp
import hashlib
import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_registry import write_tiny_gguf  # noqa: E402

from specdecode.models import catalog, prepare  # noqa: E402
from specdecode.models.catalog import ModelInfo, Part  # noqa: E402
from specdecode.models.gguf_header import gguf_architecture, tokenizer_type_of  # noqa: E402


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A tiny GGUF registered as the built-in model "fake-gguf", split over two part packages: (info, its bytes)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    half = len(data) // 2
    for i, chunk in ((1, data[:half]), (2, data[half:])):
        (tmp_path / "site" / f"fakegguf_part{i}").mkdir(parents=True)
        (tmp_path / "site" / f"fakegguf_part{i}" / "chunk.bin").write_bytes(chunk)
        (tmp_path / "site" / f"fakegguf_part{i}" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    parts = tuple(Part(f"fakegguf-part{i}", "1.0", f"fakegguf_part{i}", function=None, file="chunk.bin")
                  for i in (1, 2))
    info = catalog.register(ModelInfo("fake-gguf", "", 0, len(data), hashlib.sha256(data).hexdigest(), "fake", parts),
                            replace=True)
    yield info, data
    catalog.unregister("fake-gguf")


def test_the_fast_tokenizer_is_the_one_transformers_builds(tmp_path):
    """Told the tokenizer's type, AutoTokenizer skips rebuilding the model's config through gguf-py (20 s of a
    2-core CPU for Qwen's 152k tokens) and saves the same files, byte for byte."""
    from transformers import AutoTokenizer

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert gguf_architecture(gguf) == "qwen2" and tokenizer_type_of(gguf) == {"tokenizer_type": "qwen2"}
    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name, **tokenizer_type_of(gguf)).save_pretrained(
        tmp_path / "fast")
    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name).save_pretrained(tmp_path / "generic")
    files = sorted(os.listdir(tmp_path / "generic"))
    assert files == sorted(os.listdir(tmp_path / "fast")) and "tokenizer.json" in files
    assert all(filecmp.cmp(tmp_path / "fast" / f, tmp_path / "generic" / f, shallow=False) for f in files)
    (tmp_path / "text.gguf").write_text("not a GGUF")
    assert gguf_architecture(tmp_path / "text.gguf") is None and tokenizer_type_of(tmp_path / "text.gguf") == {}


@pytest.mark.real_models
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def test_the_fast_tokenizer_of_the_built_in_models_is_transformers_own(name, tmp_path):
    from transformers import AutoTokenizer

    gguf, _ = prepare.prepare_gguf(name)
    assert tokenizer_type_of(gguf)  # these take the fast path
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **tokenizer_type_of(gguf)).save_pretrained(
        tmp_path / "fast")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp_path / "generic")
    files = sorted(os.listdir(tmp_path / "generic"))
    assert all(filecmp.cmp(tmp_path / "fast" / f, tmp_path / "generic" / f, shallow=False) for f in files)


def test_a_first_use_checks_the_file_while_the_body_runs(split_model, monkeypatch):
    info, data = split_model
    began, sha256 = threading.Event(), prepare._sha256

    def after_the_body_began(*args, **kwargs):
        assert began.wait(30), "the checksum ran before the body"  # proves the two overlap
        return sha256(*args, **kwargs)

    monkeypatch.setattr(prepare, "_sha256", after_the_body_began)
    with prepare.preparing_gguf("fake-gguf") as prepared:
        assert prepared.path == catalog.gguf_cache_path("fake-gguf") and prepared.path.read_bytes() == data
        assert not prepare._stamp_matches(info, prepared.path)  # not recorded until it is checked
        began.set()
        tokenizer = prepared.tokenizer_dir()
    assert prepare._stamp_matches(info, prepared.path) and (tokenizer / "tokenizer.json").is_file()
    for name in ("_copy_parts", "_sha256", "_extract_tokenizer"):  # the next use costs a stat
        monkeypatch.setattr(prepare, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} again"))
    assert prepare.prepare_gguf("fake-gguf") == (prepared.path, tokenizer)


def test_a_wrong_file_is_never_kept_nor_what_was_built_from_it(split_model):
    import dataclasses

    info, _ = split_model
    catalog.register(dataclasses.replace(info, sha256="0" * 64), replace=True)
    with pytest.raises(prepare.ModelIntegrityError, match="sha256 mismatch for 'fake-gguf'"):
        with prepare.preparing_gguf("fake-gguf") as prepared:
            prepared.tokenizer_dir()  # built from the unchecked file meanwhile
    assert not prepared.path.exists() and not catalog.tokenizer_path("fake-gguf").exists()
    assert not prepare._stamp_path(info).exists()


def test_a_body_that_fails_leaves_nothing_unchecked_behind(split_model):
    info, data = split_model
    with pytest.raises(RuntimeError, match="llama.cpp failed"):
        with prepare.preparing_gguf("fake-gguf") as prepared:
            prepared.tokenizer_dir()
            raise RuntimeError("llama.cpp failed")
    assert not prepare._stamp_matches(info, prepared.path) and not catalog.tokenizer_path("fake-gguf").exists()
    assert prepare.prepare_gguf("fake-gguf")[0].read_bytes() == data  # the next use prepares it again


def test_wrong_sizes_are_refused_before_any_work(split_model, monkeypatch):
    import dataclasses

    info, data = split_model
    catalog.register(dataclasses.replace(info, size=len(data) + 1), replace=True)
    monkeypatch.setattr(prepare, "_copy_parts", lambda *a, **k: pytest.fail("joined"))
    with pytest.raises(prepare.ModelIntegrityError, match="the parts add up to"):
        prepare.prepare_gguf("fake-gguf")


def test_joining_without_copy_file_range(split_model, monkeypatch):
    def unsupported(*args):
        raise OSError("not on this file system")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    info, data = split_model
    assert prepare.prepare_gguf("fake-gguf")[0].read_bytes() == data


def test_load_model_builds_the_tokenizer_beside_the_load(split_model):
    from specdecode import load_model

    loaded = load_model("fake-gguf", backend="llamacpp", threads=1, progress=False, backend_options={"n_ctx": 64})
    assert loaded.backend == "llamacpp" and loaded.tokenizer is not None and loaded.tokenizer("Ġt")["input_ids"]
    assert prepare._stamp_matches(split_model[0], catalog.gguf_cache_path("fake-gguf"))

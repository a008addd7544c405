"""A built-in model's first check begun before the caller's imports (models/check_ahead.py): the parts are joined and
hashed once, in a background thread, and the load runs while the checksum ends; a wrong file is still never kept nor
anything built from it; an interrupted check leaves no partial file; the CLI begins it only where llama.cpp will
load the model."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_prepare_gguf import split_model  # noqa: E402,F401  (the fixture)

from specdecode.models import catalog, check_ahead, prepare  # noqa: E402
from specdecode.pairing.pair import ModelOptions, check_target_ahead  # noqa: E402


def _counting(monkeypatch, name):
    calls, real = [], getattr(prepare, name)

    def counted(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, name, counted)
    return calls


def test_the_check_ahead_joins_and_hashes_once_and_the_load_finds_the_file_checked(split_model, monkeypatch):
    info, data = split_model
    copies, hashes = _counting(monkeypatch, "_copy_parts"), _counting(monkeypatch, "_sha256")
    assert check_ahead.check_ahead("fake-gguf")
    assert not check_ahead.check_ahead("fake-gguf")  # one at a time
    path, tokenizer = prepare.prepare_gguf("fake-gguf")
    assert path.read_bytes() == data and prepare._stamp_matches(info, path) and (tokenizer / "tokenizer.json").is_file()
    assert copies == hashes == ["specdecode-check-ahead"]  # in the background thread, and only there
    assert "fake-gguf" not in prepare.CHECKS_AHEAD
    assert not check_ahead.check_ahead("fake-gguf")  # checked: nothing to do


def test_the_load_runs_while_the_check_begun_ahead_ends(split_model, monkeypatch):
    info, data = split_model
    began, sha256, hashed_in = threading.Event(), prepare._sha256, []

    def after_the_body_began(*args, **kwargs):
        hashed_in.append(threading.current_thread().name)
        assert began.wait(10), "the load waited for the whole checksum"  # proves the two overlap
        return sha256(*args, **kwargs)

    monkeypatch.setattr(prepare, "_sha256", after_the_body_began)
    assert check_ahead.check_ahead("fake-gguf")
    with prepare.preparing_gguf("fake-gguf") as prepared:
        assert prepared.path.read_bytes() == data  # whole: the copy came first
        assert not prepare._stamp_matches(info, prepared.path)  # not recorded until it is checked
        began.set()
        tokenizer = prepared.tokenizer_dir()
    assert prepare._stamp_matches(info, prepared.path) and (tokenizer / "tokenizer.json").is_file()
    assert hashed_in == ["specdecode-check-ahead"]  # once, by the check begun ahead


def test_a_wrong_file_checked_ahead_is_reported_by_the_load_and_never_kept(split_model):
    info, _ = split_model
    catalog.register(dataclasses.replace(info, sha256="0" * 64), replace=True)
    assert check_ahead.check_ahead("fake-gguf")
    with pytest.raises(prepare.ModelIntegrityError, match="sha256 mismatch for 'fake-gguf'"):
        with prepare.preparing_gguf("fake-gguf") as prepared:
            prepared.tokenizer_dir()
    assert not prepared.path.exists() and not catalog.tokenizer_path("fake-gguf").exists()
    assert not prepare._stamp_path(info).exists()


def test_an_interrupted_check_ahead_leaves_no_partial_file_and_no_stamp(split_model, monkeypatch):
    info, data = split_model
    hashing, real = threading.Event(), prepare._sha256

    def slow_sha256(path, description, progress, stop=None):
        hashing.set()
        assert stop.wait(30)
        return info.sha256  # the right digest, too late: a stopped check records nothing

    monkeypatch.setattr(prepare, "_sha256", slow_sha256)
    assert check_ahead.check_ahead("fake-gguf")
    assert hashing.wait(30)
    prepare.CHECKS_AHEAD.pop("fake-gguf").stop_and_wait()  # what the process's exit does
    assert not prepare._stamp_path(info).exists()
    assert not list(catalog.gguf_cache_path("fake-gguf").parent.glob("*partial*"))
    monkeypatch.setattr(prepare, "_sha256", real)
    assert prepare.prepare_gguf("fake-gguf")[0].read_bytes() == data  # the next use checks it


def test_a_load_that_fails_beside_a_check_begun_ahead_leaves_nothing_unchecked(split_model):
    info, data = split_model
    catalog.register(dataclasses.replace(info, sha256="0" * 64), replace=True)
    assert check_ahead.check_ahead("fake-gguf")
    with pytest.raises(prepare.ModelIntegrityError, match="sha256 mismatch") as raised:
        with prepare.preparing_gguf("fake-gguf") as prepared:
            prepared.tokenizer_dir()
            raise RuntimeError("llama.cpp failed")  # a load failed by a corrupt file is reported as the corruption
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert not prepared.path.exists() and not catalog.tokenizer_path("fake-gguf").exists()


def test_unknown_names_and_models_not_installed_are_left_alone(split_model, monkeypatch):
    assert not check_ahead.check_ahead("no-such-model")
    monkeypatch.setattr(catalog, "missing_modules", lambda info: ["fakegguf_part2"])
    assert not check_ahead.check_ahead("fake-gguf")
    assert not prepare.CHECKS_AHEAD


@pytest.mark.parametrize("options, begun", [
    (dict(backend="llamacpp"), True), (dict(backend="transformers"), False), (dict(device="cuda"), False),
    (dict(device_map="auto"), False)])
def test_the_cli_begins_it_only_where_llama_cpp_loads_the_model(options, begun, monkeypatch):
    seen = []
    monkeypatch.setattr(check_ahead, "check_ahead", seen.append)
    check_target_ahead(ModelOptions(target="qwen2.5-coder-1.5b-instruct", **options))
    assert seen == (["qwen2.5-coder-1.5b-instruct"] if begun else [])

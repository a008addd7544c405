"""Shared fixtures: a small real tokenizer trained here, and tiny random-weight models saved to disk, so the real
loading path (from_pretrained on a local directory with safetensors) is exercised without any download."""

from __future__ import annotations

import copy
import fcntl
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: one thread is fastest, and it keeps the suite fast when something else shares the two cores.
torch.set_num_threads(int(os.environ.get("SPECDECODE_TEST_THREADS", "1")))
if "PYTEST_XDIST_WORKER" in os.environ:
    # pytest-xdist starts its workers with COLUMNS=80 and LINES=24, which the CLI's consoles would keep as their
    # width when imported; a test sets COLUMNS itself where the width matters, as a terminal would.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)

# The suite runs on two workers (pytest-xdist, pyproject's addopts). Tests that share something costly to build or
# that cannot run twice at once are meant to keep to one worker: a file's tests (its module fixtures), the real
# models (loaded once), the Ray tests (one local Ray instance); see the NB in pytest_collection_modifyitems.
SHARED_WORKER = {"test_ray_serve.py": "ray", "test_ray_routing.py": "ray"}
# Tests whose assertions compare measured times (a throughput ratio, a stall limit, a latency bound) run alone: the
# other worker waits between its tests until they end.
ALONE_FILES = {"test_bench_serve.py", "test_ray_serve.py", "test_ray_routing.py", "test_server_load.py",
               "test_server_limits.py", "test_advise.py", "test_draft_auto.py",  # these two time the pair
               # llama.cpp on two threads (the split attention): its threads spin while they wait for each other, so
               # beside another process each step costs several times its own (350 s of the CI's time, 67 s alone)
               "test_llamacpp_split_attention.py", "test_forward_drift.py"}
ALONE_TESTS = {"test_qwen_invoice_walk_is_valid_and_fast",
               "test_proposing_costs_well_under_a_millisecond_per_row_at_a_million_history_tokens",
               "test_invalid_arguments_fail_before_loading"}


# ... of which these files' tests that take no model (arithmetic, a ring of keys) time nothing: they share the
# cores, so the other worker is not drained before each of them (a drain waits for its running test to end).
PURE_ALSO_SHARE = {"test_draft_auto.py", "test_advise.py", "test_ray_routing.py"}
MODEL_FIXTURES = {"tiny_pair", "tokenizer", "tiny_model_dirs", "ray_url", "smol_path"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: xdist's worker hook turns each item's xdist_group mark into its nodeid's "@group" suffix (how
    # --dist loadgroup tells the groups), so the marks must be there before it runs. pytest 9.2 keeps the nodeid
    # elsewhere than that hook writes it (xdist 3.8), which dropped every group: pyproject pins pytest below 9.2.
    for item in items:
        real = item.get_closest_marker("real_models") is not None
        group = "real-models" if real else SHARED_WORKER.get(item.path.name, item.path.name)
        item.add_marker(pytest.mark.xdist_group(group))
        pure = item.path.name in PURE_ALSO_SHARE and not MODEL_FIXTURES & set(item.fixturenames)
        if (item.path.name in ALONE_FILES and not pure) or item.originalname in ALONE_TESTS:
            item.add_marker(pytest.mark.alone)


_HELD_ALONE = []  # the cores lock's file while this worker keeps it exclusive from one `alone` test to the next


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    item.next_is_alone = nextitem is not None and nextitem.get_closest_marker("alone") is not None


@pytest.fixture(autouse=True)
def _share_the_cores(request, tmp_path_factory):
    """A shared lock for every test, an exclusive one for a test marked `alone`; the turnstile keeps a waiting
    exclusive test from being starved by the other worker's stream of shared ones. An exclusive lock is kept from
    an `alone` test to the next one on this worker: taking it again would first wait for whatever test the other
    worker started meanwhile (up to minutes), with this worker idle."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    keep = alone and getattr(request.node, "next_is_alone", False)
    if alone and _HELD_ALONE:
        cores = _HELD_ALONE.pop()
    else:
        root = tmp_path_factory.getbasetemp().parent
        cores = open(root / "cores.lock", "a")
        with open(root / "turnstile.lock", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if keep:
            _HELD_ALONE.append(cores)
        else:
            fcntl.flock(cores, fcntl.LOCK_UN)
            cores.close()


@pytest.fixture(scope="session", autouse=True)
def _suite_costs(tmp_path_factory):
    """The costs the CLI times and records (costs.json) go to the suite's own file, not the user's: a test's models
    never land in the user's record, and no test reads what the user's machine recorded (a record there changes what
    `--draft auto` and `-k auto` do). Set before any module's fixtures, so the servers they start inherit it."""
    previous = os.environ.get("SPECDECODE_COSTS")
    os.environ["SPECDECODE_COSTS"] = str(tmp_path_factory.mktemp("costs") / "costs.json")
    yield
    if previous is None:
        os.environ.pop("SPECDECODE_COSTS", None)
    else:
        os.environ["SPECDECODE_COSTS"] = previous


@pytest.fixture(autouse=True)
def _own_costs(monkeypatch, tmp_path_factory):
    """Each test starts with nothing recorded: what another test timed must not decide this one's draft or K."""
    monkeypatch.setenv("SPECDECODE_COSTS", str(tmp_path_factory.mktemp("costs") / "costs.json"))


CORPUS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "    left = [x for x in arr if x < pivot]\n    return quicksort(left) + middle + quicksort(right)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding keeps the target distribution.\n",
    "import numpy as np\nfor i in range(10):\n    print(i, i * i)\nclass Model:\n    pass\n",
    "Once upon a time there was a small model and a large model; they wrote text together.\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained here on a tiny corpus: real merges, real decoding, ~300 tokens.

    It is a Qwen2Tokenizer (vocab + merges) because transformers 5 rebuilds a saved tokenizer with the class
    that config.json's model_type implies; any other class would reload as a different tokenizer.
    """
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = {t: i for t, i in model["vocab"].items() if t not in specials}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                         unk_token=None, bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen(vocab_size: int, seed: int, layers: int = 2, hidden: int = 64, eos_token_id: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    # Random weights give near-uniform next-token distributions; a larger output layer makes them peaked like a
    # trained model's, so drafts are sometimes accepted and sometimes not.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def perturbed_copy(model, scale: float, seed: int):
    """A draft that resembles the target (acceptance well between 0 and 1) but is a different model."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return draft


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(tokenizer):
    """(target, draft) transformers models sharing the tiny tokenizer's vocabulary."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    target = tiny_qwen(len(tokenizer), seed=0, eos_token_id=eos)
    draft = perturbed_copy(target, 0.3, seed=1)
    return target, draft


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tokenizer, tiny_pair):
    """Directories {"target": path, "draft": path} saved with save_pretrained (safetensors + tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in zip(("target", "draft"), tiny_pair):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="session")
def smol_path():
    """The SmolLM2-135M GGUF (a real llama.cpp model, from the `[test]` extra's weights package)."""
    pytest.importorskip("llama_cpp")
    from specdecode.models import catalog

    info = catalog.get_model_info("smollm2-135m-instruct")
    if not info.installed:
        pytest.skip(f"needs the SmolLM2 GGUF package: {info.pip_command}")
    return catalog.part_path(info.parts[0], info)

"""torch beside llama.cpp (backends/openmp.py): where every model runs on llama.cpp, torch is single-threaded, so a
torch op in another thread (a server's worker threads) starts no OpenMP team of its own, whose threads would make
libgomp put llama.cpp's barriers to sleep for the process's life. Where a torch model computes, torch keeps its
threads."""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("llama_cpp")

from test_registry import write_tiny_gguf  # noqa: E402

from specdecode import SpeculativeGenerator, SuffixDrafter  # noqa: E402
from specdecode.backends.llamacpp import LlamaCppBackend  # noqa: E402
from specdecode.backends.openmp import computing_backends, single_threaded_torch_beside_llamacpp  # noqa: E402
from specdecode.engine.generators import AutoregressiveGenerator  # noqa: E402

VOCAB_SIZED = 152_064  # the default target's vocabulary: a mask over it is a parallel op at torch's grain size
THREADS = 2


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(autouse=True)
def torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def _native_threads_a_vocabulary_op_starts() -> int:
    """Native threads this process gains while a fresh thread runs one vocabulary-sized torch op (an OpenMP team's
    threads live as long as the thread that started it)."""
    counts = []

    def work():
        before = set(os.listdir("/proc/self/task"))
        torch.zeros(VOCAB_SIZED, dtype=torch.bool).fill_(True)
        counts.append(len(set(os.listdir("/proc/self/task")) - before))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return counts[0]


def test_only_llamacpp_models_make_torch_single_threaded(tiny_gguf):
    generator = SpeculativeGenerator(LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1), SuffixDrafter(),
                                     num_speculative_tokens=4)
    # the suffix drafter runs no model
    assert computing_backends(generator.target, generator.drafter) == [generator.target]
    assert single_threaded_torch_beside_llamacpp(generator.target, generator.drafter) is True
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < THREADS,
                    reason="counts a process's native threads in /proc, with 2 or more CPUs")
def test_a_torch_op_in_another_thread_starts_no_team_once_single_threaded(tiny_gguf):
    assert _native_threads_a_vocabulary_op_starts() >= 1  # with 2 threads torch starts a team there: the harm
    assert single_threaded_torch_beside_llamacpp(LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1)) is True
    assert _native_threads_a_vocabulary_op_starts() == 0


def test_a_torch_model_keeps_torchs_threads(tiny_gguf, tiny_pair):
    target, draft = tiny_pair
    plain = AutoregressiveGenerator(target)
    assert single_threaded_torch_beside_llamacpp(plain.target, plain.drafter) is False
    llama = LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1)
    mixed = SpeculativeGenerator(llama, draft, num_speculative_tokens=2, vocab_size=llama.vocab_size)
    assert len(computing_backends(mixed.target, mixed.drafter)) == 2  # the draft's transformers backend computes too
    assert single_threaded_torch_beside_llamacpp(mixed.target, mixed.drafter) is False
    assert torch.get_num_threads() == THREADS


def test_the_server_applies_it_before_any_request(tiny_gguf, tokenizer):
    from specdecode.server import create_app

    create_app(AutoregressiveGenerator(LlamaCppBackend(tiny_gguf, n_ctx=64, n_threads=1, max_rows=2)), "tiny",
               tokenizer)
    assert torch.get_num_threads() == 1

"""Huge pages under llama.cpp's memory (backends/huge_pages.py): fully resident 2 MiB chunks are collapsed into huge
pages, sparse ones are left alone (the process must not grow), the bytes never change, and a model's logits are
bit-identical with and without them."""

import ctypes
import mmap
import time

import numpy as np
import pytest
import torch

from specdecode.backends import huge_pages
from specdecode.backends.huge_pages import HUGE_PAGE, HugePages, huge_page_bytes

from test_registry import write_tiny_gguf


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE = 0  # <sys/mman.h>; the mmap module has only PROT_READ and PROT_WRITE


def _buffer(chunks: int):
    """An anonymous private mapping of `chunks` huge pages, huge-page aligned and a mapping of its own, as (mmap,
    numpy view, start, end). Guard pages on both sides keep the kernel from merging it with a neighbouring mapping of
    the same flags: smaps reports huge pages per mapping, and a merged one reaches outside [start, end)."""
    size = (chunks + 2) * HUGE_PAGE
    raw = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    start = -(-(base + mmap.PAGESIZE) // HUGE_PAGE) * HUGE_PAGE
    end = start + chunks * HUGE_PAGE
    for low, high in ((base, start), (end, base + size)):
        assert _libc.mprotect(low, high - low, PROT_NONE) == 0, ctypes.get_errno()
    view = np.frombuffer(raw, dtype=np.uint8)[start - base:end - base]
    return raw, view, start, end


def _collapses() -> bool:
    """Whether this kernel collapses memory into huge pages on request (THP on, Linux 6.1+ MADV_COLLAPSE)."""
    if not huge_pages.available():
        return False
    raw, view, start, end = _buffer(1)
    view[:] = 1
    pages = HugePages([(start, end)])
    pages.wait()
    return pages.collapsed == 1


needs_collapse = pytest.mark.skipif(not _collapses(), reason="this kernel does not collapse memory into huge pages "
                                                              "(THP off, or older than Linux 6.1)")


@needs_collapse
def test_resident_chunks_are_collapsed_and_keep_their_bytes():
    raw, view, start, end = _buffer(4)
    view[:] = np.random.default_rng(0).integers(0, 256, len(view), dtype=np.uint8)
    before = view.copy()
    assert huge_page_bytes(start, end) == 0
    pages = HugePages([(start, end)])
    assert pages.wait(60)
    assert pages.collapsed == pages.chunks == 4
    assert huge_page_bytes(start, end) == 4 * HUGE_PAGE
    assert np.array_equal(view, before)


@needs_collapse
def test_a_chunk_not_all_in_memory_is_left_alone():
    raw, view, start, end = _buffer(2)
    view[:HUGE_PAGE] = 7  # the first chunk whole
    view[HUGE_PAGE:HUGE_PAGE + 4096] = 7  # one page of the second
    pages = HugePages([(start, end)])
    pages.wait(60)
    assert pages.collapsed == 1
    assert huge_page_bytes(start, end) == HUGE_PAGE


def test_nothing_is_done_where_the_kernel_gives_no_huge_pages(monkeypatch, tmp_path):
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", never)
    assert not huge_pages.available()
    assert HugePages.since({}).chunks == 0


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    # float32 feed-forward matrices of 8 MiB each, ~50 MiB in all: llama.cpp reads them into a buffer of its own,
    # which the C library maps afresh (over its 32 MiB limit for reusing freed heap memory), as it does a real
    # model's; a small one can land in memory the process had already, which is not looked at
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "wide.gguf", hidden=512, ffn=4096)


def _logits(path, huge: bool):
    from specdecode.backends.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(path, n_ctx=64, n_threads=1, huge_pages=huge)
    assert backend.huge_pages.wait(60)
    backend.reset(1)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 4, 8]])
    return backend, backend.forward(ids), backend.forward(torch.tensor([[3, 6]]))


def test_a_model_in_huge_pages_gives_bit_identical_logits(wide_gguf):
    pytest.importorskip("llama_cpp")
    huge, prefill, step = _logits(wide_gguf, True)
    plain, prefill_plain, step_plain = _logits(wide_gguf, False)
    assert torch.equal(prefill, prefill_plain) and torch.equal(step, step_plain)
    assert plain.huge_pages.chunks == 0
    if _collapses():  # the weights' memory was found and collapsed
        assert huge.huge_pages.collapsed >= 3
        assert sum(huge_page_bytes(a, b) for a, b in huge.huge_pages.regions) >= 3 * HUGE_PAGE


def test_memory_a_region_grew_by_is_found_and_only_that(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    before = {(0x10_000_000, 0x10_400_000): 0, (0x20_400_000, 0x20_800_000): 0, (0x30_000_000, 0x30_200_000): 0}
    now = {(0x10_000_000, 0x10_c00_000): 0,  # grew at its end (the heap)
           (0x20_000_000, 0x20_800_000): 0,  # a new mapping merged below an old one
           (0x30_000_000, 0x30_200_000): 0,  # unchanged
           (0x40_000_000, 0x40_400_000): 0,  # new
           (0x50_000_000, 0x52_000_000): 0}  # unchanged, but as large as a model's buffers (a freed one's place)
    before[(0x50_000_000, 0x52_000_000)] = 0
    monkeypatch.setattr(huge_pages, "anonymous_regions", lambda: now)
    pages = HugePages.since(before)
    pages.stop()
    assert pages.regions == [(0x10_400_000, 0x10_c00_000), (0x20_000_000, 0x20_400_000), (0x40_000_000, 0x40_400_000),
                             (0x50_000_000, 0x52_000_000)]


@needs_collapse
def test_no_chunk_is_collapsed_while_paused_and_the_rest_after():
    """--draft auto times the target right after its load (draft_timing.measure_costs): the collapse waits."""
    raw, view, start, end = _buffer(256)  # 512 MiB: far more than is collapsed before the pause, even on a busy CPU
    view[:] = 3
    pages = HugePages([(start, end)])
    with huge_pages.paused(pages):
        assert pages.wait_held(60)  # a chunk begun before the pause is finished first (slow on a busy CPU: nice 19)
        during = pages.collapsed
        time.sleep(0.5)
        assert pages.collapsed == during < pages.chunks
    assert pages.wait(60) and pages.collapsed == pages.chunks == 256


def test_a_server_collapses_only_while_no_request_is_served(tiny_pair, tokenizer):
    """The collapse shares the CPUs and page tables with the forwards: the server pauses it while a request runs
    (a first request's prefill was slowed by it) and lets it go on once idle."""
    import httpx

    from test_server_helpers import MODEL, serve_slow

    class Recorded(HugePages):
        def __init__(self):
            super().__init__([])
            self.calls = []

        def pause(self):
            self.calls.append("pause")

        def resume(self):
            self.calls.append("resume")

    pages = Recorded()
    model = tiny_pair[0]
    model.huge_pages = pages  # where collapses_of looks (a backend's or its model's huge_pages)
    try:
        with serve_slow(tiny_pair, tokenizer, 0.05) as server:
            for _ in range(2):
                reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                   json={"model": MODEL, "prompt": "a b c", "max_tokens": 4})
                assert reply.status_code == 200
                assert "pause" in pages.calls and wait_until_resumed(pages)
    finally:
        del model.huge_pages
    assert pages.calls == ["pause", "resume", "pause", "resume"]


def wait_until_resumed(pages, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while pages.calls[-1] != "resume" and time.monotonic() < deadline:
        time.sleep(0.01)
    return pages.calls[-1] == "resume"

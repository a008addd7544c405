"""Transparent huge pages under a model's weights: the same kernels on the same bytes, fewer TLB misses.

A decoding step streams every weight once. llama.cpp reads the GGUF into (or repacks it into) anonymous memory of 4 KiB
pages, and where the kernel's transparent huge pages are "madvise" (the common default) it never asks for 2 MiB
ones, so a 1 GB model is ~250k pages whose translations the TLB cannot hold. Measured on a 2-core AMD EPYC (AVX-512),
Qwen2.5-Coder 1.5B Q4_K_M, 2 threads: llama_decode 22.4 ms a token with the weights collapsed into huge pages
against 24.3 ms without (medians of 6 interleaved runs; the outputs are bit-identical: only the page size changes).

After a model loads, the anonymous memory it added (weights, KV cache, compute buffers; and any anonymous region of
32 MiB or more, since a buffer mapped where a freed one was shows no change) is marked MADV_HUGEPAGE and
collapsed in place with MADV_COLLAPSE (Linux 6.1+), 2 MiB at a time, in a background thread at the lowest CPU
priority: copying ~1.2 GB into huge pages takes 1.5-3 s of CPU, which a one-off generation should not wait for, and
decoding speeds up as chunks are done. Only chunks whose every page is resident are collapsed (mincore): a huge
page is allocated whole, so collapsing a sparse chunk (a KV cache not yet filled) would grow the process. Anything
unavailable (another OS, THP "never", an old kernel) makes this a no-op; nothing is ever required of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
LARGE = 32 << 20  # the C library maps a buffer this large afresh (glibc's largest mmap threshold): a model's are


def available() -> bool:
    """Whether this kernel gives huge pages to memory that asks for them (THP "always" or "madvise")."""
    try:
        return "[never]" not in THP_ENABLED.read_text()
    except OSError:
        return False


def anonymous_regions() -> dict[tuple[int, int], int]:
    """(start, end) -> resident bytes of this process's private, writable, anonymous mappings of at least a huge
    page, the heap included (from /proc/self/smaps); empty where there is none to read."""
    regions, current = {}, None
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            low, high = (int(x, 16) for x in head[0].split("-"))
            anonymous = (len(head) == 5 or head[5] == "[heap]") and head[1].startswith("rw") and head[1].endswith("p")
            current = (low, high) if anonymous and high - low >= HUGE_PAGE else None
        elif current is not None and head and head[0] == "Rss:":
            regions[current] = int(head[1]) * 1024
    return regions


def huge_page_bytes(start: int, end: int) -> int:
    """Bytes of [start, end) backed by anonymous huge pages (AnonHugePages of the mappings inside it)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            low, high = (int(x, 16) for x in head[0].split("-"))
            inside = low >= start and high <= end
        elif inside and head and head[0] == "AnonHugePages:":
            total += int(head[1]) * 1024
    return total


class HugePages:
    """Collapses regions into huge pages in a background thread; wait() for it, stop() to end it early."""

    def __init__(self, regions: list[tuple[int, int]]):
        self.regions = [(_up(low), _down(high)) for low, high in regions if _down(high) > _up(low)]
        self.chunks = sum((high - low) // HUGE_PAGE for low, high in self.regions)
        self.collapsed = 0  # chunks now in huge pages
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared while paused()
        self._go.set()
        self._held = threading.Event()  # set while the thread waits out a pause
        self._thread = None
        if self.regions:
            self._thread = threading.Thread(target=self._run, name="specdecode-huge-pages", daemon=True)
            self._thread.start()

    @classmethod
    def since(cls, before: dict[tuple[int, int], int]) -> "HugePages":
        """For the anonymous memory mapped since `before` (anonymous_regions()): new regions, and what a region
        grew by (the heap grows at its end; a new mapping next to an old one can merge into it at either end); and
        every region of at least LARGE bytes, where a model's buffers always are: a buffer mapped where a freed one
        was looks like no change at all."""
        if not available():
            return cls([])
        ends = {start: end for start, end in before}
        starts = {end: start for start, end in before}
        ranges, now = [], anonymous_regions()  # one reading of the map: two could see different processes
        for start, end in now:
            if start in ends:
                ranges.append((max(start, ends[start]), end))
            elif end in starts:
                ranges.append((start, min(end, starts[end])))
            else:
                ranges.append((start, end))
        ranges += [(start, end) for start, end in now if end - start >= LARGE]
        return cls(_merged([(low, high) for low, high in ranges if high > low]))

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the collapse is over (after waiting at most timeout seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()

    def pause(self) -> None:
        """No chunk is begun until resume() (one being collapsed finishes: 2 MiB)."""
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def wait_held(self, timeout: float | None = None) -> bool:
        """Whether the thread is held by a pause (or has ended), after waiting at most timeout seconds for it to
        finish the chunk it was collapsing."""
        if self._thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._held.wait(0.05):
            if not self._thread.is_alive():
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # on Linux a thread's own niceness
        except (AttributeError, OSError):
            pass
        calls = _libc()
        if calls is None:
            return
        madvise, mincore = calls
        pages = (ctypes.c_ubyte * (HUGE_PAGE // os.sysconf("SC_PAGE_SIZE")))()
        for low, high in self.regions:
            for chunk in range(low, high, HUGE_PAGE):
                if not self._go.is_set():
                    self._held.set()
                    self._go.wait()
                    self._held.clear()
                if self._stop.is_set():
                    return
                if mincore(chunk, HUGE_PAGE, pages) != 0 or not all(b & 1 for b in pages):
                    continue  # not all in memory: a huge page would add what was never touched
                madvise(chunk, HUGE_PAGE, MADV_HUGEPAGE)  # else a later fault could split it again
                if madvise(chunk, HUGE_PAGE, MADV_COLLAPSE) == 0:
                    self.collapsed += 1


def _libc():
    """(madvise, mincore) from the C library, or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    mincore.argtypes, mincore.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
    return madvise, mincore


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges sorted, overlapping ones joined."""
    out: list[list[int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1]:
            out[-1][1] = max(out[-1][1], high)
        else:
            out.append([low, high])
    return [(low, high) for low, high in out]


def _up(address: int) -> int:
    return -(-address // HUGE_PAGE) * HUGE_PAGE


def _down(address: int) -> int:
    return address // HUGE_PAGE * HUGE_PAGE


def collapses_of(*models) -> list[HugePages]:
    """The collapses of these models' memory (LoadedModels, backends, or HugePages themselves)."""
    found = []
    for model in models:
        pages = model if isinstance(model, HugePages) else getattr(getattr(model, "model", model), "huge_pages", None)
        if isinstance(pages, HugePages):
            found.append(pages)
    return found


def wait_for(*models, timeout: float | None = 120.0) -> None:
    """Wait until these models' memory is collapsed (LoadedModels or backends; those without huge pages pass): a
    benchmark times the steady state, not the first seconds after loading."""
    for pages in collapses_of(*models):
        pages.wait(timeout)


@contextlib.contextmanager
def paused(*models):
    """No collapsing of these models' memory while the block runs (as wait_for takes them). A timing of the step's
    costs right after the load (--draft auto's) must not share the CPUs with it: MADV_COLLAPSE copies pages and
    holds the page tables the forwards read, whatever the thread's priority, and slows a 1-token forward more in
    proportion than a 9-token one. On a 2-core Xeon a first run timed during the collapse read verifying 2 tokens
    at 1.47 steps where quiet runs read 1.8, and loaded the draft model to time it."""
    collapses = collapses_of(*models)
    for pages in collapses:
        pages.pause()
    try:
        yield
    finally:
        for pages in collapses:
            pages.resume()

"""The C allocator under a long-running server (glibc malloc; elsewhere these do nothing): what it holds, and
which blocks it maps on their own.

glibc serves a block below its mmap threshold from a heap, and keeps the space a freed block leaves there; it gives
memory back to the system only where a heap's top is free. Its threshold starts at 128 KiB and rises to the size of
each mapped block freed (up to 32 MiB), so a server that has freed a few large tensors serves every mid-size block
(activations, logits, token lists) from its heaps. Under a long mixed load of the tiny models the free space in
them grew without a bound (20 minutes: 95 -> 365 MiB, RSS 811 -> 997 MiB over the second half, while the memory in
use stayed at 330-430 MiB); with the threshold fixed at 128 KiB it stayed at 5-15 MiB (docs/BENCHMARKS.md, "Memory
under a long soak")."""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    """This process's C library when it is glibc 2.33+ (mallinfo2: every arena summed, no 32-bit wrap); else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def malloc_bytes() -> tuple[int, int]:
    """(bytes in use, bytes free inside malloc's heaps) of this process; (0, 0) where glibc cannot say."""
    libc = _libc()
    if libc is None:
        return 0, 0
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def fix_mmap_threshold(kib: int) -> bool:
    """Allocations of `kib` KiB and more get their own mapping, returned to the system when freed (0: glibc's own
    threshold, left as it is); whether glibc took it. glibc's own starts at 128 KiB and rises to the largest block
    freed so far (up to 32 MiB): a server that frees a few large tensors then serves every mid-size block from its
    heaps, where the space such blocks leave is kept. A fixed threshold also ends that rise."""
    libc = _libc()
    if not kib or libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(kib) * 1024))


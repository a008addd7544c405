"""The C allocator under a long-running server (glibc malloc; elsewhere these do nothing): what it holds, and how
many arenas it may spread a process's heap over.

glibc gives threads their own arenas (up to 8 per core) and keeps the memory freed inside each as free chunks,
returned to the system only where a whole region at a heap's top is free. A server's threads (the engine worker,
the event loop, the thread pool that compiles grammars, torch's) each allocate and free steadily, in sizes that
vary with every request, and the free space inside the arenas grew without a bound: in a 20-minute soak of the
tiny models on 2 cores, RSS 811 -> 997 MiB over the second half while the memory in use stayed at 330-430 MiB and
the free space in malloc's heaps rose 95 -> 365 MiB. With two arenas it stayed at 38-43 MiB (docs/BENCHMARKS.md,
"Memory under a long soak")."""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (malloc.h)
M_ARENA_MAX = -8


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


def limit_arenas(arenas: int) -> bool:
    """At most `arenas` malloc arenas for this process from now on (0: glibc's own limit, left as it is); whether
    glibc took it. Called before the server's threads start, it bounds them all (an arena is never given back,
    and threads that come later share those there are)."""
    libc = _libc()
    if not arenas or libc is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, int(arenas)))


def fix_mmap_threshold(kib: int) -> bool:
    """Allocations of `kib` KiB and more get their own mapping, returned to the system when freed (0: glibc's own
    threshold, left as it is); whether glibc took it. glibc's own starts at 128 KiB and rises to the largest block
    freed so far (up to 32 MiB): a server that frees a few large tensors then serves every mid-size block from its
    heaps, where the space such blocks leave is kept. A fixed threshold also ends that rise."""
    libc = _libc()
    if not kib or libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(kib) * 1024))


def configure(arenas: int, mmap_threshold_kib: int) -> None:
    """The server's allocator settings (ServerSettings.malloc_arenas, malloc_mmap_threshold_kib)."""
    limit_arenas(arenas)
    fix_mmap_threshold(mmap_threshold_kib)

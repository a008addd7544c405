"""llama.cpp and torch share one OpenMP runtime in a process: keep torch's thread teams from slowing llama.cpp's.

llama-cpp-python's ggml runs each forward on an OpenMP team and meets its threads at a barrier after every graph
node (hundreds a forward). libgomp, which torch's CPU wheel ships and ggml then uses too, spins at a barrier before
it sleeps on a futex, but only while the threads it manages are no more than the CPUs: once another thread of the
process has run a torch op in parallel, that thread's team stays (one more managed thread for the process's life),
and every barrier of every team sleeps almost at once, so each of llama.cpp's node barriers pays a futex wake-up.
In `specdecode serve` a request's JSON schema is compiled in a worker thread (a vocabulary-sized torch tensor:
parallel); after the first such request a one-token step of the default target took 80 ms instead of 56 ms for as
long as the server ran (2-vCPU Intel Xeon, 2 threads: 12.5 instead of 17.5 tokens/s on every later request).

Where every model that computes runs on llama.cpp, torch only touches vocabulary-sized tensors (masks, sampling:
microseconds on one thread), so it runs single-threaded and never starts a team of its own. Where a torch model
computes (transformers or static backends, as target or draft), torch keeps its threads: that model needs them.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("specdecode")


def computing_backends(target, drafter=None) -> list:
    """The backends that run a model: the target's, and the drafter's (Drafter.backends: none for a drafter that
    only copies, such as suffix or prompt lookup)."""
    return [target, *(drafter.backends if drafter is not None else ())]


def only_llamacpp(target, drafter=None) -> bool:
    """Whether every model that computes is a llama.cpp one (no torch model)."""
    from .llamacpp import LlamaCppBackend

    return all(isinstance(backend, LlamaCppBackend) for backend in computing_backends(target, drafter))


def single_threaded_torch_beside_llamacpp(target, drafter=None) -> bool:
    """torch.set_num_threads(1) where every model that computes runs on llama.cpp (see the module's doc); True
    where it did. Call it before requests run torch ops in threads other than the one that decodes."""
    if not only_llamacpp(target, drafter):
        return False
    if torch.get_num_threads() != 1:
        log.debug("torch set to one thread: every model runs on llama.cpp, whose OpenMP barriers torch's teams "
                  "would slow")
        torch.set_num_threads(1)
    return True

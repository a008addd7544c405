"""Which machine this is, as measured costs and timing verdicts are keyed by: the CPU's model name (as lscpu
says it) and its core count. The CPU changes between machines, and what pays on one may not on another."""

from __future__ import annotations

import os
import platform


def machine_name() -> str:
    """The CPU's model name (as lscpu says it) and its core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def usable_cores() -> int:
    """The cores this process may run on: llama.cpp's threads where none are given (backends/llamacpp_context.py)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

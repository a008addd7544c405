"""The one timing loop of bench and bench latency: untimed warm-ups, then rounds that run every unit once in turn
(A B C D, A B C D, ...), so drift of a shared machine (a neighbour's load, a CPU's clock) hits every unit alike."""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

Unit = TypeVar("Unit", bound=Hashable)


def interleave(units: list[Unit], warm: Callable[[Unit, int], object], timed: Callable[[Unit, int], object],
               warmups: int, rounds: int, progress: Callable[[str], None] | None = None,
               label: Callable[[Unit], str] = str) -> dict[Unit, list]:
    """{unit: [what timed(unit, round) returned, one per round]}.

    warm(unit, w) runs warm-up w of a unit (its result is dropped); timed(unit, r) runs round r. Each call is
    reported to progress, with the unit's label.
    """
    progress = progress or (lambda _label: None)
    for w in range(warmups):
        for unit in units:
            warm(unit, w)
            progress(f"warm-up {label(unit)}")
    measured: dict[Unit, list] = {unit: [] for unit in units}
    for r in range(rounds):
        for unit in units:
            measured[unit].append(timed(unit, r))
            progress(f"run {r + 1}/{rounds} {label(unit)}")
    return measured

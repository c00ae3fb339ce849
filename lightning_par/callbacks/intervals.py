"""Pure interval math for trace analysis: merge, intersect, subtract, measure.

An interval is a ``(start, end)`` pair of numbers with ``start <= end`` (any unit; the callbacks use
nanoseconds). Lists of intervals may overlap and be unsorted; every function merges first, so nested and
overlapping events on one thread or stream count once. The definitions follow Holistic Trace Analysis (HTA):

- overlap ratio = |compute AND communication| / |communication|, both sides merged first;
- exposed communication = |communication \\ compute| (communication nothing hides);
- idle = window minus |compute OR communication|.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]


def _check(intervals: Iterable[Interval], name: str) -> list[Interval]:
    out = []
    for iv in intervals:
        start, end = iv
        if not (start <= end):  # also catches NaN
            raise ValueError(
                f"`{name}` holds the interval {iv!r} whose end is before its start (or is NaN). "
                f"Pass (start, end) pairs with start <= end, e.g. ({end!r}, {start!r})."
            )
        out.append((start, end))
    return out


def merge(intervals: Iterable[Interval], name: str = "intervals") -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the union of ``intervals`` (touching ones are joined)."""
    ivs = sorted(_check(intervals, name))
    merged: list[list[float]] = []
    for start, end in ivs:
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged if e > s]


def total(intervals: Iterable[Interval], name: str = "intervals") -> float:
    """Length of the union of ``intervals``."""
    return sum(e - s for s, e in merge(intervals, name))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals where both ``a`` and ``b`` are active (a two-pointer sweep)."""
    ma, mb = merge(a, "a"), merge(b, "b")
    out: list[Interval] = []
    i = j = 0
    while i < len(ma) and j < len(mb):
        start = max(ma[i][0], mb[j][0])
        end = min(ma[i][1], mb[j][1])
        if start < end:
            out.append((start, end))
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals where ``a`` is active and ``b`` is not."""
    mb = merge(b, "b")
    out: list[Interval] = []
    j = 0
    for start, end in merge(a, "a"):
        cur = start
        while j < len(mb) and mb[j][1] <= cur:
            j += 1
        k = j
        while k < len(mb) and mb[k][0] < end:
            if mb[k][0] > cur:
                out.append((cur, mb[k][0]))
            cur = max(cur, mb[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The parts of ``intervals`` inside ``window``, merged."""
    return intersect(intervals, [window])


def overlap_ratio(compute: Sequence[Interval], comm: Sequence[Interval]) -> float:
    """HTA's communication/computation overlap: the share of communication time that compute hides.

    NaN when there is no communication (the ratio is undefined, not 0 or 1).
    """
    comm_time = total(comm, "comm")
    if comm_time == 0:
        return math.nan
    return total(intersect(compute, comm)) / comm_time


def exposed(compute: Sequence[Interval], comm: Sequence[Interval]) -> float:
    """Communication time during which no compute runs: what a step waits for."""
    return total(subtract(comm, compute))


def idle_fraction(busy: Sequence[Interval], window: Interval) -> float:
    """Share of ``window`` where none of ``busy`` is active (HTA's idle time over the window)."""
    ((start, end),) = _check([window], "window")
    if end == start:
        return math.nan
    return 1.0 - total(clip(busy, window)) / (end - start)

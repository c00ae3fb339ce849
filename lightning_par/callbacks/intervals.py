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


def _bad(intervals: Iterable[Interval], name: str) -> ValueError | None:
    for iv in intervals:
        if not (iv[0] <= iv[1]):  # also catches NaN
            start, end = iv
            return ValueError(
                f"`{name}` holds the interval {iv!r} whose end is before its start (or is NaN). "
                f"Pass (start, end) pairs with start <= end, e.g. ({end!r}, {start!r})."
            )
    return None


def _is_merged(ivs: list[Interval]) -> bool:
    prev = None
    for s, e in ivs:
        if not (s < e) or (prev is not None and not (prev < s)):
            return False
        prev = e
    return True


def merge(intervals: Iterable[Interval], name: str = "intervals") -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the union of ``intervals`` (touching ones are joined)."""
    if isinstance(intervals, list) and _is_merged(intervals):
        return list(intervals)  # the common case in chained calls: one pass instead of a sort and a rebuild
    ivs = sorted(intervals)
    err = _bad(ivs, name)
    if err is not None:
        raise err
    out: list[Interval] = []
    if not ivs:
        return out
    cs, ce = ivs[0]
    for s, e in ivs:
        if s <= ce:
            if e > ce:
                ce = e
        else:
            if ce > cs:
                out.append((cs, ce))
            cs, ce = s, e
    if ce > cs:
        out.append((cs, ce))
    return out


def total(intervals: Iterable[Interval], name: str = "intervals") -> float:
    """Length of the union of ``intervals``."""
    return sum(e - s for s, e in merge(intervals, name))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals where both ``a`` and ``b`` are active (a two-pointer sweep)."""
    ma, mb = merge(a, "a"), merge(b, "b")
    out: list[Interval] = []
    i = j = 0
    na, nb = len(ma), len(mb)
    while i < na and j < nb:
        a0, a1 = ma[i]
        b0, b1 = mb[j]
        start = a0 if a0 > b0 else b0
        end = a1 if a1 < b1 else b1
        if start < end:
            out.append((start, end))
        if a1 < b1:
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
    err = _bad([window], "window")
    if err is not None:
        raise err
    ws, we = window
    return [(s if s > ws else ws, e if e < we else we) for s, e in merge(intervals) if e > ws and s < we]


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
    err = _bad([window], "window")
    if err is not None:
        raise err
    start, end = window
    if end == start:
        return math.nan
    return 1.0 - total(clip(busy, window)) / (end - start)

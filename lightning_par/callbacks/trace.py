"""Turn ``torch.profiler`` events into compute and communication intervals, with a kind per communication.

Two trace shapes are understood:

- **CUDA**: kernels on streams. NCCL kernels (``ncclDevKernel_*``, ``ncclKernel_*``) are communication, other
  kernels are compute, memcpy/memset are neither (HTA's "memory" category) but count as busy.
- **CPU / gloo** (see ``CPU_FACTS.md``): a collective's real duration is a ``gloo:<op>`` user annotation on a
  gloo worker thread (``gloo:send`` / ``gloo:recv`` on the calling thread). Everything on a gloo worker thread
  is communication. Compute is every ``cpu_op`` on the other threads, minus that thread's own communication
  (a thread cannot compute while it sends) and minus collective bookkeeping (``c10d::*`` / functional enqueues,
  ``*wait*`` ops), which runs no math, also where it is nested inside an op that does.

The kind of a communication comes from the context it was *issued* in: the launching CPU call of an NCCL kernel
(matched by correlation id), or the ``c10d::*`` enqueue op a gloo collective belongs to (matched in order). The
annotations around that point decide: ``FSDP::all_gather`` -> ``fsdp_all_gather``, ``FSDP::post_backward_reduce``
-> ``fsdp_reduce_scatter``, ``TP::``/``CP::``/``PP::`` prefixes (any ``record_function``) -> ``tp``/``cp``/
``pp_send_recv``, an all-reduce issued from an ``AccumulateGrad`` node (DDP's reducer hooks) -> ``ddp_all_reduce``,
a DTensor functional collective -> ``tp``, point-to-point -> ``pp_send_recv``; otherwise the collective's own name
(``all_reduce``, ``all_gather``, ...). Extra rules can be given as ``(substring, kind)`` pairs.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.autograd import DeviceType

from lightning_par.callbacks.intervals import Interval, merge, subtract

#: Every kind a communication can get, in the order the metrics list them (a fixed list, so every rank sends
#: the same vector in the cross-rank summary).
COMM_KINDS: tuple[str, ...] = (
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "ddp_all_reduce",
    "tp",
    "cp",
    "pp_send_recv",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "other",
)

#: Context rules tried innermost annotation first: (substring of an enclosing event's name, kind).
DEFAULT_CONTEXT_RULES: tuple[tuple[str, str], ...] = (
    ("FSDP::all_gather", "fsdp_all_gather"),
    ("FSDP::post_backward_reduce", "fsdp_reduce_scatter"),
    ("FSDP::reduce_scatter", "fsdp_reduce_scatter"),
    ("TP::", "tp"),
    ("CP::", "cp"),
    ("PP::", "pp_send_recv"),
)

_MARK = "lightning_par::step"  # the annotation the overlap monitor puts around each measured step
MONITOR_MARK = "lightning_par::monitor"  # around the monitors' own collectives, which the analysis leaves out


@dataclass(frozen=True)
class TraceEvent:
    """One profiler event, reduced to what the analysis needs.

    ``track`` is the thread (CPU events) or ``(device index, stream)`` (GPU events) the event ran on;
    ``activity`` is the profiler's activity type (``cpu_op``, ``user_annotation``, ``kernel``, ``gpu_memcpy``,
    ``gpu_memset``, ``cuda_runtime``, ...); ``correlation`` links a GPU event to the CPU call that launched it.
    """

    name: str
    activity: str
    track: Any
    start: int
    end: int
    on_gpu: bool = False
    correlation: int = 0


@dataclass
class ClassifiedTrace:
    """A window's compute and communication, merged per category and ready for the interval math."""

    compute: list[Interval] = field(default_factory=list)
    comm: list[Interval] = field(default_factory=list)
    other_busy: list[Interval] = field(default_factory=list)
    comm_by_kind: dict[str, list[Interval]] = field(default_factory=dict)
    steps: list[Interval] = field(default_factory=list)


def events_from_profiler(prof: Any) -> list[TraceEvent]:
    """Read a stopped ``torch.profiler.profile``'s events without building its FunctionEvent tree (slow).

    ``prof.events()`` would give the same events as FunctionEvents, but building that tree costs seconds on a
    real window; the kineto results are read directly instead (private API, see ``kineto_events``).
    """
    return [ev for e in kineto_events(prof) if (ev := to_trace_event(e, kineto_activity(e))) is not None]


def kineto_events(prof: Any) -> list[Any]:
    """The raw ``torch._C._autograd._KinetoEvent`` list of a stopped profile.

    Private API, checked on torch 2.11.0 and 2.13.0 (``prof.profiler.kineto_results.events()``, the list
    ``prof.events()`` is built from); tests/test_trace_events.py fails loudly if it changes.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise ValueError(
            f"`prof` ({type(prof).__name__}) has no kineto results. Pass a stopped torch.profiler.profile "
            f"that recorded events."
        )
    return results.events()


def to_trace_event(e: Any, activity: str) -> TraceEvent | None:
    """One kineto event as a ``TraceEvent``; ``None`` for Python-function events (the analysis reads ops only)."""
    if activity == "python_function":
        return None
    on_gpu = e.device_type() != DeviceType.CPU
    track = (e.device_index(), e.device_resource_id()) if on_gpu else e.start_thread_id()
    start = e.start_ns()
    return TraceEvent(e.name(), activity, track, start, start + e.duration_ns(), on_gpu, e.correlation_id())


def kineto_activity(e: Any) -> str:
    """The profiler activity type of a kineto event (``cpu_op``, ``user_annotation``, ``kernel``, ...).

    ``_KinetoEvent.activity_type()`` first appeared in torch 2.12 (pytorch PR #178086); older torch lacks it
    (checked: 2.11.0 lacks it, 2.13.0 has it), so there the type is rebuilt from methods both have.
    """
    read = getattr(e, "activity_type", None)
    return read() if read is not None else activity_without_activity_type(e)


# kineto's names for the CUDA synchronization events it records on a GPU track (only with enable_cuda_sync_events)
_CUDA_SYNC_NAMES = ("Stream Sync", "Event Sync", "Context Sync", "Device Sync", "Stream Wait Event")


def activity_without_activity_type(e: Any) -> str:
    """The activity type of a kineto event, from methods older torch has too (for torch < 2.12; checked on 2.11.0).

    It agrees with ``activity_type()`` on every type the analysis reads (tests/test_trace_events.py compares
    them on torch >= 2.12): ``is_user_annotation()`` is kineto's USER_ANNOTATION or GPU_USER_ANNOTATION; on a
    GPU track the rest are kernels except kineto's ``Memcpy ...``/``Memset ...``/sync events; on the CPU, Python
    calls and instant events (memory) are the only events without a correlation id, and CUDA runtime/driver
    calls (recorded by CUPTI, not by torch) are named by their API: ``cuda*`` / ``cu[A-Z]*``.
    """
    name = e.name()
    if e.device_type() != DeviceType.CPU:
        if e.is_user_annotation():
            return "gpu_user_annotation"
        if name.startswith("Memcpy"):
            return "gpu_memcpy"
        if name.startswith("Memset"):
            return "gpu_memset"
        if name.startswith(_CUDA_SYNC_NAMES):
            return "cuda_sync"
        return "kernel"
    if e.is_user_annotation():
        return "user_annotation"
    if e.correlation_id() == 0:
        return "cpu_instant_event" if name.startswith("[") else "python_function"
    if name.startswith("cuda"):
        return "cuda_runtime"
    if name.startswith("cu") and name[2:3].isupper():
        return "cuda_driver"
    return "cpu_op"


def _gloo_op(name: str) -> str | None:
    return name[5:] if name.startswith("gloo:") else None


def _is_nccl_kernel(ev: TraceEvent) -> bool:
    """NCCL's kernels: ``ncclDevKernel_*`` / ``ncclKernel_*``, and the one it runs for a reduction over a single
    rank (``oneRankReduce<...>``, e.g. an AVG all-reduce at world size 1)."""
    return ev.on_gpu and ev.activity == "kernel" and (ev.name.startswith("nccl") or "oneRankReduce" in ev.name)


def _is_enqueue(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")) and "wait" not in name


def _is_comm_bookkeeping(name: str) -> bool:
    return _is_enqueue(name) or "wait" in name.lower() or name.startswith(("record_param_comms", "nccl:"))


def _family(name: str) -> str:
    """The collective an op, gloo annotation or NCCL kernel name stands for."""
    n = name.lower().replace("_", "")
    for key, fam in (
        ("onerankreduce", "all_reduce"),  # NCCL's one-rank reduction kernel (reduce-type collectives at world 1)
        ("sendrecv", "p2p"),
        ("send", "p2p"),
        ("recv", "p2p"),
        ("reducescatter", "reduce_scatter"),
        ("allreduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("alltoall", "all_to_all"),
        ("broadcast", "broadcast"),
        ("barrier", "barrier"),
    ):
        if key in n:
            return fam
    return "other"


# gloo runs a reduce-scatter as an all-reduce and a barrier as its own op or an all-reduce
_GLOO_RUNS_AS = {"reduce_scatter": {"reduce_scatter", "all_reduce"}, "barrier": {"barrier", "all_reduce"}}


class _Contexts:
    """The enclosing events of each thread, to look up what was running at an instant.

    Only events whose names can decide a kind are kept (``patterns``), so a lookup scans a handful, not the
    tens of thousands of ops of a real window.
    """

    def __init__(self, events: Iterable[TraceEvent], patterns: Sequence[str]) -> None:
        self._by_track: dict[Any, list[TraceEvent]] = defaultdict(list)
        for ev in events:
            if not ev.on_gpu and ev.activity in ("cpu_op", "user_annotation") and any(p in ev.name for p in patterns):
                self._by_track[ev.track].append(ev)
        self._starts: dict[Any, list[int]] = {}
        for track, evs in self._by_track.items():
            evs.sort(key=lambda e: e.start)
            self._starts[track] = [e.start for e in evs]

    def stack(self, track: Any, t: int) -> list[str]:
        """Names of the events enclosing instant ``t`` on ``track``, innermost (latest start) first."""
        evs = self._by_track.get(track, [])
        i = bisect.bisect_right(self._starts.get(track, []), t)
        return [e.name for e in reversed(evs[:i]) if e.end >= t]


def _kind(family: str, stack: Sequence[str], functional: bool, rules: Sequence[tuple[str, str]]) -> str:
    for name in stack:
        for pattern, kind in rules:
            if pattern in name:
                return kind
    if family == "all_reduce" and any("AccumulateGrad" in n or "reducer" in n for n in stack):
        return "ddp_all_reduce"
    if functional:
        return "tp"
    if family == "p2p":
        return "pp_send_recv"
    if family in COMM_KINDS:
        return family
    return "other"


def classify(
    events: Sequence[TraceEvent],
    rules: Sequence[tuple[str, str]] = DEFAULT_CONTEXT_RULES,
    device_index: int | None = None,
) -> ClassifiedTrace:
    """Split a window's events into compute, communication (by kind) and other busy time.

    ``device_index`` keeps only that GPU's streams (a rank's profile can hold other devices' events);
    ``rules`` are ``(substring, kind)`` pairs for the annotations around the point a collective was issued.
    Communication issued inside a ``lightning_par::monitor`` range (the monitors' own summaries) is left out.
    """
    for pattern, kind in rules:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"`rules` holds the pattern {pattern!r}; each rule must be a (non-empty substring, kind) pair."
            )
        if kind not in COMM_KINDS:
            raise ValueError(f"`rules` maps {pattern!r} to the kind {kind!r}; use one of {COMM_KINDS}.")
    patterns = [p for p, _ in rules] + [MONITOR_MARK, "AccumulateGrad", "reducer", "functional"]
    contexts = _Contexts(events, patterns)
    # with GPU kernels in the trace, compute is what the GPU runs (HTA); CPU ops only launch it
    gpu_trace = any(ev.on_gpu and ev.activity == "kernel" for ev in events)
    gloo_threads = {ev.track for ev in events if not ev.on_gpu and _gloo_op(ev.name) not in (None, "send", "recv")}

    compute_by_track: dict[Any, list[Interval]] = defaultdict(list)
    bookkeeping_by_track: dict[Any, list[Interval]] = defaultdict(list)
    other_busy: list[Interval] = []
    steps: list[Interval] = []
    enqueues: list[TraceEvent] = []
    launches: dict[int, TraceEvent] = {}
    comm_events: list[TraceEvent] = []
    for ev in events:
        if ev.on_gpu:
            if device_index is not None and ev.track[0] != device_index:
                continue
            if _is_nccl_kernel(ev):
                comm_events.append(ev)
            elif ev.activity == "kernel":
                compute_by_track[ev.track].append((ev.start, ev.end))
            elif ev.activity in ("gpu_memcpy", "gpu_memset"):
                other_busy.append((ev.start, ev.end))
        elif ev.name == _MARK:
            steps.append((ev.start, ev.end))
        elif _gloo_op(ev.name) is not None:
            comm_events.append(ev)
        elif ev.activity in ("cuda_runtime", "cuda_driver"):
            if ev.correlation:
                launches[ev.correlation] = ev
        elif ev.activity == "cpu_op" and ev.track not in gloo_threads:
            if _is_enqueue(ev.name):
                enqueues.append(ev)
            if _is_comm_bookkeeping(ev.name):  # enqueues and waits: no math, even inside an op that does some
                bookkeeping_by_track[ev.track].append((ev.start, ev.end))
            elif not gpu_trace:
                compute_by_track[ev.track].append((ev.start, ev.end))

    # where each communication was issued: (thread, instant, family, issued by a functional collective?)
    issued: dict[int, tuple[Any, int, str, bool]] = {}
    enqueues = _outermost(enqueues)
    used = [False] * len(enqueues)
    runs_as = [_GLOO_RUNS_AS.get(_family(e.name), {_family(e.name)}) for e in enqueues]
    first_free = 0
    for idx, ev in sorted(enumerate(comm_events), key=lambda ie: ie[1].start):
        if ev.on_gpu:  # NCCL kernel: the launching runtime call (same correlation id) tells where
            launch = launches.get(ev.correlation)
            if launch is not None:
                stack = contexts.stack(launch.track, launch.start)
                issued[idx] = (launch.track, launch.start, _family(ev.name), any("functional" in n for n in stack))
            continue
        fam = _family(ev.name[5:])
        if fam == "p2p":  # gloo send/recv run on the calling thread: their own context tells the kind
            issued[idx] = (ev.track, ev.start, fam, False)
            continue
        for i in range(first_free, len(enqueues)):  # gloo collective: the oldest unmatched compatible enqueue
            if enqueues[i].start > ev.start:
                break
            if not used[i] and fam in runs_as[i]:
                used[i] = True
                while first_free < len(used) and used[first_free]:
                    first_free += 1
                enq = enqueues[i]
                issued[idx] = (enq.track, enq.start, _family(enq.name), "functional" in enq.name)
                break

    comm_by_track: dict[Any, list[Interval]] = defaultdict(list)
    by_kind: dict[str, list[Interval]] = defaultdict(list)
    for idx, ev in enumerate(comm_events):
        span = (ev.start, ev.end)
        if idx in issued:
            track, t, fam, functional = issued[idx]
            stack = contexts.stack(track, t)
            if any(MONITOR_MARK in n for n in stack):
                compute_by_track[ev.track] = subtract(compute_by_track.get(ev.track, []), [span])
                continue
            kind = _kind(fam, stack, functional, rules)
        else:
            kind = _kind(_family(ev.name[5:] if ev.name.startswith("gloo:") else ev.name), [], False, rules)
        comm_by_track[ev.track].append(span)
        by_kind[kind].append(span)

    compute: list[Interval] = []
    comm: list[Interval] = []
    for track, ivs in compute_by_track.items():  # a thread cannot compute while it communicates
        compute.extend(subtract(ivs, comm_by_track.get(track, []) + bookkeeping_by_track.get(track, [])))
    for ivs in comm_by_track.values():
        comm.extend(ivs)
    return ClassifiedTrace(
        compute=merge(compute),
        comm=merge(comm),
        other_busy=merge(other_busy),
        comm_by_kind={k: merge(v) for k, v in by_kind.items()},
        steps=sorted(steps),
    )


def _outermost(events: list[TraceEvent]) -> list[TraceEvent]:
    """Drop events nested in another of the list on the same thread (a functional op wrapping a c10d op)."""
    out: list[TraceEvent] = []
    last_end: dict[Any, int] = {}
    for ev in sorted(events, key=lambda e: (e.start, -e.end)):
        if ev.start < last_end.get(ev.track, -1) and ev.end <= last_end[ev.track]:
            continue
        out.append(ev)
        last_end[ev.track] = ev.end
    return out

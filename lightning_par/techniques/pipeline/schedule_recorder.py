"""Seeing the bubble: time every action a pipeline schedule executes on this rank, and draw the timeline.

The recorder wraps the three compute entry points of each local ``PipelineStage`` (forward, backward or
input-gradient backward, weight-gradient backward) and torch's point-to-point helpers, so it measures what the
schedule actually ran, not what its action list says. What is not compute is idle: waiting on a neighbour (the
bubble) plus the cost of the transfers themselves.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _sched

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


class Event(NamedTuple):
    kind: str  # forward | backward | backward_input | backward_weight | send | recv | send_recv | idle
    stage: int  # -1 where unknown (communication, idle)
    microbatch: int
    t0: float  # seconds, perf_counter (one clock for all processes of a host)
    t1: float


class ScheduleRecorder:
    """Context manager recording :class:`Event` s of the stages' work while it is active.

    ``with ScheduleRecorder(stages) as rec: schedule.step(...)`` then ``rec.events`` (compute and p2p waits, in
    time order), ``rec.window`` (the step's start and end) and ``rec.timeline()`` (idle gaps added).
    """

    def __init__(self, stages: Sequence[Any]) -> None:
        self.stages = list(stages)
        self.events: list[Event] = []
        self.window: tuple[float, float] = (0.0, 0.0)
        self._undo: list[Callable[[], None]] = []
        self._kinds: dict[int, str] = {}

    def _timed(self, fn: Callable, kind_of: Callable[..., tuple[str, int, int]]) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                kind, stage, mb = kind_of(*args, **kwargs)
                if kind:
                    self.events.append(Event(kind, stage, mb, t0, time.perf_counter()))
        return wrapper

    def _patch(self, owner: Any, name: str, new: Callable, instance: bool) -> None:
        old = getattr(owner, name)
        setattr(owner, name, new)
        self._undo.append((lambda: delattr(owner, name)) if instance else (lambda: setattr(owner, name, old)))

    def __enter__(self) -> ScheduleRecorder:
        for stage in self.stages:
            sid = stage.stage_index
            self._patch(stage, "forward_one_chunk", self._timed(
                stage.forward_one_chunk, lambda mb, *a, _s=sid, **k: ("forward", _s, mb)), instance=True)
            self._patch(stage, "backward_one_chunk", self._timed(
                stage.backward_one_chunk,
                lambda mb, *a, _s=sid, full_backward=True, **k: ("backward" if full_backward else "backward_input",
                                                                 _s, mb)), instance=True)
            self._patch(stage, "backward_weight_one_chunk", self._timed(
                stage.backward_weight_one_chunk, lambda mb, *a, _s=sid, **k: ("backward_weight", _s, mb)),
                instance=True)
        batch_p2p, wait_p2p = _sched._batch_p2p, _sched._wait_batch_p2p

        def tagged_batch(ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
            works = batch_p2p(ops, desc=desc)
            sends = {op.op is dist.isend for op in ops}
            self._kinds[id(works)] = "send" if sends == {True} else "recv" if sends == {False} else "send_recv"
            return works

        self._patch(_sched, "_batch_p2p", tagged_batch, instance=False)
        self._patch(_sched, "_wait_batch_p2p", self._timed(
            wait_p2p, lambda work: (self._kinds.pop(id(work), "send_recv"), -1, -1)), instance=False)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.window = (self._start, time.perf_counter())
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.events.sort(key=lambda e: e.t0)

    def timeline(self) -> list[Event]:
        """Compute and p2p events plus ``idle`` gaps between compute events, in time order."""
        return with_idle(self.events, *self.window)


def with_idle(events: Sequence[Event], start: float, end: float) -> list[Event]:
    out, t = [], start
    for e in sorted((e for e in events if e.kind in COMPUTE), key=lambda e: e.t0):
        if e.t0 > t:
            out.append(Event("idle", -1, -1, t, e.t0))
        t = max(t, e.t1)
    if end > t:
        out.append(Event("idle", -1, -1, t, end))
    return sorted(list(events) + out, key=lambda e: e.t0)


def idle_fraction(events: Sequence[Event], start: float, end: float) -> float:
    """Share of ``[start, end]`` in which this rank computed nothing (bubble plus communication)."""
    busy = sum(e.t1 - e.t0 for e in events if e.kind in COMPUTE)
    return min(1.0, max(0.0, 1.0 - busy / max(end - start, 1e-12)))


def gather_timelines(rec: ScheduleRecorder, group: dist.ProcessGroup | None = None) -> list[list[Event]]:
    """Every pp rank's timeline (with idle), on every rank, in seconds from the earliest start."""
    mine = (rec.timeline(), rec.window)
    allr: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(allr, mine, group=group)
    origin = min(w[0] for _, w in allr)
    return [[e._replace(t0=e.t0 - origin, t1=e.t1 - origin) for e in ev] for ev, _ in allr]


def theory_idle(schedule: str, pp: int, m: int, stages_per_rank: int = 1) -> float:
    """The textbook bubble: (p-1)/(m+p-1) for GPipe and 1F1B, divided by the interleaving factor v for
    interleaved 1F1B (Narayanan et al. 2021); zero-bubble schedules aim at ~0 when F = I = W in time."""
    v = stages_per_rank if schedule.startswith("interleaved") else 1
    bubble = (pp - 1) / v
    if schedule in ("interleaved_zb", "zbv"):
        return 0.0
    return bubble / (m + bubble)


_COLORS = {"forward": "tab:blue", "backward": "tab:red", "backward_input": "tab:orange",
           "backward_weight": "tab:green"}
_COMM = {"send": "0.55", "recv": "0.75", "send_recv": "0.65"}


def draw_timeline(timelines: Sequence[Sequence[Event]], title: str = "", n_microbatches: int | None = None):
    """A matplotlib Figure: one row per rank, compute as coloured blocks (colour = kind, label = stage/micro-batch,
    shade = micro-batch), p2p waits as thin grey bars, idle left blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    m = n_microbatches or 1 + max((e.microbatch for tl in timelines for e in tl), default=0)
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.7 * len(timelines)), dpi=100)
    for r, tl in enumerate(timelines):
        for e in tl:
            if e.kind in _COLORS:
                alpha = 0.45 + 0.55 * (1 - e.microbatch / max(m, 1))
                ax.broken_barh([(e.t0, e.t1 - e.t0)], (r - 0.4, 0.8), facecolors=_COLORS[e.kind], alpha=alpha,
                               edgecolor="black", linewidth=0.3)
                if e.t1 - e.t0 > 0.015 * max(ev.t1 for ev in tl):
                    ax.text((e.t0 + e.t1) / 2, r, f"{e.stage}.{e.microbatch}", ha="center", va="center", fontsize=6)
            elif e.kind in _COMM:
                ax.broken_barh([(e.t0, e.t1 - e.t0)], (r - 0.45, 0.1), facecolors=_COMM[e.kind])
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (labels: stage.microbatch)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()] + [Patch(color="0.6", label="p2p wait")],
              loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    return fig


def figure_to_array(fig) -> np.ndarray:
    """RGB uint8 (H, W, 3): ``SummaryWriter.add_image(tag, img, step, dataformats="HWC")`` logs it as is."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    buf.seek(0)
    return (plt.imread(buf)[..., :3] * 255).astype(np.uint8)

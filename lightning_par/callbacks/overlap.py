"""CommOverlapMonitor: profile a short window of steps now and then, and measure how well communication hides.

Every ``every_n_steps`` optimizer steps (from ``start_step``), ``torch.profiler`` records ``warmup_steps`` +
``window_steps`` training batches. The events are analysed in memory (no trace file unless ``export_trace_dir``):
:mod:`~lightning_par.callbacks.trace` splits them into compute and communication intervals, and
:mod:`~lightning_par.callbacks.intervals` measures them with HTA's definitions. The window is the span of the
measured batches (each wrapped in a ``lightning_par::step`` annotation), from the first batch's start to the last
batch's end (on a GPU, to the last kernel's end). Between windows the monitor only compares two integers per batch.

The summary is one ``all_gather`` at the end of each window, in ``on_train_batch_end`` on every rank; the window
boundaries depend only on ``trainer.global_step`` and batch counts, which every rank shares.

On a GPU the window's CUDA activities come from CUPTI, and kineto leaves CUPTI attached to the process after the
profiler stops unless the environment says ``TEARDOWN_CUPTI=1`` (kineto reads it when tracing stops; off by
default in torch up to 2.13 at least). Attached, CUPTI keeps intercepting kernel launches: torch's own reports
measure training 10-20 % slower for the rest of the run (pytorch issue #144455, PR #146604, kineto PR #1539). That
is the likeliest cause of the 20 % the three monitors cost a launch-bound step on an H100 (``shared/GPU_FACTS.md``),
as their hooks take ~15 us per step (``benchmarks/bench_callbacks.py``); ``benchmarks/bench_gpu.py`` measures the steps
before and after a window on a GPU. So the monitor asks for the teardown before each CUDA window
(``teardown_cupti``). A value the user or torch set is kept: torch sets ``0`` itself where CUDA graphs with
CUDA < 12.6 make the teardown crash. Windows are hundreds of steps apart, so the teardown of one has long finished
when the next starts (kineto once crashed on back-to-back sessions).

kineto prints two ``USDT: ... profiler_start/stop`` lines per rank for every window on stderr (torch 2.13), which
read like errors in a training log. Its level switch ``KINETO_LOG_LEVEL`` ranks those lines above its errors, so
the monitor sets it to ``6`` (nothing) unless the environment already decides it: set it yourself, e.g. ``4``,
to see kineto's errors again (``quiet_kineto``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_par.callbacks import intervals as iv
from lightning_par.callbacks._base import RankSummaryCallback, check_positive_int, monitor_overhead
from lightning_par.callbacks.cross_rank import (
    log_figure_on_rank_zero,
    log_on_rank_zero,
    summarize_across_ranks,
    writes_logs,
)
from lightning_par.callbacks.trace import (
    _MARK,
    COMM_KINDS,
    DEFAULT_CONTEXT_RULES,
    MONITOR_MARK,
    ClassifiedTrace,
    classify,
    events_from_profiler,
)

BASE_NAMES = (
    "comm/overlap_ratio",
    "comm/exposed_s_per_step",
    "comm/time_s_per_step",
    "comm/compute_s_per_step",
    "comm/idle_frac",
    "comm/step_time_s",
)
KIND_NAMES = tuple(f"comm/time_s/{k}" for k in COMM_KINDS)


def window_metrics(trace: ClassifiedTrace, gpu_tail: bool = False) -> dict[str, float]:
    """One rank's overlap metrics for a classified window (all times in seconds per measured step).

    ``gpu_tail`` extends the window to the last device interval, for GPU work still running after the host's
    last step ended. Raises ValueError when the trace holds no ``lightning_par::step`` marks.
    """
    if not trace.steps:
        raise ValueError(
            "`trace` has no measured steps (no `lightning_par::step` annotations); wrap each measured step in "
            "torch.profiler.record_function('lightning_par::step')."
        )
    n = len(trace.steps)
    start, end = trace.steps[0][0], max(e for _, e in trace.steps)
    if gpu_tail:
        tails = [e for ivs in (trace.compute, trace.comm, trace.other_busy) for _, e in ivs[-1:]]
        end = max([end, *tails])
    window = (start, end)
    compute, comm = iv.clip(trace.compute, window), iv.clip(trace.comm, window)
    busy = compute + comm + iv.clip(trace.other_busy, window)
    ns = 1e9 * n
    out = {
        "comm/overlap_ratio": iv.overlap_ratio(compute, comm),
        "comm/exposed_s_per_step": iv.exposed(compute, comm) / ns,
        "comm/time_s_per_step": iv.total(comm) / ns,
        "comm/compute_s_per_step": iv.total(compute) / ns,
        "comm/idle_frac": iv.idle_fraction(busy, window),
        "comm/step_time_s": (end - start) / ns,
    }
    for kind in COMM_KINDS:
        out[f"comm/time_s/{kind}"] = iv.total(iv.clip(trace.comm_by_kind.get(kind, []), window)) / ns
    return out


class CommOverlapMonitor(RankSummaryCallback):
    """Logs communication/compute overlap, exposed communication, time per communication kind and idle fraction.

    Args:
        every_n_steps: optimizer steps between the starts of two profiling windows.
        window_steps: training batches measured per window.
        warmup_steps: batches profiled but not measured first (profiler start-up cost lands there).
        start_step: global step of the first window (later ones follow every ``every_n_steps``).
        export_trace_dir: also write each window's Chrome trace here, one file per rank (large; off by default).
        log_timeline: also log a picture of every rank's compute and communication over the window (gathers the
            intervals to rank 0 with one extra ``all_gather_object`` per window).
        rules: extra ``(annotation substring, kind)`` pairs, tried before the defaults, to name communication
            issued inside your own ``torch.profiler.record_function`` ranges (kinds: ``trace.COMM_KINDS``).
        teardown_cupti: on CUDA, detach CUPTI when each window ends (sets ``TEARDOWN_CUPTI=1`` unless the
            environment already has a value), so that kernel launches after the window run at full speed; see the
            module docstring. ``False`` leaves kineto's default.
    """

    def __init__(
        self,
        every_n_steps: int = 500,
        window_steps: int = 3,
        warmup_steps: int = 1,
        start_step: int = 10,
        export_trace_dir: str | None = None,
        log_timeline: bool = False,
        rules: Sequence[tuple[str, str]] = (),
        teardown_cupti: bool = True,
    ) -> None:
        super().__init__(None)
        check_positive_int("every_n_steps", every_n_steps)
        check_positive_int("window_steps", window_steps)
        check_positive_int("warmup_steps", warmup_steps, minimum=0)
        check_positive_int("start_step", start_step, minimum=0)
        if window_steps + warmup_steps > every_n_steps:
            raise ValueError(
                f"`window_steps` + `warmup_steps` ({window_steps} + {warmup_steps}) must not exceed `every_n_steps` "
                f"({every_n_steps}): windows would overlap. Raise every_n_steps or shorten the window."
            )
        self.every_n_steps = every_n_steps
        self.window_steps = window_steps
        self.warmup_steps = warmup_steps
        self.start_step = start_step
        self.export_trace_dir = export_trace_dir
        self.log_timeline = bool(log_timeline)
        if not isinstance(teardown_cupti, bool):
            raise TypeError(f"`teardown_cupti` must be True or False, got {teardown_cupti!r}.")
        self.teardown_cupti = teardown_cupti
        self.rules = tuple(rules) + DEFAULT_CONTEXT_RULES
        classify([], self.rules)  # validates the rules now, before any training
        self._prof: Any = None
        self._active = False  # a window is in progress (recording, or skipped because another profiler runs)
        self._mark: Any = None
        self._warm_left = 0
        self._measured = 0
        self._last_window_start = -1
        self._gpu = False
        self._device_index: int | None = None
        #: this rank's values of the last window, its summary, its analysis time (s) and where images went
        self.last_values: dict[str, float] = {}
        self.last_summary: dict[str, float] = {}
        self.last_analysis_s = 0.0
        self.last_figure_targets: list[str] = []
        self.exported: list[str] = []

    @property
    def profiling(self) -> bool:
        """Whether this rank is recording a window now."""
        return self._prof is not None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        device = pl_module.device
        self._gpu = device.type == "cuda"
        self._device_index = device.index if self._gpu else None

    def _window_starts_at(self, step: int) -> bool:
        return step >= self.start_step and (step - self.start_step) % self.every_n_steps == 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            step = trainer.global_step
            if step == self._last_window_start or not self._window_starts_at(step):
                return
            self._last_window_start = step
            self._active = True
            self._warm_left, self._measured = self.warmup_steps, 0
            self._start_profiler()
        if self._warm_left == 0 and self._prof is not None:
            self._mark = torch.profiler.record_function(_MARK)
            self._mark.__enter__()

    def _start_profiler(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            # another profiler (the Trainer's, the user's) is recording: this window is skipped, but it still ends
            # with the same summary call on this rank, as on every other, so no rank waits for a gather
            rank_zero_warn("CommOverlapMonitor: another torch profiler is running; this window is skipped.")
            return
        with monitor_overhead():
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                if self.teardown_cupti:
                    request_cupti_teardown()
            quiet_kineto()
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        if self._warm_left > 0:
            self._warm_left -= 1
            return
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        self._measured += 1
        if self._measured == self.window_steps:
            with monitor_overhead():
                self._finish_window(trainer)

    def _stop(self) -> Any:
        prof, self._prof = self._prof, None
        self._active = False
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if prof is not None:
            if self._gpu:
                torch.cuda.synchronize(self._device_index)
            prof.stop()
        return prof

    def _finish_window(self, trainer: Any) -> None:
        prof = self._stop()
        t0 = time.perf_counter()
        trace, values = None, {}
        if prof is not None:
            try:
                trace = classify(events_from_profiler(prof), self.rules, self._device_index)
                values = window_metrics(trace, gpu_tail=self._gpu)
            except Exception as err:  # noqa: BLE001 - this rank still joins the gather below, so none waits forever
                rank = trainer.global_rank
                warnings.warn(f"CommOverlapMonitor: rank {rank} could not analyse its window: {err}", stacklevel=2)
                trace, values = None, {}
        self.last_analysis_s = time.perf_counter() - t0
        self.last_values = values
        if self.export_trace_dir and prof is not None:
            os.makedirs(self.export_trace_dir, exist_ok=True)
            path = os.path.join(self.export_trace_dir, f"rank{trainer.global_rank}_step{trainer.global_step}.json")
            prof.export_chrome_trace(path)
            self.exported.append(path)
        # every rank: one all_gather of the metrics, then rank 0 logs; zero-time kinds on every rank are dropped
        self._last_logged_step = trainer.global_step
        summary = summarize_across_ranks(values, BASE_NAMES + KIND_NAMES)
        for name in KIND_NAMES:
            if summary.get(f"{name}/max") == 0.0:
                for suffix in ("min", "max", "max_rank"):
                    summary.pop(f"{name}/{suffix}")
        self.last_summary = summary
        log_on_rank_zero(trainer, summary)
        if self.log_timeline:
            self._log_timeline(trainer, trace)

    def _log_timeline(self, trainer: Any, trace: ClassifiedTrace | None) -> None:
        import torch.distributed as dist

        mine: dict[str, Any] = {"compute": [], "comm": [], "end": 0.0}
        if trace is not None:
            w0 = trace.steps[0][0]
            mine = {
                "compute": [((s - w0) / 1e6, (e - s) / 1e6) for s, e in trace.compute[:20000] if e > w0],
                "comm": [((s - w0) / 1e6, (e - s) / 1e6) for s, e in trace.comm[:20000] if e > w0],
                "end": (max(e for _, e in trace.steps) - w0) / 1e6,
            }
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            with torch.profiler.record_function(MONITOR_MARK):
                dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        if writes_logs(trainer):
            fig = timeline_figure(ranks)
            self.last_figure_targets = log_figure_on_rank_zero(trainer, "comm/timeline", fig)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._active:  # training ended inside a window: drop it (no collective here)
            self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._active:
            self._stop()


#: kineto's switch (read when a trace stops): "1" detaches CUPTI from the process, anything else leaves it attached
CUPTI_TEARDOWN_ENV = "TEARDOWN_CUPTI"


def request_cupti_teardown() -> bool:
    """Ask kineto to detach CUPTI when the next CUDA trace stops, unless the environment already decides it.

    Returns whether the request is in force (``TEARDOWN_CUPTI=1``). Process-wide: later profiler sessions in this
    process (the user's too) also detach CUPTI when they stop, which only makes their after-trace steps faster.
    """
    os.environ.setdefault(CUPTI_TEARDOWN_ENV, "1")
    return os.environ[CUPTI_TEARDOWN_ENV] == "1"


#: kineto's log level (read when the first trace starts): 0 verbose ... 4 errors, 5 its USDT probe lines, 6 nothing
KINETO_LOG_LEVEL_ENV = "KINETO_LOG_LEVEL"


def quiet_kineto() -> None:
    """Keep kineto's ``USDT: ... profiler_start`` lines out of the training log, unless the environment decides."""
    os.environ.setdefault(KINETO_LOG_LEVEL_ENV, "6")


def timeline_figure(ranks: Sequence[dict[str, Any]]) -> Any:
    """A matplotlib figure with one compute row and one communication row per rank (milliseconds from the
    rank's window start)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure registry

    fig = Figure(figsize=(10, 0.9 * len(ranks) + 1.2))
    ax = fig.subplots()
    labels, ticks = [], []
    for r, data in enumerate(ranks):
        y = 2 * (len(ranks) - 1 - r)
        ax.broken_barh(data["compute"], (y + 1.05, 0.8), facecolors="tab:blue")
        ax.broken_barh(data["comm"], (y + 0.15, 0.8), facecolors="tab:orange")
        ticks += [y + 1.45, y + 0.55]
        labels += [f"rank {r} compute", f"rank {r} comm"]
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("ms since window start")
    ax.set_xlim(0, max(d["end"] for d in ranks) or 1)
    ax.set_title("compute vs communication per rank")
    fig.tight_layout()
    return fig

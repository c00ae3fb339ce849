"""Helpers shared by the benchmark scripts: paths, multi-process launch, step timing, summaries, tables, JSON.

Why one place: every benchmark must time the same way (perf_counter at the same Lightning hooks, warm-up left
out, the slowest rank per step, medians) and record the same metadata, or their numbers cannot be compared.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT / "tests"), str(ROOT)):  # the package, the examples and the tests' launcher
    if _p not in sys.path:
        sys.path.insert(0, _p)

from launch import launch  # noqa: E402  (tests/launch.py: the one multi-process launcher of the project)

__all__ = [
    "ROOT",
    "Lockstep",
    "launch",
    "format_table",
    "quiet_worker",
    "run_metadata",
    "slowest_rank_per_step",
    "step_timer",
    "summarize",
    "write_json",
]

NOISE_NOTE = (
    "CPU timings on a shared 2-core machine are noisy (other jobs, ranks sharing cores): read ratios within "
    "a few percent as equal, and compare only numbers taken in the same invocation."
)


def quiet_worker() -> None:
    """Silence Lightning's per-rank banners and warnings in launched workers, so the table stays readable."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (it sets its loggers to INFO on import: import first, then lower them)

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def synced_now(cuda: bool) -> float:
    """``perf_counter``; on cuda after the kernels queued so far have run (they run after the host queues them, so
    the host's time alone would time the queueing)."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def reset_peak_memory(cuda: bool) -> None:
    """Start a new peak of the CUDA caching allocator (nothing on the CPU)."""
    if cuda:
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(cuda: bool) -> dict[str, int] | None:
    """The process's peak GPU memory since the last :func:`reset_peak_memory`: what tensors used (allocated) and
    what the caching allocator took from the driver (reserved); None on the CPU."""
    if not cuda:
        return None
    import torch

    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def step_timer(cuda: bool = False) -> Any:
    """A Lightning Callback recording each training batch's wall time, ``on_train_batch_start`` to
    ``on_train_batch_end``, with ``time.perf_counter`` and no barrier (a barrier would change what is timed).
    With ``cuda``, the device is synchronized at both ends: kernels run after the host queues them, so the host's
    time alone would time the queueing.

    Built by a function so that importing this module does not import Lightning (3.5 s) for scripts without it.
    """
    from lightning.pytorch.callbacks import Callback

    def now() -> float:
        return synced_now(cuda)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._start = now()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(now() - self._start)

    return StepTimer()


class Lockstep:
    """Run several training loops in one process, one step at a time each, in a fixed rotation (A, B, C, A, ...).

    Why: on a shared machine other jobs' load comes in bursts of seconds; variants run one after the other let a
    burst fall on one of them only. With single steps interleaved, neighbouring steps of all variants see the same
    conditions. Each loop runs in its own thread but only the thread holding the turn runs, so the variants never
    compete for cores, and every rank issues its collectives in the same order (the rotation is the same on all).
    """

    def __init__(self, order: Sequence[str]) -> None:
        if len(set(order)) != len(order):
            raise ValueError(f"order={list(order)} names a participant twice")
        self.order = list(order)
        self._turn = 0
        self._done: set[str] = set()
        self._cond = threading.Condition()

    def run(self, loops: dict[str, Callable[[Callable[[], None]], Any]]) -> dict[str, Any]:
        """``loops[name](yield_turn)`` trains and returns a result; it must call ``yield_turn()`` after each timed
        step (outside the timed region). Returns each loop's result; re-raises the first failure."""
        results: dict[str, Any] = {}
        errors: dict[str, str] = {}

        def body(name: str) -> None:
            try:
                self._wait(name)
                results[name] = loops[name](lambda: self._yield(name))
            except BaseException:  # noqa: BLE001 - reported below, in the calling thread
                errors[name] = traceback.format_exc()
            finally:
                self._finish(name)

        threads = [threading.Thread(target=body, args=(name,), name=f"lockstep-{name}") for name in self.order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            name, tb = next(iter(errors.items()))
            raise RuntimeError(f"lockstep loop {name!r} failed:\n{tb}")
        return results

    def _current(self) -> str:
        return self.order[self._turn]

    def _wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._current() == name)

    def _advance(self) -> None:
        """Hand the turn to the next loop that has not finished (caller holds the condition)."""
        for _ in range(len(self.order)):
            self._turn = (self._turn + 1) % len(self.order)
            if self._current() not in self._done:
                break
        self._cond.notify_all()

    def _yield(self, name: str) -> None:
        with self._cond:
            self._advance()
            self._cond.wait_for(lambda: self._current() == name)

    def _finish(self, name: str) -> None:
        with self._cond:
            self._done.add(name)
            if self._current() == name:
                self._advance()


def slowest_rank_per_step(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step i of a synchronous data-parallel job takes as long as its slowest rank, so take the max over ranks."""
    lengths = {len(t) for t in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks recorded different step counts: {sorted(lengths)}")
    return [max(step) for step in zip(*per_rank)]


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median (the headline: robust to the odd step another job slowed down) with quartiles to show the spread."""
    if not times:
        raise ValueError("no step times to summarize")
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2], "min_s": min(times),
            "n": len(times)}


def run_metadata() -> dict[str, Any]:
    """Versions and machine state; the load average says how busy the shared machine was."""
    import lightning
    import torch

    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "noise_note": NOISE_NOTE,
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table: numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) or r[i] in ("", "-") for r in cells[1:]) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%").replace(",", ""))
    except ValueError:
        return False
    return True


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write results, creating the folder (benchmarks/results/ by default)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return out

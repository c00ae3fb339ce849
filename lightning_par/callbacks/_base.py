"""What the three monitors share: the logging-step decision and the summarize-then-log path."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_par.callbacks.cross_rank import log_on_rank_zero, summarize_across_ranks

_overhead_s = [0.0]  # seconds this process has spent in the monitors' own summaries, logging and trace analysis


def monitor_overhead_s() -> float:
    """Total time this process spent in monitor bookkeeping, so timing metrics can leave it out."""
    return _overhead_s[0]


@contextmanager
def monitor_overhead() -> Iterator[None]:
    """Count the enclosed time as monitor overhead (excluded from the step and data-wait times)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _overhead_s[0] += time.perf_counter() - t0


def check_positive_int(name: str, value: Any, allow_none: bool = False, minimum: int = 1) -> None:
    """ValueError naming the parameter, the value and the fix, before anything runs."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"`{name}` must be an int >= {minimum}{' or None' if allow_none else ''}, got {value!r}. "
            f"Pass e.g. {name}={max(minimum, 1) * 10}."
        )


class RankSummaryCallback(Callback):
    """Base: decide logging steps from ``trainer.global_step`` (equal on every rank) and publish summaries."""

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        check_positive_int("log_every_n_steps", log_every_n_steps, allow_none=True)
        self.log_every_n_steps = log_every_n_steps
        self._last_logged_step = -1

    def _interval(self, trainer: Any) -> int:
        return self.log_every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50))

    def _is_logging_step(self, trainer: Any, step: int | None = None) -> bool:
        step = trainer.global_step if step is None else step
        return step > 0 and step != self._last_logged_step and step % self._interval(trainer) == 0

    def _publish(self, trainer: Any, values: Mapping[str, float | None], names: Sequence[str]) -> dict[str, float]:
        """Collective on every rank, then rank-0 logging. Returns the summary (same on every rank)."""
        with monitor_overhead():
            self._last_logged_step = trainer.global_step
            summary = summarize_across_ranks(values, names)
            log_on_rank_zero(trainer, summary)
        return summary

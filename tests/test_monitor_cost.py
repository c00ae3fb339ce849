"""What the monitors cost a step, checked on the CPU (tests/test_gpu.py measures it on a GPU).

- Between logging steps their hooks do no summary (no collective) and take microseconds.
- CommOverlapMonitor asks kineto to detach CUPTI after a CUDA window (``TEARDOWN_CUPTI=1``), keeping a value the
  user or torch set: CUPTI left attached slows every later kernel launch.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.bench_callbacks import MLP
from lightning_par.callbacks import CommOverlapMonitor, DeviceUtilizationMonitor, MemoryMonitor, _base, overlap
from lightning_par.callbacks.overlap import CUPTI_TEARDOWN_ENV, request_cupti_teardown

STEPS, EVERY = 60, 10


def test_cupti_teardown_is_requested_unless_the_environment_decided(monkeypatch):
    monkeypatch.delenv(CUPTI_TEARDOWN_ENV, raising=False)
    assert request_cupti_teardown() is True
    assert os.environ[CUPTI_TEARDOWN_ENV] == "1"
    monkeypatch.setenv(CUPTI_TEARDOWN_ENV, "0")  # the user's (or torch's, under CUDA graphs) choice stays
    assert request_cupti_teardown() is False
    assert os.environ[CUPTI_TEARDOWN_ENV] == "0"


def test_teardown_cupti_option_is_checked():
    with pytest.raises(TypeError, match=r"`teardown_cupti`.*'yes'"):
        CommOverlapMonitor(teardown_cupti="yes")


def test_cpu_windows_leave_the_cupti_switch_alone(monkeypatch, tmp_path):
    """Only a CUDA window asks for the teardown: a CPU run's environment is not touched."""
    monkeypatch.delenv(CUPTI_TEARDOWN_ENV, raising=False)
    monitor = CommOverlapMonitor(every_n_steps=10, window_steps=2, warmup_steps=1, start_step=2)
    _fit([monitor], tmp_path, steps=6)
    assert monitor.last_values  # a window ran and was analysed
    assert CUPTI_TEARDOWN_ENV not in os.environ


def _fit(callbacks: list[Any], root: Any, steps: int = STEPS) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 16, 64, generator=g), torch.randn(steps * 16, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(str(root), name="csv"),
                        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=EVERY)
    trainer.fit(MLP(64), DataLoader(data, batch_size=16))


def test_between_logging_steps_the_hooks_summarize_nothing(monkeypatch, tmp_path):
    """Summaries (the only collective, and on CUDA the only host sync) run at the logging steps alone, once per
    monitor. What the hooks cost in time is measured by benchmarks/bench_callbacks.py (no timing assertions here)."""
    calls: list[tuple[str, ...]] = []

    def spy(values: Any, names: Any) -> dict[str, float]:
        calls.append(tuple(names))
        return real(values, names)

    real = _base.summarize_across_ranks
    monkeypatch.setattr(_base, "summarize_across_ranks", spy)
    monkeypatch.setattr(overlap, "summarize_across_ranks", spy)
    monitors = [DeviceUtilizationMonitor(), MemoryMonitor(), CommOverlapMonitor(start_step=STEPS + 10)]
    _fit(monitors, tmp_path)
    assert len(calls) == 2 * (STEPS // EVERY)  # utilization and memory, at each logging step; no window ran

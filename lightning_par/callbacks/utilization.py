"""DeviceUtilizationMonitor: step timing, data wait, throughput, MFU, and CPU or GPU (NVML) utilization.

Timing is host wall time from the batch hooks, with no device synchronization (that would change what it
measures): on a GPU the host runs ahead only until the allocator or a ``.item()`` stalls it, so over a logging
interval host time per step equals device time per step. For each training batch:

- compute part = ``on_train_batch_start`` -> ``on_train_batch_end`` (forward, backward, optimizer step);
- data wait = the end of this monitor's previous ``on_train_batch_end`` -> ``on_train_batch_start``: fetching the
  next batch plus the loop's own overhead (and other, non-monitor callbacks' batch-end hooks after this one);
- step time = compute part + data wait.

Time the monitors spend on themselves (this one's logging, the overlap monitor's trace analysis, the memory
monitor's summaries) is left out of both, whatever the callbacks' order.

The first batch of each epoch and the first after validation have no data wait to measure and are skipped.

FLOPs for ``perf/tflops_per_s`` and ``perf/mfu``: given (``flops_per_batch``), else counted during the first
training batch (the second under pipeline parallelism, whose first step runs an extra shape-inference forward);
``callbacks/flops.py`` says what is counted and why, and the start-up output names which way was taken. The
counted batch is not timed (the counter slows it).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_par.callbacks._base import RankSummaryCallback, monitor_overhead, monitor_overhead_s
from lightning_par.callbacks.flops import (
    SOURCE_TEXT,
    TRAINING_PER_FORWARD,
    FlopsPerBatch,
    ForwardFlopCounter,
    lookup_peak_flops,
    mean_over_batch_sharers,
    precision_kind,
)
from lightning_par.callbacks.nvml import NVML_FIELDS, NvmlSampler

IntOrFn = int | Callable[[Any], int]

__all__ = ["DeviceUtilizationMonitor", "default_batch_size", "default_num_tokens", "lookup_peak_flops"]


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)):  # before the (slower) ABC check: the common case
        items = batch
    elif isinstance(batch, Mapping):
        items = batch.values()
    else:
        return None
    for item in items:
        t = _first_tensor(item)
        if t is not None:
            return t
    return None


def _size(t: torch.Tensor | None) -> int | None:
    return int(t.shape[0]) if t is not None and t.dim() > 0 else None


def _tokens(batch: Any, first: torch.Tensor | None) -> int | None:
    if isinstance(batch, (list, tuple, torch.Tensor)):
        n = None
    elif isinstance(batch, Mapping):
        n = batch.get("num_tokens")
    else:
        n = getattr(batch, "num_tokens", None)
    if n is not None:
        return int(n)
    if first is not None and not first.is_floating_point() and not first.is_complex() and first.dtype != torch.bool:
        return int(first.numel())
    return None


def default_batch_size(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor (depth-first through tuples, lists, dicts)."""
    return _size(_first_tensor(batch))


def default_num_tokens(batch: Any) -> int | None:
    """Tokens in a batch: a ``"num_tokens"`` key or ``num_tokens`` attribute if there is one; else, when the first
    tensor holds integers (token ids, as in ``(x, y)`` language-model batches), its ``numel()``; else None.

    Give ``num_tokens`` as a Python int: a CUDA tensor there costs a device synchronization per step.
    """
    return _tokens(batch, _first_tensor(batch))


def _check_int_or_fn(name: str, value: Any) -> None:
    if value is None or callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(
            f"`{name}` must be a non-negative number or a callable taking the batch, got {value!r}. "
            f"Pass e.g. {name}=lambda batch: ... or a number."
        )


class DeviceUtilizationMonitor(RankSummaryCallback):
    """Logs step time, data-wait fraction, samples/s, tokens/s, MFU, and CPU percent or NVML GPU metrics.

    Args:
        log_every_n_steps: logging interval in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        batch_size: samples per batch (int or ``callable(batch)``); default :func:`default_batch_size`.
        tokens_per_batch: tokens per batch (int or ``callable(batch)``); default :func:`default_num_tokens`.
        flops_per_batch: model FLOPs of one training batch on one device (forward + backward), int or callable.
            Default: counted (see ``count_flops``).
        count_flops: when ``flops_per_batch`` is not given, count the FLOPs on the first training batch (Hugging
            Face models too: attention and the routed experts only); later batches scale by their tokens (else
            samples). ``False``: no FLOP metrics unless given.
        peak_flops_per_device: peak FLOP/s of one device for MFU; default: looked up by GPU name and the Trainer's
            precision (dense tensor-core figures, :data:`~lightning_par.callbacks.flops.PEAK_FLOPS`); none on CPU,
            where ``perf/tflops_per_s`` is still logged.
        nvml_interval_s: NVML polling period of the background thread.
        nvml: the NVML module (``pynvml``) to use; a test double may be passed. NVML is used on CUDA devices, or
            whenever this is given.
        nvml_device_index: NVML device to poll when ``nvml`` is given and torch has no CUDA device (tests).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        batch_size: IntOrFn | None = None,
        tokens_per_batch: IntOrFn | None = None,
        flops_per_batch: IntOrFn | float | None = None,
        count_flops: bool = True,
        peak_flops_per_device: float | None = None,
        nvml_interval_s: float = 0.1,
        nvml: Any | None = None,
        nvml_device_index: int = 0,
    ) -> None:
        super().__init__(log_every_n_steps)
        for name, value in (
            ("batch_size", batch_size),
            ("tokens_per_batch", tokens_per_batch),
            ("flops_per_batch", flops_per_batch),
        ):
            _check_int_or_fn(name, value)
        if peak_flops_per_device is not None and not (
            isinstance(peak_flops_per_device, (int, float)) and peak_flops_per_device > 0
        ):
            raise ValueError(
                f"`peak_flops_per_device` must be a positive FLOP/s number, got {peak_flops_per_device!r}. "
                f"Pass e.g. 989e12 for an H100 SXM in bf16, or leave it None to look it up."
            )
        if not (isinstance(nvml_interval_s, (int, float)) and nvml_interval_s > 0):
            raise ValueError(f"`nvml_interval_s` must be > 0 seconds, got {nvml_interval_s!r}. Pass e.g. 0.1.")
        if not isinstance(count_flops, bool):
            raise TypeError(f"`count_flops` must be True or False, got {count_flops!r}.")
        self.batch_size = batch_size
        self.tokens_per_batch = tokens_per_batch
        self.flops_per_batch = flops_per_batch
        self.count_flops = count_flops
        self.peak_flops_per_device = peak_flops_per_device
        #: where the FLOPs come from ("given", "counted" or None) and the start-up line that says so
        self.flops_source: str | None = None
        self.flops_note: str | None = None
        #: the per-device count of the first batch, scaled to later ones (None until that batch has run)
        self.flops_estimate: FlopsPerBatch | None = None
        self._counter: ForwardFlopCounter | None = None
        self._counting = self._count_pending = False
        self._count_batch = self._batches_seen = 0
        self.nvml_interval_s = nvml_interval_s
        self._nvml_module = nvml
        self.nvml_device_index = nvml_device_index
        self._sampler: NvmlSampler | None = None
        self._process: Any = None
        self._names: list[str] = []
        self._peak: float | None = None
        self._reset_interval()
        self._t_start: float | None = None
        self._t_resume: float | None = None
        self._o_start = self._o_resume = 0.0

    # --- setup -------------------------------------------------------------------------------------------------
    def _reset_interval(self) -> None:
        self._steps = 0
        self._step_s = 0.0
        self._wait_s = 0.0
        self._samples = 0.0
        self._tokens = 0.0
        self._flops = 0.0
        self._has_samples = self._has_tokens = self._has_flops = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        device = pl_module.device
        use_nvml = device.type == "cuda" or self._nvml_module is not None
        if use_nvml and self._sampler is None:
            index = device.index if device.type == "cuda" and device.index is not None else self.nvml_device_index
            try:
                self._sampler = NvmlSampler(index, self.nvml_interval_s, self._nvml_module)
            except Exception as err:  # noqa: BLE001 - no NVML (some containers): timing metrics still work
                warnings.warn(f"DeviceUtilizationMonitor: NVML unavailable, no gpu/* metrics: {err}", stacklevel=2)
        if self._sampler is not None:
            self._sampler.read()  # drop anything from before training
            self._sampler.start()
        self._setup_flops(trainer, pl_module)
        import psutil

        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # starts psutil's measurement interval
        # the names depend only on options and the device type, so every rank sends the same vector
        names = ["perf/step_time_s", "perf/data_wait_frac", "perf/samples_per_s", "perf/tokens_per_s"]
        if self.flops_source is not None:
            names += ["perf/tflops_per_s", "perf/mfu"]
        names.append("perf/cpu_percent")
        if use_nvml:  # even where NVML failed to start: this rank then sends NaN, the vector keeps its length
            names += [f"gpu/{f}" for f in NVML_FIELDS if f != "energy_j"] + ["gpu/energy_j_per_step"]
        self._names = names
        self._reset_interval()
        self._t_resume = None

    def _setup_flops(self, trainer: Any, pl_module: Any) -> None:
        """Decide where the FLOPs come from (the same on every rank: it depends on options and the model's class)
        and the peak to divide by."""
        device = pl_module.device
        self.flops_estimate, self._counter, self.flops_note = None, None, None
        if self.flops_per_batch is not None:
            self.flops_source = "given"
        elif self.count_flops:
            self.flops_source = "counted"
        else:
            self.flops_source = None
        self._count_pending = self.flops_source == "counted"
        # torch's pipeline schedules (2.13) run one extra forward per stage on their first step to infer the
        # stages' shapes: not model work, so under pipeline parallelism the second batch is counted (and not timed)
        self._count_batch = 1 if getattr(trainer.strategy, "pipeline", None) is not None else 0
        self._batches_seen = 0
        self._peak = self.peak_flops_per_device
        kind = precision_kind(getattr(trainer, "precision", None))
        if self._peak is not None:
            self._peak_text = f"{self._peak / 1e12:g} TFLOP/s (given)"
        elif device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self._peak = lookup_peak_flops(name, kind) if kind else None
            self._peak_text = f"{self._peak / 1e12:g} TFLOP/s ({name}, {kind})" if self._peak else "unknown"
            if self._peak is None and self.flops_source is not None:
                rank_zero_warn(
                    f"DeviceUtilizationMonitor: no peak FLOP/s known for {name!r} at precision "
                    f"{getattr(trainer, 'precision', None)!r}, so `perf/mfu` is not logged (`perf/tflops_per_s` is). "
                    f"Pass `peak_flops_per_device`."
                )
        else:
            self._peak_text = f"none on {device.type}"
        if self.flops_source == "given":
            self._announce("")

    def _announce(self, count: str) -> None:
        metrics = "perf/tflops_per_s and perf/mfu" if self._peak else "perf/tflops_per_s (no perf/mfu)"
        source = SOURCE_TEXT[self.flops_source].format(batch=self._count_batch)
        self.flops_note = (f"DeviceUtilizationMonitor: flops: {source}{count}; "
                           f"peak: {self._peak_text} -> {metrics}")
        rank_zero_info(self.flops_note)

    def _start_counting(self) -> None:
        if (self._count_pending and self.flops_source == "counted" and self._counter is None
                and self._batches_seen == self._count_batch):
            self._counter = ForwardFlopCounter()
            self._counter.__enter__()
            self._counting = True

    def _stop_counting(self) -> None:
        """The counter is entered in one hook and left in a later one; every way out of the step leaves it."""
        if self._counting and self._counter is not None:
            self._counting = False
            self._counter.__exit__(None, None, None)

    def _local_flops(self, trainer: Any, batch: Any) -> tuple[float, str]:
        """This rank's model FLOPs for the first batch, NaN with the reason when there are none."""
        counter, self._counter = self._counter, None
        if counter is None:
            return math.nan, "the first batch was not counted"
        if counter.error is not None:
            return math.nan, f"counting failed on {counter.error}"
        return float(TRAINING_PER_FORWARD * counter.forward_flops), "no matmul or attention was seen"

    def _finish_count(self, trainer: Any, batch: Any, samples: float | None, tokens: float | None) -> None:
        """After the first batch, on every rank: this rank's count, averaged over the ranks sharing the batch."""
        self._stop_counting()
        self._count_pending = False
        flops, why = self._local_flops(trainer, batch)
        dims, sharers = getattr(trainer.strategy, "dims", None), 1
        if dims is not None and getattr(dims, "world_size", 1) > 1:
            flops, sharers = mean_over_batch_sharers(flops, dims)
        if not flops > 0:  # NaN or zero
            rank_zero_warn(f"DeviceUtilizationMonitor: no FLOP count for the model ({why or 'another rank failed'}), "
                           f"so neither perf/tflops_per_s nor perf/mfu is logged. Pass `flops_per_batch`.")
            return
        self.flops_estimate = FlopsPerBatch(flops, tokens, samples, self.flops_source)
        per_token = f", {flops / tokens:.4g} per token" if tokens else ""
        shared = f", the mean over the {sharers} ranks that read the same batch" if sharers > 1 else ""
        self._announce(f": {flops:.4g} FLOP per device per batch{per_token}{shared}")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stop_counting()  # the optimizer's own math is not the model's

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop_counting()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop_counting()
        if self._sampler is not None:
            self._sampler.stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop_counting()
        if self._sampler is not None:
            self._sampler.stop()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._t_resume = None  # the gap since the last batch is not data loading

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop_counting()  # a batch skipped by on_train_batch_start returning -1 never reaches batch end

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._t_resume = None

    # --- per batch ---------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start_counting()
        self._t_start = time.perf_counter()
        self._o_start = monitor_overhead_s()

    @staticmethod
    def _value(spec: Any, batch: Any) -> float | None:
        v = spec(batch) if callable(spec) else spec
        return None if v is None else float(v)

    def _batch_counts(self, batch: Any) -> tuple[float | None, float | None]:
        """(samples, tokens) of a batch, by the options or the defaults."""
        first = _first_tensor(batch) if self.batch_size is None or self.tokens_per_batch is None else None
        samples = _size(first) if self.batch_size is None else self._value(self.batch_size, batch)
        tokens = _tokens(batch, first) if self.tokens_per_batch is None else self._value(self.tokens_per_batch, batch)
        return samples, tokens

    def _batch_flops(self, batch: Any, samples: float | None, tokens: float | None) -> float | None:
        if self.flops_per_batch is not None:
            return self._value(self.flops_per_batch, batch)
        return None if self.flops_estimate is None else self.flops_estimate(tokens, samples)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        t_end, o_end = time.perf_counter(), monitor_overhead_s()
        counted = self._count_pending and self._batches_seen == self._count_batch
        self._batches_seen += 1
        # the counted batch is not timed: the counter slows it (the first batch is never timed anyway)
        measured = self._t_start is not None and self._t_resume is not None and not counted
        samples = tokens = None
        if measured or counted:
            samples, tokens = self._batch_counts(batch)
        if counted:  # every rank, one small gather
            with monitor_overhead():
                self._finish_count(trainer, batch, samples, tokens)
        if measured:
            # other monitors' bookkeeping (trace analysis, summaries) is not training time: leave it out
            wait = max(0.0, (self._t_start - self._t_resume) - (self._o_start - self._o_resume))
            compute = max(0.0, (t_end - self._t_start) - (o_end - self._o_start))
            self._steps += 1
            self._step_s += compute + wait
            self._wait_s += wait
            if samples is None:
                self._has_samples = False
            else:
                self._samples += samples
            if tokens is None:
                self._has_tokens = False
            else:
                self._tokens += tokens
            if self.flops_source is not None:
                flops = self._batch_flops(batch, samples, tokens)
                if flops is None:
                    self._has_flops = False
                else:
                    self._flops += flops
        if self._is_logging_step(trainer):
            self._publish(trainer, self._interval_values(), self._names)
            self._reset_interval()
        self._t_resume, self._o_resume = time.perf_counter(), monitor_overhead_s()

    def _interval_values(self) -> dict[str, float | None]:
        v: dict[str, float | None] = {"perf/cpu_percent": self._process.cpu_percent(None) if self._process else None}
        if self._steps and self._step_s > 0:
            v["perf/step_time_s"] = self._step_s / self._steps
            v["perf/data_wait_frac"] = self._wait_s / self._step_s
            if self._has_samples:
                v["perf/samples_per_s"] = self._samples / self._step_s
            if self._has_tokens:
                v["perf/tokens_per_s"] = self._tokens / self._step_s
            if self._has_flops and self.flops_source is not None:
                achieved = self._flops / self._step_s
                v["perf/tflops_per_s"] = achieved / 1e12
                v["perf/mfu"] = achieved / self._peak if self._peak else None
        if self._sampler is not None:
            gpu = self._sampler.read()
            energy = gpu.pop("energy_j", None)
            v.update({f"gpu/{k}": val for k, val in gpu.items()})
            if energy is not None and self._steps:
                v["gpu/energy_j_per_step"] = energy / self._steps
        return {k: (None if val is None or math.isinf(val) else val) for k, val in v.items()}

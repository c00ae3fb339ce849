"""MemoryMonitor: per-interval memory peaks, fragmentation, allocator retries/OOMs, and memory outside torch.

On CUDA the caching allocator's own counters are read (``torch.cuda.memory_stats``) and its peaks reset after
each log, so each logged peak belongs to its interval (this resets the peaks for everyone in the process: code that
reads ``max_memory_allocated`` for itself should not run beside this monitor). Memory outside the allocator (NCCL
buffers, the CUDA context, cuBLAS workspaces) = this process's device memory per NVML, or, without NVML,
``total - free`` from ``cudaMemGetInfo`` (which counts every process on the GPU) minus reserved bytes.

On CPU: resident set size now and its peak. The peak is the kernel's high-water mark (``VmHWM``), reset after
each log through ``/proc/self/clear_refs`` where Linux allows it; elsewhere it is the peak since process start.

Snapshots: at ``snapshot_at_step`` and on an out-of-memory error (``torch.OutOfMemoryError`` reaching the Trainer,
or the CUDA allocator's OOM observer), a dump goes to ``snapshot_dir``: a ``torch.cuda.memory`` snapshot pickle
on CUDA (open it at https://pytorch.org/memory_viz; ``record_history=True`` adds stack traces), a JSON memory
report on CPU.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import torch

from lightning_par.callbacks._base import RankSummaryCallback, check_positive_int

CUDA_NAMES = (
    "mem/allocated_peak_bytes",
    "mem/active_peak_bytes",
    "mem/reserved_peak_bytes",
    "mem/allocated_bytes",
    "mem/reserved_bytes",
    "mem/fragmentation",
    "mem/alloc_retries",
    "mem/ooms",
    "mem/outside_allocator_bytes",
)
CPU_NAMES = ("mem/rss_bytes", "mem/rss_peak_bytes")


def _read_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak RSS (VmHWM) to the current RSS; nothing else changes
        return True
    except OSError:
        return False


_process: list[Any] = []  # this process's psutil handle, made once


def _this_process() -> Any:
    import psutil

    if not _process or _process[0].pid != os.getpid():  # a forked child gets its own
        _process[:] = [psutil.Process(os.getpid())]
    return _process[0]


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return int(_this_process().memory_info().rss)


def rss_peak_bytes() -> int:
    """Peak resident set size: since the last reset on Linux, since process start elsewhere."""
    hwm = _read_status_kb("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryMonitor(RankSummaryCallback):
    """Logs per-interval memory peaks and allocator health, summarized across ranks (see the module docstring).

    Args:
        log_every_n_steps: logging interval in optimizer steps (default: the Trainer's ``log_every_n_steps``).
        snapshot_at_step: global step after which to dump a memory snapshot (None: never).
        snapshot_on_oom: dump a snapshot when an out-of-memory error happens.
        snapshot_dir: where dumps go (default: ``<trainer.default_root_dir>/memory_snapshots``).
        record_history: on CUDA, record allocation stack traces from the start of training so snapshots show them
            (costs a few percent of step time; off by default).
        nvml: the NVML module for the per-process "outside the allocator" reading on CUDA (default ``pynvml``
            when it can initialize; else ``mem_get_info`` is used).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        snapshot_at_step: int | None = None,
        snapshot_on_oom: bool = False,
        snapshot_dir: str | None = None,
        record_history: bool = False,
        nvml: Any | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        check_positive_int("snapshot_at_step", snapshot_at_step, allow_none=True)
        self.snapshot_at_step = snapshot_at_step
        self.snapshot_on_oom = bool(snapshot_on_oom)
        self.snapshot_dir = snapshot_dir
        self.record_history = bool(record_history)
        self._nvml = nvml
        self._nvml_handle: Any = None
        self._device: torch.device | None = None
        self._last_retries = 0
        self._last_ooms = 0
        self._trainer: Any = None
        self.snapshots: list[str] = []  # paths written by this rank

    # --- setup -------------------------------------------------------------------------------------------------
    @property
    def _cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._device = pl_module.device
        self._trainer = trainer
        if self._cuda:
            stats = torch.cuda.memory_stats(self._device)
            self._last_retries = stats.get("num_alloc_retries", 0)
            self._last_ooms = stats.get("num_ooms", 0)
            torch.cuda.reset_peak_memory_stats(self._device)
            self._init_nvml()
            if self.record_history:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            if self.snapshot_on_oom:
                attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
                if attach is not None:  # private API: without it, only OOMs reaching the Trainer dump
                    attach(self._on_cuda_oom)
        else:
            _reset_peak_rss()

    def _init_nvml(self) -> None:
        try:
            from lightning_par.callbacks.nvml import _default_nvml, nvml_handle

            nv = self._nvml if self._nvml is not None else _default_nvml()
            nv.nvmlInit()
            self._nvml_handle = nvml_handle(nv, self._device.index or 0)
            self._nvml = nv
        except Exception:  # noqa: BLE001 - no NVML: fall back to mem_get_info
            self._nvml_handle = None

    # --- readings ----------------------------------------------------------------------------------------------
    def _outside_allocator(self, reserved: int) -> float | None:
        if self._nvml_handle is not None:
            try:
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle):
                    if p.pid == os.getpid() and p.usedGpuMemory is not None:
                        return float(p.usedGpuMemory - reserved)
            except Exception:  # noqa: BLE001 - not permitted in some containers: fall back below
                pass
        free, total = torch.cuda.mem_get_info(self._device)
        return float(total - free - reserved)

    def read(self) -> dict[str, float]:
        """This rank's values for the current interval (resets the interval's peaks)."""
        if not self._cuda:
            values = {"mem/rss_bytes": float(rss_bytes()), "mem/rss_peak_bytes": float(rss_peak_bytes())}
            _reset_peak_rss()
            return values
        s = torch.cuda.memory_stats(self._device)
        allocated = s.get("allocated_bytes.all.current", 0)
        reserved = s.get("reserved_bytes.all.current", 0)
        retries, ooms = s.get("num_alloc_retries", 0), s.get("num_ooms", 0)
        values = {
            "mem/allocated_peak_bytes": float(s.get("allocated_bytes.all.peak", 0)),
            "mem/active_peak_bytes": float(s.get("active_bytes.all.peak", 0)),
            "mem/reserved_peak_bytes": float(s.get("reserved_bytes.all.peak", 0)),
            "mem/allocated_bytes": float(allocated),
            "mem/reserved_bytes": float(reserved),
            "mem/fragmentation": 1.0 - allocated / reserved if reserved else 0.0,
            "mem/alloc_retries": float(retries - self._last_retries),
            "mem/ooms": float(ooms - self._last_ooms),
        }
        outside = self._outside_allocator(reserved)
        if outside is not None:
            values["mem/outside_allocator_bytes"] = outside
        self._last_retries, self._last_ooms = retries, ooms
        torch.cuda.reset_peak_memory_stats(self._device)
        return values

    # --- hooks -------------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.snapshot_at_step is not None and step == self.snapshot_at_step and not self._snapshot_taken(step):
            self.dump_snapshot(f"step{step}")
        if self._is_logging_step(trainer, step):
            self._publish(trainer, self.read(), CUDA_NAMES if self._cuda else CPU_NAMES)

    def _snapshot_taken(self, step: int) -> bool:
        return any(f"step{step}" in os.path.basename(p) for p in self.snapshots)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.snapshot_on_oom and isinstance(exception, torch.OutOfMemoryError):
            self.dump_snapshot("oom")

    def _on_cuda_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        self.dump_snapshot("oom")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._cuda and self.record_history:
            torch.cuda.memory._record_memory_history(enabled=None)

    def dump_snapshot(self, tag: str) -> str:
        """Write this rank's snapshot now; returns its path. Local to the rank: no collective."""
        trainer = self._trainer
        root = self.snapshot_dir or os.path.join(
            getattr(trainer, "default_root_dir", None) or os.getcwd(), "memory_snapshots"
        )
        os.makedirs(root, exist_ok=True)
        rank = getattr(trainer, "global_rank", 0)
        if self._cuda:
            path = os.path.join(root, f"rank{rank}_{tag}.pickle")
            torch.cuda.memory._dump_snapshot(path)
        else:
            path = os.path.join(root, f"rank{rank}_{tag}.json")
            info = _this_process().memory_full_info()._asdict()
            report = {
                "tag": tag,
                "rank": rank,
                "global_step": getattr(trainer, "global_step", None),
                "rss_bytes": rss_bytes(),
                "rss_peak_bytes": rss_peak_bytes(),
                "memory_full_info": {k: int(v) for k, v in info.items()},
            }
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
        self.snapshots.append(path)
        return path

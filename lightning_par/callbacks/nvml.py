"""NVML sampling in a background thread, averaged between reads (one read per logging interval).

Why a thread: NVML's counters are instantaneous (power, clocks, throttle reasons) or short-window (utilization,
GPM), so one read per logging step would see a single instant. A daemon thread polling every ``interval_s``
and keeping running sums costs the training loop nothing (the NVML calls release the GIL in ctypes) and gives
interval means. Any metric the GPU does not support (NVMLError on first use) is dropped and reported as missing.

The ``nvml`` object is the ``pynvml`` module from ``nvidia-ml-py`` by default; tests pass a fake with the same
functions because NVML cannot run on a machine without a GPU.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

# throttle ("clocks event") reason bits, as in nvml.h
_POWER = 0x4 | 0x80  # SW power cap, HW power brake
_THERMAL = 0x20 | 0x40  # SW thermal, HW thermal slowdown
_HW_SLOWDOWN = 0x8

#: GPM metric ids (nvml.h): SM active, SM occupancy, any tensor-core active, DRAM bandwidth.
GPM_METRICS = {"sm_active_pct": 2, "sm_occupancy_pct": 3, "tensor_active_pct": 5, "dram_bw_pct": 10}

#: The values :meth:`NvmlSampler.read` returns (all means over the interval unless noted).
NVML_FIELDS = (
    "busy_pct",
    "mem_bw_pct",
    "sm_active_pct",
    "sm_occupancy_pct",
    "tensor_active_pct",
    "dram_bw_pct",
    "power_w",
    "energy_j",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "throttle/any_frac",
    "throttle/power_frac",
    "throttle/thermal_frac",
    "throttle/hw_slowdown_frac",
)


def _default_nvml() -> Any:
    import pynvml

    return pynvml


def nvml_handle(nvml: Any, device_index: int) -> Any:
    """The NVML handle of torch's CUDA device ``device_index`` (by UUID, so CUDA_VISIBLE_DEVICES is respected)."""
    try:
        import torch

        if torch.cuda.is_available():
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # noqa: BLE001 - fall back to the index below
        pass
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


class NvmlSampler:
    """Poll one GPU through NVML; :meth:`read` returns the means since the previous read."""

    def __init__(self, device_index: int, interval_s: float = 0.1, nvml: Any | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"`interval_s` must be > 0 seconds, got {interval_s!r}. Pass e.g. 0.1.")
        self.nvml = nvml if nvml is not None else _default_nvml()
        self.interval_s = interval_s
        self.nvml.nvmlInit()
        self.handle = nvml_handle(self.nvml, device_index)
        self._lock = threading.Lock()  # guards the sums
        self._sample_lock = threading.Lock()  # one sample at a time (the thread, or read() topping up)
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self._disabled: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpm_prev = None
        self._gpm_ok = self._gpm_supported()
        self._energy_prev = self._energy_mj()

    # --- reads that may be unsupported -------------------------------------------------------------------------
    def _try(self, key: str, fn: Any, *args: Any) -> Any:
        if key in self._disabled:
            return None
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: drop that metric
            self._disabled.add(key)
            return None

    def _gpm_supported(self) -> bool:
        support = self._try("gpm", getattr(self.nvml, "nvmlGpmQueryDeviceSupport", None) or _unsupported, self.handle)
        return bool(support is not None and getattr(support, "isSupportedDevice", 0))

    def _energy_mj(self) -> float | None:
        return self._try("energy", self.nvml.nvmlDeviceGetTotalEnergyConsumption, self.handle)

    def _gpm(self) -> dict[str, float]:
        nv = self.nvml
        sample = self._try("gpm", nv.nvmlGpmSampleAlloc)
        if sample is None or self._try("gpm", nv.nvmlGpmSampleGet, self.handle, sample) is None:
            self._gpm_ok = False
            return {}
        prev, self._gpm_prev = self._gpm_prev, sample
        if prev is None:
            return {}
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version = nv.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(GPM_METRICS)
        req.sample1, req.sample2 = prev, sample
        for i, metric_id in enumerate(GPM_METRICS.values()):
            req.metrics[i].metricId = metric_id
        if self._try("gpm", nv.nvmlGpmMetricsGet, req) is None:
            self._gpm_ok = False
            return {}
        free = getattr(nv, "nvmlGpmSampleFree", None)
        if free is not None:
            self._try("gpm_free", free, prev)
        return {name: float(req.metrics[i].value) for i, name in enumerate(GPM_METRICS)}

    # --- sampling ----------------------------------------------------------------------------------------------
    def sample(self) -> None:
        """Take one sample of every supported metric (the thread calls this; tests may call it directly)."""
        with self._sample_lock:
            self._sample()

    def _sample(self) -> None:
        nv, h = self.nvml, self.handle
        values: dict[str, float] = {}
        util = self._try("util", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            values["busy_pct"] = float(util.gpu)
            values["mem_bw_pct"] = float(util.memory)
        power = self._try("power", nv.nvmlDeviceGetPowerUsage, h)
        if power is not None:
            values["power_w"] = power / 1000.0
        sm = self._try("sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        if sm is not None:
            values["sm_clock_mhz"] = float(sm)
        mem = self._try("mem_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        if mem is not None:
            values["mem_clock_mhz"] = float(mem)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", _unsupported
        )
        reasons = self._try("throttle", reasons_fn, h)
        if reasons is not None:
            values["throttle/power_frac"] = float(bool(reasons & _POWER))
            values["throttle/thermal_frac"] = float(bool(reasons & _THERMAL))
            values["throttle/hw_slowdown_frac"] = float(bool(reasons & _HW_SLOWDOWN))
            values["throttle/any_frac"] = float(bool(reasons & (_POWER | _THERMAL | _HW_SLOWDOWN)))
        if self._gpm_ok:
            values.update(self._gpm())
        with self._lock:
            for k, v in values.items():
                self._sums[k] += v
                self._counts[k] += 1

    def read(self) -> dict[str, float]:
        """Means since the last read, and ``energy_j``: joules used since the last read (NVML's energy counter).

        An interval shorter than the polling period gets one sample taken here, so it is never empty.
        """
        with self._lock:
            empty = not self._counts
        if empty:
            self.sample()
        with self._lock:
            out = {k: self._sums[k] / n for k, n in self._counts.items() if n}
            self._sums.clear()
            self._counts.clear()
        energy = self._energy_mj()
        if energy is not None and self._energy_prev is not None:
            out["energy_j"] = (energy - self._energy_prev) / 1000.0
        self._energy_prev = energy
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        """Start the polling thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="lightning_par-nvml", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the polling thread and wait for it (idempotent)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def _unsupported(*_: Any) -> Any:
    """Stands in for an NVML function this nvidia-ml-py does not have: the metric is then reported unsupported."""
    raise AttributeError("not provided by this nvidia-ml-py version")

"""Monitoring callbacks: device utilization, communication overlap, memory, experts' load; summarized across ranks.

Each callback observes training and never changes it. Per-rank values are gathered with one small ``all_gather``
per logging step in a hook every rank runs, and logged on rank 0 as ``<name>/min``, ``<name>/max`` and
``<name>/max_rank`` through the Trainer's loggers. ``docs/monitoring.md`` lists every metric.
"""

from lightning_par.callbacks.cross_rank import summarize_across_ranks
from lightning_par.callbacks.expert_load import ExpertLoadMonitor
from lightning_par.callbacks.memory import MemoryMonitor
from lightning_par.callbacks.overlap import CommOverlapMonitor
from lightning_par.callbacks.pipeline_timeline import PipelineTimelineMonitor
from lightning_par.callbacks.utilization import DeviceUtilizationMonitor

__all__ = ["CommOverlapMonitor", "DeviceUtilizationMonitor", "ExpertLoadMonitor", "MemoryMonitor",
           "PipelineTimelineMonitor", "summarize_across_ranks"]

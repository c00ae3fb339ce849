"""Cross-rank summaries (min, max, rank of the max) and rank-zero logging to the Trainer's loggers.

Why one ``all_gather`` of a float vector: a straggler or an imbalanced rank only shows when every rank's value
is compared, and a vector of a few dozen floats costs one small collective per logging step. Every rank must
call :func:`summarize_across_ranks` at the same step with the same ``names`` (the callbacks call it from
``on_train_batch_end``, which every rank runs, and decide the step from ``trainer.global_step``, which every rank
shares). Missing values travel as NaN, so the vector has the same length everywhere. Only the logging itself is
rank-zero: no collective ever runs in rank-zero-only code.

Why ``logger.log_metrics(..., step=trainer.global_step)`` and not ``LightningModule.log``: ``self.log`` reduces
with one collective per key and only knows mean/sum/max (no arg-max), is tied to the module's hooks, and its
``sync_dist`` would run on ranks' values that are meant to differ. Calling each logger directly on rank 0 writes
exactly the summarized values, at the optimizer step, through every configured logger (TensorBoard, W&B, CSV).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_par.callbacks.trace import MONITOR_MARK


def _gather_device() -> torch.device:
    """CPU where the default group can talk on it (gloo), else this rank's GPU (NCCL-only groups)."""
    backend = str(dist.get_backend())
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def gather_values(values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (same length on every rank), rank 0 first; the local list when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [list(values)]
    local = torch.tensor(list(values), dtype=torch.float64, device=_gather_device())
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    with torch.profiler.record_function(MONITOR_MARK):  # so the overlap analysis leaves this gather out
        dist.all_gather(out, local)
    return torch.stack(out).cpu().tolist()


def summarize(names: Sequence[str], per_rank: Sequence[Sequence[float]]) -> dict[str, float]:
    """``<name>/min``, ``<name>/max`` and ``<name>/max_rank`` for each name some rank has a value for."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        column = [(row[i], rank) for rank, row in enumerate(per_rank) if not math.isnan(row[i])]
        if not column:
            continue
        values = [v for v, _ in column]
        top, top_rank = max(column, key=lambda vr: (vr[0], -vr[1]))  # ties: the lowest rank
        out[f"{name}/min"] = min(values)
        out[f"{name}/max"] = top
        out[f"{name}/max_rank"] = float(top_rank)
    return out


def summarize_across_ranks(values: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """Collective: gather ``values`` (keys among ``names``; absent or None -> NaN) and summarize them.

    Must be called by every rank with the same ``names`` in the same order. Returns the same dict on every rank.
    """
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(
            f"`values` has keys {sorted(unknown)} that are not in `names`; add them to `names` so every rank "
            f"sends the same vector."
        )
    row = [float("nan") if values.get(n) is None else float(values[n]) for n in names]
    return summarize(names, gather_values(row))


def writes_logs(trainer: Any) -> bool:
    """Whether this rank writes the run's logs: global rank 0, and the rank Lightning's loggers write on (these
    differ under fault-tolerant replica groups, where only group 0's rank 0 logs)."""
    return bool(trainer.is_global_zero) and rank_zero_only.rank == 0


def log_on_rank_zero(trainer: Any, metrics: Mapping[str, float]) -> None:
    """Write ``metrics`` through each of the Trainer's loggers at ``trainer.global_step``, on global rank 0 only."""
    if not metrics or not writes_logs(trainer):
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=trainer.global_step)


def log_figure_on_rank_zero(trainer: Any, name: str, figure: Any) -> list[str]:
    """Log a matplotlib figure as an image: TensorBoard images, W&B media, or a PNG next to other loggers' files.

    Returns where it went (for tests and messages). Rank 0 only; other ranks return ``[]``.
    """
    if not writes_logs(trainer):
        return []
    import os

    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    where = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_figure(name, figure, global_step=trainer.global_step, close=False)
            where.append("tensorboard")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=name, images=[figure], step=trainer.global_step)
            where.append("wandb")
        else:
            log_dir = getattr(logger, "log_dir", None) or trainer.default_root_dir
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, f"{name.replace('/', '_')}_step{trainer.global_step}.png")
            figure.savefig(path)
            where.append(path)
    return where

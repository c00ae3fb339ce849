"""ExpertLoadMonitor: how evenly a mixture of experts' router spreads tokens over the experts, layer by layer.

Counts the (token, choice) rows each experts module receives per expert, over the training batches between two
logging steps and over every data-parallel rank (the routing decisions of the whole global batch), and logs per
layer the busiest expert's load relative to the mean (``moe/<layer>/max_over_mean``: 1.0 is perfect balance, E means
one expert took everything) and the share of experts that got no token, plus their worst and mean over layers; for a
model that drops choices over a capacity and reports them (:func:`lightning_par.count_dropped_choices`), the share
dropped per layer (``moe/<layer>/dropped``, its mean and max, and the worst expert's); and a layers x experts heat
map of the token shares (PNG, TensorBoard and Weights & Biases image). Expert parallelism makes the busiest
expert's rank the step's straggler, so ``max_over_mean`` is also its slowdown bound.

The experts modules are the ones expert parallelism splits: the strategy's ``ep_plan``, else the LightningModule's
``ep_plan`` attribute, else the Hugging Face models' ``base_model_ep_plan``; with or without ``ep > 1``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from lightning_par.callbacks._base import check_positive_int, monitor_overhead
from lightning_par.callbacks.cross_rank import writes_logs
from lightning_par.techniques.experts.experts import TokenCounter, find_experts


class ExpertLoadMonitor(Callback):
    """Log the experts' load every ``log_every_n_steps`` training steps (default: the Trainer's), and draw the heat
    map every ``heatmap_every_n_steps`` (``None``: never). ``dirpath``: where the PNGs go (default
    ``<log_dir>/expert_load``)."""

    def __init__(self, log_every_n_steps: int | None = None, heatmap_every_n_steps: int | None = 100,
                 dirpath: str | os.PathLike | None = None) -> None:
        check_positive_int("log_every_n_steps", log_every_n_steps, allow_none=True)
        check_positive_int("heatmap_every_n_steps", heatmap_every_n_steps, allow_none=True)
        self.log_every_n_steps, self.heatmap_every_n_steps = log_every_n_steps, heatmap_every_n_steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.layers: list[str] = []  # FQNs of this rank's experts modules
        self.counter: TokenCounter | None = None  # (layers, experts) rows routed since the last logging step
        self.last: dict[str, float] = {}  # the last logged metrics (every rank)
        self.last_shares: torch.Tensor | None = None  # the last (layers, experts) token shares (every rank)
        self.all_layers: list[str] = []  # the layers of the last shares: every pipeline rank's
        self.written: list[Path] = []

    # ---- finding and hooking the experts ---------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # trainer.log_dir is a collective: resolved where every rank runs
            self._dir = self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "expert_load"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(getattr(trainer.strategy, "expert_parallel", None), "plan", None)
        experts = find_experts(pl_module, plan)
        if not experts:
            raise ValueError(
                f"ExpertLoadMonitor found no experts module in {type(pl_module).__name__}. It needs an `ep_plan` "
                f"(strategy argument or LightningModule attribute) or a Hugging Face mixture of experts; remove the "
                f"callback for a model without experts.")
        self.counter = TokenCounter(experts, pl_module.device)
        self.layers = self.counter.names

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.counter is not None:
            self.counter.remove()

    # ---- logging ---------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        every = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps or 50))
        if self.counter is None or step == 0 or step % every:
            return
        with monitor_overhead():
            layers, counts, dropped, reports = _global_counts(trainer, self.counter)  # collective: every rank
            self.counter.zero_()
            shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
            load = shares * shares.shape[1]  # 1.0 = an even share
            metrics = {}
            self.all_layers = layers
            for name, row in zip(layers, load):
                metrics[f"moe/{name}/max_over_mean"] = float(row.max())
                metrics[f"moe/{name}/idle_experts"] = float((row == 0).double().mean())
            per_layer = load.max(dim=1).values
            metrics["moe/max_over_mean/max"] = float(per_layer.max())
            metrics["moe/max_over_mean/mean"] = float(per_layer.mean())
            metrics["moe/idle_experts/mean"] = float((load == 0).double().mean())
            metrics.update(_dropped_metrics(layers, counts, dropped, reports))
            self.last, self.last_shares = metrics, shares.cpu()
            if not writes_logs(trainer):
                return
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            if self.heatmap_every_n_steps and step % self.heatmap_every_n_steps == 0:
                self._draw(trainer, step)

    def _draw(self, trainer: pl.Trainer, step: int) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from lightning_par.techniques.pipeline.schedule_recorder import figure_to_array

        shares = self.last_shares.numpy()
        fig, ax = plt.subplots(figsize=(max(4, 0.3 * shares.shape[1] + 2), max(2.5, 0.3 * shares.shape[0] + 1.5)))
        im = ax.imshow(shares * shares.shape[1], aspect="auto", cmap="viridis", vmin=0)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(self.all_layers)), _short_names(self.all_layers), fontsize=7)
        ax.set_title(f"tokens per expert / mean (step {step})")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        image = figure_to_array(fig)
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"step{step:06d}.png"
        plt.imsave(path, image)
        self.written.append(path)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("moe/expert_load", image, step, dataformats="HWC")
            elif isinstance(logger, WandbLogger):
                logger.log_image("moe/expert_load", [image], step=step)


def _short_names(names: list[str]) -> list[str]:
    """The layer names without what they all share in front and behind (``model.blocks.3.mlp.experts`` -> ``3``)."""
    if len(names) < 2:
        return names
    parts = [n.split(".") for n in names]
    head = 0
    while all(len(p) > head + 1 and p[head] == parts[0][head] for p in parts):
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == parts[0][-1 - tail] for p in parts):
        tail += 1
    return [".".join(p[head:len(p) - tail]) for p in parts]


def _dropped_metrics(layers: list[str], counts: torch.Tensor, dropped: torch.Tensor,
                     reports: torch.Tensor) -> dict[str, float]:
    """Of the layers whose model reported its capacity's drops (:func:`lightning_par.count_dropped_choices`): the
    share of routed choices dropped per layer, its mean and maximum over them, and the share of the most-dropping
    expert's choices (the expert the router overloads most)."""
    reporting = reports > 0
    if not bool(reporting.any()):
        return {}
    routed = (counts + dropped)[reporting]
    share = dropped[reporting].sum(dim=1) / routed.sum(dim=1).clamp(min=1)
    metrics = {f"moe/{name}/dropped": float(v) for name, v in zip(
        [n for n, r in zip(layers, reporting.tolist()) if r], share)}
    metrics["moe/dropped/mean"] = float(share.mean())
    metrics["moe/dropped/max"] = float(share.max())
    metrics["moe/dropped/worst_expert"] = float((dropped[reporting] / routed.clamp(min=1)).max())
    return metrics


def _global_counts(trainer: pl.Trainer, counter: TokenCounter
                   ) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layers, counts, dropped, reports): summed over the ranks that read different tokens (data x context
    parallel; tp ranks see the same tokens; under another strategy every rank reads its own), then the layers of
    every pipeline rank gathered (each holds its stages' layers), in pipeline order."""
    dims = getattr(trainer.strategy, "dims", None)
    totals = counter.summed(dims.mesh("dp_cp").get_group() if dims is not None else None)
    if dims is None or dims.pp == 1:
        return (counter.names, *totals)
    parts: list[Any] = [None] * dims.pp
    dist.all_gather_object(parts, (counter.names, [t.cpu() for t in totals]), group=dims.mesh("pp").get_group())
    device = totals[0].device
    layers = [n for names, _ in parts for n in names]
    return (layers, *(torch.cat([ts[i] for _, ts in parts if len(ts[i])]).to(device) for i in range(3)))

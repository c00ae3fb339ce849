"""PipelineTimelineMonitor: time one training step's schedule on every pipeline rank and draw it.

Each recorded step gives, per pp rank, every action the schedule ran (forward, backward, input/weight gradient,
send/recv waits, idle) by stage and micro-batch. Rank 0 draws its pipeline group's timeline (ranks as rows,
micro-batches as coloured blocks), writes it as PNG, logs it as an image to TensorBoard and Weights & Biases
loggers, and logs each rank's idle fraction next to the textbook bubble.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from lightning_par.callbacks.cross_rank import writes_logs
from lightning_par.techniques.pipeline.schedule_recorder import (
    draw_timeline,
    figure_to_array,
    gather_timelines,
    idle_fraction,
    theory_idle,
)


class PipelineTimelineMonitor(Callback):
    """Record the schedule of training step ``first_step`` and every ``every_n_steps`` after it.

    Args:
        every_n_steps: steps between recordings (the recording itself costs a few hundred microseconds of
            bookkeeping per action and one gather of the events over the pp group).
        first_step: the first recorded step; step 0 includes tracing the stages, so it is skipped by default.
        dirpath: where the PNGs go; default ``<trainer.log_dir or default_root_dir>/pipeline_timeline``.
    """

    def __init__(self, every_n_steps: int = 100, first_step: int = 1, dirpath: str | os.PathLike | None = None) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("first_step", first_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "every_n_steps" else 0):
                raise ValueError(f"PipelineTimelineMonitor({name}={value!r}) must be an int >= "
                                 f"{1 if name == 'every_n_steps' else 0}.")
        self.every_n_steps, self.first_step = every_n_steps, first_step
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self._dir = self.dirpath
        self._step = 0
        self.written: list[Path] = []  # PNGs written on rank 0
        self.timelines: list[list[Any]] = []  # the last recording: per pp rank, its events (seconds from start)

    @staticmethod
    def _pipeline(trainer: pl.Trainer) -> Any:
        return getattr(trainer.strategy, "pipeline", None)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dims = getattr(trainer.strategy, "dims", None)
        if stage == "fit" and (dims is None or dims.pp == 1):
            raise ValueError(f"PipelineTimelineMonitor needs a lightning_par strategy with pp > 1; the strategy is "
                             f"{type(trainer.strategy).__name__}{f' with pp={dims.pp}' if dims else ''}.")
        # trainer.log_dir is a collective (a broadcast): resolve it here, where every rank runs
        self._dir = self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "pipeline_timeline"

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step, pipeline = trainer.global_step, self._pipeline(trainer)
        if pipeline is not None and step >= self.first_step and (step - self.first_step) % self.every_n_steps == 0:
            pipeline.record_next = True
            self._step = step  # global_step has moved on by on_train_batch_end
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pipeline = self._pipeline(trainer)
        if pipeline is None or pipeline.last_recording is None:
            return
        recording, pipeline.last_recording = pipeline.last_recording, None
        timelines = self.timelines = gather_timelines(recording, group=pipeline.group)  # collective over pp
        if not writes_logs(trainer):
            return
        step = self._step
        title = (f"{pipeline.name}: pp={pipeline.pp}, {pipeline.n_microbatches} micro-batches, "
                 f"{pipeline.plan.num_stages} stages (step {step})")
        fig = draw_timeline(timelines, title, pipeline.n_microbatches)
        image = figure_to_array(fig)
        self._write_png(image, step)
        start = min((e.t0 for tl in timelines for e in tl), default=0.0)
        end = max((e.t1 for tl in timelines for e in tl), default=0.0)
        metrics = {f"pipeline/idle_fraction/rank{r}": idle_fraction(tl, start, end) for r, tl in enumerate(timelines)}
        metrics["pipeline/idle_fraction/theory"] = theory_idle(pipeline.name, pipeline.pp, pipeline.n_microbatches,
                                                               pipeline.stages_per_rank)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("pipeline/timeline", image, step, dataformats="HWC")
            elif isinstance(logger, WandbLogger):
                logger.log_image("pipeline/timeline", [image], step=step)

    def _write_png(self, image: Any, step: int) -> None:
        import matplotlib.pyplot as plt

        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"step{step:06d}.png"
        plt.imsave(path, image)
        self.written.append(path)

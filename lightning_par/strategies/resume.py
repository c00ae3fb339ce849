"""Exact mid-epoch resume of the training data.

Lightning restores the loop counters of a checkpoint taken mid-epoch but restarts that epoch's data from its first
batch, so a resumed run trains on some batches twice and never sees others: it cannot match an uninterrupted run.
For the common case (a map-style dataset behind a ``DistributedSampler``, which is what Lightning injects), the
sampler below skips the samples of the batches already trained on in the restored epoch. Written here because
neither Lightning nor torch offers it for a plain ``DataLoader`` (torchdata's StatefulDataLoader does, for its own
loader class).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, Sampler


class ResumeSampler(Sampler[int]):
    """Delegates to ``inner``; the first epoch it iterates after a restart skips the already-trained batches.

    It also owns the shuffling epoch: after a restart from a checkpoint taken at an epoch's end, Lightning 2.6 calls
    ``set_epoch`` one higher than an uninterrupted run would (it counts the restored epoch as processed), so the
    epoch is taken from ``trainer.current_epoch`` when iteration starts, which is what an uninterrupted run uses.
    """

    def __init__(self, inner: DistributedSampler, trainer: pl.Trainer, batch_size: int) -> None:
        self.inner, self.trainer, self.batch_size = inner, trainer, batch_size
        self._pending_skip = True

    def set_epoch(self, epoch: int) -> None:
        """Ignored: see the class docstring."""

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        self.inner.set_epoch(self.trainer.current_epoch)
        indices = list(self.inner)
        skip = 0
        if self._pending_skip:
            self._pending_skip = False
            skip = batches_done_in_epoch(self.trainer) * self.batch_size
        return iter(indices[skip:])


def batches_done_in_epoch(trainer: pl.Trainer) -> int:
    """Batches of the current epoch that the restored checkpoint had already trained on (0 if not restarting)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not trainer.fit_loop.restarting and not epoch_loop.restarting:
        return 0
    return epoch_loop.batch_progress.current.ready


def resumable_train_dataloader(dataloader: Any, trainer: pl.Trainer | None) -> Any:
    """Wrap the training loader's DistributedSampler in a :class:`ResumeSampler` when resuming mid-epoch."""
    if (
        trainer is None
        or trainer.state.stage != RunningStage.TRAINING
        or not isinstance(dataloader, DataLoader)
        or not isinstance(dataloader.sampler, DistributedSampler)
        or dataloader.batch_size is None
        or batches_done_in_epoch(trainer) == 0
    ):
        return dataloader
    sampler = ResumeSampler(dataloader.sampler, trainer, dataloader.batch_size)
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)

"""What every parallel technique is to the engine: its options, its checks, how it applies itself, and what it
needs while a step runs.

:class:`~lightning_par.strategies.nd.NDParallelStrategy` is an ordered list of these. Each technique wraps what the
earlier ones produced, so the order is part of the recipe (``techniques/recipe.py``): pipeline split, tensor
parallel, context parallel, expert parallel, activation checkpointing, compile, FSDP (torchtitan's order, for the same
reasons, with expert parallelism after the attention's techniques and before the wrappers). A technique that is off
for a layout (its size is 1, its flag False) does nothing in every hook.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import find_block_list, match_modules

if TYPE_CHECKING:
    from lightning_par.costs.sheet import CostSheet


@dataclass
class Target:
    """The part of the model the techniques act on, handed down the recipe.

    Without pipeline parallelism it is the whole LightningModule. The pipeline split (first in the recipe) narrows
    it to this rank's stages: ``keep`` then names the modules this rank runs, ``whole`` is a meta-device copy of the
    whole model (plans are validated against it, so every rank checks the same thing), and there is no FSDP root
    (each stage module is its own).
    """

    module: nn.Module
    device: torch.device  # where tensors still on the meta device are materialized
    precision: str  # the Trainer's precision flag, e.g. "bf16-mixed"
    block_list: str | None = None  # the user's block_list option (None: found automatically)
    whole: nn.Module | None = None  # None: ``module`` itself
    keep: list[str] | None = None  # FQNs of the modules this rank runs; None: all of them
    fsdp_root: nn.Module | None = None  # set in __post_init__ to ``module`` unless a pipeline cleared it
    experts: list[str] = field(default_factory=list)  # FQNs of the expert-parallel modules (FSDP: their own mesh)
    _blocks: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.whole is None:
            self.whole = self.module
        if self.fsdp_root is None and self.keep is None:
            self.fsdp_root = self.module

    @property
    def blocks(self) -> list[str]:
        """FQNs of the blocks this rank runs (the block list's entries), resolved once, before any wrapping."""
        if self._blocks is None:
            block_fqn, container = find_block_list(self.module, self.block_list)
            self._blocks = [f"{block_fqn}.{name}" for name in container._modules]
        return self._blocks

    def narrow(self, keep: list[str], blocks: list[str], whole: nn.Module) -> None:
        """Restrict the later techniques to this rank's pipeline stages."""
        self.keep, self._blocks, self.whole, self.fsdp_root = keep, blocks, whole, None

    def units(self, patterns: list[str] | None) -> list[str]:
        """FSDP shard units: the modules this rank runs under pipeline parallelism (each its own root); else the
        given class names / FQN globs, or every block."""
        if self.keep is not None:
            return list(self.keep)
        if patterns is not None:
            return [fqn for fqn, _ in match_modules(self.module, patterns, "shard_units")]
        return self.blocks


class Technique:
    """Base class: every hook does nothing, so a technique implements only what it is about."""

    def check(self, dims: ParallelDims) -> None:
        """Refuse what cannot work with this layout (called on every rank before any collective: at construction
        with the sizes as given, ``-1`` included, and again once the world size has resolved them)."""

    def setup_environment(self, dims: ParallelDims) -> None:
        """Once the process group and the mesh exist, before the model is touched."""

    def apply(self, target: Target, dims: ParallelDims) -> None:
        """Transform ``target.module`` in place (or narrow ``target`` for the techniques after this one)."""

    def step_context(self, dims: ParallelDims) -> AbstractContextManager | None:
        """Entered around every step method and around backward; None when there is nothing to enter."""
        return None

    def after_optimizer_step(self) -> None:
        """After every optimizer step (float8's scales for the next all-gathers)."""

    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of a batch that every rank of the technique's group received whole."""
        return batch

    def describe(self, dims: ParallelDims) -> str | None:
        """A few words for the start-up summary; None when the technique is off."""
        return None

    def account(self, sheet: CostSheet) -> None:
        """For the planner: write what this technique does to memory and communication into ``sheet`` (called in
        the engine's order, with the layout's resolved sizes in ``sheet.dims``)."""

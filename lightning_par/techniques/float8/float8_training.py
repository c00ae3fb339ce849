"""float8 as a technique of the engine: its option (:class:`Float8Options`), its place in the recipe (first after the
pipeline split, before anything wraps the blocks) and what it does after each optimizer step (the float8
all-gathers' scales). The conversion itself: ``float8_layers``.

Under tensor parallelism the converted layers take the engine's ordinary column and row styles: their weights become
DTensors and their inputs and output gradients arrive as DTensors, so torchao's dynamic scales are the largest
values of the whole tensors (an all-reduce of the shards' amax), as in one process. The tensor-parallel collectives
carry high-precision tensors: torchao's float8 tensor-parallel styles, which all-gather a sequence-parallel input in
float8 (NCCL only; gloo cannot carry float8), are not used yet. The rowwise recipe is refused under tensor
parallelism: its scales did not reproduce one float8 process there (tests/test_float8.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from lightning_par.dims import ParallelDims
from lightning_par.techniques.float8.float8_layers import ALIGNMENT, check_float8, convert_to_float8
from lightning_par.techniques.technique import Options, Target, Technique


@dataclass(frozen=True)
class Float8Options(Options):
    """float8's option, under the name ``NDParallelStrategy`` takes it: ``"tensorwise"``, ``"rowwise"`` or None."""

    float8: str | None = None

    def restrict(self) -> dict[str, list[int]]:
        return {"tp": [1]} if self.float8 == "rowwise" else {}  # see Float8Training.check

    def build(self) -> Float8Training:
        return Float8Training(self.float8)


class Float8Training(Technique):
    """``float8``: the blocks' linear layers in float8 (torchao), before tensor parallelism and FSDP wrap them."""

    def __init__(self, recipe: str | None = None) -> None:
        self.recipe = check_float8(recipe)
        self.layers: list[str] = []
        self._precompute_for: nn.Module | None = None

    def check(self, dims: ParallelDims) -> None:
        if self.recipe == "rowwise" and dims.tp > 1:
            raise ValueError(
                f"float8='rowwise' with tp={dims.tp}: under tensor parallelism the rowwise recipe's per-row scales did "
                f"not reproduce one float8 process (the first step's loss 3e-4 apart at tp 2, where 'tensorwise' is "
                f"exact), so lightning_par refuses it. Use float8='tensorwise' with tensor parallelism, or tp=1.")

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if self.recipe is None:
            return
        gather_in_float8 = self.recipe == "tensorwise" and dims.fsdp_enabled and target.device.type == "cuda"
        self.layers = convert_to_float8(target.module, self.recipe, target.blocks, target.experts,
                                        fsdp_float8_all_gather=gather_in_float8)
        if not self.layers:
            warnings.warn(f"float8={self.recipe!r} converted no layer: no nn.Linear inside the blocks has both "
                          f"dimensions multiples of {ALIGNMENT}.", stacklevel=2)
        self._precompute_for = target.module if gather_in_float8 and self.layers else None

    def after_optimizer_step(self) -> None:
        """With float8 all-gathers: every unit's weight scales for the next forward, in one pass (torchao)."""
        if self._precompute_for is not None:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self._precompute_for)

    def describe(self, dims: ParallelDims) -> str | None:
        if self.recipe is None:
            return None
        gathers = ", float8 all-gathers" if self._precompute_for is not None else ""
        return f"float8 {self.recipe} ({len(self.layers)} linear layers{gathers})"

    def warn_if_slow(self, device: torch.device, compiled: bool) -> None:
        """float8 is fast only compiled: eager, its casts cost more than the float8 matmul saves."""
        if self.recipe is not None and device.type == "cuda" and not compiled:
            warnings.warn(f"float8={self.recipe!r} without compile=True on a GPU: float8 is only faster than bf16 "
                          f"when compiled (its casts and scales fuse then). Pass compile=True.", stacklevel=2)

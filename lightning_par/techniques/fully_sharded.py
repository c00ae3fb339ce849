"""FSDP2 as a technique of the engine: the last step of the recipe, it shards whatever the earlier steps left."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.checks import check_bool, check_str_list
from lightning_par.dims import ParallelDims
from lightning_par.parallel.fsdp import apply_fsdp
from lightning_par.techniques.technique import Target, Technique

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FullySharded(Technique):
    """``fully_shard`` of each shard unit, then of the root, over ``dp_shard x cp`` (HSDP with ``dp_replicate``).

    On whenever several ranks hold the same weights (data or context parallel). Under pipeline parallelism every
    module a stage runs is its own root: the LightningModule, whose forward is not what runs the stages, cannot be.
    """

    def __init__(self, shard_units: list[str] | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False) -> None:
        self.shard_units = check_str_list("shard_units", shard_units, "class names or FQN globs",
                                          ["Block", "model.blocks.*"])
        self.reshard_after_forward = check_bool("reshard_after_forward", reshard_after_forward)
        self.cpu_offload = check_bool("cpu_offload", cpu_offload)

    def apply(self, target: Target, dims: ParallelDims) -> None:
        units = target.units(self.shard_units)  # resolved even when off: a bad pattern fails in every layout
        if not dims.fsdp_enabled:
            return
        bf16_mixed = target.precision == "bf16-mixed"
        apply_fsdp(
            target.fsdp_root,
            dims.fsdp_mesh(),
            [target.module.get_submodule(fqn) for fqn in units],
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=torch.bfloat16 if bf16_mixed else None,
            reduce_dtype=torch.float32 if bf16_mixed else None,
            cpu_offload=self.cpu_offload,
        )
        if target.fsdp_root is not None:
            register_step_methods(target.fsdp_root)

    def describe(self, dims: ParallelDims) -> str | None:
        if not dims.fsdp_enabled:
            return None
        zero = "ZeRO-3" if self.reshard_after_forward else "ZeRO-2-like"
        return (f"FSDP2 ({zero}{', HSDP' if dims.dp_replicate > 1 else ''}"
                f"{', CPU offload' if self.cpu_offload else ''})")


def register_step_methods(module: nn.Module) -> None:
    """Lightning calls ``training_step`` etc., not ``forward``: FSDP's root hooks must run around them."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in _STEP_METHODS:
        if hasattr(module, name):
            register_fsdp_forward_method(module, name)

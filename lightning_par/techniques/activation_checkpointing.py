"""Activation checkpointing and ``torch.compile`` of blocks: the two techniques that wrap each block alone."""

from __future__ import annotations

from lightning_par.checks import check_bool
from lightning_par.dims import ParallelDims
from lightning_par.parallel.checkpointing import apply_activation_checkpointing
from lightning_par.parallel.context_routing import recompute_in_active_scope
from lightning_par.planner.sheet import CostSheet
from lightning_par.techniques.technique import Target, Technique


class ActivationCheckpointing(Technique):
    """Recompute each block's activations in backward. Before FSDP, so FSDP's all-gathers run around the
    recomputation; the recomputation re-enters the context-parallel scope the forward ran in (if any)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = check_bool("activation_checkpointing", enabled)

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if self.enabled:
            # the recomputation runs in autograd's backward: it must re-enter the context-parallel scope there
            context_fn = recompute_in_active_scope if dims.cp > 1 else None  # (compile wants the default)
            apply_activation_checkpointing(target.module, target.blocks, context_fn=context_fn)

    def describe(self, dims: ParallelDims) -> str | None:
        return "activation checkpointing" if self.enabled else None

    def account(self, sheet: CostSheet) -> None:
        """A block keeps only its input until backward, which recomputes its forward (one more forward pass) and
        holds one block's activations at a time."""
        sheet.activation_checkpointing = self.enabled


class Compile(Technique):
    """``torch.compile`` each block: every block reuses one compiled graph, and FSDP's hooks (applied later) stay
    outside it. Not with context parallelism yet: its attention routing is a TorchFunctionMode that compiled graphs
    have not been validated with."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = check_bool("compile", enabled)

    def check(self, dims: ParallelDims) -> None:
        if self.enabled and dims.cp != 1:
            raise ValueError(
                f"compile=True with cp={dims.cp}: compiling blocks together with context-parallel attention is not "
                f"supported yet. Use compile=False with context parallelism."
            )

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if self.enabled:
            for name in target.blocks:
                target.module.get_submodule(name).compile()

    def describe(self, dims: ParallelDims) -> str | None:
        return "torch.compile per block" if self.enabled else None

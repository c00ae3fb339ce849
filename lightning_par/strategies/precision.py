"""Lightning precision plugins whose gradient-norm clipping is correct for sharded and pipelined parameters.

Lightning clips through ``Trainer.precision_plugin.clip_gradients``; its plugins call
``torch.nn.utils.clip_grad_norm_``, which is wrong or fails for mixes of FSDP, TP and pipeline stages. These
subclasses keep Lightning's dtype handling (autocast, casting) and swap only the clipping.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_par.parallel.grad_norm import clip_grad_norm_

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


class _ShardedClipping:
    #: set by the strategy once the mesh exists: stage totals are summed over it
    pipeline_group: dist.ProcessGroup | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, float(clip_val), pipeline_group=self.pipeline_group)


class ParallelPrecision(_ShardedClipping, Precision):
    """``32-true``."""


class ParallelMixedPrecision(_ShardedClipping, MixedPrecision):
    """``bf16-mixed``: autocast to bf16; FSDP2 additionally all-gathers bf16 parameters and reduces in fp32."""


class ParallelHalfPrecision(_ShardedClipping, HalfPrecision):
    """``bf16-true``: parameters and compute in bf16."""


def to_parallel_precision(plugin: Precision, accelerator: str) -> Precision:
    """Turn the plugin Lightning built from ``Trainer(precision=...)`` into ours, refusing what we cannot do."""
    if isinstance(plugin, _ShardedClipping):
        return plugin
    flag: Any = getattr(plugin, "precision", None)
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision) or flag not in SUPPORTED_PRECISION:
        raise ValueError(
            f"precision={flag!r} ({type(plugin).__name__}) is not supported by lightning_par strategies. "
            f"Use one of {SUPPORTED_PRECISION}: 'bf16-mixed' instead of '16-mixed' (sharded fp16 needs loss "
            f"scaling across shards), 'bf16-true' instead of '16-true'."
        )
    if flag == "32-true":
        return ParallelPrecision()
    if flag == "bf16-mixed":
        return ParallelMixedPrecision("bf16-mixed", device="cuda" if accelerator == "cuda" else "cpu")
    return ParallelHalfPrecision("bf16-true")

"""Lightning precision plugins that are correct for sharded and pipelined parameters.

Lightning clips through ``Trainer.precision_plugin.clip_gradients``; its plugins call
``torch.nn.utils.clip_grad_norm_``, which is wrong or fails for mixes of FSDP, TP and pipeline stages. These
subclasses keep Lightning's dtype handling (autocast, casting) and swap only the clipping, and for ``16-mixed``
the gradient scaler (:class:`ParallelGradScaler`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_par.techniques.sharding.grad_norm import clip_grad_norm_

SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")


class ParallelGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check covers the gradients of every rank: FSDP shards, tensor-parallel
    shards, plain (replicated) parameters beside them, and the parameters of other pipeline stages.

    Each rank checks and unscales the values it holds (``to_local()`` of DTensor gradients), then one all-reduce
    (MAX) of the found-inf flag over ``process_group`` (default: the whole world) makes every rank skip the same
    steps and change its scale alike. torch's own GradScaler passes DTensor gradients to its unscale op, whose
    DTensor rule (pytorch PR #132816) reduces the flag only over the mesh dimensions on which the *first* gradient
    is not replicated (so an inf in one tp shard can be missed by the other tp ranks), fails when plain tensors
    sit beside DTensors ("got mixed torch.Tensor and DTensor"), and knows nothing of pipeline stages.

    A ``Partial`` gradient (sequence-parallel norms) is checked as its local partial sums: finite fp32 partials
    whose sum overflows are not caught; loss scaling keeps gradients far from the fp32 range.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group

    # torch private API: GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16) -> {device:
    # found_inf}, called by unscale_() and, for fused optimizers, by step(). torch's own ShardedGradScaler overrides
    # it the same way. Checked on torch 2.13 (the same signature in earlier 2.x sources); tests/test_precision16.py
    # fails loudly if it changes.
    @torch.no_grad()
    def _unscale_grads_(self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        local_grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")  # torch's own message and rule
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if local.is_sparse:  # as torch does: duplicate indices must be summed before checking fp16 values
                    if local.dtype == torch.float16:
                        param.grad = local = local.coalesce()
                    local = local._values()
                local_grads[(local.device, local.dtype)].append(local)
        for (device, _), grads in local_grads.items():
            found_here = torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale.to(device))
            found_inf.add_(found_here.to(found_inf.device))
        # unconditionally, on every rank (a rank without gradients too): every rank must skip the same steps
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        return {found_inf.device: found_inf}


class _ShardedClipping:
    #: set by the strategy once the mesh exists: stage totals are summed over it
    pipeline_group: dist.ProcessGroup | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, float(clip_val), pipeline_group=self.pipeline_group)


class ParallelPrecision(_ShardedClipping, Precision):
    """``32-true``."""


class ParallelMixedPrecision(_ShardedClipping, MixedPrecision):
    """``bf16-mixed`` and ``16-mixed``: autocast to bf16 / fp16 over fp32 master weights (FSDP2's all-gather and
    reduce dtypes are chosen by ``techniques/sharding/fully_sharded.py``).

    ``16-mixed`` scales the loss with a :class:`ParallelGradScaler`; Lightning's loop unscales the gradients before
    clipping, and skips the optimizer step on every rank alike when any rank's gradients hold an inf or NaN. Under
    pipeline parallelism the schedule's per-micro-batch loss is scaled (``pipeline/pipeline_adapter.py``). The
    scaler's state (scale, growth tracker) is saved in checkpoints as Lightning's own plugin saves it.
    """

    def __init__(self, precision: Literal["16-mixed", "bf16-mixed"], device: str,
                 scaler: ParallelGradScaler | None = None) -> None:
        if precision == "16-mixed" and scaler is None:
            scaler = ParallelGradScaler(device)
        if scaler is not None and not isinstance(scaler, ParallelGradScaler):
            raise TypeError(
                f"scaler={type(scaler).__name__}: a plain GradScaler does not agree across ranks on which steps to "
                f"skip. Pass lightning_par.strategies.precision.ParallelGradScaler(device, init_scale=..., ...).")
        super().__init__(precision, device, scaler)

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Lightning refuses to clip for an optimizer that unscales inside its step (``fused=True``) whatever the
        precision; only a loss scaler makes clipping before that step wrong. ``bf16-mixed`` has none: it clips a
        fused optimizer's gradients as ``32-true`` does (torchtitan's fused AdamW with clipping)."""
        if self.scaler is None:
            return Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint saved by Lightning's own ``MixedPrecision`` (one process, Lightning's strategies) keeps the
        scaler state under that class's name: resume it too."""
        if self.scaler is not None and type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["MixedPrecision"])


class ParallelHalfPrecision(_ShardedClipping, HalfPrecision):
    """``bf16-true``: parameters and compute in bf16."""


def _parallel_scaler(scaler: torch.amp.GradScaler | None, device: str) -> ParallelGradScaler:
    """Ours, with the settings of the GradScaler Lightning (or the user, through ``MixedPrecision(scaler=...)``)
    built. A subclass with logic of its own is refused rather than silently replaced."""
    if scaler is None:
        return ParallelGradScaler(device)
    if isinstance(scaler, ParallelGradScaler):
        return scaler
    if type(scaler).__module__.split(".")[0] != "torch":
        raise TypeError(
            f"MixedPrecision('16-mixed', scaler={type(scaler).__name__}(...)): lightning_par replaces the scaler by "
            f"its ParallelGradScaler (found-inf agreed across all ranks) and would drop your subclass's logic. Pass "
            f"lightning_par.strategies.precision.ParallelMixedPrecision('16-mixed', device, "
            f"scaler=ParallelGradScaler(...)) in Trainer(plugins=[...]), or a plain torch.amp.GradScaler.")
    return ParallelGradScaler(device, init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
                              growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                              growth_interval=scaler.get_growth_interval(), enabled=scaler.is_enabled())


def to_parallel_precision(plugin: Precision, accelerator: str) -> Precision:
    """Turn the plugin Lightning built from ``Trainer(precision=...)`` into ours, refusing what we cannot do."""
    if isinstance(plugin, _ShardedClipping):
        return plugin
    flag: Any = getattr(plugin, "precision", None)
    if flag == "16-true" and type(plugin) is HalfPrecision:
        raise ValueError(
            "precision='16-true' is not supported by lightning_par strategies: fp16 parameters have no fp32 master "
            "copy and no loss scaling, so updates below 2**-11 of a weight are lost and small gradients flush to "
            "zero (torch's GradScaler refuses fp16 gradients for that reason). Use '16-mixed' (fp16 compute, fp32 "
            "weights, loss scaling) on GPUs without bf16, or 'bf16-true' instead of '16-true'."
        )
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision) or flag not in SUPPORTED_PRECISION:
        raise ValueError(
            f"precision={flag!r} ({type(plugin).__name__}) is not supported by lightning_par strategies. "
            f"Use one of {SUPPORTED_PRECISION}."
        )
    if flag == "32-true":
        return ParallelPrecision()
    if flag in ("16-mixed", "bf16-mixed"):
        assert isinstance(plugin, MixedPrecision)
        device = "cuda" if accelerator == "cuda" else "cpu"
        scaler = _parallel_scaler(plugin.scaler, device) if flag == "16-mixed" else None
        return ParallelMixedPrecision(flag, device=device, scaler=scaler)
    return ParallelHalfPrecision("bf16-true")

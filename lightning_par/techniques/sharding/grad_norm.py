"""Gradient-norm clipping that is correct when parameters are sharded (FSDP2, TP) or split over pipeline stages.

``torch.nn.utils.clip_grad_norm_`` needs every DTensor on one mesh and knows nothing of pipeline stages, so with
FSDP x TP, or with pipeline parallelism, it either fails or clips by a per-rank norm. Written here because no
library offers it for arbitrary mixes of meshes (torchtitan has a similar private helper).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate


def _local_view(grad: Tensor) -> tuple[Tensor, tuple[dist.ProcessGroup, ...]]:
    """The values this rank holds of ``grad`` and the groups over which those values are disjoint shards."""
    if not isinstance(grad, DTensor):
        return grad, ()
    if any(p.is_partial() for p in grad.placements):  # partial sums: reduce first, the norm is not linear
        grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
    groups = tuple(grad.device_mesh.get_group(i) for i, p in enumerate(grad.placements) if p.is_shard())
    return grad.to_local(), groups


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[Tensor], norm_type: float = 2.0, pipeline_group: dist.ProcessGroup | None = None
) -> Tensor:
    """The norm of all gradients of the whole model, the same on every rank.

    Shards are summed over the mesh dimensions they are split on, replicas are counted once, and the per-stage
    totals are summed over ``pipeline_group`` (stages hold disjoint parameters).
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    per_groups: dict[tuple[dist.ProcessGroup, ...], Tensor] = {}
    device = grads[0].device if grads else torch.device("cpu")
    for grad in grads:
        local, groups = _local_view(grad)
        local = local.float()
        value = local.abs().max() if is_inf else local.norm(norm_type) ** norm_type
        acc = per_groups.get(groups)
        if acc is None:
            per_groups[groups] = value.clone()
        else:
            per_groups[groups] = torch.maximum(acc, value) if is_inf else acc + value
    total = torch.zeros((), device=device)
    for groups, value in per_groups.items():
        for group in groups:
            dist.all_reduce(value, op=op, group=group)
        total = torch.maximum(total, value) if is_inf else total + value
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        dist.all_reduce(total, op=op, group=pipeline_group)
    return total if is_inf else total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before clipping."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, pipeline_group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.mul_(coef.to(local.device, local.dtype))
    return total

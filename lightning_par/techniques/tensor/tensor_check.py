"""A check after the first backward under tensor parallelism: every parameter the plan leaves whole has the same
gradient on every tp rank.

Those ranks see the same batch, so a parameter that computes on whole activations gets the same gradient on each.
One that computes on activations the plan split over tp (a learnable activation function between a column- and a
row-parallel layer, a per-head norm the plan does not name) gets only its rank's share: training would go on with
replicas that drift apart, silently. The plan cannot show this (it depends on what the model's forward does with
each tensor), so it is measured once, on the gradients themselves: two checksums per parameter, one all-gather over
the tp group, the same verdict on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

#: relative difference between tp ranks' checksums above which a gradient is "not the same" (a missed reduction
#: differs by O(1); the same computation on the same data agrees to the last bits)
RELATIVE_TOLERANCE = 1e-4


def _whole_over_tp(param: torch.Tensor, tp_ranks: set[int]) -> bool:
    """Whether ``param`` is the same whole tensor on every tp rank: a plain tensor, or a DTensor replicated along
    the dimension of its mesh that spans the tp ranks. The dimension is found by its ranks, not its name: a model
    parallelized by hand names it as it likes (Lightning's mesh says ``"tensor_parallel"``)."""
    if not isinstance(param, DTensor):
        return True
    mesh = param.device_mesh
    return all(isinstance(placement, Replicate) or set(dist.get_process_group_ranks(mesh.get_group(i))) != tp_ranks
               for i, placement in enumerate(param.placements))


def check_whole_parameters_agree(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Raise (on every rank) naming the parameters the tp plan leaves whole whose gradients differ across tp."""
    names, checksums = [], []
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    for name, param in module.named_parameters():
        grad = param.grad
        if grad is None or not _whole_over_tp(param, tp_ranks):
            continue
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            continue  # a partial sum DTensor itself reduces (a 'head_norm' or sequence-parallel norm's gradient)
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).detach().double()
        names.append(name)
        checksums.append(torch.stack([local.sum(), local.square().sum(), local.new_tensor(float(local.numel()))]))
    group = tp_mesh.get_group()
    count = torch.tensor([len(names)], device=tp_mesh.device_type)
    counts = [torch.zeros_like(count) for _ in range(tp_mesh.size())]
    dist.all_gather(counts, count, group=group)
    if len({int(c) for c in counts}) != 1 or not names:
        return  # nothing to compare (a tp group holds one pipeline stage, so the sets agree in practice)
    local = torch.stack(checksums).to(tp_mesh.device_type)
    gathered = [torch.empty_like(local) for _ in range(tp_mesh.size())]
    dist.all_gather(gathered, local, group=group)
    spread = (torch.stack(gathered) - local).abs().amax(0).cpu()  # (parameters, 3)
    local = local.cpu()
    # scales: |sum| <= sqrt(numel * sum of squares) (a sum near 0 must not turn rounding into a verdict)
    scale = torch.stack([(local[:, 2] * local[:, 1]).sqrt(), local[:, 1]], dim=1) + 1e-30
    differ = [name for name, bad in zip(names, (spread[:, :2] > RELATIVE_TOLERANCE * scale).any(1)) if bool(bad)]
    if differ:
        raise ValueError(
            f"tensor parallelism: the tp plan leaves {differ[:5]}{' ...' if len(differ) > 5 else ''} whole, but "
            f"their gradients differ across the tp ranks after the first backward: they compute on activations the "
            f"plan split over tp (e.g. a learnable activation between a 'colwise' and a 'rowwise' layer, or a "
            f"per-head norm), so each rank sees only its share and the replicas would drift apart. Give each such "
            f"module the style 'head_norm' in `tp_plan` (its weight stays whole and its gradient is summed over "
            f"tp), or shard the layers around it differently, or use tp=1.")

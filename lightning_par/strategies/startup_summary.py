"""The start-up summary: the mesh, which ranks form each group, and what each rank holds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.dims import MESH_DIM_NAMES, ParallelDims
from lightning_par.techniques.quantize.nf4_weights import is_nf4, nf4_bytes


def local_parameter_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes, elements) of the parameters this rank stores: local shards of DTensors, whole plain tensors."""
    nbytes = numel = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes += nf4_bytes(local) if is_nf4(local) else local.numel() * local.element_size()
        numel += local.numel()
    return nbytes, numel


def layout_summary(dims: ParallelDims, module: nn.Module, backend: str, what: str, held: str = "") -> str | None:
    """Collective (one small all_gather_object): the summary text on rank 0, ``None`` elsewhere. ``held``: what
    this rank holds beyond its shards (e.g. its pipeline stages)."""
    nbytes, numel = local_parameter_bytes(module)
    row = (dist.get_rank(), dims.coordinates(), nbytes, numel, held)
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() != 0:
        return None
    mesh = dims.world_mesh.mesh
    lines = [f"lightning_par: {dims} on {dims.world_size} processes ({backend}); {what}"]
    for i, name in enumerate(MESH_DIM_NAMES):
        size = mesh.size(i)
        if size > 1:
            groups = mesh.movedim(i, -1).reshape(-1, size).tolist()
            lines.append(f"  {name:<13} groups of {size}: {groups}")
    if dims.ep > 1:  # the experts' mesh: ep groups (experts split), efsdp groups (experts FSDP-sharded)
        experts = dims.expert_mesh().mesh
        for i, name in ((3, "ep"), (2, "efsdp")):
            size = experts.size(i)
            if size > 1:
                groups = experts.movedim(i, -1).reshape(-1, size).tolist()
                lines.append(f"  {name:<13} groups of {size}: {groups}")
    header = "  rank  " + "  ".join(f"{n:>12}" for n in MESH_DIM_NAMES) + "   parameters held"
    lines.append(header)
    total = sum(r[3] for r in rows)
    for rank, coords, nb, n, extra in rows:
        cells = "  ".join(f"{coords[n_]:>12}" for n_ in MESH_DIM_NAMES)
        lines.append(f"  {rank:>4}  {cells}   {n:>12,} ({nb / 2**20:.2f} MiB){'  ' + extra if extra else ''}")
    lines.append(f"  sum over ranks: {total:,} parameter elements")
    return "\n".join(lines)


def describe_hand_parallelization(module: nn.Module) -> str:
    """What a ``configure_model`` that parallelized by hand applied, read off the modules (no collective): how many
    modules ``fully_shard`` made FSDP2 units, and the parameters by placement and mesh (FSDP shards show as
    ``Shard(0)`` over the data-parallel dimension, tensor-parallel ones over the tensor-parallel dimension)."""
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in module.modules())
    kinds: Counter[str] = Counter(
        f"{_placements(p)} over {_mesh_words(p.device_mesh)}" if isinstance(p, DTensor) else "plain (not DTensor)"
        for p in module.parameters()
    )
    found = "; ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    return f"parallelized in configure_model: fully_shard on {units} modules; parameters: {found}"


def _mesh_words(mesh: Any) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))


def _placements(p: DTensor) -> str:
    return "(" + ", ".join(str(pl) for pl in p.placements) + ")"

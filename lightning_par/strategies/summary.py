"""The start-up summary: the mesh, which ranks form each group, and what each rank holds."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.dims import MESH_DIM_NAMES, ParallelDims


def local_parameter_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes, elements) of the parameters this rank stores: local shards of DTensors, whole plain tensors."""
    nbytes = numel = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes += local.numel() * local.element_size()
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
    header = "  rank  " + "  ".join(f"{n:>12}" for n in MESH_DIM_NAMES) + "   parameters held"
    lines.append(header)
    total = sum(r[3] for r in rows)
    for rank, coords, nb, n, extra in rows:
        cells = "  ".join(f"{coords[n_]:>12}" for n_ in MESH_DIM_NAMES)
        lines.append(f"  {rank:>4}  {cells}   {n:>12,} ({nb / 2**20:.2f} MiB){'  ' + extra if extra else ''}")
    lines.append(f"  sum over ranks: {total:,} parameter elements")
    return "\n".join(lines)

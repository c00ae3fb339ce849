"""Tensor parallelism (Megatron-style, on DTensor) from a plan: FQN globs -> style names.

``apply_tp(model, tp_mesh, plan)`` validates the whole plan on every rank first (no communication), then turns each
style name into a torch ``ParallelStyle`` and calls ``parallelize_module`` once. The layouts between modules follow
torchtitan's ``apply_tp``: activations are plain local tensors of shape (batch, seq, ...), the full sequence without
sequence parallelism, this rank's sequence chunk with it (norms then run on chunks, rowwise layers reduce-scatter
instead of all-reducing, colwise layers all-gather their input). Plans and their validation: ``tensor_plan.py``; the
styles, and the ``ParallelStyle`` each is built into: ``tensor_styles.py``.

Two things the caller owns: every rank must hold the same weights before ``apply_tp`` (sharded layers are scattered
from rank 0, but ``sequence_parallel`` norms keep each rank's own copy, as torch's ``SequenceParallel`` does), and
with ``loss_parallel=True`` both the loss and its ``backward()`` run inside ``torch.distributed.tensor.parallel.
loss_parallel()`` (the logits are a vocab-sharded DTensor).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_par.techniques.tensor.sequence_regather import save_chunks_of_gathered_input
from lightning_par.techniques.tensor.tensor_plan import (
    TPPlan,
    check_tp_size,
    gathers_its_input,
    head_params,
    mla_rope_dim,
    partial_sum_params,
    prefix_plan,
    resolve_tp_plan,
    validate_tp_plan,
)
from lightning_par.techniques.tensor.tensor_styles import (
    HF_ALIASES,
    SEQ_DIM,
    STYLES,
    _HeadParams,
    _PartialSum,
    build_style,
)

__all__ = [
    "HF_ALIASES",
    "STYLES",
    "apply_tp",
    "build_style",
    "check_tp_size",
    "prefix_plan",
    "resolve_tp_plan",
    "validate_tp_plan",
]


def apply_tp(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    whole_model: bool = True,
    regather_sequence: bool = False,
) -> None:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following ``plan`` (keys relative to ``module``).
    ``whole_model=False``: ``module`` holds a pipeline rank's stages only (see ``validate_tp_plan``).

    ``sequence_parallel``: norms/dropout on the residual stream run on sequence chunks (activation memory / tp).
    ``loss_parallel``: the 'vocab_parallel_head' output stays a vocab-sharded DTensor, so cross-entropy inside
    ``loss_parallel()`` never materializes the full logits; otherwise the logits are gathered to a plain tensor.
    ``regather_sequence``: with ``sequence_parallel``, the layers that gather their input save its sequence chunk
    and gather it again in backward while :func:`~lightning_par.techniques.tensor.sequence_regather.regathered_sequence`
    is active (the step's context).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tp needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D dims {tp_mesh.mesh_dim_names}. "
            f"Pass the tp sub-mesh, e.g. world_mesh['tp']."
        )
    if dist.is_initialized():
        check_tp_size(tp_mesh.size(), dist.get_world_size())
    resolved = validate_tp_plan(
        module, plan, tp_mesh.size(), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
        whole_model=whole_model,
    )
    already = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if already:
        raise ValueError(
            f"apply_tp: {type(module).__name__} already has DTensor parameters ({already[:3]}...): tensor "
            f"parallelism was applied before (or configure_model parallelized by hand). Apply it once."
        )
    gathered = [name for name, style in resolved.items() if style == "gather_sequence"]
    styles = {
        name: built
        for name, style in resolved.items()
        if (built := build_style(style, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                 input_gathered=any(name.startswith(g + ".") for g in gathered),
                                 rope_dim=mla_rope_dim(module, name) if style == "mla_kv_a_proj" else 0))
        is not None
    }
    by_head = head_params(module, plan, tp_mesh.size())  # their owners may have a style too: applied on their own
    summed = partial_sum_params(module, plan, tp_mesh.size())
    if styles or by_head or summed:
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        if styles:
            parallelize_module(module, tp_mesh, styles)
        for owner, names in by_head.items():
            parallelize_module(module.get_submodule(owner), tp_mesh, _HeadParams(names))
        for owner, dims in summed.items():
            parallelize_module(module.get_submodule(owner), tp_mesh, _PartialSum(dims))
        # torch's SequenceParallel re-creates parameters without their requires_grad (torch 2.11-2.13): a frozen
        # norm would start training. Put every flag back by name.
        for name, p in module.named_parameters():
            if name in frozen and p.requires_grad:
                p.requires_grad_(False)
    if sequence_parallel and regather_sequence:
        marked = [name for name, style in resolved.items()
                  if gathers_its_input(style, any(name.startswith(g + ".") for g in gathered))]
        for name in marked:
            save_chunks_of_gathered_input(module.get_submodule(name), tp_mesh, SEQ_DIM)
        if not marked:
            warnings.warn(
                f"regather_sequence=True: no module of the tensor-parallel plan gathers its input from the sequence "
                f"chunks ({sorted(set(map(str, resolved.values())))}; ParallelStyle objects are not looked into), "
                f"so nothing is saved as chunks. Name the styles ('colwise', 'gather_sequence', "
                f"'vocab_parallel_head') or turn regather_sequence off.", stacklevel=2)


@torch.no_grad()
def broadcast_replicated_parameters(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Before :func:`apply_tp`: make every plain parameter and buffer equal on all ranks of the tp group.

    TP scatters sharded weights from one rank, but replicated ones (norms, position embeddings, and
    ``SequenceParallel`` norms, which torch builds from each rank's local copy) keep each rank's own
    initialization; ranks not seeded alike would train different replicas. One broadcast per tensor at setup;
    meta tensors (materialized later, by the DTensor RNG) are skipped.
    """
    group = tp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for tensor in list(module.parameters()) + list(module.buffers()):
        if not isinstance(tensor, DTensor) and not tensor.is_meta:
            dist.broadcast(tensor.data, src=src, group=group)

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

from lightning_par._compat import inner_tensor_names, is_quantized
from lightning_par.parallel.quantized_cut import QuantizedCut
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
    QUANTIZED_STYLES,
    SEQ_DIM,
    STYLES,
    _HeadParams,
    _PartialSum,
    build_style,
    quantized_style,
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
    quantized_cut: QuantizedCut | None = None,
    shards_after: int = 1,
) -> None:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` following ``plan`` (keys relative to ``module``).
    ``whole_model=False``: ``module`` holds a pipeline rank's stages only (see ``validate_tp_plan``).
    ``quantized_cut``: how the quantized weights (QLoRA's NF4) of 'colwise' and 'rowwise' layers are cut (given by
    the technique that quantized them); ``shards_after``: FSDP's row shards of each piece, which it must allow.

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
    problems = quantized_cut_problems(module, resolved, tp_mesh.size(), quantized_cut, shards_after)
    if problems:
        raise ValueError(" ".join(problems))
    gathered = [name for name, style in resolved.items() if style == "gather_sequence"]
    styles = {
        name: built
        for name, style in resolved.items()
        if (built := quantized_style(style, quantized_cut.cut, sequence_parallel=sequence_parallel,
                                     input_gathered=any(name.startswith(g + ".") for g in gathered),
                                     shards_after=shards_after)
            if _quantized_linear(module, name) else
            build_style(style, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
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


def _quantized_linear(module: nn.Module, name: str) -> bool:
    layer = module.get_submodule(name)
    return isinstance(layer, nn.Linear) and is_quantized(layer.weight)


def quantized_cut_problems(module: nn.Module, resolved: dict[str, object], tp: int, cut: QuantizedCut | None,
                           shards_after: int = 1) -> list[str]:
    """What keeps the plan's layers with quantized weights from being cut over ``tp`` ranks (no communication:
    the caller raises, on every rank under a pipeline), one line per reason with the layers it holds for: a style
    other than column- and row-parallel, no ``cut``, a weight the format cannot cut exactly (``cut.why_not``)."""
    found: dict[str, list[str]] = {}
    for name, style in resolved.items():
        if not _quantized_linear(module, name):
            continue
        weight = module.get_submodule(name).weight
        named = HF_ALIASES.get(style, style) if isinstance(style, str) else None
        if named not in QUANTIZED_STYLES:
            why = (f"a quantized weight (quantize_base) with the style {style!r}; a quantized weight is cut for "
                   f"{sorted(QUANTIZED_STYLES)} only. Give the layer one of those, or drop its plan entry (it then "
                   f"stays whole on every rank)")
        elif cut is None:
            why = (f"a quantized weight ({type(weight).__name__}) and no cut for it: quantize it through the "
                   f"strategy's quantize_base=, which tells tensor parallelism how")
        elif (reason := cut.why_not(weight, QUANTIZED_STYLES[named], tp, shards_after)) is not None:
            why = (f"a quantized weight {style!r} over tp={tp}: {reason}. Choose a tp (and dp_shard x cp) that "
                   f"divides it so, or drop its plan entry (it then stays whole on every rank)")
        else:
            continue
        found.setdefault(why, []).append(name)
    return [f"tp_plan: {names[0]!r}{f' (and {len(names) - 1} more)' if len(names) > 1 else ''}: {why}."
            for why, names in found.items()]


def _storages(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor's values: itself, or a quantized subclass's inner tensors."""
    return [getattr(tensor, name) for name in inner_tensor_names(tensor)] or [tensor.data]


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
            for storage in _storages(tensor):
                dist.broadcast(storage, src=src, group=group)

"""Tensor parallelism (Megatron-style, on DTensor) from a plan: FQN globs -> style names.

``apply_tp(model, tp_mesh, plan)`` validates the whole plan on every rank first (no communication), then turns each
style name into a torch ``ParallelStyle`` and calls ``parallelize_module`` once. The layouts between modules follow
torchtitan's ``apply_tp``: activations are plain local tensors of shape (batch, seq, ...), the full sequence without
sequence parallelism, this rank's sequence chunk with it (norms then run on chunks, rowwise layers reduce-scatter
instead of all-reducing, colwise layers all-gather their input). Plans and their validation: ``tensor_plan.py``.

Two things the caller owns: every rank must hold the same weights before ``apply_tp`` (sharded layers are scattered
from rank 0, but ``sequence_parallel`` norms keep each rank's own copy, as torch's ``SequenceParallel`` does), and
with ``loss_parallel=True`` both the loss and its ``backward()`` run inside ``torch.distributed.tensor.parallel.
loss_parallel()`` (the logits are a vocab-sharded DTensor).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_par.parallel.modules import SHRINKING_INPUT_HOOKS, local_parameters
from lightning_par.techniques.tensor.sequence_regather import first_tensor_argument, save_chunks_of_gathered_input
from lightning_par.techniques.tensor.tensor_plan import (
    HF_ALIASES,
    STYLES,
    Plan,
    check_tp_size,
    gathers_its_input,
    head_params,
    mla_rope_dim,
    partial_sum_params,
    prefix_plan,
    resolve_tp_plan,
    validate_tp_plan,
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

SEQ_DIM = 1  # activations are (batch, seq, hidden)


def apply_tp(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Plan,
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


def build_style(
    style: str | ParallelStyle, *, sequence_parallel: bool = False, loss_parallel: bool = False,
    input_gathered: bool = False, rope_dim: int = 0,
) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for a style name (see ``STYLES``); ``None`` where there is nothing to do.
    ``input_gathered``: the module sits inside a 'gather_sequence' module, so under SP a plain-tensor input of a
    column-parallel layer is a whole sequence (an inner activation), not a chunk of the residual stream.
    ``rope_dim``: the rope part of an 'mla_kv_a_proj' output (:func:`mla_rope_dim`)."""
    if isinstance(style, ParallelStyle):
        return style
    style = HF_ALIASES.get(style, style)
    sp = sequence_parallel
    seq = Shard(SEQ_DIM)
    rep = Replicate()
    if style is None:
        return None
    if style == "colwise":
        return ColwiseParallel(input_layouts=seq if sp and not input_gathered else rep)
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq if sp else rep)
    if style == "colwise_rep":
        return ColwiseParallel(input_layouts=seq if sp and not input_gathered else rep, output_layouts=rep)
    if style == "rowwise_rep":  # its output joins the residual stream, sequence-sharded under SP
        return RowwiseParallel(input_layouts=rep, output_layouts=seq if sp else rep)
    if style == "vocab_parallel_embedding":
        return _SequenceChecked(RowwiseParallel(input_layouts=rep, output_layouts=seq if sp else rep), sp)
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=rep, output_layouts=rep)
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=rep, output_layouts=rep)
    if style == "vocab_parallel_head":
        return ColwiseParallel(
            input_layouts=seq if sp else rep,
            output_layouts=Shard(-1) if loss_parallel else rep,
            use_local_output=not loss_parallel,
        )
    if style == "sequence_parallel":
        # local output: the next module may slice or reshape it as a plain tensor (HF's lm_head input does)
        return SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=True) if sp else None
    if style == "replicate":
        return _ShardOutputSequence() if sp else None
    if style == "head_norm":
        # torch's SequenceParallel on the leading dim: weights replicated DTensors, the input declared sharded (any
        # leading dim gives the same local math), so each weight gradient is a partial sum DTensor all-reduces
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if style == "mla_kv_a_proj":
        return _SumRopeGradient(rope_dim)
    if style == "partial_sum":  # its bare parameters' split dims come from the plan: apply_tp applies it
        return None
    if style == "split_sequence":
        return _FirstInput(_split_sequence, shrinks=True) if sp else None
    if style == "gather_sequence":
        return _GatherSequence() if sp else None
    raise ValueError(f"unknown tensor-parallel style {style!r}; valid: {sorted(STYLES)}")  # validate_tp_plan caught it


# ---- the few styles torch does not have ----------------------------------------------------------------------
def _check_seq_len(tensor: torch.Tensor, dim: int, mesh: DeviceMesh, where: str) -> None:
    """Uneven sequence chunks would silently mislabel DTensor shapes: fail on every rank, before the collective."""
    if tensor.size(dim) % mesh.size():
        raise ValueError(
            f"sequence parallelism: {where} sees a sequence of length {tensor.size(dim)} (dim {dim} of shape "
            f"{tuple(tensor.shape)}), not divisible by tp={mesh.size()}. Pad or crop sequences to a multiple of "
            f"{mesh.size()}, or turn sequence_parallel off."
        )


def _split_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int = SEQ_DIM) -> torch.Tensor:
    """Full tensor -> this rank's sequence chunk (no communication; backward all-gathers the gradient)."""
    _check_seq_len(x, dim, mesh, "split_sequence")
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(dim)]).to_local()


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sequence chunk -> replicated DTensor, once for all colwise children (their grads sum, one reduce-scatter)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(SEQ_DIM)], run_check=False)
    return x.redistribute(mesh, [Replicate()])


class _FirstInput(ParallelStyle):
    """Apply ``fn`` to the module's first tensor argument, or to ``hidden_states=`` (how HF layers are called)."""

    def __init__(self, fn: Callable[[torch.Tensor, DeviceMesh], torch.Tensor], shrinks: bool = False) -> None:
        super().__init__()
        self.fn, self.shrinks = fn, shrinks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            x = first_tensor_argument(args, kwargs)
            if x is not None and args and args[0] is x:
                return (self.fn(x, device_mesh), *args[1:]), kwargs
            if x is not None:
                return args, {**kwargs, "hidden_states": self.fn(x, device_mesh)}
            raise TypeError(
                f"{type(module).__name__}: 'split_sequence'/'gather_sequence' act on the first positional tensor "
                f"argument or `hidden_states=`; this call passed neither."
            )

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        if self.shrinks:
            module.__dict__.setdefault(SHRINKING_INPUT_HOOKS, []).append((hook, handle))
        return module


class _GatherSequence(_FirstInput):
    """'gather_sequence': the input's sequence is gathered once for the module's column-parallel children. An output
    that comes out whole (its last projection gathers its output, as in Hugging Face's plans for linear-attention
    layers) is cut back to this rank's chunk for the sequence-sharded residual stream (backward all-gathers)."""

    def __init__(self) -> None:
        super().__init__(_gather_sequence)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        local_len: list[int] = []

        def remember(_mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            x = first_tensor_argument(args, kwargs)
            local_len[:] = [x.size(SEQ_DIM)] if x is not None else []

        def cut(_mod: nn.Module, _args: tuple, _kwargs: dict[str, Any], out: Any) -> Any:
            first = out[0] if isinstance(out, tuple) else out
            if (not local_len or not isinstance(first, torch.Tensor) or isinstance(first, DTensor)
                    or first.ndim < 2 or first.size(SEQ_DIM) != local_len[0] * device_mesh.size()):
                return out
            first = _split_sequence(first, device_mesh)
            return (first, *out[1:]) if isinstance(out, tuple) else first

        module.register_forward_pre_hook(remember, with_kwargs=True, prepend=True)
        module.register_forward_hook(cut, with_kwargs=True)
        return module


class _OwnShards(ParallelStyle):
    """A module's own bare parameters ``dims`` (name -> split dim) become DTensors split over tp, and its forward runs
    with this rank's shards: plain tensors its code can index and broadcast against (``_run``)."""

    def __init__(self, dims: dict[str, int]) -> None:
        super().__init__()
        self.dims = dims

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.dims.items():
            p = module.get_parameter(name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p.data, device_mesh, [Shard(dim % p.dim())]), requires_grad=p.requires_grad))
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(module, device_mesh, inner, args, kwargs)

        module.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) call it
        return module

    def _run(self, module: nn.Module, device_mesh: DeviceMesh, inner: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        with local_parameters(module):
            return inner(*args, **kwargs)


class _HeadParams(_OwnShards):
    """'head_params' on the owner of bare parameters ``names``: split on dim 0 (by head), so that its code indexes
    and broadcasts them against its local heads."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(dict.fromkeys(names, 0))


class _PartialSum(_OwnShards):
    """'partial_sum' on a module whose own parameters are split over tp (``dims``) and whose output sums over that
    split (Inkling's stacked shared experts: gate/up split on the intermediate dim, down on it too). Its output, a
    partial sum, is all-reduced (backward: identity); each floating-point tensor input is whole on every rank, but
    its gradient from this rank's shards is partial, so it is all-reduced in backward (Megatron's f and g around a
    column- then row-parallel MLP)."""

    def _run(self, module: nn.Module, device_mesh: DeviceMesh, inner: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        def whole_with_partial_gradient(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or not x.is_floating_point():
                return x
            return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])

        out = super()._run(module, device_mesh, inner, tuple(map(whole_with_partial_gradient, args)),
                           {k: whole_with_partial_gradient(v) for k, v in kwargs.items()})
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"'partial_sum' all-reduces a module's output tensor, but {type(module).__name__} "
                            f"returned {type(out).__name__}; give it another style.")
        return DTensor.from_local(out, device_mesh, [Partial()], run_check=False).redistribute(
            device_mesh, [Replicate()]).to_local()


class _SumRopeGradient(ParallelStyle):
    """'mla_kv_a_proj': the last ``rope_dim`` outputs go to every head as they are, so each tp rank's heads give
    them only part of their gradient: summed over tp in backward (Replicate in, Partial gradient back)."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(hook)
        return module


class _ShardOutputSequence(ParallelStyle):
    """'replicate' under SP: a replicated module's output (e.g. a position embedding, (seq, hidden)) is cut to this
    rank's sequence chunk (dim -2) so it adds to the sharded residual stream; backward all-gathers its gradient, so
    the replicated weights get the full, identical gradient on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _args, out: _split_sequence(out, device_mesh, out.ndim - 2))
        return module


class _SequenceChecked(ParallelStyle):
    """A style whose module receives (batch, seq) inputs: checks seq % tp under SP before its first collective."""

    def __init__(self, inner: ParallelStyle, sequence_parallel: bool) -> None:
        super().__init__()
        self.inner, self.sequence_parallel = inner, sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.inner._apply(module, device_mesh)
        if self.sequence_parallel:
            name = type(module).__name__
            module.register_forward_pre_hook(
                lambda _m, args: _check_seq_len(args[0], SEQ_DIM, device_mesh, name), prepend=True
            )
        return module



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

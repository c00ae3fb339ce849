"""Fully sharded data parallelism (FSDP2, the ZeRO-3 family) on a DeviceMesh."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def apply_fsdp(
    root: nn.Module | None,
    mesh: DeviceMesh,
    units: Sequence[nn.Module],
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` each unit (given in model order), then the root, which takes every parameter no unit holds.
    ``root=None`` shards the units only, each its own FSDP root (pipeline stages, whose root module is never
    called).

    ``mesh`` is 1-D for FSDP and 2-D ``(replicate, shard)`` for HSDP. ``reshard_after_forward=False`` keeps the
    gathered parameters between forward and backward (ZeRO-2-like: less communication, more memory). The last unit
    never reshards after forward: backward needs its parameters at once, so freeing them would only add an
    all-gather (torchtitan does the same).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    # children must be sharded before their parents: units come in model (pre-)order, so go backwards
    for i in reversed(range(len(units))):
        fully_shard(
            units[i],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward and i < len(units) - 1,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
        _zero_gradients_of_unused_parameters(units[i], record=root is not None)
    if root is None:
        return
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                offload_policy=offload_policy)


#: (unit, parameter name) of every gradient this rank zero-filled since the last :func:`drop_gradients_no_rank_had`
_FILLED: list[tuple[nn.Module, str]] = []


class _FillMissingGradients(torch.autograd.Function):
    """Identity on a unit's inputs; in backward (just before FSDP's own post-backward, which wraps the inputs
    first), gives every trainable parameter of the unit that got no gradient a zero one."""

    @staticmethod
    def forward(ctx, unit: nn.Module, record: bool, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.record = unit, record
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None | torch.Tensor, ...]:
        for name, param in ctx.unit.named_parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
                if ctx.record:
                    _FILLED.append((ctx.unit, name))
        return (None, None, *grads)


def drop_gradients_no_rank_had(root: nn.Module, group: dist.ProcessGroup, had_none: list[str],
                               device: torch.device) -> None:
    """After a backward: a parameter that got no gradient on any rank of the data-parallel ``group`` (each rank
    zero-filled it) gets none after all, as in one process, so the optimizer skips it (AdamW would otherwise decay
    it and move it by its momentum). ``had_none``: the parameters without a gradient before this backward, in the
    same order on every rank. One all-reduce of a flag per such parameter (every rank takes part, filled or not)."""
    filled, _FILLED[:] = list(_FILLED), []
    if not had_none:
        return
    names: set[str] = set()
    if filled:
        fqn_of = {id(module): fqn for fqn, module in root.named_modules()}
        names = {f"{fqn_of[id(unit)]}.{name}".lstrip(".") for unit, name in filled if id(unit) in fqn_of}
    flags = torch.tensor([name in names for name in had_none], dtype=torch.uint8).to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    dropped = [name for name, every_rank_filled in zip(had_none, flags.tolist()) if every_rank_filled]
    if dropped:
        params = dict(root.named_parameters())
        for name in dropped:
            params[name].grad = None


def _zero_gradients_of_unused_parameters(unit: nn.Module, record: bool) -> None:
    """FSDP2 reduce-scatters only the parameters that got a gradient on this rank, so when ranks use different
    parameters (a mixture of experts whose routing left some experts without tokens on one rank), their
    reduce-scatters differ in size and the job aborts or hangs (pytorch/pytorch#158719, open in torch 2.13). With a
    zero gradient for each unused parameter every rank reduces the same tensors: the average is the one-process
    gradient of the whole batch. Written by hand because torch has no option for it. A parameter no rank used gets
    its gradient taken back (:func:`drop_gradients_no_rank_had`, one small all-reduce per backward), where
    ``record``: not for pipeline stages, whose schedules compute weight gradients after input gradients."""

    def wrap_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        flat = [(i, x) for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        keys = [k for k, x in kwargs.items() if isinstance(x, torch.Tensor) and x.requires_grad]
        tensors = [x for _, x in flat] + [kwargs[k] for k in keys]
        if not tensors:
            return None
        wrapped = _FillMissingGradients.apply(module, record, *tensors)
        args = list(args)
        for (i, _), x in zip(flat, wrapped):
            args[i] = x
        kwargs = {**kwargs, **dict(zip(keys, wrapped[len(flat):]))}
        return tuple(args), kwargs

    unit.register_forward_pre_hook(wrap_inputs, with_kwargs=True)

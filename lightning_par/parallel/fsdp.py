"""Fully sharded data parallelism (FSDP2, the ZeRO-3 family) on a DeviceMesh."""

from __future__ import annotations

from collections.abc import Sequence

import torch
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
        _zero_gradients_of_unused_parameters(units[i])
    if root is None:
        return
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                offload_policy=offload_policy)


class _FillMissingGradients(torch.autograd.Function):
    """Identity on a unit's inputs; in backward (just before FSDP's own post-backward, which wraps the inputs
    first), gives every trainable parameter of the unit that got no gradient a zero one."""

    @staticmethod
    def forward(ctx, unit: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None | torch.Tensor, ...]:
        for param in ctx.unit.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        return (None, *grads)


def _zero_gradients_of_unused_parameters(unit: nn.Module) -> None:
    """FSDP2 reduce-scatters only the parameters that got a gradient on this rank, so when ranks use different
    parameters (a mixture of experts whose routing left some experts without tokens on one rank), their
    reduce-scatters differ in size and the job aborts or hangs (pytorch/pytorch#158719, open in torch 2.13). With a
    zero gradient for each unused parameter every rank reduces the same tensors: the average is the one-process
    gradient of the whole batch. Written by hand because torch has no option for it; costs nothing while every
    parameter is used. (A parameter that no rank used gets a zero gradient where one process would have none.)"""

    def wrap_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        flat = [(i, x) for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        keys = [k for k, x in kwargs.items() if isinstance(x, torch.Tensor) and x.requires_grad]
        tensors = [x for _, x in flat] + [kwargs[k] for k in keys]
        if not tensors:
            return None
        wrapped = _FillMissingGradients.apply(module, *tensors)
        args = list(args)
        for (i, _), x in zip(flat, wrapped):
            args[i] = x
        kwargs = {**kwargs, **dict(zip(keys, wrapped[len(flat):]))}
        return tuple(args), kwargs

    unit.register_forward_pre_hook(wrap_inputs, with_kwargs=True)

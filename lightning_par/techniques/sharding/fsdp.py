"""Fully sharded data parallelism (FSDP2, the ZeRO-3 family) on a DeviceMesh."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_par._compat import is_quantized
from lightning_par.parallel.unused_parameters import UnusedParameterGuard


def apply_fsdp(
    root: nn.Module | None,
    mesh: DeviceMesh,
    units: Sequence[nn.Module],
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    keep_last_gathered: bool = True,
) -> UnusedParameterGuard:
    """``fully_shard`` each unit (given in model order), then the root, which takes every parameter no unit holds.
    ``root=None`` shards the units only, each its own FSDP root (pipeline stages, whose root module is never
    called).

    ``mesh`` is 1-D for FSDP and 2-D ``(replicate, shard)`` for HSDP. ``reshard_after_forward=False`` keeps the
    gathered parameters between forward and backward (ZeRO-2-like: less communication, more memory). The last unit
    never reshards after forward: backward needs its parameters at once, so freeing them would only add an
    all-gather (torchtitan does the same); ``keep_last_gathered=False`` where the units are not the model's last
    (each experts module, sharded apart in the middle of its block).

    Returns the guard of parameters a rank's forward may leave out (``parallel/unused_parameters.py``): call its
    ``before_backward``/``after_backward`` around each backward when ``root`` is given.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    guard = UnusedParameterGuard(record=root is not None)
    watch = mesh.size() > 1  # one rank reduces with nobody: a zero gradient there would only differ from no gradient
    ignored = _whole_quantized_weights(root, units, mesh)
    # children must be sharded before their parents: units come in model (pre-)order, so go backwards
    for i in reversed(range(len(units))):
        fully_shard(
            units[i],
            mesh=mesh,
            reshard_after_forward=reshard_after_forward and (i < len(units) - 1 or not keep_last_gathered),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored,
        )
        if watch:
            guard.watch(units[i])
    if root is not None:
        fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy, ignored_params=ignored)
    return guard


def _whole_quantized_weights(root: nn.Module | None, units: Sequence[nn.Module], mesh: DeviceMesh) -> set[nn.Parameter]:
    """The quantized (NF4) weights FSDP must leave alone: all of them where the shard dimension has one rank (HSDP
    with ``dp_shard=1``: replication only). There torch's FSDP2 copies a parameter's first all-gather input as its
    whole value (``FSDPParamGroup.wait_for_unshard``, torch 2.11-2.13), and torchao's NF4Tensor gathers three
    (codes, scales, factors). Frozen and unsharded, such a weight loses nothing by staying out of FSDP: it has no
    gradient to reduce, and every rank holds the same codes."""
    if mesh.size(mesh.ndim - 1) > 1:
        return set()
    modules = [*units, *([root] if root is not None else [])]
    return {p for m in modules for p in m.parameters() if is_quantized(p)}


#: FSDP modules whose gradients stay unsharded across the micro-batches of a step (``mark_accumulate_unsharded``)
_ACCUMULATE_UNSHARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_holding = [0]  # > 0 inside ``hold_reductions``


@contextmanager
def hold_reductions() -> Iterator[None]:
    """No marked FSDP module reduces inside (``sync_gradients`` keeps them unsharded whatever it is asked): around
    a batch of gradient accumulation before the last, whose pipeline schedule would reduce at its last
    micro-batch."""
    _holding[0] += 1
    try:
        yield
    finally:
        _holding[0] -= 1


def mark_accumulate_unsharded(module: nn.Module) -> None:
    """Let :func:`sync_gradients` switch the FSDP modules in ``module`` (the option ``accumulate_unsharded``)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            _ACCUMULATE_UNSHARDED.add(m)


@contextmanager
def sync_gradients(module: nn.Module, sync: bool) -> Iterator[None]:
    """Run a backward with the marked FSDP modules in ``module`` (:func:`mark_accumulate_unsharded`) reducing their
    gradients (``sync=True``) or keeping them unsharded to accumulate, with their gathered parameters kept for the
    next micro-batch (``sync=False``: a micro-batch before the step's last; no communication after its backward, one
    reduce-scatter per step). Afterwards the flags are back to FSDP's defaults (reduce, reshard after backward);
    what the backward kept gathered stays so until the next forward uses it. Unmarked modules: nothing changes."""
    units = [m for m in module.modules() if m in _ACCUMULATE_UNSHARDED] if _ACCUMULATE_UNSHARDED else []
    sync = sync and not _holding[0]
    for unit in units:
        unit.set_requires_gradient_sync(sync, recurse=False)
        unit.set_reshard_after_backward(sync, recurse=False)
    try:
        yield
    finally:
        if not sync:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)
                unit.set_reshard_after_backward(True, recurse=False)

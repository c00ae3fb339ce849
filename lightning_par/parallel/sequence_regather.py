"""Sequence parallelism that saves each rank's sequence chunk for backward and gathers it again there (Megatron-LM's
way), instead of the whole gathered sequence.

Under sequence parallelism every column-parallel layer (and every 'gather_sequence' module) all-gathers its input
from the ranks' sequence chunks, and its matmul saves that whole input for the weight gradient: per block the
attention's and the MLP's inputs, each ``tp`` times a chunk. With ``regather_sequence`` the gathered input is saved as
this rank's chunk (1/tp of it) and gathered again the first time backward needs it, one all-gather per gathered
input per micro-batch (its saved views, e.g. q, k and v's, share it). torch's DTensor styles have no such option;
this is written by hand with ``saved_tensors_hooks``, the mechanism torch's own checkpointing and offloading use.

Where it applies: tensors saved outside activation checkpointing (a checkpointed block saves its input only, and its
recomputation gathers again anyway). Under autocast without FSDP the matmuls save autocast's own half-precision copy
of the input, not the gathered tensor, so nothing changes there. A chunk modified in place between forward and
backward is refused at backward (the gradients would be wrong).

While the hooks are active every tensor autograd saves is held by a Python object (their pack hook hands it back),
so a scan of the live tensors (``planner.measure.live_storages``) sees the step's activations.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

#: gathered inputs by the address of their storage, while the gathered tensor is alive (its forward)
_GATHERED: dict[int, tuple[weakref.ref, _Gathered]] = {}


class _Gathered:
    """One all-gather of a sequence-parallel input: this rank's chunk, kept for backward, and the whole tensor,
    gathered again from it when backward first needs it and shared by every saved view until the last is used."""

    __slots__ = ("chunk", "version", "mesh", "dim", "pending", "_whole")

    def __init__(self, chunk: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        self.chunk, self.version, self.mesh, self.dim = chunk.detach(), chunk._version, mesh, dim
        self.pending, self._whole = 0, None

    def whole(self) -> torch.Tensor:
        if self._whole is None:
            if self.chunk._version != self.version:
                raise RuntimeError(
                    "regather_sequence=True: a sequence-parallel input was modified in place after its layer "
                    "gathered it, so backward cannot gather it again. Make the in-place op out of place, or turn "
                    "regather_sequence off.")
            gathered = DTensor.from_local(self.chunk, self.mesh, [Shard(self.dim)], run_check=False)
            self._whole = gathered.redistribute(self.mesh, [Replicate()]).to_local()
        return self._whole

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self._whole = None


class _SavedView:
    """What autograd keeps instead of a view of a gathered input: the view's geometry, and its DTensor spec."""

    __slots__ = ("source", "size", "stride", "offset", "spec")

    def __init__(self, source: _Gathered, local: torch.Tensor, base_offset: int, spec: tuple | None) -> None:
        self.source, self.spec = source, spec
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset() - base_offset
        source.pending += 1

    def unpack(self) -> torch.Tensor:
        local = self.source.whole().as_strided(self.size, self.stride, self.offset)
        self.source.release()
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Held:
    """Any other saved tensor, held by a Python object (what a scan of the live tensors can see)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _pack(t: torch.Tensor) -> Any:
    local = _local(t)
    if local.device.type != "meta" and _GATHERED:
        found = _GATHERED.get(local.untyped_storage().data_ptr())
        gathered = found[0]() if found is not None else None
        if gathered is not None and gathered.untyped_storage().nbytes() == local.untyped_storage().nbytes():
            spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
            return _SavedView(found[1], local, gathered.storage_offset(), spec)
    return _Held(t)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.unpack() if isinstance(saved, _SavedView) else saved.tensor


@contextmanager
def regathered_sequence() -> Iterator[None]:
    """While a step runs (forward and backward): gathered inputs are saved as chunks (see the module docstring)."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def save_chunks_of_gathered_input(module: nn.Module, mesh: DeviceMesh, dim: int) -> None:
    """Mark ``module``'s gathered input, after its tensor-parallel style registered the gather (an input hook):
    its chunk is taken before that hook and the gathered tensor after it."""
    chunks: list[torch.Tensor] = []

    def before(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = _first_tensor(args, kwargs)
        chunks[:] = [_local(x)] if x is not None and torch.is_grad_enabled() else []

    def after(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = _first_tensor(args, kwargs)
        if not chunks or x is None:
            return
        chunk, whole = chunks.pop(), _local(x)
        if (whole.device.type == "meta" or whole.data_ptr() == chunk.data_ptr() or not whole.is_contiguous()
                or whole.size(dim) != chunk.size(dim) * mesh.size()):
            return  # not gathered here (no sequence parallelism on this call), or laid out unlike a fresh gather
        key = whole.untyped_storage().data_ptr()
        entry = _Gathered(chunk, mesh, dim)
        _GATHERED[key] = (weakref.ref(whole, lambda _ref, k=key, e=entry: _forget(k, e)), entry)

    module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    module.register_forward_pre_hook(after, with_kwargs=True)


def _forget(key: int, entry: _Gathered) -> None:
    found = _GATHERED.get(key)
    if found is not None and found[1] is entry:
        del _GATHERED[key]

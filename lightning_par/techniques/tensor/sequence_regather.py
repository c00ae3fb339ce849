"""Sequence parallelism that saves each rank's sequence chunk for backward and gathers it again there (Megatron-LM's
way), instead of the whole gathered sequence.

Under sequence parallelism every column-parallel layer (and every 'gather_sequence' module, and a head that gathers
its input) all-gathers its input from the ranks' sequence chunks, and its matmuls save that whole input for the
weight gradient: per block the attention's and the MLP's inputs, each ``tp`` times a chunk. With
``regather_sequence`` the gathered input is saved as this rank's chunk (1/tp of it) and gathered again the first
time a backward pass needs it, one all-gather per gathered input per pass (its saved views, e.g. q, k and v's,
share it; a schedule that splits backward into an input and a weight pass gathers twice). torch's DTensor styles
have no such option; this is written by hand with ``saved_tensors_hooks``, the mechanism torch's own
checkpointing and offloading use.

Where it applies: tensors saved outside activation checkpointing (a checkpointed block saves its input only, and its
recomputation gathers again anyway). Under autocast without FSDP the matmuls save autocast's own half-precision copy
of the input, not the gathered tensor, so nothing changes there.

While the hooks are active autograd does not check saved tensors for in-place changes; the hooks do, for every
tensor they hold (the chunks included), and raise at backward instead of computing a wrong gradient. Every saved
tensor is then held by a Python object (detached: the hooks never keep a graph alive), so a scan of the live
tensors (``planner.measure.live_storages``) sees the step's activations.
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

from lightning_par._compat import local_tensor, tensor_version

#: gathered inputs by (device, storage address), while the gathered tensor is alive (its forward)
_GATHERED: dict[tuple[str, int], tuple[weakref.ref, _Gathered]] = {}
#: backward all-gathers done since the process started (what the tests and the monitor can read)
_STATS = {"gathered_again": 0}


def gathered_again() -> int:
    """How many gathered inputs backward has gathered again in this process (``regather_sequence``)."""
    return _STATS["gathered_again"]


def _modified_in_place(what: str) -> RuntimeError:
    return RuntimeError(
        f"regather_sequence=True: {what} was modified in place after forward saved it for backward, so backward "
        f"would compute a wrong gradient (autograd leaves this check to the saved-tensor hooks). Make the in-place op "
        f"out of place (x = x * 2 instead of x.mul_(2)), or turn regather_sequence off.")


def _plain(t: torch.Tensor) -> bool:
    """A tensor with storage of its own: not a wrapper subclass (a functional collective's waiting result, float8)."""
    return type(t) is torch.Tensor and t.device.type != "meta"


def _key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class _Gathered:
    """One all-gather of a sequence-parallel input: this rank's chunk, kept for backward, and the whole tensor,
    gathered again from it the first time a backward pass needs it and shared by every saved view of it in that
    pass."""

    __slots__ = ("chunk", "chunk_version", "whole_version", "mesh", "dim", "dtype", "views", "remaining", "_whole")

    def __init__(self, chunk: torch.Tensor, whole: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        self.chunk, self.chunk_version = chunk.detach(), tensor_version(chunk)
        self.whole_version, self.dtype = tensor_version(whole), whole.dtype
        self.mesh, self.dim = mesh, dim
        self.views, self.remaining, self._whole = 0, 0, None

    def whole(self) -> torch.Tensor:
        if self._whole is None:
            if tensor_version(self.chunk) != self.chunk_version:
                raise _modified_in_place("a sequence-parallel layer's input chunk")
            gathered = DTensor.from_local(self.chunk, self.mesh, [Shard(self.dim)], run_check=False)
            self._whole = gathered.redistribute(self.mesh, [Replicate()]).to_local()
            self.remaining = self.views  # one pass of backward unpacks each view once
            _STATS["gathered_again"] += 1
        return self._whole

    def release(self) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self._whole = None


class _SavedView:
    """What autograd keeps instead of a view of a gathered input: the view's geometry, and its DTensor spec."""

    __slots__ = ("source", "size", "stride", "offset", "spec")

    def __init__(self, source: _Gathered, local: torch.Tensor, base_offset: int, spec: tuple | None) -> None:
        self.source, self.spec = source, spec
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset() - base_offset
        source.views += 1

    def unpack(self) -> torch.Tensor:
        local = self.source.whole().as_strided(self.size, self.stride, self.offset)
        self.source.release()
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Held:
    """Any other saved tensor, detached (a saved output would otherwise tie its graph into a cycle gc cannot free)
    and checked for in-place changes at backward."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor.detach(), tensor_version(tensor)

    def unpack(self) -> torch.Tensor:
        if tensor_version(self.tensor) != self.version:
            raise _modified_in_place(f"a tensor of shape {tuple(self.tensor.shape)} saved for backward")
        return self.tensor


def _pack(t: torch.Tensor) -> Any:
    local = local_tensor(t)
    if _GATHERED and _plain(local):
        found = _GATHERED.get(_key(local))
        whole = found[0]() if found is not None else None
        if (whole is not None and tensor_version(whole) == found[1].whole_version and local.dtype == whole.dtype
                and whole.untyped_storage().nbytes() == local.untyped_storage().nbytes()):
            spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
            return _SavedView(found[1], local, whole.storage_offset(), spec)
    return _Held(t)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.unpack()


@contextmanager
def regathered_sequence() -> Iterator[None]:
    """While a step runs (forward and backward): gathered inputs are saved as chunks (see the module docstring)."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def first_tensor_argument(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A module call's first positional tensor, or ``hidden_states=`` (how Hugging Face layers are called)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def save_chunks_of_gathered_input(module: nn.Module, mesh: DeviceMesh, dim: int) -> None:
    """Mark ``module``'s gathered input, after its tensor-parallel style registered the gather (an input hook):
    its chunk is taken before that hook and the gathered tensor after it."""
    chunks: list[torch.Tensor] = []

    def before(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = first_tensor_argument(args, kwargs)
        chunks[:] = [local_tensor(x)] if x is not None and torch.is_grad_enabled() else []

    def after(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        x = first_tensor_argument(args, kwargs)
        if not chunks or x is None:
            return
        chunk, whole = chunks.pop(), local_tensor(x)
        if (not (_plain(chunk) and _plain(whole)) or whole.data_ptr() == chunk.data_ptr()
                or not whole.is_contiguous() or whole.storage_offset() != 0
                or whole.untyped_storage().nbytes() != whole.numel() * whole.element_size()
                or whole.size(dim) != chunk.size(dim) * mesh.size() or whole.dtype != chunk.dtype):
            return  # not gathered here (no sequence parallelism on this call), or laid out unlike a fresh gather
        key, entry = _key(whole), _Gathered(chunk, whole, mesh, dim)
        _GATHERED[key] = (weakref.ref(whole, lambda _ref, k=key, e=entry: _forget(k, e)), entry)

    module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    module.register_forward_pre_hook(after, with_kwargs=True)


def _forget(key: tuple[str, int], entry: _Gathered) -> None:
    found = _GATHERED.get(key)
    if found is not None and found[1] is entry:
        del _GATHERED[key]

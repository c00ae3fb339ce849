"""Measuring what the planner predicts, on a real run: the model state a rank holds and the peak bytes of the tensors
autograd saves for backward. Used by the planner's tests and benchmarks (and usable in any training step)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for ``tensor``: its local shard if it is a DTensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Model state on this rank: parameters, their gradients, the optimizer's state tensors (local shards)."""
    params = list(params)
    optim = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optim": optim,
        "param_numel": sum(p.numel() for p in params),  # global sizes (DTensor.numel is the full tensor's)
        "param_tensors": len(params),
    }
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out


def saved_activations() -> tuple[AbstractContextManager, Callable[[], int]]:
    """A ``saved_tensors_hooks`` context and a function returning the peak bytes of the tensors autograd saved for
    backward that were alive at once: distinct storages (a storage counts from its first save until autograd releases
    its last saved reference, i.e. after the backward that used it), parameters and views of them left out (FSDP's
    all-gathered ones too), DTensors by their local shard. A pipeline stage's received input (a leaf that requires
    grad, not a parameter) counts."""
    live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references alive]
    state = {"now": 0, "peak": 0}

    def storage(t: torch.Tensor) -> tuple[int, int]:
        t = t._local_tensor if isinstance(t, DTensor) else t  # not to_local(): no autograd op inside a pack hook
        wait = getattr(t, "trigger_wait", None)
        if callable(wait):  # a functional collective's AsyncCollectiveTensor has no storage: count its result's
            t = wait()
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()

    def is_param(t: torch.Tensor) -> bool:
        # decided per tensor, never by remembered addresses: FSDP frees each block's all-gathered parameters after
        # its forward, and a later activation may be allocated at the same address
        base = t._base if t._base is not None else t
        return isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter)

    def release(ptr: int) -> None:
        entry = live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del live[ptr]
            state["now"] -= entry[0]

    class Saved:
        """What autograd keeps instead of the tensor: freed with the graph node, after the backward that used it."""

        __slots__ = ("tensor", "ptr")

        def __init__(self, tensor: torch.Tensor, ptr: int) -> None:
            self.tensor, self.ptr = tensor, ptr

        def __del__(self) -> None:
            release(self.ptr)

    def pack(t: torch.Tensor) -> Any:
        if is_param(t):
            return t
        ptr, nbytes = storage(t)
        if ptr in live:
            live[ptr][1] += 1
        else:
            live[ptr] = [nbytes, 1]
            state["now"] += nbytes
            state["peak"] = max(state["peak"], state["now"])
        return Saved(t, ptr)

    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, Saved) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack), lambda: state["peak"]


def probe_callback(probe_step: int) -> Any:
    """A Lightning callback measuring, at ``probe_step``, the saved-activation peak of the whole batch and then the
    model state after its optimizer step (``.activation_bytes``, ``.state``)."""
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.ctx: Any = None
            self.total: Any = None
            self.activation_bytes: int | None = None
            self.state: dict[str, int] | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == probe_step:
                self.ctx, self.total = saved_activations()
                self.ctx.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.ctx is not None:
                self.ctx.__exit__(None, None, None)
                self.ctx = None
                self.activation_bytes = self.total()
                self.state = state_bytes(pl_module.parameters(), trainer.optimizers[0])

    return Probe()

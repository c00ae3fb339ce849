"""Measuring what the planner predicts, on a real run: the model state a rank holds and the peak bytes of the tensors
autograd saves for backward. Used by the planner's tests and benchmarks (and usable in any training step)."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_par._compat import local_tensor
from lightning_par.collectives import settle_process_groups


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
        t = local_tensor(t)  # no autograd op inside a pack hook
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


def live_storages() -> dict[int, tuple[int, StorageWeakRef]]:
    """Every storage a tensor visible to Python holds (address -> bytes and a weak reference, which tells a storage
    freed since from a new one at the same address; DTensors by their local tensor): what a run keeps that
    autograd's hooks do not see, e.g. the outputs selective checkpointing caches. Unreachable cycles are collected
    first, so only what is held counts."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type != "meta":
            try:
                storage = obj.untyped_storage()
                if storage.nbytes():
                    out[storage.data_ptr()] = (storage.nbytes(), StorageWeakRef(storage))
            except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own, or one
                continue  # freed under it (gc.get_objects can still list a tensor whose storage is gone)
    return out


def _pause_for_other_threads() -> None:
    time.sleep(0.05)  # the GIL released: a thread about to drop its references gets to


def settled_new_storages(before: dict[int, tuple[int, StorageWeakRef]], exclude: set[int],
                         pause: Callable[[], None] = _pause_for_other_threads,
                         max_scans: int = 20) -> dict[int, int]:
    """The storages (address -> bytes) alive now that were not alive in ``before`` (a ``live_storages()`` taken
    earlier) and are not in ``exclude``, once other threads have let go of theirs: scans a ``pause`` apart until two
    agree (a warning if ``max_scans`` never do). A gloo worker thread drops a finished collective, and the buffers it
    still references (an all-gather's raw output, before the copy that rearranges it), just after waking the
    caller, and it needs the GIL to free their Python objects: a single scan counted one whole-sequence tensor more
    now and then. Across ranks, ``collectives.settle_process_groups`` first narrows that window."""
    if max_scans < 2:
        raise ValueError(f"max_scans={max_scans}: two scans must agree; pass 2 or more.")

    def is_new(ptr: int) -> bool:
        old = before.get(ptr)
        return old is None or old[1].expired()

    def scan() -> dict[int, int]:
        return {ptr: n for ptr, (n, _) in live_storages().items() if is_new(ptr) and ptr not in exclude}

    pause()
    last = scan()
    for _ in range(max_scans - 1):
        pause()
        now = scan()
        if now == last:
            return now
        last = now
    warnings.warn(f"settled_new_storages: {max_scans} scans, {pause} apart, never agreed; the last one is returned "
                  f"(another thread keeps allocating or freeing tensors)", stacklevel=2)
    return last


def probe_callback(probe_step: int, live: bool = False) -> Any:
    """A Lightning callback measuring, at ``probe_step``, the saved-activation peak of the whole batch and then the
    model state after its optimizer step (``.activation_bytes``, ``.state``); and what the step's forward left alive
    until backward (``.live_bytes``, with ``live=True``: every storage that did not exist when the batch started
    and is not a parameter, counted once, whoever holds it: autograd's saved tensors, selective checkpointing's
    cache, the loss; not for pipelines, whose backward runs inside ``training_step``)."""
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.ctx: Any = None
            self.total: Any = None
            self.activation_bytes: int | None = None
            self.state: dict[str, int] | None = None
            self.live_bytes: int | None = None
            self.before: dict[int, tuple[int, StorageWeakRef]] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == probe_step:
                self.before = live_storages() if live else {}
                self.ctx, self.total = saved_activations()
                self.ctx.__enter__()

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self.ctx is not None and live:
                params = {local_tensor(p).untyped_storage().data_ptr() for p in pl_module.parameters()}
                if dist.is_initialized() and dist.get_world_size() > 1:
                    settle_process_groups()  # every rank is here: a barrier per group (see settled_new_storages)
                self.live_bytes = sum(settled_new_storages(self.before, params).values())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            # the model state at its fullest: gradients (freed right after the step) beside the optimizer's state
            if self.ctx is not None:
                self.state = state_bytes(pl_module.parameters(), trainer.optimizers[0])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.ctx is not None:
                self.ctx.__exit__(None, None, None)
                self.ctx = None
                self.activation_bytes = self.total()

    return Probe()

"""The few collectives that the checkpoint, pretrained-weight and strategy modules share (below all of them).

Each is called by every rank at the same point; none hides a collective in rank-zero-only code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_par._compat import is_quantized, live_process_groups


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


#: how long ``settle_process_groups`` waits for a rank before naming it
SETTLE_SECONDS = 120.0


def settle_process_groups(timeout: float = SETTLE_SECONDS) -> None:
    """Wait for every rank, then let gloo's worker threads finish with what they ran.

    A gloo worker (``pt_gloo_runloop``) drops its reference to a finished collective after waking the caller; where
    it holds the last reference to a tensor with a Python object it takes the GIL to free it (seen in gdb:
    ``~AsyncWork`` -> ``decref_pyobject`` -> ``THPVariable_dealloc``). Until then the tensor is alive: at exit the
    interpreter may be finalizing (``terminate called without an active exception``, see
    ``strategies.base._destroy_process_group``), and mid-step a memory measurement counts it
    (``planner.measure``). So: a monitored barrier on the default group (it names a rank that does not come within
    ``timeout`` seconds, instead of hanging; it only exchanges messages with rank 0), then a plain barrier on every
    gloo group this rank belongs to, the default one included, in creation order (the same on every rank). A gloo
    barrier waits for every earlier collective of its group and takes the group's work lock, which a worker holds
    while it drops a finished collective. That narrows the window to a worker that has not yet taken the lock back:
    it makes the exit abort rare, and a measurement also scans until its count is stable."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout))
    elif torch.cuda.is_available() and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    for group in live_process_groups():
        if dist.get_backend(group) == "gloo":
            dist.barrier(group=group)


def raise_on_every_rank(problems: list[str]) -> None:
    """Raise one ``ValueError`` on every rank if any rank found a problem. Ranks holding different parameters
    (pipeline stages) find different problems; one small all-gather, so no rank is left waiting in a later
    collective."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems)
        problems = list(dict.fromkeys(p for part in gathered for p in part))
    if problems:
        raise ValueError(" ".join(problems))


@contextmanager
def _quantized_weights_dequantized(module: torch.nn.Module) -> Iterator[None]:
    """While inside, every 4-bit base weight (QLoRA's NF4, any tensor with ``get_original_weight``) holds its
    dequantized values, sharded as it was: a full state dict then gathers plain tensors. Gathering the NF4 tensors
    themselves (their codes and scales, through DTensor's redistribute) crashed a gloo rank with heap corruption
    once in five runs of tests/test_qlora.py, cause unknown; the plain gather is the path every other weight takes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for owner in module.modules():  # a gathered unit's state-dict hook would put its NF4 shards back
        if isinstance(owner, FSDPModule) and any(
                is_quantized(p) for p in owner.parameters()):
            owner.reshard()
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            local = param.to_local() if isinstance(param, DTensor) else param
            if local is None or not hasattr(local, "get_original_weight"):
                continue
            values = local.get_original_weight().to(local.dtype)
            if isinstance(param, DTensor):
                values = DTensor.from_local(values, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
            swapped.append((owner, name, param))
            owner._parameters[name] = torch.nn.Parameter(values, requires_grad=False)
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the module's full (unsharded) weights on CPU, on rank 0; an empty dict on other ranks.

    Keys are the module's own parameter names (activation-checkpoint wrappers stripped), whatever the layout;
    under pipeline parallelism each rank holds only its stages, and rank 0 merges them. 4-bit base weights
    (``quantize_base="nf4"``) come dequantized, in the dtype they were quantized from.
    """
    with _quantized_weights_dequantized(module):
        return _full_state_dict(module)


def _full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    keys: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized() and len(keys) > 1:
        dist.all_gather_object(keys, sorted(module.state_dict().keys()))
    if all(k == keys[0] for k in keys):  # every rank holds the whole model (sharded or replicated)
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # pipeline stages: each rank gathers its own stages' full tensors, rank 0 merges them
    local = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    parts: list[Any] | None = [None] * len(keys) if is_rank_zero() else None
    dist.gather_object({k: v.cpu() for k, v in local.items()}, parts, dst=0)
    return {k: v for part in parts or [] for k, v in part.items()}

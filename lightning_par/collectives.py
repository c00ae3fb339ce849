"""The few collectives that the checkpoint, pretrained-weight and strategy modules share (below all of them).

Each is called by every rank at the same point; none hides a collective in rank-zero-only code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the module's full (unsharded) weights on CPU, on rank 0; an empty dict on other ranks.

    Keys are the module's own parameter names (activation-checkpoint wrappers stripped), whatever the layout;
    under pipeline parallelism each rank holds only its stages, and rank 0 merges them.
    """
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

"""Activation checkpointing of blocks: recompute a block's activations in backward instead of storing them."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, fqns: list[str]) -> None:
    """Wrap each module named in ``fqns`` with torch's non-reentrant ``checkpoint_wrapper``, in place.

    The wrapper inserts ``_checkpoint_wrapped_module`` into parameter names; torch's state-dict helpers (and so
    every checkpoint lightning_par writes) strip it, so checkpoints stay loadable with or without checkpointing.
    """
    for fqn in fqns:
        parent_name, _, child_name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_module(child_name, checkpoint_wrapper(parent.get_submodule(child_name)))

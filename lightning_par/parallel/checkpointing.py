"""Activation checkpointing of blocks: recompute a block's activations in backward instead of storing them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from lightning_par.parallel.tensor import SHRINKING_INPUT_HOOKS

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]


def apply_activation_checkpointing(model: nn.Module, fqns: list[str], context_fn: ContextFn | None = None) -> None:
    """Wrap each module named in ``fqns`` with torch's non-reentrant ``checkpoint_wrapper``, in place.

    ``context_fn`` (torch.utils.checkpoint's) returns the contexts for the forward and for the recomputation: the
    recomputation runs inside autograd's backward, where the modes active during forward (e.g. context-parallel
    attention routing) are not, so they must be re-entered there.

    The wrapper inserts ``_checkpoint_wrapped_module`` into parameter names; torch's state-dict helpers (and so
    every checkpoint lightning_par writes) strip it, so checkpoints stay loadable with or without checkpointing.
    """
    for fqn in fqns:
        parent_name, _, child_name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        block = parent.get_submodule(child_name)
        wrapper = checkpoint_wrapper(block, **kwargs)
        _move_shrinking_input_hooks(block, wrapper)
        parent.register_module(child_name, wrapper)


def _move_shrinking_input_hooks(block: nn.Module, wrapper: nn.Module) -> None:
    """A block whose input tensor parallelism cuts to this rank's sequence chunk (``split_sequence``): the cut moves
    onto the wrapper, before the checkpoint, which otherwise would keep the whole input alive until backward."""
    for hook, handle in block.__dict__.pop(SHRINKING_INPUT_HOOKS, []):
        handle.remove()
        wrapper.register_forward_pre_hook(hook, with_kwargs=True)

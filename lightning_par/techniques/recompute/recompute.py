"""Activation checkpointing of blocks: recompute a block's activations in backward instead of storing them, all of
them (full) or all but the outputs of the costly ops (selective)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_par._compat import checkpoint_wrapper, ignore_profiler_ranges_in_selective_checkpointing
from lightning_par.parallel.modules import SHRINKING_INPUT_HOOKS

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]

_aten = torch.ops.aten
#: matmuls: selective checkpointing keeps the output of every other one of a block (the 1st, 3rd, ...), the policy
#: of torchtitan's ``selective_ac_option="op"``: half the matmul recomputation for about half the memory
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
#: ops whose outputs selective checkpointing always keeps: the attention kernels (their FLOPs grow with the square of
#: the sequence), sequence parallelism's reduce-scatter and expert parallelism's token all-to-alls (recomputing them
#: would communicate again; torchtitan keeps the same)
KEPT_OPS = frozenset({
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_to_all_single.default,
})


class SelectivePolicy:
    """Selective checkpointing's decision for one pass over one block, op by op: keep the output of ``func``?
    The engine asks it in the forward and, apart, in the recomputation; the planner's profile asks it while tracing
    each block, so both keep the same ops."""

    def __init__(self) -> None:
        self.matmuls = 0

    def keeps(self, func: Any) -> bool:
        if func in MATMUL_OPS:
            self.matmuls += 1
            return self.matmuls % 2 == 1
        return func in KEPT_OPS


def selective_checkpoint_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` of selective checkpointing: torch's own caching of the ops ``SelectivePolicy`` keeps (fresh
    per block call; the recomputation decides apart, so it skips the same matmuls the forward kept)."""
    ignore_profiler_ranges_in_selective_checkpointing()  # an FSDP unit inside the block (experts) needs it
    passes = {False: SelectivePolicy(), True: SelectivePolicy()}  # the forward, the recomputation

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = passes[ctx.is_recompute].keeps(func)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def combine_contexts(*fns: ContextFn) -> ContextFn:
    """One ``context_fn`` entering the forward contexts of all ``fns``, and their recomputation contexts."""
    if len(fns) == 1:
        return fns[0]

    def context_fn() -> tuple[AbstractContextManager, AbstractContextManager]:
        pairs = [fn() for fn in fns]
        return _all_of([p[0] for p in pairs]), _all_of([p[1] for p in pairs])

    return context_fn


@contextmanager
def _all_of(contexts: list[AbstractContextManager]) -> Iterator[None]:
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


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

"""Routing a model's attention to context-parallel attention, without changing the model.

Inside :class:`ContextParallelScope` every call of ``torch.nn.functional.scaled_dot_product_attention`` (the
attention of nanoGPT-style models and of Hugging Face models with ``attn_implementation="sdpa"``) is answered by
:func:`~lightning_par.parallel.context.context_parallel_attention` over the cp group: the same mechanism torch's own
``context_parallel`` uses (a ``TorchFunctionMode``), with our attention that also runs on gloo. The one thing a
model must do itself is take positions from :func:`context_positions` instead of ``arange(seq_len)``, because a
rank's tokens are not the first ``seq_len / cp`` of the sequence.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.context import context_parallel_sdpa
from lightning_par.parallel.context_sharding import sequence_positions, shard_sequence, unshard_sequence

_ACTIVE: list[ContextParallelScope] = []


class ContextParallelScope(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` is context-parallel over ``group``."""

    def __init__(self, group: dist.ProcessGroup, algorithm: str = "ring", load_balance: bool = True) -> None:
        super().__init__()
        self.group, self.algorithm, self.load_balance = group, algorithm, load_balance
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._sdpa = context_parallel_sdpa(group, algorithm=algorithm, load_balance=load_balance)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> ContextParallelScope:
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.pop()
        super().__exit__(*exc)

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return shard_sequence(tensor, dim, self.rank, self.size, self.load_balance)


def active_scope() -> ContextParallelScope | None:
    """The innermost active scope: the cp group, algorithm and layout of the step running now (None outside)."""
    return _ACTIVE[-1] if _ACTIVE else None


def recompute_in_active_scope() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for activation checkpointing: the recomputation (run by autograd during backward, where no
    TorchFunctionMode of the forward is active) re-enters the scope that was active when the forward ran."""
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None:
        return nullcontext(), nullcontext()
    return nullcontext(), ContextParallelScope(scope.group, scope.algorithm, scope.load_balance)


def context_positions(local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens: ``arange(local_len)`` unless context parallelism is
    active, where the rank holds load-balanced chunks of a ``local_len * cp`` long sequence."""
    if not _ACTIVE:
        return torch.arange(local_len, device=device)
    scope = _ACTIVE[-1]
    return sequence_positions(local_len * scope.size, scope.rank, scope.size, scope.load_balance, device=device)


def whole_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Every cp rank's part of ``tensor`` along its sequence dimension ``dim``, joined into the whole sequence in
    order (a collective over the cp group; no gradient): for decisions a model makes over whole sequences, such as
    an expert's capacity per sequence. ``tensor`` itself unless context parallelism is active."""
    if not _ACTIVE:
        return tensor
    scope = _ACTIVE[-1]
    return unshard_sequence(tensor.detach(), dim, scope.group, scope.load_balance)


def local_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole-sequence ``tensor`` (the inverse of :func:`whole_sequence`); ``tensor`` itself
    unless context parallelism is active."""
    return _ACTIVE[-1].shard(tensor, dim) if _ACTIVE else tensor


def shard_batch(batch: Any, scope: ContextParallelScope, seq_dim: int = 1) -> Any:
    """This rank's part of every tensor of ``batch`` with a sequence dimension (``ndim > seq_dim``); others as is.

    Every sharded tensor must have the same sequence length; a length that cannot be split raises a ValueError
    naming it (on every rank alike, before any communication: all ranks of a cp group read the same batch).
    """
    from lightning.fabric.utilities.apply_func import apply_to_collection

    lengths = set()

    def _shard(t: torch.Tensor) -> torch.Tensor:
        if t.ndim <= seq_dim:
            return t
        lengths.add(t.size(seq_dim))
        return scope.shard(t, seq_dim)

    out = apply_to_collection(batch, torch.Tensor, _shard)
    if len(lengths) > 1:
        raise ValueError(
            f"context parallelism shards dim {seq_dim} of every batch tensor, but they have different lengths "
            f"{sorted(lengths)}. Give inputs and targets the same sequence length."
        )
    return out

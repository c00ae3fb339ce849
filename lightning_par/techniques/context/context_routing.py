"""Routing a model's attention to context-parallel attention, without changing the model.

Inside :class:`ContextParallelScope` every call of ``torch.nn.functional.scaled_dot_product_attention`` (the
attention of nanoGPT-style models and of Hugging Face models with ``attn_implementation="sdpa"``) is answered by
:func:`~.context.context_parallel_attention` over the cp group: the same mechanism torch's own
``context_parallel`` uses (a ``TorchFunctionMode``), with our attention that also runs on gloo. Every
``F.cross_entropy`` with the mean reduction is answered by the mean over the whole sequences' counted tokens
(``parallel/token_loss``). The one thing a model must do itself is take positions from
:func:`context_positions` instead of ``arange(seq_len)``, because a rank's tokens are not the first
``seq_len / cp`` of the sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.sequence_scope import (  # noqa: F401 - re-exported: the model's and the engine's
    active_scope,
    context_positions,
    enter_scope,
    leave_scope,
    local_sequence,
    recompute_in_active_scope,
    whole_sequence,
)
from lightning_par.parallel.token_loss import TokenLoss
from lightning_par.techniques.context.context import context_parallel_sdpa
from lightning_par.techniques.context.context_sharding import sequence_positions, shard_sequence, unshard_sequence


class ContextParallelScope(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` is context-parallel over ``group``, and ``F.cross_entropy``
    (mean reduction) averages over the tokens of the whole sequences (``parallel/token_loss``)."""

    def __init__(self, group: dist.ProcessGroup, algorithm: str = "ring", load_balance: bool = True) -> None:
        super().__init__()
        self.group, self.algorithm, self.load_balance = group, algorithm, load_balance
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._sdpa = context_parallel_sdpa(group, algorithm=algorithm, load_balance=load_balance)
        self._tokens = TokenLoss(group)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **(kwargs or {}))
        if func is F.cross_entropy and self.size > 1:
            return self._tokens.cross_entropy(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> ContextParallelScope:
        enter_scope(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        leave_scope()
        super().__exit__(*exc)

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return shard_sequence(tensor, dim, self.rank, self.size, self.load_balance)

    def positions(self, local_len: int, device: torch.device | str | None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens (``sequence_scope.context_positions``)."""
        return sequence_positions(local_len * self.size, self.rank, self.size, self.load_balance, device=device)

    def unshard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence from every rank's part (``sequence_scope.whole_sequence``)."""
        return unshard_sequence(tensor.detach(), dim, self.group, self.load_balance)

    def reentered(self) -> ContextParallelScope:
        """A scope like this one, for a recomputation to enter (``sequence_scope.recompute_in_active_scope``)."""
        return ContextParallelScope(self.group, self.algorithm, self.load_balance)

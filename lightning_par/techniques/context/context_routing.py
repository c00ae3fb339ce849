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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.documents import attendable_tokens, document_ids
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
    (mean reduction) averages over the tokens of the whole sequences (``parallel/token_loss``).

    ``algorithm="ulysses"``: all-to-all over the whole cp group; ``ulysses`` = k between 1 and cp (with ``"ring"``
    or ``"allgather"``): the hybrid, all-to-all inside ``ulysses_group`` (k consecutive cp ranks), then the ring over
    ``ring_group`` (the cp / k ranks of the same member index). The rows' documents and padding (``tokens``) are
    the scope's while a forward runs."""

    def __init__(self, group: dist.ProcessGroup, algorithm: str = "ring", load_balance: bool = True,
                 ulysses: int = 1, ring_group: dist.ProcessGroup | None = None,
                 ulysses_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group, self.algorithm, self.load_balance = group, algorithm, load_balance
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._tokens = TokenLoss(group)
        if algorithm == "ulysses" or ulysses == self.size:
            ulysses, attention_group, attention_algorithm, ulysses_group = self.size, group, "ulysses", None
        elif ulysses > 1:
            if ring_group is None or ulysses_group is None:
                raise ValueError(f"ulysses={ulysses} below the cp size {self.size}: the hybrid needs ring_group and "
                                 f"ulysses_group (ContextParallel builds them from the mesh).")
            attention_group, attention_algorithm = ring_group, algorithm
        else:
            attention_group, attention_algorithm, ulysses_group = group, algorithm, None
        self.ulysses = ulysses
        self.ring_group, self.ulysses_group = ring_group, ulysses_group
        #: the rows running now: their documents and padding (whole rows; None: one document, no padding)
        self.documents: torch.Tensor | None = None
        self.attendable: torch.Tensor | None = None
        #: a Hugging Face model's local positions whose documents its mask function has yet to confirm (context_hf)
        self._documents_to_confirm: torch.Tensor | None = None
        self._attention = dict(group=attention_group, algorithm=attention_algorithm, load_balance=load_balance,
                               ulysses_group=ulysses_group)
        self._sdpa = context_parallel_sdpa(**self._attention, tokens=self.token_tables)

    def attention_kwargs(self) -> dict[str, Any]:
        """What :func:`~.context.context_parallel_attention` takes for this scope's layout and rows."""
        return {**self._attention, **self.token_tables()}

    def token_tables(self) -> dict[str, torch.Tensor | None]:
        return {"documents": self.documents, "attendable": self.attendable}

    def set_tokens(self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                   confirm: bool = False) -> None:
        """The documents (from this rank's part of ``position_ids``) and padding (this rank's part of a 2-D
        ``attention_mask``) of the rows about to run, gathered into whole rows (one small all-gather each).
        ``confirm``: a Hugging Face model's, kept only if its own mask function separates documents
        (``context_hf._confirm_documents``)."""
        whole_positions = None if position_ids is None else self.unshard(_rows(position_ids), 1)
        whole_mask = None if attention_mask is None else self.unshard(_rows(attention_mask), 1)
        self.documents = None if whole_positions is None else document_ids(whole_positions)
        self.attendable = attendable_tokens(whole_mask)
        self._documents_to_confirm = position_ids if confirm and self.documents is not None else None

    @contextmanager
    def tokens(self, position_ids: torch.Tensor | None,
               attention_mask: torch.Tensor | None) -> Iterator[None]:
        """``parallel/documents.packed_documents`` under context parallelism: the rows' tables while inside."""
        before = self.documents, self.attendable
        self.set_tokens(position_ids, attention_mask)
        try:
            yield
        finally:
            self.documents, self.attendable = before

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
        return shard_sequence(tensor, dim, self.rank, self.size, self.load_balance, self.ulysses)

    def positions(self, local_len: int, device: torch.device | str | None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens (``sequence_scope.context_positions``)."""
        return sequence_positions(local_len * self.size, self.rank, self.size, self.load_balance, device=device,
                                  ulysses=self.ulysses)

    def unshard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence from every rank's part (``sequence_scope.whole_sequence``)."""
        return unshard_sequence(tensor.detach(), dim, self.group, self.load_balance, self.ulysses)

    def reentered(self) -> ContextParallelScope:
        """A scope like this one, with the rows running now, for a recomputation to enter
        (``sequence_scope.recompute_in_active_scope``)."""
        scope = ContextParallelScope(self.group, self.algorithm, self.load_balance, self.ulysses, self.ring_group,
                                     self.ulysses_group)
        scope.documents, scope.attendable = self.documents, self.attendable
        return scope


def _rows(table: torch.Tensor) -> torch.Tensor:
    """A (seq,) table as one row (batch, seq)."""
    return table.unsqueeze(0) if table.dim() == 1 else table

"""The sequence split active now, as the model and the techniques see it (context parallelism's scope).

Context parallelism (``techniques/context/``) enters its scope around every step. What a model asks of it (its
tokens' positions, the whole sequence, this rank's part of one) and what other techniques need of it (activation
checkpointing recomputes inside it; a pipelined Hugging Face model takes its positions from it) is answered here,
below every technique, by the active scope's own methods. Outside any scope each answer is the unsplit one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Protocol

import torch


class SequenceScope(Protocol):
    """What a scope answers (``techniques.context.context_routing.ContextParallelScope``)."""

    def positions(self, local_len: int, device: torch.device | str | None) -> torch.Tensor: ...

    def unshard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    def reentered(self) -> AbstractContextManager: ...

    def tokens(self, position_ids: torch.Tensor | None,
               attention_mask: torch.Tensor | None) -> AbstractContextManager: ...

    def set_tokens(self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                   confirm: bool = False) -> None: ...


_ACTIVE: list[Any] = []


def enter_scope(scope: SequenceScope) -> None:
    _ACTIVE.append(scope)


def leave_scope() -> None:
    _ACTIVE.pop()


def active_scope() -> Any:
    """The innermost active scope: the cp group, algorithm and layout of the step running now (None outside)."""
    return _ACTIVE[-1] if _ACTIVE else None


def recompute_in_active_scope() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for activation checkpointing: the recomputation (run by autograd during backward, where no
    TorchFunctionMode of the forward is active) re-enters the scope that was active when the forward ran, and the
    one-process document mask (``parallel/documents``) where one was."""
    from lightning_par.parallel.documents import active_document_mask  # (it asks this module for the scope)

    again = [mode.reentered() for mode in (_ACTIVE[-1] if _ACTIVE else None, active_document_mask()) if mode]
    if not again:
        return nullcontext(), nullcontext()
    return nullcontext(), _Entered(again)


class _Entered(AbstractContextManager):
    """Several contexts entered in order and left in reverse."""

    def __init__(self, contexts: list[AbstractContextManager]) -> None:
        self.stack = ExitStack()
        self.contexts = contexts

    def __enter__(self) -> None:
        for context in self.contexts:
            self.stack.enter_context(context)

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def context_positions(local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens: ``arange(local_len)`` unless context parallelism is
    active, where the rank holds load-balanced chunks of a ``local_len * cp`` long sequence."""
    if not _ACTIVE:
        return torch.arange(local_len, device=device)
    return _ACTIVE[-1].positions(local_len, device)


def whole_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Every cp rank's part of ``tensor`` along its sequence dimension ``dim``, joined into the whole sequence in
    order (a collective over the cp group; no gradient): for decisions a model makes over whole sequences, such as
    an expert's capacity per sequence. ``tensor`` itself unless context parallelism is active."""
    if not _ACTIVE:
        return tensor
    return _ACTIVE[-1].unshard(tensor, dim)


def local_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole-sequence ``tensor`` (the inverse of :func:`whole_sequence`); ``tensor`` itself
    unless context parallelism is active."""
    return _ACTIVE[-1].shard(tensor, dim) if _ACTIVE else tensor

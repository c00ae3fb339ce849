"""Packed documents and padding for the user's own attention: the one way a model passes document boundaries.

Fine-tuning packs several documents into one row and restarts the positions at each (TRL's packing,
transformers' ``DataCollatorWithFlattening``); a document must then attend to itself only. Hugging Face models find
the documents from ``position_ids`` themselves (and, under context parallelism, ``techniques/context/context_hf``
does the same). A model of one's own wraps its forward::

    with lightning_par.packed_documents(position_ids):   # and/or attention_mask=... (1 = token, 0 = padding)
        logits = self.model(input_ids, position_ids)

Inside, every causal or full ``F.scaled_dot_product_attention`` call without a mask of its own keeps documents
apart and hides padding as keys: in one process (and under FSDP, tensor or expert parallelism) through a dense
boolean mask; under context parallelism the active scope's distributed attention gets the documents of the whole
rows (``techniques/context/context_routing``). Activation checkpointing's recomputation re-enters it
(``sequence_scope.recompute_in_active_scope``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par.parallel import sequence_scope


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document index of every token of packed rows (batch, seq) from their positions: a new document wherever the
    position does not go up by one (transformers' ``find_packed_sequence_indices`` rule); None when every row is
    one document."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    first = position_ids[:, :1] - 1
    ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return ids if bool(ids[:, -1].any()) else None


def attendable_tokens(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Hugging Face's 2-D ``attention_mask`` (1: a token, 0: padding) as booleans; None when it hides nothing."""
    if attention_mask is None or bool(attention_mask.bool().all()):
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be the 2-D (batch, seq) padding mask of 1s (tokens) and 0s (padding), "
                         f"got shape {tuple(attention_mask.shape)}.")
    return attention_mask.bool()


class DocumentMask(TorchFunctionMode):
    """One process's answer: ``F.scaled_dot_product_attention`` without a mask gets the documents' dense mask."""

    def __init__(self, documents: torch.Tensor | None, attendable: torch.Tensor | None) -> None:
        super().__init__()
        self.documents, self.attendable = documents, attendable

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = {**dict(zip(names, args)), **kwargs}
        if given.get("attn_mask") is not None:
            raise ValueError("packed_documents: this attention passes an attn_mask of its own; inside "
                             "packed_documents the documents' mask is applied for it. Call the attention with "
                             "is_causal=True (or full attention) and no attn_mask.")
        query = given.pop("query")
        rows = query.size(-2)
        visible = self.mask(rows, query.device, bool(given.pop("is_causal", False)))
        return func(query, given.pop("key"), given.pop("value"), attn_mask=visible, **given)

    def mask(self, rows: int, device: torch.device, causal: bool) -> torch.Tensor:
        """(batch, 1, rows, rows) booleans: causal (where asked), same document, key not padding; a row that would
        see nothing (a padding query before any token) sees itself, so the kernel returns no NaN."""
        visible = torch.ones(rows, rows, dtype=torch.bool, device=device)
        if causal:
            visible = visible.tril()
        visible = visible[None]
        if self.documents is not None:
            docs = self.documents.to(device)
            visible = visible & (docs[:, :, None] == docs[:, None, :])
        if self.attendable is not None:
            visible = visible & self.attendable.to(device)[:, None, :]
        visible = visible | torch.eye(rows, dtype=torch.bool, device=device)[None]
        return visible.unsqueeze(1)

    def __enter__(self) -> DocumentMask:
        _MASKS.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _MASKS.pop()
        super().__exit__(*exc)

    def reentered(self) -> DocumentMask:
        return DocumentMask(self.documents, self.attendable)


_MASKS: list[DocumentMask] = []


def active_document_mask() -> DocumentMask | None:
    """The innermost one-process document mask (for activation checkpointing's recomputation)."""
    return _MASKS[-1] if _MASKS else None


@contextmanager
def packed_documents(position_ids: torch.Tensor | None = None, *,
                     attention_mask: torch.Tensor | None = None) -> Iterator[None]:
    """Keep packed documents apart (found from ``position_ids``, which restart at each document) and hide padding
    (``attention_mask``: 1 token, 0 padding) in every ``F.scaled_dot_product_attention`` inside. Both are this
    rank's part of the rows, as the batch gave them (under context parallelism: sharded with the batch)."""
    scope = sequence_scope.active_scope()
    if scope is not None:
        with scope.tokens(position_ids, attention_mask):
            yield
        return
    documents = None if position_ids is None else document_ids(position_ids)
    attendable = attendable_tokens(attention_mask)
    if documents is None and attendable is None:
        yield
        return
    with DocumentMask(documents, attendable):
        yield

"""Context parallelism as a technique of the engine: while a step runs, every batch's sequence is split over the cp
group and the model's attention is answered by ring / all-gather attention. Plain models need nothing changed
(their ``F.scaled_dot_product_attention`` calls are routed); Hugging Face models get their attention and mask
functions through transformers' own interfaces, and their positions filled in (``context_hf``)."""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_par.checks import check_bool, check_choice
from lightning_par.costs.sheet import CostSheet, Transfer, busiest_sections, per_cut
from lightning_par.dims import ParallelDims
from lightning_par.parallel.hf import outermost_hf_models
from lightning_par.techniques.context import context as cp_attention
from lightning_par.techniques.context.context import ALGORITHMS
from lightning_par.techniques.context.context_hf import route_attention
from lightning_par.techniques.context.context_routing import ContextParallelScope
from lightning_par.techniques.technique import Options, Target, Technique

#: the score-sized fp32 tensors a block's backward holds at once (``context._tile_backward``; its fp32
#: dK/dV accumulators, keys x head size each, are left out: a score tensor is keys x query rows)
SCORE_TENSORS = 3
FP32_BYTES = 4


@dataclass(frozen=True)
class ContextParallelOptions(Options):
    """Context parallelism's options, under the names ``NDParallelStrategy`` takes them (the one source of their
    defaults; ``docs/strategies.md``'s option table names each)."""

    cp_algorithm: str = "ring"
    cp_load_balance: bool = True
    cp_seq_dim: int = 1

    def build(self) -> ContextParallel:
        return ContextParallel(self.cp_algorithm, self.cp_load_balance, self.cp_seq_dim)


class ContextParallel(Technique):
    def __init__(self, algorithm: str = "ring", load_balance: bool = True, seq_dim: int = 1) -> None:
        self.algorithm = check_choice("cp_algorithm", algorithm, ALGORITHMS)
        self.load_balance = check_bool("cp_load_balance", load_balance)
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(f"cp_seq_dim={seq_dim!r} must be the batch tensors' sequence dimension (>= 1), e.g. 1.")
        self.seq_dim = seq_dim
        self.scope: ContextParallelScope | None = None

    def setup_environment(self, dims: ParallelDims) -> None:
        if dims.cp > 1:
            self.scope = ContextParallelScope(dims.mesh("cp").get_group(), self.algorithm, self.load_balance)

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if dims.cp > 1:
            for _, model in outermost_hf_models(target.module):
                route_attention(model)

    def step_context(self, dims: ParallelDims) -> AbstractContextManager | None:
        return self.scope

    def shard_batch(self, batch: Any) -> Any:
        return batch if self.scope is None else shard_batch(batch, self.scope, self.seq_dim)

    def account(self, sheet: CostSheet) -> None:
        """Every activation split over cp (each rank holds its share of the sequence); per attention and
        micro-batch the keys and values go around the ring (cp - 1 hops forward, again in backward with their
        gradients in fp32), hidden behind the attention's own compute as far as it lasts (the next hop is in flight
        while a block is computed: at short sequences the blocks are short and the ring shows), or are
        all-gathered and their gradients reduce-scattered, exposed (the engine waits for them). Each block's
        attention sends its own messages (their count sets the latency paid).

        Each block's scores are materialized in fp32 (the math path; ``context.py``), the rank's own block
        of ``(seq / cp)^2`` the largest, cut into row tiles of ``SCORE_TILE_BYTES``: backward holds three such
        tensors at once (the probabilities, their gradient, the scores' gradient), a transient the buffers add."""
        cp = sheet.dims.cp
        if cp == 1:
            return
        sheet.cp = cp
        sheet.buffer_bytes += SCORE_TENSORS * per_cut(
            sheet, ("cp_scores", sheet.token_scale, sheet.sequence_scale, cp, sheet.tp, cp_attention.SCORE_TILE_BYTES),
            lambda: _score_tile_bytes(sheet))
        m = sheet.microbatches
        grad = sheet.grad_scale  # dK/dV travel in fp32
        # attentions of one size (the blocks) are one Transfer with their message counts summed
        scale = sheet.token_scale * sheet.activation_scale / cp / sheet.tp
        attentions = per_cut(sheet, ("cp_attentions",), lambda: tuple(Counter(
            sheet.profile.sections[name].kv_bytes for name in busiest_sections(sheet)).items()))
        for traced_kv, k in attentions:
            kv = traced_kv * scale
            if not kv:
                continue
            # a recomputed forward sends the forward's messages again (no checkpointing policy keeps them)
            if self.algorithm == "ring":  # forward: cp-1 hops of K/V; backward: again, plus cp hops of dK/dV
                forward = (cp - 1) * m * k
                sheet.transfers.append(Transfer("cp", "cp", "send_recv", kv, (2 * (cp - 1) + cp * grad) * m * k, True,
                                                forward, forward, hides_behind="attention"))
            else:
                sheet.transfers.append(Transfer("cp", "cp", "all_gather", kv * cp, 2 * m * k, False, m * k, m * k))
                sheet.transfers.append(Transfer("cp", "cp", "reduce_scatter", grad * kv * cp, m * k, False))

    def describe(self, dims: ParallelDims) -> str | None:
        if dims.cp == 1:
            return None
        return f"context parallel ({self.algorithm}, load balance {self.load_balance})"


def _score_tile_bytes(sheet: CostSheet) -> float:
    """The fp32 scores of one row tile of the largest block (``context.rows_per_tile``): the rank's own,
    its micro-batch's queries and keys of one sequence chunk (heads split over tp)."""
    scores = max((sheet.profile.sections[name].attention_scores for name in busiest_sections(sheet)), default=0)
    cp = sheet.dims.cp
    block = scores * sheet.token_scale * sheet.sequence_scale / cp**2 / sheet.tp * FP32_BYTES
    rows = sheet.seq_len / cp  # the block's query rows, one sequence chunk
    return min(rows, cp_attention.rows_per_tile(block / rows)) * block / rows


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

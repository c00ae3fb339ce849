"""Context parallelism as a technique of the engine: while a step runs, every batch's sequence is split over the cp
group and the model's attention is answered by ring / all-gather attention. Plain models need nothing changed
(their ``F.scaled_dot_product_attention`` calls are routed); Hugging Face models get their attention and mask
functions through transformers' own interfaces, and their positions filled in (``context_hf``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
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
from lightning_par.techniques.context.ulysses import kv_repeats
from lightning_par.techniques.technique import Options, Target, Technique, planned

#: the score-sized fp32 tensors a block's backward holds at once (``context._tile_backward``; its fp32
#: dK/dV accumulators, keys x head size each, are left out: a score tensor is keys x query rows)
SCORE_TENSORS = 3
FP32_BYTES = 4


@dataclass(frozen=True)
class ContextParallelOptions(Options):
    """Context parallelism's options, under the names ``NDParallelStrategy`` takes them (the one source of their
    defaults; ``docs/strategies.md``'s option table names each)."""

    cp_algorithm: str = planned(
        "ring", weigh=("ring", "ulysses"), flag="with cp > 1: the attention algorithms to weigh: the ring, "
        "Ulysses (all-to-all; where cp divides the heads after tp), the all-gather (default: ring and ulysses)",
        flag_values={"ring": "ring", "ulysses": "ulysses", "allgather": "allgather"})
    cp_load_balance: bool = True
    cp_seq_dim: int = 1
    cp_ulysses_size: int | None = planned(
        None, weigh=(None, 2, 4, 8), flag="with cp > 2: the hybrids to weigh, all-to-all inside groups of that many "
        "cp ranks then the ring over the groups (none: no hybrid; default: none 2 4 8, each where it divides cp "
        "and the heads)", flag_values={"none": None, "2": 2, "4": 4, "8": 8})

    LEGEND = ((r"\bUlysses\b(?! \d)", "Ulysses = context parallelism by all-to-all (cp_algorithm='ulysses')"),
              (r"\bUlysses \d+ x\b", "Ulysses k x ring = all-to-all inside groups of k cp ranks, then the ring (or the "
                                   "all-gather) over the groups (cp_ulysses_size=k)"),
              (r"\ball-gather\b", "all-gather = context parallelism gathering keys and values (cp_algorithm="
                                   "'allgather')"))

    def build(self) -> ContextParallel:
        return ContextParallel(self.cp_algorithm, self.cp_load_balance, self.cp_seq_dim, self.cp_ulysses_size)

    def label(self, dims: ParallelDims) -> list[str]:
        if dims.cp == 1:
            return []
        k = self.cp_ulysses_size or 1
        if self.cp_algorithm != "ulysses" and 1 < k < dims.cp:
            return [f"Ulysses {k} x {'all-gather' if self.cp_algorithm == 'allgather' else 'ring'}"]
        return {"ulysses": ["Ulysses"], "allgather": ["all-gather"]}.get(self.cp_algorithm, [])

    @staticmethod
    def choices(sizes: Mapping[str, int], weighed: Mapping[str, tuple], profile: Any) -> list[dict[str, Any]]:
        """The algorithms weighed, with cp > 1: Ulysses only where cp divides every attention's query heads left
        after tensor parallelism (``ulysses.check_heads``)."""
        cp, tp = sizes["cp"], sizes["tp"]
        if cp == 1:
            return [{}]
        heads = [s.attention_heads for s in profile.sections.values() if s.attention_heads]

        def splits(k: int) -> bool:
            return bool(heads) and all(h % tp == 0 and (h // tp) % k == 0 for h in heads)

        algorithms = [a for a in weighed["cp_algorithm"] if a != "ulysses" or splits(cp)] or ["ring"]
        out: list[dict[str, Any]] = [{"cp_algorithm": a} for a in algorithms]
        # the hybrids: all-to-all inside groups of k, then the weighed ring or all-gather over cp / k groups
        for k in weighed["cp_ulysses_size"]:
            if k is not None and 1 < k < cp and cp % k == 0 and splits(k):
                out += [{"cp_algorithm": a, "cp_ulysses_size": k} for a in algorithms if a != "ulysses"]
        return out


class ContextParallel(Technique):
    def __init__(self, algorithm: str = "ring", load_balance: bool = True, seq_dim: int = 1,
                 ulysses_size: int | None = None) -> None:
        self.algorithm = check_choice("cp_algorithm", algorithm, ALGORITHMS)
        self.load_balance = check_bool("cp_load_balance", load_balance)
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(f"cp_seq_dim={seq_dim!r} must be the batch tensors' sequence dimension (>= 1), e.g. 1.")
        if ulysses_size is not None and (isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int)
                                         or ulysses_size < 1):
            raise ValueError(f"cp_ulysses_size={ulysses_size!r} must be a positive int: the cp ranks of one all-to-all "
                             f"group (a divisor of cp), or None.")
        self.seq_dim = seq_dim
        self.ulysses_size = ulysses_size
        self.scope: ContextParallelScope | None = None

    def ulysses(self, cp: int) -> int:
        """The ranks of one all-to-all group: cp with ``cp_algorithm="ulysses"``, else ``cp_ulysses_size`` (1:
        none)."""
        return cp if self.algorithm == "ulysses" else (self.ulysses_size or 1)

    def check(self, dims: ParallelDims) -> None:
        if self.ulysses_size is None or dims.cp == -1:
            return
        if self.algorithm == "ulysses" and self.ulysses_size != dims.cp:
            raise ValueError(f"cp_ulysses_size={self.ulysses_size} with cp_algorithm='ulysses': the all-to-all then "
                             f"spans the whole cp group ({dims.cp}). Leave cp_ulysses_size out, or give cp_algorithm "
                             f"'ring' or 'allgather' for the hybrid (all-to-all inside groups of cp_ulysses_size "
                             f"ranks, then the ring over the groups).")
        if dims.cp % self.ulysses_size != 0:
            raise ValueError(f"cp_ulysses_size={self.ulysses_size} must divide cp={dims.cp} (each all-to-all group is "
                             f"that many consecutive cp ranks), e.g. {_divisors(dims.cp)}.")

    def setup_environment(self, dims: ParallelDims) -> None:
        if dims.cp == 1:
            return
        k = self.ulysses(dims.cp)
        ring_group = ulysses_group = None
        if 1 < k < dims.cp:  # the hybrid: the cp dimension cut into (ring, Ulysses group), the group innermost
            ring_group, ulysses_group = hybrid_groups(dims, k)
        self.scope = ContextParallelScope(dims.mesh("cp").get_group(), self.algorithm, self.load_balance, k,
                                          ring_group, ulysses_group)

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
        ulysses = self.ulysses(cp)
        ring = cp // ulysses
        m = sheet.microbatches
        grad = sheet.grad_scale  # dK/dV travel in fp32
        scale = sheet.token_scale * sheet.activation_scale / cp / sheet.tp
        repeats = 1
        if ulysses > 1:
            repeats = self._account_all_to_all(sheet, ulysses, scale)
        if ring == 1:
            return
        sheet.buffer_bytes += SCORE_TENSORS * per_cut(
            sheet, ("cp_scores", sheet.token_scale, sheet.sequence_scale, cp, sheet.tp, cp_attention.SCORE_TILE_BYTES),
            lambda: _score_tile_bytes(sheet))
        # attentions of one size (the blocks) are one Transfer with their message counts summed; after a Ulysses
        # group's all-to-all each ring rank holds the group's tokens for its heads: as many key/value elements as
        # one rank's own (repeated where fewer heads than the group), passed around a ring of cp / ulysses
        attentions = per_cut(sheet, ("cp_attentions",), lambda: tuple(Counter(
            sheet.profile.sections[name].kv_bytes for name in busiest_sections(sheet)).items()))
        for traced_kv, k in attentions:
            kv = traced_kv * scale * repeats
            if not kv:
                continue
            # a recomputed forward sends the forward's messages again (no checkpointing policy keeps them)
            if self.algorithm == "ring":  # forward: ring-1 hops of K/V; backward: again, plus ring hops of dK/dV
                forward = (ring - 1) * m * k
                sheet.transfers.append(Transfer("cp", "cp", "send_recv", kv, (2 * (ring - 1) + ring * grad) * m * k,
                                                True, forward, forward, hides_behind="attention"))
            else:  # collectives over the ring of `ring` ranks, written over the cp group: (cp - 1) / cp of nbytes
                whole = kv * (ring - 1) * cp / (cp - 1)
                sheet.transfers.append(Transfer("cp", "cp", "all_gather", whole, 2 * m * k, False, m * k, m * k))
                sheet.transfers.append(Transfer("cp", "cp", "reduce_scatter", grad * whole, m * k, False))

    def _account_all_to_all(self, sheet: CostSheet, ulysses: int, scale: float) -> int:
        """All-to-all inside each Ulysses group (``ulysses.py``): per attention and micro-batch, queries, keys,
        values and the output in forward, their gradients in backward, each rank sending ``(ulysses - 1) /
        ulysses`` of its part, exposed (the attention waits for its inputs); key/value heads fewer than the group
        repeated first (``kv_repeats``). The attention then runs over the group's tokens for ``heads / ulysses``
        of the heads: the same compute as the ring's blocks. Returns the key/value repetition. A group smaller than
        cp is priced over the cp group's links with its own share of the bytes."""
        cp, m = sheet.dims.cp, sheet.microbatches
        repeats = 1
        for name in busiest_sections(sheet):
            section = sheet.profile.sections[name]
            heads, kv_heads = section.attention_heads // sheet.tp, section.attention_kv_heads // sheet.tp
            repeats = kv_repeats(heads, kv_heads, ulysses) if heads and kv_heads else 1
            moved = (section.qo_bytes + section.kv_bytes * repeats) * scale
            if moved:
                share = (ulysses - 1) / ulysses * cp / (cp - 1)  # of nbytes, over cp: the group's own
                sheet.transfers.append(Transfer("cp", "cp", "all_to_all", moved / 4 * share, 8 * m, False, 4 * m,
                                                4 * m))
        return repeats

    def describe(self, dims: ParallelDims) -> str | None:
        if dims.cp == 1:
            return None
        k = self.ulysses(dims.cp)
        if k == dims.cp:
            return "context parallel (ulysses all-to-all)"
        how = self.algorithm if k == 1 else f"ulysses all-to-all in groups of {k}, then {self.algorithm}"
        return f"context parallel ({how}, load balance {self.load_balance})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hybrid_groups(dims: ParallelDims, ulysses: int) -> tuple[Any, Any]:
    """The process groups of the hybrid: the ring over ``cp / ulysses`` ranks and the all-to-all group of ``ulysses``
    consecutive cp ranks (one mesh of their own over the same ranks, as the experts' mesh is; every rank builds
    every group)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dims.world_mesh
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp // ulysses, ulysses, dims.tp)
    mesh = DeviceMesh(world.device_type, world.mesh.reshape(shape),
                      mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp"))
    return mesh["cp_ring"].get_group(), mesh["cp_ulysses"].get_group()


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

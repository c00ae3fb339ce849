"""The cost sheet of one layout: what each technique does to memory, compute and communication, filled in by the
techniques themselves (``Technique.account``), in the engine's order, so the planner predicts from the same place
the engine applies from.

Everything is per rank and per optimizer step, for the rank that needs the most (memory) or takes the longest
(time). Bytes are bytes; times come later, from the hardware (``planner/predict``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from lightning_par.costs.profile import ModelProfile, ParamInfo
from lightning_par.dims import ParallelDims


@dataclass(frozen=True)
class Transfer:
    """One kind of communication in a step: ``count`` messages of ``nbytes`` each sends per rank over the group of
    the mesh dimension ``dim``, by ``collective`` (its time model), hidden behind compute when ``overlappable``."""

    kind: str  # the CommOverlapMonitor's kinds: fsdp_all_gather, fsdp_reduce_scatter, tp, cp, pp_send_recv, ...
    dim: str  # a ParallelDims mesh name: "tp", "cp", "dp_shard_cp", "dp_replicate", "pp"
    collective: str  # "all_reduce", "all_gather", "reduce_scatter", "send_recv"
    nbytes: float  # the whole tensor of one message (an all-gather's output, an all-reduce's input)
    count: float
    overlappable: bool
    # of ``count``, the messages the blocks' forward sends, which activation checkpointing's recomputation sends
    # again: all of them under full checkpointing, those whose outputs the selective policy does not keep
    recomputed_full: float = 0.0
    recomputed_selective: float = 0.0
    # what an overlappable transfer hides behind: any compute ("compute": FSDP's prefetch runs beside every kernel),
    # or only the attention kernels' ("attention": the ring's next hop is in flight while a block is computed); or,
    # not overlappable in that sense, "matmul": pipelined chunk by chunk with one matmul of ``behind_flops`` (async
    # tensor parallelism)
    hides_behind: str = "compute"
    behind_flops: float = 0.0

    def copy_with(self, *, count: float | None = None, nbytes: float | None = None,
                  recomputed: bool = True) -> Transfer:
        """A copy with another ``count`` or ``nbytes`` (``recomputed=False``: none of it sent again by a
        recomputation); ``dataclasses.replace``, which tens of thousands of layouts' accounts make slow."""
        return Transfer(self.kind, self.dim, self.collective, self.nbytes if nbytes is None else nbytes,
                        self.count if count is None else count, self.overlappable,
                        self.recomputed_full if recomputed else 0.0, self.recomputed_selective if recomputed else 0.0,
                        self.hides_behind, self.behind_flops)


@dataclass
class CostSheet:
    """Filled by ``Technique.account`` in order. Sections are the profile's: "first", each block, "last"."""

    dims: ParallelDims
    profile: ModelProfile
    batch: int  # samples per data-parallel rank per step
    seq_len: int
    # pipeline parallelism: the sections each pp rank runs, its micro-batches, and how many of their activations
    # are alive at once (in micro-batch x stage units, per pp rank)
    rank_sections: Sequence[Sequence[str]] = ()
    microbatches: int = 1
    inflight: Sequence[float] = ()
    bubble: float = 0.0
    # how parameters and activations are divided (tensor, context, data parallelism)
    tp: int = 1
    cp: int = 1
    shard: int = 1  # FSDP's shard group size (dp_shard x cp); 1: parameters whole on each rank
    #: the residual stream between tensor-parallel regions split over tp along the sequence (sequence parallelism)
    sequence_sharded: bool = False
    #: the gathered layer inputs saved as this rank's sequence chunk and gathered again in backward (not under
    #: autocast alone, where the matmuls save autocast's own copy: ``TensorParallel.account`` leaves it False)
    inputs_chunked: bool = False
    #: the blocks' re-gathers in backward, which activation checkpointing removes (a checkpointed block saves only
    #: its input; its recomputation gathers anew)
    regathered_in_blocks: Transfer | None = None
    #: the pipeline schedule runs backward in two passes (input gradients, then weight gradients: zero bubble),
    #: each unpacking what forward saved
    split_backward: bool = False
    #: the logits and what follows them split over tp along the vocabulary (loss parallelism)
    vocab_sharded: bool = False
    checkpointing: str = "none"  # activation checkpointing: "none", "full" or "selective"
    offload: bool = False  # parameters, gradients and optimizer state in host memory
    transfers: list[Transfer] = field(default_factory=list)
    buffer_bytes: float = 0.0  # transient device memory beyond state and saved activations (gathered FSDP units)
    # precision, relative to the profile (traced in the model's own dtype, fp32 for the usual model)
    activation_scale: float = 1.0  # bf16 activations: 0.5
    #: mixed precision by autocast alone (no FSDP casting the parameters to half precision, e.g. on one rank or
    #: under tensor or pipeline parallelism only): only what the matmul family saves is in half precision (the
    #: profile's ``autocast_lowered``), the rest (``autocast_kept``, blocks' inputs) stays in the traced dtype, and
    #: a half-precision copy of every weight those functions read is saved too
    autocast_only: bool = False
    gather_scale: float = 1.0  # what FSDP all-gathers per parameter byte (bf16-mixed: 0.5)
    #: float8 training's all-gathers (torchao's ``enable_fsdp_float8_all_gather``, which the engine turns on for
    #: "tensorwise" on GPUs): the blocks' converted weights gathered at 1 byte an element
    float8_gathers: bool = False
    #: devices per node (consecutive ranks), where known: expert parallelism across nodes dispatches in two steps
    ranks_per_node: int | None = None
    grad_scale: float = 1.0  # gradients kept in fp32 against activations (bf16: 2)
    #: FSDP's gradient reductions against the parameters' bytes: mixed precision reduces in fp32 (over 16-bit
    #: weights: 2)
    reduce_scale: float = 1.0

    @property
    def microbatch_tokens(self) -> float:
        """Tokens of one micro-batch on this rank: its share of the sequence under context parallelism, whichever
        technique asks (tensor and pipeline parallelism account before context parallelism sets ``cp``)."""
        return self.batch * self.seq_len / self.microbatches / self.dims.cp

    @property
    def token_scale(self) -> float:
        """One micro-batch on one rank, in units of the profile's traced micro-batch (before tp/cp)."""
        return (self.batch / self.microbatches) * self.seq_len / self.profile.tokens

    @property
    def sequence_scale(self) -> float:
        return self.seq_len / self.profile.seq_len


T = TypeVar("T")


def per_cut(sheet: CostSheet, key: tuple, compute: Callable[[], T]) -> T:
    """``compute()`` remembered per profile, pipeline cut (``sheet.rank_sections``, a tuple that every layout of
    one pipeline shape shares) and ``key``: the accounts of the tens of thousands of layouts a plan at thousands of
    GPUs weighs ask the same few questions of each cut."""
    memo = sheet.profile.__dict__.setdefault("_per_cut", {})
    full_key = (id(sheet.rank_sections), *key)
    hit = memo.get(full_key)
    if hit is None or hit[0] is not sheet.rank_sections:
        if len(memo) > 100_000:
            memo.clear()
        hit = memo[full_key] = (sheet.rank_sections, compute())
    return hit[1]


def busiest_sections(sheet: CostSheet) -> tuple[str, ...]:
    """The sections of the pipeline rank that runs the most of them (all of them without a pipeline)."""
    return per_cut(sheet, ("busiest",), lambda: tuple(max(sheet.rank_sections, key=len)))


_OWNERS: dict[int, tuple[ModelProfile, dict[str, list[ParamInfo]]]] = {}


def params_by_planned_module(profile: ModelProfile) -> dict[str, list[ParamInfo]]:
    """The parameters of each module the tensor-parallel plan names (the plan's module FQN -> its parameters, the
    nearest planned module owning each), computed once per profile: the accounts of thousands of layouts ask."""
    cached = _OWNERS.get(id(profile))
    if cached is not None and cached[0] is profile:
        return cached[1]
    owners: dict[str, list[ParamInfo]] = {module: [] for module in profile.tp_plan}
    for p in profile.params:
        parts = p.fqn.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in owners:
                owners[module].append(p)
                break
    if len(_OWNERS) > 8:
        _OWNERS.clear()
    _OWNERS[id(profile)] = (profile, owners)
    return owners

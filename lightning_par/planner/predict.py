"""Memory and step time of one layout, from the model's profile, the techniques' own accounts and the hardware.

Memory is per rank, for the rank that needs the most: parameters, gradients and optimizer state (exact from the
shapes and the sharding the layout applies), the activations autograd saves (the profile's trace, scaled to the
layout's micro-batch and divided as tensor, context and sequence parallelism divide them, times the micro-batches a
pipeline rank holds at once), and transient buffers (FSDP's gathered units).

Step time is compute (the rank's forward FLOPs x 3, plus what activation checkpointing recomputes, over the
hardware's achievable FLOP/s) plus the communication compute does not hide, stretched by the pipeline's bubble. A
transfer takes the ring model's time on the link its mesh dimension spans (within a node or across nodes); an
overlappable one hides behind compute up to ``OVERLAP`` of it (the context-parallel ring only behind the attention
kernels it overlaps with).

Ranks on one CPU (``Hardware.device`` "cpu ...", as ``planner.probe`` names them) differ in two ways, both
measured at world 4 on 2 cores (benchmarks/bench_planner.py): gloo moves and reduces the bytes on the same cores
that compute, so nothing overlaps; and the ranks share those cores (the probe measured each rank's throughput with
all of them busy), so what one rank leaves idle in a pipeline bubble the others use: the step is the busiest rank's
work, not stretched by the bubble.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, astuple, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightning_par.costs.profile import END_SECTIONS, ModelProfile, Section
from lightning_par.costs.sheet import CostSheet, Transfer, per_cut
from lightning_par.dims import MESH_DIM_NAMES, ParallelDims
from lightning_par.techniques.experts.expert_parallel import dispatch_ranks_per_node, dispatched_bytes
from lightning_par.techniques.pipeline.pipeline_parallel import PipelineOptions
from lightning_par.techniques.recipe import Recipe, build_recipe, options_of, planned_options
from lightning_par.techniques.sharding.fully_sharded import MIXED_HALF_DTYPES
from lightning_par.techniques.technique import Options

if TYPE_CHECKING:
    from lightning_par.devices import GroupedMatmulCurve, Hardware

#: the share of compute time that overlappable communication (FSDP prefetch, the CP ring) can hide behind: not all of
#: it, since the first gather of a step and the last reduce-scatter have nothing to hide behind
OVERLAP = 0.8
#: what torch's checkpoint keeps per checkpointed block besides activations: the CPU generator's state, to replay
#: random ops alike in the recomputation (read off this torch)
CHECKPOINT_RNG_BYTES = torch.get_rng_state().numel()
#: the FLOP rate of fused attention kernels against the device's matmul rate: FlashAttention-2's causal forward and
#: backward run at 35-40 % of an H100's bf16 peak, large GEMMs at 70-80 % (FlashAttention-3 paper, Shah et al.
#: 2024, figs. 5-7): attention's FLOPs, counted as the kernel does them (causal: half), take twice a matmul's time
ATTENTION_RATE = 0.5
#: the context-parallel math path's backward beyond the 2 forwards a backward counts: it recomputes the scores and
#: runs four matmuls (dV, dP, dQ, dK) against the forward's two (QK, PV), 2.5 forwards
MATH_PATH_BACKWARD_EXTRA = 0.5
#: the bytes the backward of the non-matmul ops moves against their forward's: each reads the gradient of its output
#: and what it saved (its inputs or output) and writes the gradient of its inputs, about twice the forward's reads
#: and writes (a residual add's backward moves fewer, a norm's more)
BACKWARD_TRAFFIC = 2.0
#: bytes float8 training's casts move per activation element of a converted matmul, over a step: its input and its
#: output's gradient each read twice in bf16 (the largest value, then the scaled cast: 4 bytes) and written once in
#: float8 (1), and the transposed float8 copy the backward's other matmul takes written and read (2)
FLOAT8_CAST_BYTES = 7.0
#: per element of a converted weight, each micro-batch: read twice in fp32 (8), written in float8 (1), for the
#: forward and again transposed for the backward
FLOAT8_WEIGHT_CAST_BYTES = 18.0
#: the share of device memory the planner keeps free for what it does not model: the caching allocator's reserved
#: but unallocated blocks (fragmentation), cuBLAS/NCCL workspaces and the CUDA context. Measured on an H200
#: (2026-11-26, ``bench_planner.py --device cuda``, 325 M-parameter models, 8-13 GiB allocated): 1.36 GiB outside the
#: allocator whatever the layout, cached free blocks 7-25 % of the allocated bytes; in all 1.4-2.4 % of the device.
#: 10 % (8 GB of an 80 GB H100) covers the fixed part and 20-25 % of cache on a 30 GB working set, not on a nearly
#: full device; ``plan_layouts(memory_reserve=...)`` and ``--memory-reserve`` change it, and each prediction reports
#: its margin
RESERVE = 0.1
_PRECISION = {  # activation bytes, FSDP all-gather bytes per parameter byte, gradient bytes per activation byte
    "32-true": (1.0, 1.0, 1.0), "bf16-mixed": (0.5, 0.5, 2.0), "16-mixed": (0.5, 0.5, 2.0),
    "bf16-true": (1.0, 1.0, 2.0),  # traced in bf16 (trace_dtype); context parallelism's dK/dV travel in fp32
}
#: the precisions that store the weights in another dtype than the module's: the trace runs on a copy cast to it
_TRACE_DTYPES = {"bf16-true": torch.bfloat16}


def trace_dtype(precision: str) -> torch.dtype | None:
    """The dtype a module is traced in for ``precision`` (``profile_model(dtype=...)``): bf16 for ``"bf16-true"``,
    whose weights, gradients, optimizer state and activations are all bf16; None (the module's own) otherwise."""
    return _TRACE_DTYPES.get(precision)


def check_profile_precision(profile: ModelProfile, precision: str) -> None:
    """The profile's bytes are priced relative to the dtype it was traced in: ``"bf16-true"`` needs a bf16 trace (an
    fp32 one would count every weight, gradient and optimizer state at twice its size): refuse another, naming the
    fix. (Mixed precision over weights already in 16 bits is priced as they are: ``account``.)"""
    expected = trace_dtype(precision)
    if expected is not None and profile.dtype != expected:
        raise ValueError(f"precision={precision!r} prices a profile traced with {expected} weights, but this one was "
                         f"traced with {profile.dtype} weights: profile the module with profile_model(..., "
                         f"dtype=trace_dtype({precision!r})), or pass the module itself.")


#: the options every layout carries, with their defaults: each technique's planned ones
#: (``techniques.technique.planned``), in the recipe's order
PLANNED = planned_options()
SIZES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


@dataclass(frozen=True, init=False)
class Layout:
    """One way to parallelize: the sizes, and the values of the technique options the planner decides, as data
    (``options``: those that differ from their defaults). ``Layout(tp=4, **{name: value})`` names them as
    ``NDParallelStrategy`` does, and ``getattr(layout, name)`` reads one back (its default where not set);
    ``strategy_kwargs()`` is what ``NDParallelStrategy`` takes to train it. Each technique's options say how they
    show (``str``) and pass on (``strategy_kwargs``): nothing here names one."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism, within dp_shard x cp
    #: without a pipeline: the Trainer's ``accumulate_grad_batches`` (each step's batch in that many micro-batches,
    #: activations of one at a time; every FSDP collective once per micro-batch, as the engine runs it). A pipeline
    #: splits its batch into its own micro-batches instead
    accumulate_grad_batches: int = 1
    #: (name, value) of each planned option that differs from its default, in the recipe's order
    options: tuple[tuple[str, Any], ...] = ()

    def __init__(self, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
                 accumulate_grad_batches: int = 1, options: Iterable[tuple[str, Any]] = (), **named: Any) -> None:
        values = dict(options, **named) if named else dict(options)
        unknown = values.keys() - PLANNED.keys()
        if unknown:
            raise TypeError(f"Layout() got {sorted(unknown)}: a layout carries the sizes {(*SIZES, 'ep')}, "
                            f"accumulate_grad_batches and the options the planner decides, {list(PLANNED)}.")
        # (the instance's dict written directly, as object.__setattr__ would: a plan builds some 100,000 layouts)
        put = self.__dict__
        put["dp_replicate"], put["dp_shard"], put["cp"], put["tp"], put["pp"] = dp_replicate, dp_shard, cp, tp, pp
        put["ep"], put["accumulate_grad_batches"] = ep, accumulate_grad_batches
        chosen = []
        for name, default in PLANNED.items():
            value = values.get(name, default)
            put[name] = value  # read as an attribute
            if value != default:
                chosen.append((name, value))
        put["options"] = tuple(chosen)

    @classmethod
    def names(cls) -> list[str]:
        """What a layout decides: the sizes, ``ep``, ``accumulate_grad_batches`` and the planned options."""
        return [*SIZES, "ep", "accumulate_grad_batches", *PLANNED]

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: the pipeline's, else gradient accumulation's."""
        return self.of(PipelineOptions).step_microbatches(self.pp) if self.pp > 1 else self.accumulate_grad_batches

    @property
    def recomputes(self) -> bool:
        """Whether the blocks' forward runs again in backward (activation checkpointing)."""
        return any(options.recomputes() for options in self.technique_options())

    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep)

    def technique_options(self) -> tuple[Options, ...]:
        """Every technique's options dataclass with this layout's values, in the recipe's order."""
        return _technique_options(self.options)

    def of(self, cls: type[T]) -> T:
        """This layout's values of one technique's options (``layout.of(PipelineOptions)``)."""
        return next(options for options in self.technique_options() if type(options) is cls)

    def strategy_kwargs(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in SIZES}
        if self.ep > 1:
            out["ep"] = self.ep
        dims = self._dims()
        for options in self.technique_options():
            out.update(options.layout_kwargs(dims))
        return out

    def trainer_kwargs(self) -> dict[str, Any]:
        """What ``lightning.Trainer`` takes besides the strategy (each data loader batch is then one micro-batch:
        the step's batch divided by ``accumulate_grad_batches``)."""
        return {"accumulate_grad_batches": self.accumulate_grad_batches} if self.accumulate_grad_batches > 1 else {}

    def words(self, columns: bool = False) -> str:
        """The layout as text: its sizes, then each technique's words (``columns``: less those the planner's table
        shows in columns of their own, ``Options.COLUMN``)."""
        sizes = " x ".join(f"{n}{getattr(self, n)}" for n in MESH_DIM_NAMES if getattr(self, n) > 1) or "1 rank"
        if self.ep > 1:
            sizes += f" (ep{self.ep})"
        dims = self._dims()
        extras = [word for options in self.technique_options() if not (columns and options.COLUMN)
                  for word in options.label(dims)]
        if self.accumulate_grad_batches > 1:
            extras.append(f"accumulate {self.accumulate_grad_batches}")
        return sizes + (f" ({', '.join(extras)})" if extras else "")

    def __str__(self) -> str:
        return self.words()

    def _dims(self) -> ParallelDims:
        return _planning_dims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep)


T = TypeVar("T")


@lru_cache(maxsize=4096)
def _technique_options(options: tuple[tuple[str, Any], ...]) -> tuple[Options, ...]:
    return options_of(dict(options))


@dataclass
class Prediction:
    """What one layout costs, per rank (the largest rank for memory, the slowest for time), per optimizer step."""

    layout: Layout
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    compute_s: float
    comm_s: dict[str, float]  # exposed (not hidden by compute), per kind
    comm_total_s: dict[str, float]  # all of it, per kind
    bubble_s: float
    step_s: float
    tokens_per_s: float  # per device
    budget: float | None  # device memory the layout may use (bytes), None: unknown
    host_bytes: float = 0.0  # state kept in host memory (CPU offload)
    extra: dict[str, Any] = field(default_factory=dict)

    #: worked out once, at creation: ranking and filtering a plan of tens of thousands of layouts asks for them
    #: several times each (a property's call costs a second at 8,192 GPUs)
    model_state: float = field(init=False)
    memory: float = field(init=False)
    fits: bool = field(init=False)

    def __post_init__(self) -> None:
        self.model_state = self.params + self.grads + self.optimizer
        self.memory = self.model_state + self.activations + self.buffers
        self.fits = self.budget is None or self.memory <= self.budget

    @property
    def over_by(self) -> float:
        return 0.0 if self.budget is None else max(0.0, self.memory - self.budget)

    @property
    def reason(self) -> str:
        """Fits or not, by how much, and what the step time is made of (worked out when asked: a plan predicts
        tens of thousands of layouts and shows a few)."""
        return _reason(self)

    @property
    def margin(self) -> float | None:
        """Bytes left under the budget (negative: over it); None where the device's memory is unknown."""
        return None if self.budget is None else self.budget - self.memory

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "layout"}
        out.update(layout=str(self.layout), strategy_kwargs=self.layout.strategy_kwargs(),
                   trainer_kwargs=self.layout.trainer_kwargs(), model_state=self.model_state,
                   memory=self.memory, fits=self.fits, over_by=self.over_by, margin=self.margin, reason=self.reason)
        return out


def account(layout: Layout, profile: ModelProfile, batch: int, seq_len: int, precision: str,
            ranks_per_node: int | None = None, float8_gathers: bool = False) -> CostSheet:
    """Every technique of the engine's recipe writes its share into one sheet, in the engine's order
    (``ranks_per_node``: the devices of a node, where the hardware says; ``float8_gathers``: float8 training's
    all-gathers, ``CostSheet.float8_gathers``)."""
    mixed = precision in MIXED_HALF_DTYPES
    # mixed precision over weights already in its half dtype (a module built so) computes, gathers and keeps them
    # as the trace did, and autocast changes nothing; FSDP still reduces in fp32, cp's dK/dV travel in fp32
    half_weights = mixed and profile.dtype == MIXED_HALF_DTYPES[precision]
    act, gather, grad = (1.0, 1.0, 2.0) if half_weights else _PRECISION.get(precision, (1.0, 1.0, 1.0))
    dims = _planning_dims(layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.pp, layout.ep)
    recipe = _planning_recipe(layout.options)
    autocast_only = mixed and not half_weights and not recipe.fully_sharded.casts_parameters(dims)
    sheet = CostSheet(dims, profile, batch, seq_len, activation_scale=act, autocast_only=autocast_only,
                      gather_scale=gather, grad_scale=grad, reduce_scale=2.0 if half_weights else 1.0,
                      microbatches=layout.accumulate_grad_batches,
                      ranks_per_node=ranks_per_node, float8_gathers=float8_gathers)
    for technique in recipe:
        technique.account(sheet)
    return sheet


# a plan at thousands of GPUs accounts tens of thousands of layouts with a few hundred meshes and recipes: each
# built once (accounting only reads them)
@lru_cache(maxsize=4096)
def _planning_dims(*sizes: int) -> ParallelDims:
    return ParallelDims(*sizes)


@lru_cache(maxsize=4096)
def _planning_recipe(options: tuple[tuple[str, Any], ...]) -> Recipe:
    """The recipe of a layout's options (accounting only reads it)."""
    return build_recipe(**dict(options))


def predict(layout: Layout, profile: ModelProfile, hardware: Hardware, batch: int, seq_len: int,
            precision: str = "32-true", memory_budget: float | None = None,
            memory_reserve: float = RESERVE) -> Prediction:
    """``batch``: samples per data-parallel rank per step; ``memory_budget``: bytes a device may use (default: the
    hardware's memory less ``memory_reserve`` of it)."""
    # float8 training gathers its converted weights in float8 where the engine runs it on GPUs ("tensorwise" over
    # NCCL; gloo cannot all-gather float8), under FSDP's mixed precision
    float8_gathers = hardware.float8_speedup is not None and not shares_cores(hardware) and precision in (
        "bf16-mixed", "bf16-true")
    sheet = account(layout, profile, batch, seq_len, precision, hardware.gpus_per_node, float8_gathers)
    # the non-matmul ops' bytes, in the matmuls' time units (none where the hardware's rate covers them)
    flops_per_byte = (hardware.matmul_rate(layout.tp) / hardware.memory_bandwidth
                      if hardware.memory_bandwidth else 0.0)
    (params, grads, optimizer, activations), busiest, recompute = _busiest_ranks(sheet, hardware.matmul_share,
                                                                                 hardware.grouped_mm,
                                                                                 hardware.cp_attention_rate,
                                                                                 flops_per_byte,
                                                                                 _float8(hardware, layout.tp))
    host = 0.0
    if sheet.offload:
        host, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0
    rate = hardware.matmul_rate(layout.tp)  # measured at the matmuls' split shapes where the probe measured it
    compute, attention = busiest[5] / rate, busiest[6] / rate
    total = dict.fromkeys([t.kind for t in sheet.transfers], 0.0)
    hidden = total.copy()  # behind any compute
    behind_attention = total.copy()  # behind the attention kernels only
    pipelined = total.copy()  # hidden behind their own matmul (async tp)
    links = _links_of(sheet.dims, hardware)  # per mesh dimension: its group size and links
    shared = shares_cores(hardware)
    for t in sheet.transfers:
        link = links.get(t.dim)
        if link is None:
            link = links[t.dim] = _cached_link(t.dim, sheet.dims, hardware)
        seconds = _transfer_time(t, *link)
        total[t.kind] += seconds
        if t.hides_behind == "matmul" and not shared:
            # cut into n chunks, the next in flight while this one is multiplied: (n - 1) / n of the matmul hides
            # the transfer, per message (a transfer larger than its matmul shows the rest)
            n = link[0]
            pipelined[t.kind] += min(seconds, t.count * (n - 1) / n * t.behind_flops / rate)
        elif t.overlappable:
            (behind_attention if t.hides_behind == "attention" else hidden)[t.kind] += seconds
    overlap = 0.0 if shared else OVERLAP
    # what hides behind attention first (up to OVERLAP of the attention kernels' time), the rest of the compute
    # for the others
    exposed = {kind: max(0.0, seconds - overlap * attention) if seconds else 0.0
               for kind, seconds in behind_attention.items()}
    # the matmuls that async tp's chunks hide behind are not there for FSDP's prefetch too
    hideable = overlap * compute - sum(behind_attention.values()) + sum(exposed.values()) - sum(pipelined.values())
    overlapped = sum(hidden.values())
    for kind in total:
        share = hidden[kind] / overlapped if overlapped else 0.0
        exposed[kind] += (total[kind] - hidden[kind] - behind_attention[kind] - pipelined[kind]
                          + share * max(0.0, overlapped - hideable))
    busy = compute + sum(exposed.values())
    step = busy if shared else busy / (1.0 - sheet.bubble)
    budget = memory_budget if memory_budget is not None else (
        hardware.memory_bytes * (1 - memory_reserve) if hardware.memory_bytes else None)
    tokens = batch * layout.dp * seq_len
    return Prediction(layout, params, grads, optimizer, activations, sheet.buffer_bytes + recompute, compute, exposed,
                      total, step - busy, step, tokens / step / layout.world_size, budget, host_bytes=host)


def _float8(hardware: Hardware, tp: int) -> tuple[float, float] | None:
    """float8 training's (speedup of the matmuls it converts, its casts' bytes in matmul FLOPs), or None."""
    if hardware.float8_speedup is None:
        return None
    return hardware.float8_speedup, hardware.matmul_rate(tp) / hardware.float8_cast_bandwidth


def shares_cores(hardware: Hardware) -> bool:
    """Whether the ranks run on CPU cores they share, communication included (see the module docstring)."""
    return hardware.device.lower().startswith("cpu")


def _busiest_ranks(sheet: CostSheet, matmul_share: float, grouped_mm: GroupedMatmulCurve | None = None,
                   cp_attention_rate: float | None = None, flops_per_byte: float = 0.0,
                   float8: tuple[float, float] | None = None) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Of the pipeline ranks' ``_rank_costs``: the (parameters, gradients, optimizer state, saved activations) of
    the one that needs the most memory, the costs of the one that computes the most, and the largest transient
    activations; a layout whose sheet asks what an earlier one's asked gets the same answer back."""
    def reduce() -> tuple[tuple[float, ...], tuple[float, ...], float]:
        ranks = _rank_costs(sheet, matmul_share, grouped_mm, cp_attention_rate, flops_per_byte, float8)
        return max((r[:4] for r in ranks), key=sum), max(ranks, key=lambda r: r[5]), max(r[4] for r in ranks)

    return per_cut(sheet, ("busiest ranks", tuple(sheet.inflight), sheet.token_scale, sheet.sequence_scale,
                           sheet.activation_scale, sheet.autocast_only, sheet.tp, sheet.cp, sheet.shard,
                           sheet.sequence_sharded, sheet.inputs_chunked, sheet.vocab_sharded, sheet.checkpointing,
                           sheet.dims.ep, sheet.microbatches, matmul_share, grouped_mm, cp_attention_rate,
                           flops_per_byte, float8), reduce)


def _rank_costs(sheet: CostSheet, matmul_share: float = 1.0, grouped_mm: GroupedMatmulCurve | None = None,
                cp_attention_rate: float | None = None, flops_per_byte: float = 0.0,
                float8: tuple[float, float] | None = None) -> list[tuple[float, ...]]:
    """Per pipeline rank: (parameters, gradients, optimizer state, saved activations, transient activations,
    FLOPs and of them the attention kernels', in time at the hardware's matmul throughput). Ranks holding equal
    sections (blocks alike in parameters and costs) are worked out once: planning thousands of layouts of an
    80-layer model asks the same few questions again and again."""
    kinds = _section_kinds(sheet.profile)
    memo = sheet.profile.__dict__.setdefault("_rank_memo", {})  # across layouts: their ranks repeat
    if len(memo) > 200_000:
        memo.clear()
    scale = sheet.token_scale
    # the pipeline's rank sections are shared by every layout of one pipeline shape (``pipeline_shape`` caches
    # them), so their keys are too
    keys_key = ("keys", id(sheet.rank_sections))
    hit = memo.get(keys_key)
    if hit is None or hit[0] is not sheet.rank_sections:  # each rank's sorted section kinds, as a small number
        numbers = memo.setdefault("rank kinds", {})
        hit = memo[keys_key] = (sheet.rank_sections, [numbers.setdefault(tuple(sorted(kinds[n] for n in names)),
                                                                         len(numbers))
                                                      for names in sheet.rank_sections])
    costs: dict[tuple, tuple] = {}  # this layout's ranks of equal sections: one lookup
    out = []
    for rank, key in enumerate(hit[1]):
        if key not in costs:
            state_key = ("state", key, sheet.tp, sheet.shard)
            if state_key not in memo:
                memo[state_key] = _rank_state(sheet, rank)
            act_key = ("activations", key, scale, sheet.activation_scale, sheet.autocast_only, sheet.tp, sheet.cp,
                       sheet.sequence_sharded, sheet.inputs_chunked, sheet.vocab_sharded, sheet.checkpointing,
                       sheet.dims.ep)
            if act_key not in memo:
                memo[act_key] = _rank_activations(sheet, rank)
            flops_key = ("flops", key, scale, sheet.sequence_scale, sheet.tp, sheet.cp, sheet.checkpointing,
                         sheet.microbatches, matmul_share, sheet.dims.ep, grouped_mm, cp_attention_rate,
                         flops_per_byte, sheet.activation_scale, sheet.sequence_sharded, sheet.vocab_sharded,
                         float8)
            if flops_key not in memo:
                memo[flops_key] = _rank_flops(sheet, rank, matmul_share, grouped_mm, cp_attention_rate,
                                              flops_per_byte, float8)
            costs[key] = (memo[state_key], memo[act_key], memo[flops_key])
        (params, grads, optimizer), (kept, transient, weight_copies), (flops, attention) = costs[key]
        inflight = sheet.inflight[rank] if sheet.inflight else 1.0  # micro-batches whose activations it holds
        out.append((params, grads, optimizer, kept * inflight + weight_copies, transient, flops, attention))
    return out


def _section_kinds(profile: ModelProfile) -> dict[str, int]:
    """Section name -> a number shared by the sections equal in parameters, FLOPs and saved activations."""
    cache = profile.__dict__.get("_section_kinds")
    if cache is None:
        numbers: dict[tuple, int] = {}
        cache = {}
        for name, section in profile.sections.items():
            saved = section.saved
            end = name if name in END_SECTIONS else ""  # activation checkpointing treats these apart
            key = (end, _signature(profile, name), section.flops, section.attention_flops,
                   tuple(section.attention_calls), section.input_bytes,
                   section.kv_bytes, section.attention_scores, astuple(saved),
                   astuple(section.selective_kept), section.selective_recompute_flops, section.full_recompute_flops,
                   section.reduce_scattered_bytes, astuple(section.autocast_lowered),
                   astuple(section.autocast_kept), section.autocast_weight_bytes, astuple(section.memory_traffic),
                   section.routed_bytes, section.routed_rows, section.routed_choices, section.expert_flops,
                   section.expert_width, section.expert_saved)
            cache[name] = numbers.setdefault(key, len(numbers))
        profile.__dict__["_section_kinds"] = cache
    return cache


# ---- memory ----------------------------------------------------------------------------------------------------
def _rank_state(sheet: CostSheet, rank: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) of pipeline rank ``rank``."""
    params = grads = optimizer = 0.0
    for section in set(sheet.rank_sections[rank]):
        p, g, o = _section_state(_signature(sheet.profile, section), sheet.tp, sheet.shard,
                                 sheet.profile.optimizer_bytes_per_element)
        params, grads, optimizer = params + p, grads + g, optimizer + o
    return params, grads, optimizer


def _signature(profile: ModelProfile, section: str) -> tuple:
    """A section's parameters as (shape, tp dim, item size, trainable): the blocks of a model share one, so their
    sharded sizes are worked out once per layout shape (planning thousands of layouts of an 80-layer model)."""
    cache = profile.__dict__.setdefault("_signatures", {})
    if not cache:
        groups: dict[str, list] = {}
        for p in profile.params:
            groups.setdefault(p.section, []).append((p.shape, p.tp_dim, p.itemsize, p.trainable))
        cache.update({k: tuple(v) for k, v in groups.items()})
    return cache.get(section, ())


@lru_cache(maxsize=4096)
def _section_state(signature: tuple, tp: int, shard: int, optimizer_bytes: float) -> tuple[float, float, float]:
    params = grads = optimizer = 0.0
    for shape, tp_dim, itemsize, trainable in signature:
        local = _local_numel(shape, tp_dim, tp, shard)
        params += local * itemsize
        if trainable:
            grads += local * itemsize
            optimizer += local * optimizer_bytes
    return params, grads, optimizer


def _local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, shard: int) -> float:
    """Elements one rank keeps: tensor parallelism splits ``tp_dim`` evenly, FSDP2 splits dim 0 into ``shard``
    chunks of ``ceil(rows / shard)`` (the largest rank's share, padding included)."""
    dims = list(shape) or [1]
    if tp_dim is not None:
        dims[tp_dim] //= tp
    dims[0] = math.ceil(dims[0] / shard)
    return float(math.prod(dims))


def _rank_activations(sheet: CostSheet, rank: int) -> tuple[float, float, float]:
    """(saved until backward per micro-batch in flight, transient, once per rank): with activation checkpointing a
    block keeps its input (and under selective checkpointing the outputs its policy keeps) and backward recomputes
    one block at a time, whose activations are the transient part. Under autocast alone the half-precision copies
    of the weights the matmuls read are saved too, one per weight whatever the micro-batches in flight (autocast's
    cache serves them all), and only for what is not checkpointed."""
    profile, scale = sheet.profile, sheet.token_scale * sheet.activation_scale
    tp, cp, sp, lp = sheet.tp, sheet.cp, sheet.sequence_sharded, sheet.vocab_sharded
    # under autocast alone a block's input, the residual stream, stays in the traced dtype
    input_scale = sheet.token_scale if sheet.autocast_only else scale
    kept, peak_block, weight_copies = 0.0, 0.0, 0.0
    for name in sheet.rank_sections[rank]:
        section = profile.sections[name]
        copies = section.autocast_weight_bytes * sheet.activation_scale / tp if sheet.autocast_only else 0.0
        if sheet.autocast_only:
            full = (section.autocast_kept.per_rank(tp, cp, sp, lp, sheet.token_scale)
                    + section.autocast_lowered.per_rank(tp, cp, sp, lp, scale))
        else:
            full = section.saved.per_rank(tp, cp, sp, lp, scale)
        # experts not whole on every tp rank (``price_experts_as``) keep 1 / tp of their intermediates (under
        # sequence parallelism their rows are priced as the residual stream's, split already)
        split_off = 0.0 if sp else section.expert_saved * scale * (1 - profile.expert_tp_share(tp)) / cp
        full -= split_off
        if sheet.checkpointing != "none" and name not in END_SECTIONS:
            kept += section.input_bytes * input_scale / (tp if sp else 1) / cp  # the block's input
            kept += CHECKPOINT_RNG_BYTES
            if sheet.checkpointing == "selective":
                kept += section.selective_kept.per_rank(tp, cp, sp, lp, scale)
                if sheet.dims.ep > 1:  # the dispatch's two all-to-alls' outputs (kept: the profile traces no ep)
                    places = [sheet.dims.ep]
                    per_node = dispatch_ranks_per_node(sheet.dims, sheet.ranks_per_node)
                    if section.routed_choices and 1 < per_node < sheet.dims.ep:  # and the step between nodes'
                        places.append(sheet.dims.ep // per_node)
                    kept += sum(2 * dispatched_bytes(section, profile.num_experts, n, sheet.activation_scale,
                                                     profile.expert_groups) for n in places) * sheet.token_scale / cp
                if sp:  # its reduce-scatters' outputs, on this rank's sequence chunk
                    kept += section.reduce_scattered_bytes * scale / tp / cp
            peak_block = max(peak_block, full + copies)  # recomputed in backward, one block at a time
        else:  # (the re-gathered inputs' chunks: only outside checkpointing, which saves nothing else)
            kept += section.saved.per_rank(tp, cp, sp, lp, scale, True) - split_off if sheet.inputs_chunked else full
            weight_copies += copies
    return kept, peak_block, weight_copies


# ---- time ------------------------------------------------------------------------------------------------------
def _rank_flops(sheet: CostSheet, rank: int, matmul_share: float = 1.0,
                grouped_mm: GroupedMatmulCurve | None = None,
                cp_attention_rate: float | None = None, flops_per_byte: float = 0.0,
                float8: tuple[float, float] | None = None) -> tuple[float, float]:
    """The rank's FLOPs in one step, and of them its attention kernels' (what the cp ring hides behind): forward
    x 3 (backward = 2 forward), + the blocks' forward again with full activation checkpointing (up to where torch
    stops the recomputation). Selective checkpointing recomputes the matmuls its policy does not keep and all the
    non-matmul work: the latter counted as the ``1 - matmul_share`` of a forward's time it takes. The experts'
    grouped matmuls run at ``grouped_mm``'s share of the matmul rate (``expert_slowdown``, on the ``matmul_share``
    of their time that is matmuls), not divided by tp (every tp rank runs the whole experts on the micro-batch's
    tokens; unless the profile prices other software's experts, ``costs.profile.price_experts_as``), recomputed
    under either checkpointing (neither keeps a grouped matmul), as is
    context-parallel attention (the engine's own function: selective checkpointing keeps only fused kernels).

    With ``cp_attention_rate`` (a GPU's: ``Hardware.cp_attention_rate``) and context parallelism, attention is the
    engine's math path: its blocks' FLOPs (``Section.blockwise_work``) at that rate, and a backward of five matmuls
    (the scores again, then dV, dP, dQ, dK) against the forward's two: 2.5 forwards, where the rest counts 2.

    With ``flops_per_byte`` (the matmul rate over the memory bandwidth, a GPU's: ``Hardware.memory_bandwidth``) the
    bytes of the non-matmul ops (``Section.memory_traffic``, this rank's share of them) are priced too, as the
    FLOPs that take as long: forward, backward (:data:`BACKWARD_TRAFFIC` times the forward's) and again where
    either checkpointing recomputes the block.

    With ``float8`` (float8 training, ``devices.with_float8``: (speedup, FLOPs per cast byte)) the matmuls float8
    converts (``Section.float8_flops``) run ``speedup`` times faster, forward, backward and recomputed, and its
    casts move ``FLOAT8_CAST_BYTES`` per activation element and ``FLOAT8_WEIGHT_CAST_BYTES`` per weight element of
    each micro-batch, at the casts' own bandwidth."""
    forward = recomputed = attentions = backward_extra = traffic = casts = 0.0
    tp, cp, sp, lp = sheet.tp, sheet.cp, sheet.sequence_sharded, sheet.vocab_sharded
    byte_scale = sheet.token_scale * sheet.activation_scale
    math_path = cp_attention_rate is not None and sheet.cp > 1
    for name in sheet.rank_sections[rank]:
        section = sheet.profile.sections[name]
        # in matmul-time units: the kernel's FLOPs at its own rate (ATTENTION_RATE), or the math path's
        if math_path:
            attention = (section.blockwise_work(sheet.seq_len, sheet.cp) * sheet.token_scale * sheet.sequence_scale
                         / cp_attention_rate)
            backward_extra += MATH_PATH_BACKWARD_EXTRA * attention
            attentions += MATH_PATH_BACKWARD_EXTRA * attention
        else:
            attention = (section.attention_work(sheet.seq_len) * sheet.token_scale * sheet.sequence_scale
                         / ATTENTION_RATE)
        # the experts' extra matmul time, in the step's units (a pass's matmuls are matmul_share of its time)
        slower = matmul_share * expert_slowdown(sheet, section, grouped_mm)
        # tensor parallelism leaves the experts whole: every tp rank runs them on the micro-batch's tokens (as
        # ExpertParallel.account routes them), so they are not divided by tp as the rest is (below: per_step);
        # unless priced as software that splits or folds them (``price_experts_as``)
        whole = 0.0 if sheet.profile.experts_over_tp != "whole" else (
            (sheet.tp - 1) * (section.expert_flops * sheet.token_scale + slower))
        flops = section.flops * sheet.token_scale + attention + slower + whole
        faster = 0.0  # the converted matmuls' time float8 saves, in FLOPs at the matmul rate
        if float8 is not None:
            faster = section.float8_flops * sheet.token_scale * (1 - 1 / float8[0])
            flops -= faster
            casts += (FLOAT8_CAST_BYTES * section.float8_cast_elements * byte_scale / cp
                      + FLOAT8_WEIGHT_CAST_BYTES * section.float8_weight_elements) / tp
        forward += flops
        attentions += 3 * attention
        moved = section.memory_traffic.per_rank(tp, cp, sp, lp, byte_scale) if flops_per_byte else 0.0
        traffic += (1 + BACKWARD_TRAFFIC) * moved
        if name in END_SECTIONS:
            continue
        if sheet.checkpointing != "none":
            traffic += moved
        if sheet.checkpointing == "full":
            recomputed += section.full_recompute_flops * sheet.token_scale + attention + slower + whole - faster
            attentions += attention
        elif sheet.checkpointing == "selective":  # (whole: the duplicated experts, recomputed in full)
            recomputed += (matmul_share * section.selective_recompute_flops * sheet.token_scale + slower + whole
                           + (1 - matmul_share) * (flops - slower - whole))
            if sheet.cp > 1:  # the engine's context-parallel attention is its own function, recomputed whole
                recomputed += matmul_share * attention
                attentions += attention
    per_step = sheet.microbatches / (sheet.tp * sheet.cp)
    cast_flops = casts * float8[1] * sheet.microbatches if float8 is not None else 0.0
    return ((3 * forward + recomputed + backward_extra) * per_step + traffic * flops_per_byte * sheet.microbatches
            + cast_flops, attentions * per_step)


def expert_slowdown(sheet: CostSheet, section: Section, grouped_mm: GroupedMatmulCurve | None) -> float:
    """The extra matmul time (in FLOPs at the dense matmul rate) of one micro-batch's pass through the section's
    experts: their FLOPs at ``grouped_mm``'s rate instead of the dense matmuls'. Each of a rank's ``E / ep``
    experts gets ``rows x ep / E`` of the rows routed on a rank (every tensor-parallel rank routes its micro-batch's
    tokens, of its context-parallel chunk: as ``ExpertParallel.account`` counts them), so expert parallelism feeds
    them more rows and context parallelism and gradient accumulation fewer."""
    experts = sheet.profile.num_experts
    if grouped_mm is None or not section.expert_flops or not section.routed_rows or not experts:
        return 0.0
    ep = sheet.dims.ep
    rows = section.routed_rows * sheet.token_scale / sheet.cp * ep / experts
    # split over tp (``price_experts_as``): the same rows through 1 / tp of each expert's width; folded: 1 / tp of
    # the rows (each tp rank routes its chunk) over experts spread over tp times the ranks
    width = section.expert_width / sheet.tp if sheet.profile.experts_over_tp == "split" else section.expert_width
    rows /= sheet.tp if sheet.profile.experts_over_tp == "folded" else 1
    rate = grouped_mm.rate(rows, max(1, experts // ep), width)
    return section.expert_flops * sheet.token_scale * (1.0 / rate - 1.0)


#: a mesh dimension's groups as the time model sees them: (ranks, ring bandwidth, latency, a rank's own bandwidth,
#: ranks of the group in one node, the node-internal bandwidth and latency), see ``_link``
Link = tuple[int, float, float, float, int, float, float]


#: per mesh (``_planning_dims`` shares one ParallelDims per set of sizes) and hardware: its dimensions' links, filled
#: in as transfers ask (the key holds ids: each entry keeps its mesh and hardware, and an entry whose objects are
#: not those asked about is replaced)
_LINKS: dict[tuple[int, int], tuple[ParallelDims, Hardware, dict[str, Link]]] = {}


def _links_of(dims: ParallelDims, hw: Hardware) -> dict[str, Link]:
    """The links of ``dims``' mesh dimensions on ``hw`` worked out so far (``_cached_link`` fills it): a plan at
    thousands of GPUs prices some 600,000 transfers over a few hundred meshes."""
    key = (id(dims), id(hw))
    hit = _LINKS.get(key)
    if hit is None or hit[0] is not dims or hit[1] is not hw:
        if len(_LINKS) > 4096:
            _LINKS.clear()
        hit = _LINKS[key] = (dims, hw, {})
    return hit[2]


def _cached_link(dim: str, dims: ParallelDims, hw: Hardware) -> Link:
    """``_link``, remembered across layouts (the same few mesh shapes recur in thousands of them)."""
    return _link_of_sizes(dim, (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep), hw)


@lru_cache(maxsize=4096)
def _link_of_sizes(dim: str, sizes: tuple[int, ...], hw: Hardware) -> Link:
    return _link(dim, ParallelDims(*sizes), hw)


def _link(dim: str, dims: ParallelDims, hw: Hardware) -> Link:
    """The group size of mesh dimension ``dim``, the bandwidth and latency of the link its groups' ring collectives
    use (measured for groups of that shape when the probe measured it, else the node's or the inter-node link, whose
    NICs a group across nodes uses as many of as it has ranks in a node: ``Hardware.link``), the bandwidth one
    rank's own sends get (point-to-point and all-to-all: its own NIC across nodes), and for a group across nodes how
    many of its ranks share a node and the link inside it (an all-to-all reaches those over it, not over the NIC).

    Not on ranks that share CPU cores: there a pair of ranks measured on its own gets the cores between its hops,
    while in training the other ranks compute meanwhile, and the all-reduce over the whole node, which waits for
    every rank, prices training's collectives better. Measured (benchmarks/bench_planner.py, world 4 on 2 cores):
    with the pairs' figures the rank correlation of predicted against measured step times fell from 0.84 to 0.32
    (GPT) and from 0.87 to 0.60 (Llama)."""
    size, stride = dims.mesh_size(dim), dims.group_stride(dim)
    within = dims.within_node(dim, hw.gpus_per_node)
    by_shape = not shares_cores(hw)
    ring, latency = hw.link(size, stride, within, by_shape=by_shape,
                            members_per_node=dims.members_per_node(dim, hw.gpus_per_node))
    own, _ = hw.link(size, stride, within, by_shape=by_shape)
    return (size, ring, latency, own, dims.members_per_node(dim, hw.gpus_per_node), hw.intra_bandwidth,
            hw.intra_latency)


def _transfer_time(t: Transfer, n: int, bandwidth: float, latency: float, own_bandwidth: float | None = None,
                   node_ranks: int | None = None, node_bandwidth: float | None = None,
                   node_latency: float | None = None) -> float:
    """The ring model of one transfer over a group of ``n`` ranks, ``t.count`` times: ring collectives at the
    group's ``bandwidth``, all-to-alls and point-to-point messages at a rank's ``own_bandwidth`` (default: the
    same). An all-to-all across nodes, ``node_ranks`` of its ranks in each, sends ``(n - node_ranks) / n`` of its
    bytes over the rank's own NIC and, at the same time, those for the other ranks of its node over the node's link
    (``node_bandwidth``): the slower of the two. The two steps of a dispatch across nodes (``ExpertParallel``):
    ``all_to_all_between`` over the ``n / node_ranks`` ranks of a place in every node, through the NICs, and
    ``all_to_all_inside`` over the ``node_ranks`` ranks of a node, over its link (``node_latency`` a hop)."""
    if n <= 1:
        return 0.0
    own = bandwidth if own_bandwidth is None else own_bandwidth
    if t.collective in ("all_to_all_between", "all_to_all_inside") and node_ranks is not None and node_ranks < n:
        if t.collective == "all_to_all_between":
            size, link, hop = n // node_ranks, own, latency
        else:
            size, link, hop = node_ranks, node_bandwidth or own, latency if node_latency is None else node_latency
        return ((size - 1) / size * t.nbytes / link + (size - 1) * hop) * t.count
    if t.collective == "all_to_all" and node_ranks is not None and node_bandwidth is not None and node_ranks < n:
        remote = (n - node_ranks) / n * t.nbytes / own
        local = (node_ranks - 1) / n * t.nbytes / node_bandwidth
        return (max(remote, local) + (n - 1) * latency) * t.count
    if t.collective == "all_reduce":
        one = 2 * (n - 1) / n * t.nbytes / bandwidth + 2 * (n - 1) * latency
    elif t.collective in ("all_gather", "reduce_scatter"):  # (n - 1) / n of the bytes leave
        one = (n - 1) / n * t.nbytes / bandwidth + (n - 1) * latency
    elif t.collective.startswith("all_to_all"):
        one = (n - 1) / n * t.nbytes / own + (n - 1) * latency
    else:  # one point-to-point message
        one = t.nbytes / own + latency
    return one * t.count


def _reason(p: Prediction) -> str:
    gib = 2**30
    if p.budget is None:
        memory = f"{p.memory / gib:.2f} GiB per device"
    elif p.fits:
        memory = f"fits: {p.memory / gib:.2f} of {p.budget / gib:.2f} GiB ({p.margin / gib:.2f} to spare)"
    else:
        memory = f"does not fit: {p.memory / gib:.2f} GiB, {p.over_by / gib:.2f} GiB over {p.budget / gib:.2f}"
    parts = [f"compute {p.compute_s * 1e3:.1f} ms"]
    worst = max(p.comm_s.items(), key=lambda kv: kv[1], default=None)
    if worst and worst[1] > 0:
        parts.append(f"exposed communication {sum(p.comm_s.values()) * 1e3:.1f} ms (most: {worst[0]})")
    if p.bubble_s > 0:
        parts.append(f"pipeline bubble {p.bubble_s * 1e3:.1f} ms")
    return f"{memory}; step {p.step_s * 1e3:.1f} ms = " + " + ".join(parts)

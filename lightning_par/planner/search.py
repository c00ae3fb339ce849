"""Every valid layout of a model on a world, predicted and ranked: ``plan_layouts``.

Validity is the engine's own: the same checks a strategy runs before any collective (tensor-parallel plans validated
for each tp, pipeline layouts for each schedule, sequence lengths for context parallelism), so a layout the planner
names is one ``NDParallelStrategy(**layout.strategy_kwargs())`` accepts.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from itertools import product
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_par._compat import is_quantized
from lightning_par.costs.profile import ModelProfile, profile_model
from lightning_par.planner.predict import (
    RESERVE,
    SIZES,
    Layout,
    Prediction,
    check_profile_precision,
    predict,
    shares_cores,
    trace_dtype,
)
from lightning_par.techniques.pipeline.pipeline import SCHEDULES
from lightning_par.techniques.pipeline.pipeline_parallel import PipelineOptions
from lightning_par.techniques.quantize.nf4_weights import NF4_CUT
from lightning_par.techniques.recipe import OPTIONS, weighed_options
from lightning_par.techniques.sharding.fully_sharded import FullyShardedOptions
from lightning_par.techniques.tensor.tensor import quantized_cut_problems
from lightning_par.techniques.tensor.tensor_parallel import TensorParallelOptions, plan_fits

if TYPE_CHECKING:
    from lightning_par.devices import Hardware

#: what ``restrict`` may name: the sizes, and expert parallelism (within dp_shard x cp)
RESTRICTABLE = (*SIZES, "ep")
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")
#: schedules whose stages per rank the planner chooses (the others fix it)
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")
#: the most interleaved stages per rank weighed: published recipes run up to 12 (Megatron's 530B ran 35 stages of 3
#: layers with interleaving 3, Llama 3's 405B 16 stages x 8); beyond that the time model, which prices each stage's
#: sends but not its scheduling overhead per micro-batch, would favour one block per stage
MAX_STAGES_PER_RANK = 16
#: what ``plan_layouts`` weighs of each option it takes (its keyword arguments beyond the sizes): the values each
#: technique's options dataclass names (``techniques.technique.planned``)
WEIGH: dict[str, tuple] = {name: f.metadata["weigh"] for name, f in weighed_options().items()}
#: activation checkpointing options the planner weighs: none, selective, full (the option its table shows as a
#: column)
CHECKPOINTING: tuple[bool | str, ...] = next(f.metadata["weigh"] for options in OPTIONS if options.COLUMN
                                             for f in fields(options) if f.metadata.get("weigh"))


@dataclass
class Plan:
    """Layouts ranked: those that fit first, fastest (most tokens per second per device) first, at equal speed the
    one that communicates less; then those that do not fit, closest to fitting first."""

    predictions: list[Prediction]
    profile: ModelProfile
    hardware: Hardware
    world_size: int
    batch: int  # samples per data-parallel rank per step (batch_is_global: the global batch)
    seq_len: int
    precision: str
    skipped: dict[str, int] = field(default_factory=dict)  # why candidate layouts were left out, with counts

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    @property
    def fitting(self) -> list[Prediction]:
        return [p for p in self.predictions if p.fits]

    def find(self, **options: Any) -> tuple[int, Prediction]:
        """Where the best layout with these options ranks (1 = first) and its prediction, e.g.
        ``plan.find(pp=16, tp=8)``, or with the value of any option a layout carries (``Layout.names()``: the
        sizes and the techniques' planned options; ``vars(layout)`` too, whose ``options`` the names given apart
        override)."""
        options = {**dict(options.pop("options", ())), **options}
        fields = set(Layout.names())
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"Plan.find: {unknown} are not layout options; use {sorted(fields)}.")
        for rank, prediction in enumerate(self.predictions, 1):
            if all(getattr(prediction.layout, k) == v for k, v in options.items()):
                return rank, prediction
        raise ValueError(f"Plan.find({', '.join(f'{k}={v!r}' for k, v in options.items())}): no planned layout has "
                         f"these options; the planner left out {self.skipped or 'nothing'} (check the sizes multiply "
                         f"to the world, {self.world_size}, and the options the plan weighed).")

    def require_fit(self) -> Prediction:
        """The best layout; a ``ValueError`` naming the smallest memory that would fit, and with which layout, when
        none fits the budget."""
        best = self.best
        if best.fits:
            return best
        smallest = min(self.predictions, key=lambda p: p.memory)
        gib = 2**30
        raise ValueError(
            f"No layout of {self.profile.name} fits memory_budget={best.budget / gib:.2f} GiB per device on "
            f"{self.world_size} devices: the smallest needs {smallest.memory / gib:.2f} GiB ({smallest.layout}). "
            f"Raise the budget to at least that, use more devices, a smaller batch or sequence, or allow CPU offload.")

    def table(self, top: int = 10, width: int = 120, marked: Callable[[Layout], bool] | None = None) -> str:
        """The first ``top`` layouts, one line each within ``width`` columns (a long layout wraps at its options),
        and a legend of every abbreviation they use. ``marked``: layouts to flag with ``*`` (by default those
        using a technique never run on the hardware: ``untried``), which the legend explains."""
        marked = marked or (lambda layout: bool(untried(layout, self.hardware)))
        gib = 2**30
        columns = [cls.COLUMN for cls in OPTIONS if cls.COLUMN]
        head = (f"{'#':>3}  {'tok/s/dev':>9}  {'step ms':>9}  {'GiB/dev':>7}  {'state':>6}  {'act':>6}  "
                f"{'fits':<4}  " + "".join(f"{heading:<{width}}  " for heading, width, _ in columns) + "layout")
        indent = len(head) - len("layout")
        rows, shown = [head], self.predictions[:top]
        for i, p in enumerate(shown, 1):
            mark = "*" if marked(p.layout) else " "
            fits = "yes" if p.fits else "no"
            cells = (f"{i:>3}{mark} {p.tokens_per_s:>9,.0f}  {p.step_s * 1e3:>9.1f}  {p.memory / gib:>7.2f}  "
                     f"{p.model_state / gib:>6.2f}  {p.activations / gib:>6.2f}  {fits:<4}  "
                     + "".join(f"{options.column():<{options.COLUMN[1]}}  "
                               for options in p.layout.technique_options() if options.COLUMN))
            rows += _wrap(cells, p.layout.words(columns=True), width, indent)
        rows += textwrap.wrap(legend([p.layout for p in shown], any(marked(p.layout) for p in shown)), width,
                              subsequent_indent="  ")
        return "\n".join(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.profile.name, "world_size": self.world_size, "hardware": vars(self.hardware),
                "batch": self.batch, "seq_len": self.seq_len, "precision": self.precision, "skipped": self.skipped,
                "layouts": [p.as_dict() for p in self.predictions]}


#: the legend: what each abbreviation of a layout means, shown where the table uses it (pattern, meaning): the
#: sizes', each technique's own (``Options.LEGEND``), gradient accumulation's
_LEGEND = (
    (r"\bdp_replicate\d", "dp_replicateN = N replicas (DDP, HSDP with dp_shard)"),
    (r"\bdp_shard\d", "dp_shardN = FSDP2 (ZeRO-3) over N ranks"),
    (r"\bcp\d", "cpN = context parallelism (the sequence split over N ranks)"),
    (r"\btp\d", "tpN = tensor parallelism over N ranks"),
    (r"\bpp\d", "ppN = N pipeline stages"),
    (r"\(ep\d", "epN = expert parallelism over N ranks"),
    *(entry for cls in OPTIONS for entry in cls.LEGEND),
    (r"\baccumulate \d", "accumulate N = accumulate_grad_batches N (the batch in N micro-batches)"),
)
#: techniques the engine has never run, with why (each technique's ``Options.UNTRIED``): the planner weighs them
#: only when asked (their command-line flag, ``AutoParallelStrategy``'s argument) and the table marks the layouts
#: that use them
UNTRIED = {name: why for cls in OPTIONS for name, why in cls.UNTRIED.items()}


def untried(layout: Layout, hardware: Hardware | None = None) -> list[str]:
    """What of ``layout`` the engine has never run (on any hardware yet: ``UNTRIED``), as the table names it."""
    return [why for options in layout.technique_options() for why in options.untried()]


def legend(layouts: Iterable[Layout], marked: bool = False) -> str:
    """One paragraph expanding every abbreviation these layouts' table rows use."""
    import re

    text = " | ".join(str(layout) for layout in layouts)
    terms = [meaning for pattern, meaning in _LEGEND if re.search(pattern, text)]
    columns = ("Legend: tok/s/dev = tokens per second per device; GiB/dev = predicted peak memory per device, of "
               "which state = parameters, gradients and optimizer state, act = saved activations; fits = within "
               "the memory budget; AC = activation checkpointing: off, full (every block recomputed in backward) or "
               "selective")
    marks = ["* = uses a technique never run on this hardware (" + "; ".join(UNTRIED.values()) + ")"] if marked else []
    return "; ".join([columns, *terms, *marks]) + "."


def _wrap(cells: str, text: str, width: int, indent: int) -> list[str]:
    """``cells`` then ``text``, wrapped within ``width`` at ``text``'s commas onto lines indented by ``indent``."""
    lines, line = [], cells
    pieces = text.split(", ")
    for i, piece in enumerate(pieces):
        piece += "," if i < len(pieces) - 1 else ""
        gap = "" if line.endswith(" ") else " "
        if len(line) + len(gap) + len(piece) > width and line.strip() and line != cells:
            lines.append(line.rstrip())
            line, gap = " " * indent, ""
        line += gap + piece
    lines.append(line.rstrip())
    return lines


def plan_layouts(module: nn.Module | ModelProfile, example_batch: Any, world_size: int, hardware: Hardware, *,
                 precision: str = "32-true", batch_is_global: bool = True, memory_budget: float | None = None,
                 restrict: Mapping[str, Iterable[int]] | None = None,
                 schedules: Iterable[str] = PIPELINE_SCHEDULES, allow_offload: bool = False,
                 block_list: str | None = None, memory_reserve: float = RESERVE,
                 gradient_accumulation: bool = True, uneven_stages: bool = True, **weigh: Iterable) -> Plan:
    """Predict and rank every valid layout of ``module`` on ``world_size`` devices of ``hardware``.

    Args:
        module: the LightningModule (or any module; built on the meta device is fine), or a ready profile.
        example_batch: one batch: the global batch (``batch_is_global=True``) or one data-parallel rank's.
        hardware: measured (``planner.probe.probe_hardware``) or from the table (``devices.known_hardware``).
        memory_budget: bytes per device a layout may use (default: the hardware's memory less ``memory_reserve``).
        memory_reserve: the share of device memory kept free for what the model of memory leaves out (allocator
            fragmentation, workspaces; ``planner.predict.RESERVE``, 10 %); each prediction reports its ``margin``.
        restrict: sizes allowed per dimension, e.g. ``{"pp": [1], "tp": [1, 2]}``.
        schedules: the pipeline schedules to weigh (``PIPELINE_SCHEDULES``); interleaved ones with every stage
            count per rank that cuts the blocks evenly and, with ``uneven_stages``, 4, 8 and 16 where they cannot
            be even (the engine cuts unevenly, as torchtitan and NeMo AutoModel do; Megatron-LM cut evenly only).
        allow_offload: also consider CPU offload (otherwise only when nothing else fits).
        gradient_accumulation: for a layout without a pipeline whose batch does not fit, also weigh splitting each
            rank's batch into micro-batches (the Trainer's ``accumulate_grad_batches``, in the layout's
            ``trainer_kwargs()``; the fewest that fit: ``accumulated_variants``), as Megatron's and DeepSpeed's
            published runs did. ``auto_parallel`` passes ``False``: the Trainer's own setting stands.
        **weigh: for each technique option the planner weighs (``WEIGH``: the options that
            ``techniques.technique.planned`` marks with the values it weighs by default, ``docs/planner.md``'s
            table), the values to weigh, e.g. ``(False,)``: that value only, or both (``(False, True)``; for most of
            them the twins of the layouts that could come near the fastest, as the technique's options say: e.g.
            ``FullyShardedOptions.zero2_twins``, ``TensorParallelOptions.regather_twins``).
    """
    profile = module if isinstance(module, ModelProfile) else profile_model(
        module, example_batch, block_list=block_list, dtype=trace_dtype(precision))
    check_profile_precision(profile, precision)
    batch, seq_len = profile.batch, profile.seq_len
    weigh = _weighed(weigh)
    if isinstance(schedules, str):
        raise TypeError(f"schedules={schedules!r} must be a sequence of schedule names, e.g. ({schedules!r},).")
    schedules = tuple(schedules)
    unknown = [name for name in schedules if name not in SCHEDULES]
    if unknown:  # (else each pipeline layout would be skipped as one that does not fit)
        raise ValueError(f"schedules={schedules!r}: {unknown} are not pipeline schedules; choose from "
                         f"{sorted(SCHEDULES)}, or restrict={{'pp': [1]}} for no pipeline.")
    TensorParallelOptions.check_weighed(weigh)
    if not isinstance(gradient_accumulation, bool):
        raise TypeError(f"gradient_accumulation={gradient_accumulation!r} must be True (weigh micro-batches for "
                        f"layouts whose batch does not fit) or False.")
    if not isinstance(uneven_stages, bool):
        raise TypeError(f"uneven_stages={uneven_stages!r} must be True (also weigh interleavings whose stages cannot "
                        f"be equal) or False.")
    twins, reduce_once = FullyShardedOptions.twins_weighed(weigh)  # ZeRO-2 variants where they can matter, below
    candidates, skipped = enumerate_layouts(profile, world_size, hardware.gpus_per_node, batch, batch_is_global,
                                            restrict or {}, schedules=schedules, uneven_stages=uneven_stages,
                                            weigh=weigh)
    if not candidates:
        raise ValueError(_no_layout_message(profile, world_size, skipped))

    if not 0 <= memory_reserve < 1:
        raise ValueError(f"memory_reserve={memory_reserve!r} must be a share of device memory in [0, 1), e.g. 0.1.")

    def local(layout: Layout) -> int:
        return batch // layout.dp if batch_is_global else batch

    def run(layouts: list[Layout]) -> list[Prediction]:
        return [predict(layout, profile, hardware, local(layout), seq_len, precision, memory_budget, memory_reserve)
                for layout in layouts]

    def accumulated(predictions: list[Prediction]) -> list[Prediction]:
        return accumulated_variants(predictions, local, run) if gradient_accumulation else []

    # each technique's variants, in this order: FSDP's ZeRO-2-like twins, gradient accumulation, FSDP's reducing
    # once, tensor parallelism's re-gathered chunks and async collectives, FSDP's CPU offload
    predictions = run(candidates)
    if twins:
        predictions += run(zero2_twins(predictions, reduce_once=reduce_once))
    predictions += accumulated(predictions)
    predictions = FullyShardedOptions.reduce_once(predictions, weigh, Judge, run)
    predictions = TensorParallelOptions.regather(predictions, weigh, Judge, run, accumulated)
    if not shares_cores(hardware):
        predictions = TensorParallelOptions.pipelined(predictions, weigh, Judge, run)
    if allow_offload or not any(p.fits for p in predictions):
        predictions += run([_forced(layout, weigh) for layout in FullyShardedOptions.offloaded(candidates)])
    # equal speed, within the model's resolution (SPEED_RESOLUTION): the one that moves less first, as it leaves
    # less to what the time model does not see (contention, jitter, per-stage scheduling)
    predictions = rank_predictions(predictions)
    return Plan(predictions, profile, hardware, world_size, batch, seq_len, precision, skipped)


def _weighed(given: Mapping[str, Iterable]) -> dict[str, tuple]:
    """Every weighed option's values (``WEIGH``'s where not given), each once; a name that is none of them, or
    nothing to weigh, refused."""
    unknown = sorted(set(given) - set(WEIGH))
    if unknown:
        raise TypeError(f"plan_layouts() got unexpected keyword arguments {unknown}; the options it weighs: "
                        f"{list(WEIGH)}.")
    out = {}
    for name, default in WEIGH.items():
        values = tuple(given.get(name, default))
        if all(isinstance(v, bool) for v in default):  # on / off: each once
            values = tuple(dict.fromkeys(bool(x) for x in values))
            if not values:
                raise ValueError(f"{name}=() leaves nothing to weigh; pass (True,), (False,) or (True, False).")
        out[name] = values
    return out


def _forced(layout: Layout, weigh: Mapping[str, tuple]) -> Layout:
    """``layout`` as what each technique weighs alone makes every layout (``Options.force``)."""
    for cls in OPTIONS:
        layout = cls.force(layout, weigh)
    return layout


#: predicted speeds closer than this (relative) rank as equal: the time model is not finer than that (a 0.1 % edge
#: of a pipelined, context-parallel variant over plain FSDP x TP, as for Llama 3.1 405B on 128 H100, is noise)
SPEED_RESOLUTION = 0.01


def rank_predictions(predictions: list[Prediction]) -> list[Prediction]:
    """Fitting first, fastest first; those that do not fit, closest to fitting first. Speeds within
    ``SPEED_RESOLUTION`` of the fastest of their run rank as equal: then the layout with fewer parallel dimensions
    first (each adds costs the time model leaves out: pipeline scheduling per stage, more process groups), then the
    one that communicates less."""
    fitting = sorted((p for p in predictions if p.fits), key=lambda p: -p.tokens_per_s)
    ranked: list[Prediction] = []
    while fitting:
        lead = fitting[0].tokens_per_s
        cut = next((i for i, p in enumerate(fitting) if p.tokens_per_s < lead * (1 - SPEED_RESOLUTION)),
                   len(fitting))
        ranked += sorted(fitting[:cut], key=lambda p: (_dimensions(p.layout), sum(p.comm_total_s.values()),
                                                       -p.tokens_per_s))
        fitting = fitting[cut:]
    return ranked + sorted((p for p in predictions if not p.fits), key=lambda p: (p.over_by, -p.tokens_per_s))


#: ZeRO-2-like twins (no resharding after forward) are weighed for the FSDP layouts that could come within this
#: share of the fastest fitting one without their backward all-gathers (planning 8,192 GPUs takes about 10 s)
ZERO2_WINDOW = 0.8


def zero2_twins(predictions: list[Prediction], reduce_once: bool = True) -> list[Layout]:
    """FSDP's ZeRO-2-like (and ZeRO-1-like) twins of the layouts that could come near the fastest
    (``FullyShardedOptions.zero2_twins``)."""
    return FullyShardedOptions.zero2_twins(predictions, Judge(predictions), reduce_once)


class Judge:
    """What a technique's twin of a layout must be able to reach to be planned (the techniques' twins ask it,
    ``FullyShardedOptions.zero2_twins`` and the others): ``ZERO2_WINDOW`` of the fastest fitting layout's speed
    among ``predictions``."""

    def __init__(self, predictions: list[Prediction]) -> None:
        self.floor = ZERO2_WINDOW * max((p.tokens_per_s for p in predictions if p.fits), default=0.0)

    def near(self, p: Prediction, best_step_s: float) -> bool:
        """Whether ``p`` would reach the floor at a step of ``best_step_s`` (its step with what the twin saves
        gone)."""
        return p.tokens_per_s * p.step_s / max(best_step_s, 1e-30) >= self.floor

    @staticmethod
    def stretched(p: Prediction, busy_seconds: float) -> float:
        """``busy_seconds`` of the rank's work as step time: the pipeline's bubble stretches it by step / busy."""
        return busy_seconds * p.step_s / max(p.step_s - p.bubble_s, 1e-30)

    @staticmethod
    def could_fit_without_buffers(p: Prediction) -> bool:
        """Whether a twin of ``p`` with the same state and activations and other FSDP buffers (reducing once)
        could fit: not if ``p`` is over budget even without its buffers. A plan at thousands of GPUs would
        otherwise predict some 12,000 twins that cannot fit (Llama 3 405B on 8,192 GPUs). Not a test for the plain
        ZeRO-2-like twins: they are weighed before gradient accumulation, whose micro-batches may make them
        fit."""
        return p.budget is None or p.memory - p.buffers <= p.budget


def accumulated_variants(predictions: list[Prediction], local_batch: Callable[[Layout], int],
                         run: Callable[[list[Layout]], list[Prediction]]) -> list[Prediction]:
    """For each layout without a pipeline whose batch does not fit: the same with the batch split into 2, 4, 8 ...
    micro-batches (and one sample each), up to the first that fits. More micro-batches only add collectives (FSDP
    gathers once per micro-batch), so the fewest that fit is the one worth ranking; checkpointing and accumulation
    are weighed together (each checkpointing option is a layout of its own)."""
    out = []
    for p in predictions:
        layout = p.layout
        if p.fits or layout.pp > 1 or FullyShardedOptions.offloads(layout) or layout.accumulate_grad_batches > 1:
            continue
        for count in _accumulations(local_batch(layout)):
            variant = run([replace(layout, accumulate_grad_batches=count)])[0]
            out.append(variant)
            if variant.fits:
                break
    return out


def _accumulations(local_batch: int) -> list[int]:
    """Micro-batch counts that divide a rank's batch: the powers of two, and one sample per micro-batch."""
    counts = {2**k for k in range(1, local_batch.bit_length()) if local_batch % 2**k == 0} | {local_batch}
    return sorted(c for c in counts if c > 1)


def _dimensions(layout: Layout) -> int:
    return sum(getattr(layout, name) > 1 for name in SIZES)


def enumerate_layouts(profile: ModelProfile, world_size: int, per_node: int, batch: int, batch_is_global: bool,
                      restrict: Mapping[str, Iterable[int]], *, schedules: tuple[str, ...] = PIPELINE_SCHEDULES,
                      uneven_stages: bool = True, weigh: Mapping[str, tuple] | None = None,
                      ) -> tuple[list[Layout], dict[str, int]]:
    """The layouts the engine would accept; ``skipped`` counts the candidates left out, by reason. Per set of sizes,
    each technique's choices (``choices`` of its options: tensor parallelism's sequence parallelism, activation
    checkpointing's modes, FSDP's resharding), each expert split, and under a pipeline each of its shapes."""
    weigh = _weighed(weigh or {})
    unknown = set(restrict) - set(RESTRICTABLE)
    if unknown:
        raise ValueError(f"restrict={dict(restrict)!r}: {sorted(unknown)} are not layout dimensions; use "
                         f"{RESTRICTABLE}.")
    for name, sizes in restrict.items():
        if isinstance(sizes, str) or not isinstance(sizes, Iterable) or not all(
                isinstance(size, int) and not isinstance(size, bool) for size in sizes):
            raise TypeError(f"restrict={dict(restrict)!r}: {name!r} takes the sizes to allow, a list of ints such "
                            f"as {{{name!r}: [2]}}.")
    allowed = {k: set(v) for k, v in restrict.items()}
    skipped: dict[str, int] = {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    blocks = len(profile.blocks)
    has_attention = any(s.kv_bytes for s in profile.sections.values())
    out = []
    for sizes in _factorizations(world_size, len(SIZES)):
        dims = dict(zip(SIZES, sizes))
        if any(k in allowed and v not in allowed[k] for k, v in dims.items()):
            skip("restricted")
            continue
        dp = dims["dp_replicate"] * dims["dp_shard"]
        if (dims["dp_replicate"] > 1 and dims["dp_shard"] * dims["cp"] * dims["tp"] < per_node
                and dp in allowed.get("dp_shard", (dp,))):
            # the same layout with the replicas folded into dp_shard moves less across nodes (kept where
            # `restrict` forbids that dp_shard: plain data parallelism, as Megatron ran it)
            skip("replicas smaller than a node (use dp_shard)")
            continue
        if dims["tp"] > 1 and (dims["tp"] > per_node or not plan_fits(profile, dims["tp"], False)):
            skip("tp does not fit the model or a node")
            continue
        if dims["tp"] > 1 and not _quantized_weights_cut(profile, dims["tp"], dims["dp_shard"] * dims["cp"]):
            skip("tp does not cut the 4-bit weights into whole blocks")
            continue
        if dims["cp"] > 1 and (not has_attention or profile.seq_len % (2 * dims["cp"])):
            skip("sequence not divisible by 2 x cp")
            continue
        if batch_is_global and batch % dp:
            skip("global batch not divisible by dp")
            continue
        local = batch // dp if batch_is_global else batch
        eps = _expert_splits(profile, dims["dp_shard"] * dims["cp"], allowed.get("ep"))
        if not eps:
            skip("restricted")
            continue
        # (in this order: a layout's neighbours in the list differ in the pipeline's shape first)
        choices = [cls.choices(dims, weigh, profile) for cls in OPTIONS]
        for *chosen, ep in product(*choices, eps):
            options = dict(dims, ep=ep)
            for part in chosen:
                options.update(part)
            if dims["pp"] == 1:
                out.append(Layout(**options))
                continue
            for shape in PipelineOptions.shapes(schedules, blocks, dims["pp"], dp * dims["cp"], local,
                                                 uneven_stages, _stages_per_rank, _microbatches, skip):
                out.append(Layout(**options, **shape))
    return out, skipped


def _quantized_weights_cut(profile: ModelProfile, tp: int, shards: int) -> bool:
    """Whether tensor parallelism cuts the model's 4-bit weights (``quantize_base``: NF4 placeholders in the traced
    copy) over ``tp`` ranks, each piece's rows then over FSDP's ``shards``: the engine's own check, cached."""
    if ("quantized",) not in profile.tp_checks:
        profile.tp_checks[("quantized",)] = any(is_quantized(p) for p in profile.meta_module.parameters())
    key = ("quantized", tp, shards)
    if key not in profile.tp_checks:
        profile.tp_checks[key] = not (profile.tp_checks[("quantized",)] and quantized_cut_problems(
            profile.meta_module, profile.tp_plan, tp, NF4_CUT, shards))
    return profile.tp_checks[key]


def _expert_splits(profile: ModelProfile, borrowed: int, allowed: set[int] | None) -> list[int]:
    """The ep sizes to weigh: 1, and with experts every size that divides both the data/context ranks it borrows
    (``dp_shard x cp``) and the expert count."""
    fits = range(1, borrowed + 1) if profile.num_experts else (1,)
    return [ep for ep in fits if borrowed % ep == 0 and profile.num_experts % max(ep, 1) == 0
            and (allowed is None or ep in allowed)]


@cache
def _stages_per_rank(schedule: str, blocks: int, pp: int, uneven: bool = True) -> tuple[int | None, ...]:
    """Stages per rank to weigh: the schedule's own (None: 2 for the interleaved ones), and for the interleaved
    ones every other count up to ``MAX_STAGES_PER_RANK`` that cuts the blocks into ``pp x v`` equal stages (fewer
    bubbles, more sends), and with ``uneven`` the usual 4, 8 and 16 where the stages cannot be equal:
    DeepSeek-V3's 61 layers ran at pp 4 x vp 8 (NeMo). The engine's cut (``even_cut``) then leaves no rank more
    than ``ceil(blocks / pp)`` blocks, and the bubble is priced by the largest stage (``pipeline_shape``)."""
    if schedule not in INTERLEAVED:
        return (None,)
    top = min(blocks // pp, MAX_STAGES_PER_RANK)
    even = {v for v in range(3, top + 1) if blocks % (pp * v) == 0}
    return (None, *sorted(even | ({v for v in (4, 8, 16) if v <= top} if uneven else set())))


def _microbatches(pp: int, local_batch: int) -> list[int]:
    """A few micro-batch counts that divide the batch: one per stage up to eight per stage, and those of micro-batches
    of 4, 2 and 1 samples where the batch holds more than that (Megatron's large runs used micro-batches of 1
    sample: the bubble shrinks with the count, the matmuls stay large at long sequences)."""
    counts = (pp, 2 * pp, 4 * pp, 8 * pp, local_batch // 4, local_batch // 2, local_batch)
    return sorted({m for m in counts if pp <= m <= local_batch and local_batch % m == 0})


@cache
def _factorizations(n: int, parts: int) -> tuple[tuple[int, ...], ...]:
    if parts == 1:
        return ((n,),)
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return tuple((d, *rest) for d in divisors for rest in _factorizations(n // d, parts - 1))


def _no_layout_message(profile: ModelProfile, world_size: int, skipped: dict[str, int]) -> str:
    reasons = ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1]))
    return (f"No layout of {profile.name} fits a world of {world_size}: {reasons or 'no candidates'}. Choose a world "
            f"size whose factors the model allows (heads and widths divisible by tp, {len(profile.blocks)} blocks "
            f"for pp, sequence {profile.seq_len} divisible by 2 x cp, batch divisible by dp), or relax `restrict`.")



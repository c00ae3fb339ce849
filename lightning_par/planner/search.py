"""Every valid layout of a model on a world, predicted and ranked: ``plan_layouts``.

Validity is the engine's own: the same checks a strategy runs before any collective (tensor-parallel plans validated
for each tp, pipeline layouts for each schedule, sequence lengths for context parallelism), so a layout the planner
names is one ``NDParallelStrategy(**layout.strategy_kwargs())`` accepts.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from itertools import product
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_par.costs.profile import ModelProfile, profile_model
from lightning_par.planner.predict import (
    RESERVE,
    Layout,
    Prediction,
    check_profile_precision,
    predict,
    shares_cores,
    trace_dtype,
)
from lightning_par.techniques.pipeline.pipeline import SCHEDULES, validate_pipeline
from lightning_par.techniques.tensor.tensor_plan import validate_tp_plan

if TYPE_CHECKING:
    from lightning_par.devices import Hardware

SIZES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
#: what ``restrict`` may name: the sizes, and expert parallelism (within dp_shard x cp)
RESTRICTABLE = (*SIZES, "ep")
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")
#: schedules whose stages per rank the planner chooses (the others fix it)
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")
#: the most interleaved stages per rank weighed: published recipes run up to 12 (Megatron's 530B ran 35 stages of 3
#: layers with interleaving 3, Llama 3's 405B 16 stages x 8); beyond that the time model, which prices each stage's
#: sends but not its scheduling overhead per micro-batch, would favour one block per stage
MAX_STAGES_PER_RANK = 16
#: activation checkpointing options the planner weighs: none, selective, full
CHECKPOINTING: tuple[bool | str, ...] = (False, "selective", True)


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
        ``plan.find(pp=16, tp=8)`` or ``plan.find(tp=8, sequence_parallel=False)``: options are ``Layout`` fields."""
        fields = set(Layout.__dataclass_fields__)
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
        head = (f"{'#':>3}  {'tok/s/dev':>9}  {'step ms':>9}  {'GiB/dev':>7}  {'state':>6}  {'act':>6}  "
                f"{'fits':<4}  {'AC':<9}  layout")
        indent = len(head) - len("layout")
        rows, shown = [head], self.predictions[:top]
        for i, p in enumerate(shown, 1):
            mark = "*" if marked(p.layout) else " "
            fits = "yes" if p.fits else "no"
            cells = (f"{i:>3}{mark} {p.tokens_per_s:>9,.0f}  {p.step_s * 1e3:>9.1f}  {p.memory / gib:>7.2f}  "
                     f"{p.model_state / gib:>6.2f}  {p.activations / gib:>6.2f}  {fits:<4}  "
                     f"{_CHECKPOINTING_NAMES[p.layout.activation_checkpointing]:<9}  ")
            rows += _wrap(cells, _layout_words(p.layout), width, indent)
        rows += textwrap.wrap(legend([p.layout for p in shown], any(marked(p.layout) for p in shown)), width,
                              subsequent_indent="  ")
        return "\n".join(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.profile.name, "world_size": self.world_size, "hardware": vars(self.hardware),
                "batch": self.batch, "seq_len": self.seq_len, "precision": self.precision, "skipped": self.skipped,
                "layouts": [p.as_dict() for p in self.predictions]}


#: the table's AC column
_CHECKPOINTING_NAMES: dict[bool | str, str] = {False: "off", True: "full", "selective": "selective"}
#: techniques the engine has never run, by ``Layout`` field, with why: the planner weighs them only when asked
#: (``--async-tp``, ``AutoParallelStrategy(async_tp=True)``) and the table marks the layouts that use them
UNTRIED = {"async_tp": "async TP needs 2+ CUDA GPUs and has never run"}
#: the legend: what each abbreviation of a layout means, shown where the table uses it (pattern, meaning)
_LEGEND = (
    (r"\bdp_replicate\d", "dp_replicateN = N replicas (DDP, HSDP with dp_shard)"),
    (r"\bdp_shard\d", "dp_shardN = FSDP2 (ZeRO-3) over N ranks"),
    (r"\bcp\d", "cpN = context parallelism (the sequence split over N ranks)"),
    (r"\btp\d", "tpN = tensor parallelism over N ranks"),
    (r"\bpp\d", "ppN = N pipeline stages"),
    (r"\(ep\d", "epN = expert parallelism over N ranks"),
    (r"\bpp\d", "the name before vN or mM is the pipeline schedule (pp_schedule)"),
    (r" v\d+ m\d+", "vN mM = N pipeline stages per rank, M micro-batches per step"),
    (r"(?<! v\d)(?<! v\d\d) m\d+", "mM = M pipeline micro-batches per step (the schedule's own stages per rank: "
                                    "2 for the interleaved ones)"),
    (r"\bSP\b", "SP = sequence parallelism"),
    (r"\bregather\b", "regather = sequence-parallel inputs gathered again in backward"),
    (r"\basync TP\b", "async TP = tensor-parallel collectives pipelined with their matmuls (compile=True)"),
    (r"\bLP\b", "LP = loss parallelism (cross-entropy on vocabulary-sharded logits)"),
    (r"\boffload\b", "offload = FSDP state on the CPU"),
    (r"\bZeRO-2\b", "ZeRO-2 = FSDP without resharding after forward"),
    (r"\bZeRO-1\b", "ZeRO-1 = FSDP gathered and reduced once per step (reshard_after_forward=False, "
                    "accumulate_unsharded=True)"),
    (r"\breduce once\b", "reduce once = gradients reduced once per step (accumulate_unsharded=True)"),
    (r"\baccumulate \d", "accumulate N = accumulate_grad_batches N (the batch in N micro-batches)"),
)


def untried(layout: Layout, hardware: Hardware | None = None) -> list[str]:
    """What of ``layout`` the engine has never run (on any hardware yet: ``UNTRIED``), as the table names it."""
    return [why for name, why in UNTRIED.items() if getattr(layout, name)]


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


def _layout_words(layout: Layout) -> str:
    """The layout as the table shows it: checkpointing is a column of its own."""
    return str(replace(layout, activation_checkpointing=False))


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
                 activation_checkpointing: Iterable[bool | str] = CHECKPOINTING,
                 schedules: Iterable[str] = PIPELINE_SCHEDULES, allow_offload: bool = False,
                 block_list: str | None = None, sequence_parallel: Iterable[bool] = (True, False),
                 reshard_after_forward: Iterable[bool] = (True, False), memory_reserve: float = RESERVE,
                 gradient_accumulation: bool = True, accumulate_unsharded: Iterable[bool] = (False, True),
                 regather_sequence: Iterable[bool] = (False, True), async_tp: Iterable[bool] = (False, True),
                 uneven_stages: bool = True) -> Plan:
    """Predict and rank every valid layout of ``module`` on ``world_size`` devices of ``hardware``.

    Args:
        module: the LightningModule (or any module; built on the meta device is fine), or a ready profile.
        example_batch: one batch: the global batch (``batch_is_global=True``) or one data-parallel rank's.
        hardware: measured (``planner.probe.probe_hardware``) or from the table (``devices.known_hardware``).
        memory_budget: bytes per device a layout may use (default: the hardware's memory less ``memory_reserve``).
        memory_reserve: the share of device memory kept free for what the model of memory leaves out (allocator
            fragmentation, workspaces; ``planner.predict.RESERVE``, 10 %); each prediction reports its ``margin``.
        restrict: sizes allowed per dimension, e.g. ``{"pp": [1], "tp": [1, 2]}``.
        activation_checkpointing: the options to weigh: ``False``, ``"selective"``, ``True`` (full).
        schedules: the pipeline schedules to weigh (``PIPELINE_SCHEDULES``); interleaved ones with every stage
            count per rank that cuts the blocks evenly and, with ``uneven_stages``, 4, 8 and 16 where they cannot
            be even (the engine cuts unevenly, as torchtitan and NeMo AutoModel do; Megatron-LM cut evenly only).
        allow_offload: also consider CPU offload (otherwise only when nothing else fits).
        sequence_parallel: with ``tp > 1``, weigh sequence parallelism on (``True``), off (``False``) or both.
        reshard_after_forward: with FSDP, weigh resharding after forward (``True``, ZeRO-3), keeping units gathered
            until their backward (``False``, ZeRO-2-like: no all-gather in backward, more memory) or both (the
            ZeRO-2-like twins of the layouts that could come near the fastest: ``zero2_twins``; where reducing once
            is weighed too, the ZeRO-1-like twin of a layout that comes near only without its per-micro-batch
            reductions as well).
        accumulate_unsharded: with FSDP and several micro-batches per step (a pipeline's, or accumulation's),
            weigh reducing the gradients in every micro-batch (``False``), once per step with every unit gathered
            and its gradients unsharded meanwhile (``True``; ZeRO-1-like without resharding after forward), or both
            (the twins of the layouts that could come near the fastest: ``reduce_once_twins``, and those
            ``zero2_twins`` makes).
        regather_sequence: with sequence parallelism, weigh saving the gathered layer inputs whole (``False``), as
            this rank's chunk gathered again in backward (``True``: less memory, one more all-gather per input) or
            both (the twins of the layouts that do not fit but could come near the fastest: ``regather_twins``).
        async_tp: with sequence parallelism on a GPU (not on CPUs: ``shares_cores``), weigh its collectives exposed
            (``False``), pipelined with their matmuls (``True``: Inductor's async tensor parallelism, which needs
            ``compile=True``; the layout's ``strategy_kwargs()`` include it; not with cp > 1 or re-gathered chunks,
            which are not compiled, nor for the CPU-offload variants) or both (the twins of the layouts that could
            come near the fastest: ``async_tp_twins``).
        gradient_accumulation: for a layout without a pipeline whose batch does not fit, also weigh splitting each
            rank's batch into micro-batches (the Trainer's ``accumulate_grad_batches``, in the layout's
            ``trainer_kwargs()``; the fewest that fit: ``accumulated_variants``), as Megatron's and DeepSpeed's
            published runs did. ``auto_parallel`` passes ``False``: the Trainer's own setting stands.
    """
    profile = module if isinstance(module, ModelProfile) else profile_model(
        module, example_batch, block_list=block_list, dtype=trace_dtype(precision))
    check_profile_precision(profile, precision)
    batch, seq_len = profile.batch, profile.seq_len
    options = {}
    for name, given in (("sequence_parallel", sequence_parallel), ("reshard_after_forward", reshard_after_forward),
                        ("accumulate_unsharded", accumulate_unsharded), ("regather_sequence", regather_sequence),
                        ("async_tp", async_tp)):
        options[name] = tuple(dict.fromkeys(bool(x) for x in given))
        if not options[name]:
            raise ValueError(f"{name}=() leaves nothing to weigh; pass (True,), (False,) or (True, False).")
    if isinstance(schedules, str):
        raise TypeError(f"schedules={schedules!r} must be a sequence of schedule names, e.g. ({schedules!r},).")
    schedules = tuple(schedules)
    unknown = [name for name in schedules if name not in SCHEDULES]
    if unknown:  # (else each pipeline layout would be skipped as one that does not fit)
        raise ValueError(f"schedules={schedules!r}: {unknown} are not pipeline schedules; choose from "
                         f"{sorted(SCHEDULES)}, or restrict={{'pp': [1]}} for no pipeline.")
    if options["regather_sequence"] == (True,) and options["async_tp"] == (True,):
        raise ValueError("regather_sequence=(True,) with async_tp=(True,): async tensor parallelism is compiled and "
                         "re-gathering is not (see NDParallelStrategy). Weigh one of them, or both: (False, True).")
    if not isinstance(gradient_accumulation, bool):
        raise TypeError(f"gradient_accumulation={gradient_accumulation!r} must be True (weigh micro-batches for "
                        f"layouts whose batch does not fit) or False.")
    if not isinstance(uneven_stages, bool):
        raise TypeError(f"uneven_stages={uneven_stages!r} must be True (also weigh interleavings whose stages cannot "
                        f"be equal) or False.")
    twins = len(options["reshard_after_forward"]) == 2  # ZeRO-2 variants weighed where they can matter, below
    candidates, skipped = enumerate_layouts(profile, world_size, hardware.gpus_per_node, batch, batch_is_global,
                                            restrict or {}, tuple(activation_checkpointing), schedules,
                                            options["sequence_parallel"],
                                            (True,) if twins else options["reshard_after_forward"],
                                            uneven_stages)
    if not candidates:
        raise ValueError(_no_layout_message(profile, world_size, skipped))

    if not 0 <= memory_reserve < 1:
        raise ValueError(f"memory_reserve={memory_reserve!r} must be a share of device memory in [0, 1), e.g. 0.1.")

    def local(layout: Layout) -> int:
        return batch // layout.dp if batch_is_global else batch

    def run(layouts: list[Layout]) -> list[Prediction]:
        return [predict(layout, profile, hardware, local(layout), seq_len, precision, memory_budget, memory_reserve)
                for layout in layouts]

    predictions = run(candidates)
    if twins:
        predictions += run(zero2_twins(predictions, reduce_once=True in options["accumulate_unsharded"]))
    if gradient_accumulation:
        predictions += accumulated_variants(predictions, local, run)
    if options["accumulate_unsharded"] == (True,):
        predictions = run([replace(p.layout, accumulate_unsharded=True) if _accumulates(p.layout) else p.layout
                           for p in predictions])
    elif len(options["accumulate_unsharded"]) == 2:
        predictions += run(reduce_once_twins(predictions))
    forced_regather = options["regather_sequence"] == (True,)
    if forced_regather:
        predictions = run([replace(p.layout, regather_sequence=p.layout.sequence_parallel) for p in predictions])
    elif len(options["regather_sequence"]) == 2:
        regathered = run(regather_twins(predictions))
        predictions += regathered
        if gradient_accumulation:  # a twin that still does not fit, with its batch in micro-batches
            predictions += accumulated_variants(regathered, local, run)
    if options["async_tp"] != (False,) and not shares_cores(hardware):
        pipelined = async_tp_twins(predictions, everyone=options["async_tp"] == (True,))
        if options["async_tp"] == (True,):  # every such layout pipelined instead, the others as they are
            twinned = {replace(layout, async_tp=False) for layout in pipelined}
            predictions = [p for p in predictions if p.layout not in twinned]
        predictions += run(pipelined)
    if allow_offload or not any(p.fits for p in predictions):
        predictions += run([replace(layout, cpu_offload=True,
                                    regather_sequence=forced_regather and layout.sequence_parallel)
                            for layout in candidates if layout.dp_shard * layout.dp_replicate * layout.cp > 1])
    # equal speed, within the model's resolution (SPEED_RESOLUTION): the one that moves less first, as it leaves
    # less to what the time model does not see (contention, jitter, per-stage scheduling)
    predictions = rank_predictions(predictions)
    return Plan(predictions, profile, hardware, world_size, batch, seq_len, precision, skipped)


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
    """The ZeRO-2-like twin of every FSDP layout that, with all its exposed all-gather time gone (more than the
    twin saves: it still gathers before forward; exposed time is the rank's busy time, which a pipeline's bubble
    stretches by step / busy), would be at least ``ZERO2_WINDOW`` as fast as the fastest fitting layout; the twin
    keeps every unit gathered until its backward, so it needs more memory. With several
    micro-batches per step and ``reduce_once`` weighed, a layout that comes near only with its per-micro-batch
    reductions gone too gets the ZeRO-1-like twin instead (gathered once, reduced once: ``accumulate_unsharded``),
    where that could fit: else a pipeline whose reduce-scatters cost as much as its gathers would never reach its
    fastest variant."""
    floor = _floor(predictions)
    out = []
    for p in predictions:
        if p.layout.dp_shard * p.layout.cp == 1 or p.layout.cpu_offload:
            continue
        gathers = p.comm_s.get("fsdp_all_gather", 0.0)
        reductions = p.comm_s.get("fsdp_reduce_scatter", 0.0)
        if _could_come_near(p, p.step_s - _stretched(p, gathers), floor):
            out.append(replace(p.layout, reshard_after_forward=False))
        elif (reduce_once and _accumulates(p.layout) and _twin_could_fit(p)
              and _could_come_near(p, p.step_s - _stretched(p, gathers + reductions), floor)):
            out.append(replace(p.layout, reshard_after_forward=False, accumulate_unsharded=True))
    return out


def _stretched(p: Prediction, busy_seconds: float) -> float:
    """``busy_seconds`` of the rank's work as step time: the pipeline's bubble stretches it by step / busy."""
    return busy_seconds * p.step_s / max(p.step_s - p.bubble_s, 1e-30)


def regather_twins(predictions: list[Prediction]) -> list[Layout]:
    """The ``regather_sequence`` twin of every sequence-parallel layout outside activation checkpointing that does
    not fit and would be at least ``ZERO2_WINDOW`` as fast as the fastest fitting layout: the twin saves the
    gathered layer inputs as chunks (it may fit where the layout does not, and run without recomputation where
    the fitting variants recompute) for one more exposed all-gather per input. A layout that fits gains nothing."""
    floor = _floor(predictions)
    return [replace(p.layout, regather_sequence=True) for p in predictions
            if p.layout.sequence_parallel and not p.layout.regather_sequence and not p.fits
            and not p.layout.activation_checkpointing and _could_come_near(p, p.step_s, floor)
            # at most every saved activation shrinks to 1/tp: a layout further over its budget stays over
            and (p.budget is None or p.memory - p.activations * (1 - 1 / p.layout.tp) <= p.budget)]


def _twin_could_fit(p: Prediction) -> bool:
    """Whether a reduce-once twin of ``p`` (the same state and activations, other FSDP buffers) could fit: not if
    ``p`` is over budget even without its buffers. A plan at thousands of GPUs would otherwise predict some 12,000
    twins that cannot fit (Llama 3 405B on 8,192 GPUs); ``zero2_twins`` asks it too before making a ZeRO-1-like
    twin. Not a test for the plain ZeRO-2-like twins: they are weighed before gradient accumulation, whose
    micro-batches may make them fit."""
    return p.budget is None or p.memory - p.buffers <= p.budget


def async_tp_twins(predictions: list[Prediction], everyone: bool = False) -> list[Layout]:
    """The async tensor-parallel twin of every sequence-parallel layout (not re-gathering, not context-parallel:
    neither is compiled yet) that, with all its exposed tensor-parallel time gone (more than the twin saves: what
    does not fit behind its matmul stays), would be at least ``ZERO2_WINDOW`` as fast as the fastest fitting layout
    (``everyone``: of each). Same memory, same compute: only the time differs, so only layouts that fit get a twin
    (``everyone``: all)."""
    floor = _floor(predictions)
    return [replace(p.layout, async_tp=True) for p in predictions
            if p.layout.tp > 1 and p.layout.sequence_parallel and not p.layout.regather_sequence
            and p.layout.cp == 1 and not p.layout.async_tp
            and (everyone or (p.fits and _could_come_near(p, p.step_s - p.comm_s.get("tp", 0.0), floor)))]


def _floor(predictions: list[Prediction]) -> float:
    """``ZERO2_WINDOW`` of the fastest fitting layout's speed: what a twin must be able to reach to be planned."""
    return ZERO2_WINDOW * max((p.tokens_per_s for p in predictions if p.fits), default=0.0)


def _could_come_near(p: Prediction, best_step_s: float, floor: float) -> bool:
    """Whether ``p`` would reach ``floor`` at a step of ``best_step_s`` (its step with what the twin saves gone)."""
    return p.tokens_per_s * p.step_s / max(best_step_s, 1e-30) >= floor


def _accumulates(layout: Layout) -> bool:
    """Whether FSDP runs several micro-batches per step in this layout (whose reductions it could merge)."""
    microbatches = (layout.pp_microbatches or layout.pp) if layout.pp > 1 else layout.accumulate_grad_batches
    return (layout.dp_replicate * layout.dp_shard * layout.cp > 1 and microbatches > 1 and not layout.cpu_offload
            and not layout.accumulate_unsharded)


def reduce_once_twins(predictions: list[Prediction]) -> list[Layout]:
    """The ``accumulate_unsharded`` twin of every FSDP layout with several micro-batches per step that, with all
    its exposed FSDP time gone (more than the twin saves: it still gathers and reduces once), would be at least
    ``ZERO2_WINDOW`` as fast as the fastest fitting layout; the twin holds every unit gathered and its unsharded
    gradients, so it needs more memory."""
    floor, out = _floor(predictions), []
    for p in predictions:
        if not _accumulates(p.layout) or not _twin_could_fit(p):
            continue
        fsdp = p.comm_s.get("fsdp_all_gather", 0.0) + p.comm_s.get("fsdp_reduce_scatter", 0.0)
        if _could_come_near(p, p.step_s - _stretched(p, fsdp), floor):
            out.append(replace(p.layout, accumulate_unsharded=True))
    return out


def accumulated_variants(predictions: list[Prediction], local_batch: Callable[[Layout], int],
                         run: Callable[[list[Layout]], list[Prediction]]) -> list[Prediction]:
    """For each layout without a pipeline whose batch does not fit: the same with the batch split into 2, 4, 8 ...
    micro-batches (and one sample each), up to the first that fits. More micro-batches only add collectives (FSDP
    gathers once per micro-batch), so the fewest that fit is the one worth ranking; checkpointing and accumulation
    are weighed together (each checkpointing option is a layout of its own)."""
    out = []
    for p in predictions:
        layout = p.layout
        if p.fits or layout.pp > 1 or layout.cpu_offload or layout.accumulate_grad_batches > 1:
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
                      restrict: Mapping[str, Iterable[int]], checkpointing: tuple[bool | str, ...],
                      schedules: tuple[str, ...], sequence_parallel: tuple[bool, ...] = (True, False),
                      reshard_after_forward: tuple[bool, ...] = (True, False), uneven_stages: bool = True,
                      ) -> tuple[list[Layout], dict[str, int]]:
    """The layouts the engine would accept; ``skipped`` counts the candidates left out, by reason."""
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
    vocab_parallel_head = "vocab_parallel_head" in {s for s in profile.tp_plan.values() if isinstance(s, str)}
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
        if dims["tp"] > 1 and (dims["tp"] > per_node or not _tp_ok(profile, dims["tp"], False)):
            skip("tp does not fit the model or a node")
            continue
        if dims["cp"] > 1 and (not has_attention or profile.seq_len % (2 * dims["cp"])):
            skip("sequence not divisible by 2 x cp")
            continue
        if batch_is_global and batch % dp:
            skip("global batch not divisible by dp")
            continue
        local = batch // dp if batch_is_global else batch
        sp_choices = [sp for sp in sequence_parallel if not sp or _tp_ok(profile, dims["tp"], True)]
        if dims["tp"] == 1 or not sp_choices:
            sp_choices = [False]
        sharded = dims["dp_shard"] * dims["cp"] > 1
        reshard_choices = reshard_after_forward if sharded else (True,)
        eps = _expert_splits(profile, dims["dp_shard"] * dims["cp"], allowed.get("ep"))
        if not eps:
            skip("restricted")
            continue
        for sp, ac, reshard, ep in product(sp_choices, checkpointing, reshard_choices, eps):
            lp = sp and vocab_parallel_head
            options = dict(dims, activation_checkpointing=ac, sequence_parallel=sp, loss_parallel=lp,
                           reshard_after_forward=reshard, ep=ep)
            if dims["pp"] == 1:
                out.append(Layout(**options))
                continue
            for schedule in schedules:
                if schedule in ("interleaved_zb", "zbv") and dims["dp_shard"] * dims["dp_replicate"] * dims["cp"] > 1:
                    skip("zero-bubble schedule with FSDP")
                    continue
                for v, m in product(_stages_per_rank(schedule, blocks, dims["pp"], uneven_stages),
                                    _microbatches(dims["pp"], local)):
                    try:
                        validate_pipeline(schedule, dims["pp"], m, blocks, v, local)
                    except ValueError:
                        skip("pipeline does not fit the blocks or the batch")
                        continue
                    # (built directly: ``dataclasses.replace`` costs a third of a second at 8,192 GPUs)
                    out.append(Layout(**options, pp_schedule=schedule, pp_microbatches=m, pp_stages_per_rank=v))
    return out, skipped


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


def _tp_ok(profile: ModelProfile, tp: int, sequence_parallel: bool) -> bool:
    """Whether the model's plan validates for ``tp`` (the engine's own check), cached on the profile."""
    key = (tp, sequence_parallel)
    if key not in profile.tp_checks:
        try:
            validate_tp_plan(profile.meta_module, profile.tp_source_plan, tp, sequence_parallel=sequence_parallel)
            profile.tp_checks[key] = bool(profile.tp_source_plan)
        except (ValueError, TypeError):
            profile.tp_checks[key] = False
    return profile.tp_checks[key]


def _no_layout_message(profile: ModelProfile, world_size: int, skipped: dict[str, int]) -> str:
    reasons = ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1]))
    return (f"No layout of {profile.name} fits a world of {world_size}: {reasons or 'no candidates'}. Choose a world "
            f"size whose factors the model allows (heads and widths divisible by tp, {len(profile.blocks)} blocks "
            f"for pp, sequence {profile.seq_len} divisible by 2 x cp, batch divisible by dp), or relax `restrict`.")



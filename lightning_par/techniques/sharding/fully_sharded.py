"""FSDP2 as a technique of the engine: the last step of the recipe, it shards whatever the earlier steps left."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_par.checks import check_bool, check_choice, check_str_list
from lightning_par.costs.sheet import CostSheet, Transfer, busiest_sections, per_cut
from lightning_par.dims import ParallelDims
from lightning_par.parallel.token_loss import LOSS_NORMALIZATIONS, TokenLoss, TokenMeanScope
from lightning_par.parallel.unused_parameters import UnusedParameterGuard
from lightning_par.techniques.sharding.fsdp import apply_fsdp, mark_accumulate_unsharded
from lightning_par.techniques.technique import Options, Target, Technique, planned

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


#: the mixed precisions and the half dtype FSDP gathers and computes in (it reduces in fp32)
MIXED_HALF_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

def fsdp_casts_parameters(dims: ParallelDims, cpu_offload: bool) -> bool:
    """Whether FSDP2 wraps the model in this layout, and so, under mixed precision, gathers its parameters in half
    precision (the whole forward then runs in it); otherwise the precision plugin's autocast alone lowers the
    matmul family (the planner prices the two apart: ``CostSheet.autocast_only``)."""
    return dims.fsdp_enabled or cpu_offload


@dataclass(frozen=True)
class FullyShardedOptions(Options):
    """FSDP2's options, under the names ``NDParallelStrategy`` takes them (the one source of their defaults;
    ``docs/strategies.md``'s option table names each)."""

    shard_units: list[str] | None = None
    reshard_after_forward: bool = planned(
        True, weigh=(True, False), flag="with FSDP: weigh resharding after forward (ZeRO-3) on, off (ZeRO-2-like) or "
        "both")
    #: the planner offloads where asked (``allow_offload``) or where nothing else fits
    cpu_offload: bool = planned(False)
    accumulate_unsharded: bool = planned(
        False, weigh=(False, True), flag="with FSDP and several micro-batches per step: weigh reducing gradients "
        "once per step (units kept gathered, gradients unsharded meanwhile) on, off or both (default)")
    loss_normalization: str = "mean"

    LEGEND = (
        (r"\boffload\b", "offload = FSDP state on the CPU"),
        (r"\bZeRO-2\b", "ZeRO-2 = FSDP without resharding after forward"),
        (r"\bZeRO-1\b", "ZeRO-1 = FSDP gathered and reduced once per step (reshard_after_forward=False, "
                        "accumulate_unsharded=True)"),
        (r"\breduce once\b", "reduce once = gradients reduced once per step (accumulate_unsharded=True)"),
    )

    def build(self) -> FullySharded:
        return FullySharded(self.shard_units, self.reshard_after_forward, self.cpu_offload, self.accumulate_unsharded,
                            self.loss_normalization)

    def label(self, dims: ParallelDims) -> list[str]:
        words = ["offload"] if self.cpu_offload else []
        if not self.reshard_after_forward:
            words.append("ZeRO-1" if self.accumulate_unsharded else "ZeRO-2")
        elif self.accumulate_unsharded:
            words.append("reduce once")
        return words

    # ---- what the planner weighs (``planner/search.py`` calls these in its order; ``judge(predictions)`` says
    # whether a twin could come near the fastest of them) ----
    @staticmethod
    def choices(sizes: Mapping[str, int], weighed: Mapping[str, tuple], profile: Any) -> list[dict[str, Any]]:
        """Resharding after forward as weighed where FSDP shards; where both are weighed, only on: the ZeRO-2-like
        layouts are the twins of those that could come near the fastest (``zero2_twins``)."""
        if sizes["dp_shard"] * sizes["cp"] == 1:
            return [{"reshard_after_forward": True}]
        given = weighed["reshard_after_forward"]
        return [{"reshard_after_forward": reshard} for reshard in ((True,) if len(given) == 2 else given)]

    @staticmethod
    def twins_weighed(weigh: Mapping[str, tuple]) -> tuple[bool, bool]:
        """Whether the ZeRO-2-like twins are weighed, and with them the ZeRO-1-like ones (reducing once is)."""
        return len(weigh["reshard_after_forward"]) == 2, True in weigh["accumulate_unsharded"]

    @staticmethod
    def zero2_twins(predictions: list, judge: Any, reduce_once: bool = True) -> list:
        """The ZeRO-2-like twin of every FSDP layout that, with all its exposed all-gather time gone (more than the
        twin saves: it still gathers before forward; exposed time is the rank's busy time, which a pipeline's
        bubble stretches by step / busy: ``judge.stretched``), could come near the fastest (``judge.near``); the
        twin keeps every unit gathered until its backward, so it needs more memory. With several micro-batches per
        step and ``reduce_once`` weighed, a layout that comes near only with its per-micro-batch reductions gone
        too gets the ZeRO-1-like twin instead (gathered once, reduced once: ``accumulate_unsharded``), where that
        could fit: else a pipeline whose reduce-scatters cost as much as its gathers would never reach its fastest
        variant."""
        out = []
        for p in predictions:
            if p.layout.dp_shard * p.layout.cp == 1 or p.layout.cpu_offload:
                continue
            gathers = p.comm_s.get("fsdp_all_gather", 0.0)
            reductions = p.comm_s.get("fsdp_reduce_scatter", 0.0)
            if judge.near(p, p.step_s - judge.stretched(p, gathers)):
                out.append(replace(p.layout, reshard_after_forward=False))
            elif (reduce_once and FullyShardedOptions.accumulates(p.layout) and judge.could_fit_without_buffers(p)
                  and judge.near(p, p.step_s - judge.stretched(p, gathers + reductions))):
                out.append(replace(p.layout, reshard_after_forward=False, accumulate_unsharded=True))
        return out

    @staticmethod
    def accumulates(layout: Any) -> bool:
        """Whether FSDP runs several micro-batches per step in this layout (whose reductions it could merge)."""
        return (layout.dp_replicate * layout.dp_shard * layout.cp > 1 and layout.microbatches > 1
                and not layout.cpu_offload and not layout.accumulate_unsharded)

    @staticmethod
    def reduce_once(predictions: list, weigh: Mapping[str, tuple], judge: Callable, run: Callable) -> list:
        """Reducing once per step: everywhere FSDP accumulates (weighed ``(True,)``), or the twins of the layouts
        that could come near the fastest (``reduce_once_twins``)."""
        if weigh["accumulate_unsharded"] == (True,):
            return run([replace(p.layout, accumulate_unsharded=True) if FullyShardedOptions.accumulates(p.layout)
                        else p.layout for p in predictions])
        if len(weigh["accumulate_unsharded"]) == 2:
            return predictions + run(FullyShardedOptions.reduce_once_twins(predictions, judge(predictions)))
        return predictions

    @staticmethod
    def reduce_once_twins(predictions: list, judge: Any) -> list:
        """The ``accumulate_unsharded`` twin of every FSDP layout with several micro-batches per step that, with
        all its exposed FSDP time gone (more than the twin saves: it still gathers and reduces once), could come
        near the fastest; the twin holds every unit gathered and its unsharded gradients, so it needs more
        memory."""
        out = []
        for p in predictions:
            if not FullyShardedOptions.accumulates(p.layout) or not judge.could_fit_without_buffers(p):
                continue
            fsdp = p.comm_s.get("fsdp_all_gather", 0.0) + p.comm_s.get("fsdp_reduce_scatter", 0.0)
            if judge.near(p, p.step_s - judge.stretched(p, fsdp)):
                out.append(replace(p.layout, accumulate_unsharded=True))
        return out

    @staticmethod
    def offloads(layout: Any) -> bool:
        """Whether the layout keeps FSDP's state on the CPU (the planner weighs no other variants of it)."""
        return layout.cpu_offload

    @staticmethod
    def offloaded(layouts: list) -> list:
        """The CPU-offload variant of every layout that shards or replicates its state."""
        return [replace(layout, cpu_offload=True) for layout in layouts
                if layout.dp_shard * layout.dp_replicate * layout.cp > 1]


class FullySharded(Technique):
    """``fully_shard`` of each shard unit, then of the root, over ``dp_shard x cp`` (HSDP with ``dp_replicate``).

    On whenever several ranks hold the same weights (data or context parallel). Under pipeline parallelism every
    module a stage runs is its own root: the LightningModule, whose forward is not what runs the stages, cannot be.

    The loss's normalization across the ranks whose gradients FSDP averages is decided here too
    (``loss_normalization``): each rank's own mean (``"mean"``, DDP's convention), or with ``"tokens"`` one mean over
    the counted tokens of every ``dp_cp`` rank and of every micro-batch of a gradient accumulation
    (``parallel/token_loss``), entered around each step.
    """

    def __init__(self, shard_units: list[str] | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, accumulate_unsharded: bool = False,
                 loss_normalization: str = "mean") -> None:
        self.shard_units = check_str_list("shard_units", shard_units, "class names or FQN globs",
                                          ["Block", "model.blocks.*"])
        self.reshard_after_forward = check_bool("reshard_after_forward", reshard_after_forward)
        self.cpu_offload = check_bool("cpu_offload", cpu_offload)
        self.accumulate_unsharded = check_bool("accumulate_unsharded", accumulate_unsharded)
        if self.accumulate_unsharded and self.cpu_offload:
            raise ValueError("accumulate_unsharded=True with cpu_offload=True: keeping every unit gathered and its "
                             "gradients unsharded on the device between micro-batches undoes what offloading saves. "
                             "Choose one: accumulate_unsharded=False to offload, or cpu_offload=False.")
        self.loss_normalization = check_choice("loss_normalization", loss_normalization, LOSS_NORMALIZATIONS)
        self.unused_parameters: UnusedParameterGuard | None = None  # set by apply
        self.token_loss: TokenLoss | None = None  # loss_normalization="tokens", set by setup_environment

    def setup_environment(self, dims: ParallelDims) -> None:
        if self.loss_normalization == "tokens":
            group = dims.mesh("dp_cp").get_group() if dims.mesh_size("dp_cp") > 1 else None
            self.token_loss = TokenLoss(group)

    def step_context(self, dims: ParallelDims) -> AbstractContextManager | None:
        """With ``loss_normalization="tokens"``: every mean cross-entropy inside a step is one over the global
        count (innermost: it answers before context parallelism's count over the cp ranks)."""
        return None if self.token_loss is None else TokenMeanScope(self.token_loss)

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if not fsdp_casts_parameters(dims, self.cpu_offload):  # one rank: nothing to shard, unless offloading
            if self.shard_units is not None or target.block_list is not None:
                target.units(self.shard_units)  # resolved even when off: a bad pattern fails in every layout
            return
        units = self._units(target)
        half = MIXED_HALF_DTYPES.get(target.precision)
        if target.experts:  # first: children before the blocks that hold them
            shard_experts(target, dims, reshard_after_forward=self.reshard_after_forward, param_dtype=half,
                          cpu_offload=self.cpu_offload)
        # mixed precision: half-precision all-gathers, fp32 reductions and master weights
        self.unused_parameters = apply_fsdp(
            target.fsdp_root,
            dims.fsdp_mesh(),
            [target.module.get_submodule(fqn) for fqn in units],
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=half,
            reduce_dtype=torch.float32 if half is not None else None,
            cpu_offload=self.cpu_offload,
        )
        if target.fsdp_root is not None:
            register_step_methods(target.fsdp_root)
        if self.accumulate_unsharded:
            mark_accumulate_unsharded(target.module)

    def casts_parameters(self, dims: ParallelDims) -> bool:
        """Whether this technique wraps the model in ``dims`` (``fsdp_casts_parameters``)."""
        return fsdp_casts_parameters(dims, self.cpu_offload)

    def _units(self, target: Target) -> list[str]:
        """The shard units; a model without a list of blocks (and no ``shard_units``) is one unit, the root, as
        under Lightning's FSDP with no wrap policy: it trains, it only gathers all its parameters at once."""
        if self.shard_units is not None or target.keep is not None or target.block_list is not None:
            return target.units(self.shard_units)
        try:
            return target.blocks
        except ValueError as e:
            if target.fsdp_root is None:
                raise
            warnings.warn(f"FSDP2 shards the whole model as one unit: {e}", stacklevel=2)
            return []

    def describe(self, dims: ParallelDims) -> str | None:
        if not dims.fsdp_enabled:
            return None
        if self.accumulate_unsharded:
            zero = ("ZeRO-1-like: gathered and reduced once per step" if not self.reshard_after_forward
                    else "ZeRO-3, gradients reduced once per step")
        else:
            zero = "ZeRO-3" if self.reshard_after_forward else "ZeRO-2-like"
        return (f"FSDP2 ({zero}{', HSDP' if dims.dp_replicate > 1 else ''}"
                f"{', CPU offload' if self.cpu_offload else ''})")


    def account(self, sheet: CostSheet) -> None:
        """Parameters, gradients and optimizer state split over ``dp_shard x cp``; per unit an all-gather before
        forward (and again before backward when resharding after forward) and a reduce-scatter of its gradients
        after backward; HSDP adds an all-reduce of the gradient shards across replicas. Under a pipeline schedule
        (torch's ``PipelineStage``) the gradients are reduced once per step, after the last micro-batch, and a
        unit stays gathered from a micro-batch's backward to the next forward: one all-gather per micro-batch and
        one more. Prefetching hides them behind compute; the gathered units are extra device memory: two in
        flight, or every unit from its forward to its backward without resharding after forward.

        By default each micro-batch (of the pipeline's schedule, or of gradient accumulation) gathers and reduces
        as a step of its own. With ``accumulate_unsharded`` the units keep their gradients unsharded and stay
        gathered from one micro-batch's backward to the next forward, as torch's schedules do for a stage that is
        an FSDP module: one reduce-scatter per step, and one all-gather per micro-batch and one more (one in all
        without resharding after forward); every unit gathered at the peak, with the unsharded gradients (in the
        master weights' dtype) it accumulates."""
        dims = sheet.dims
        if not dims.fsdp_enabled:
            return
        sheet.shard = dims.dp_shard * dims.cp
        sheet.offload = self.cpu_offload
        counted, whole_bytes, largest = _units(sheet)
        m = sheet.microbatches
        accumulating = self.accumulate_unsharded and m > 1
        if accumulating:
            gathers, scatters = (m + 1 if self.reshard_after_forward else 1), 1
        else:
            gathers, scatters = m * (2 if self.reshard_after_forward else 1), m
        # units of one size (the blocks) are one Transfer with their counts summed: the same time, and planning
        # thousands of layouts of a 126-block model does not build a message per block
        # under ep each experts module is a unit of its own, of this rank's experts, sharded over efsdp
        for group, equal_units in zip(("dp_shard_cp", "efsdp"), counted):
            if not equal_units:
                continue
            size = dims.mesh_size(group)
            if size > 1:
                float8 = _float8_elements(sheet) if sheet.float8_gathers and group == "dp_shard_cp" else {}
                for nbytes, k in equal_units:
                    # float8 all-gathers (torchao's, on GPUs): the converted weights travel as 1 byte an element
                    wire = nbytes * sheet.gather_scale - float8.get(nbytes, 0.0) * (
                        sheet.profile.dtype.itemsize * sheet.gather_scale - 1)
                    sheet.transfers.append(Transfer("fsdp_all_gather", group, "all_gather", wire, gathers * k,
                                                    True))
                    sheet.transfers.append(Transfer("fsdp_reduce_scatter", group, "reduce_scatter",
                                                    nbytes * sheet.reduce_scale, scatters * k, True))
            if dims.dp_replicate > 1:
                for nbytes, k in equal_units:
                    sheet.transfers.append(Transfer("fsdp_reduce_scatter", "dp_replicate", "all_reduce",
                                                    nbytes * sheet.reduce_scale / size, scatters * k, True))
        gathered, largest = whole_bytes * sheet.gather_scale, largest * sheet.gather_scale  # bf16-mixed: bf16 copies
        if accumulating:  # kept gathered, and the gradients unsharded, from micro-batch to micro-batch
            # the unsharded gradients beyond the shards the state counts already
            sheet.buffer_bytes += gathered + trainable_unit_bytes(sheet) * (1 - 1 / sheet.shard)
        elif self.reshard_after_forward:
            sheet.buffer_bytes += 2 * largest
        else:  # each unit stays whole from its forward to its backward: all of them at the peak
            sheet.buffer_bytes += gathered


def shard_experts(target: Target, dims: ParallelDims, *, reshard_after_forward: bool, param_dtype: torch.dtype | None,
                  cpu_offload: bool) -> None:
    """Each expert-parallel module is an FSDP unit of its own over the experts' FSDP mesh (``efsdp``, the data ranks
    outside its expert group; a mesh of one rank too, which keeps its parameters out of the block's unit). FSDP
    averages their gradients over that mesh; the dispatch has already divided them by ``ep``."""
    for fqn in target.experts:
        module = target.module.get_submodule(fqn)
        apply_fsdp(None, dims.expert_fsdp_mesh(), [module], reshard_after_forward=reshard_after_forward,
                   param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None,
                   cpu_offload=cpu_offload, keep_last_gathered=False)


def _units(sheet: CostSheet) -> tuple[tuple[tuple[tuple[float, int], ...], ...], float, float]:
    """Of ``unit_bytes``: the units of each group (the blocks', the experts') counted by size, the bytes of all of
    them and of the largest; worked out once per pipeline cut and sizes."""
    ep = sheet.dims.ep if sheet.profile.num_experts else 1

    def compute() -> tuple:
        units, expert_units = unit_bytes(sheet)
        return (tuple(tuple(Counter(u).items()) for u in (units, expert_units)), sum(units) + sum(expert_units),
                max(units + expert_units, default=0.0))

    return per_cut(sheet, ("fsdp_units", sheet.tp, ep), compute)


def unit_bytes(sheet: CostSheet) -> tuple[list[float], list[float]]:
    """Bytes of each FSDP unit on the busiest pipeline rank, whole (before sharding), after tensor parallelism:
    every block it runs, and the root (what it runs outside the blocks); and under expert parallelism, apart, each
    block's experts on this rank (``1 / ep`` of them, a unit of their own)."""
    per_section, experts = _section_units(sheet)
    ep = sheet.dims.ep if sheet.profile.num_experts else 1
    root = per_section.pop("first", 0.0) + per_section.pop("last", 0.0)
    return [*per_section.values(), *([root] if root else [])], [n / ep for n in experts.values() if n]


def _section_units(sheet: CostSheet) -> tuple[dict[str, float], dict[str, float]]:
    """Per section of the busiest pipeline rank: the bytes of its unit after tensor parallelism, its experts
    apart (their bytes before ep splits them; none without ep)."""
    sizes = section_bytes(sheet.profile)
    ep = sheet.dims.ep if sheet.profile.num_experts else 1
    busiest = busiest_sections(sheet)
    held = sheet.profile.expert_tp_share(sheet.tp)
    experts = {s: sizes[s][2] * held for s in busiest if s in sizes} if ep > 1 else {}
    return ({s: sizes[s][0] / sheet.tp + sizes[s][1] - experts.get(s, 0.0) for s in busiest if s in sizes},
            experts)


def _float8_elements(sheet: CostSheet) -> dict[float, float]:
    """Block unit bytes -> the elements of its weights float8 converts (after tensor parallelism): what its
    float8 all-gather sends at 1 byte an element (the blocks of one size convert alike)."""
    def compute() -> dict[float, float]:
        per_section, _ = _section_units(sheet)
        return {nbytes: sheet.profile.sections[s].float8_weight_elements / sheet.tp
                for s, nbytes in per_section.items() if s not in ("first", "last")}

    ep = sheet.dims.ep if sheet.profile.num_experts else 1
    return per_cut(sheet, ("float8_units", sheet.tp, ep), compute)


def trainable_unit_bytes(sheet: CostSheet) -> float:
    """Bytes of the trainable parameters the busiest pipeline rank holds whole (after tensor parallelism, its
    ``1 / ep`` of the experts): the unsharded gradients FSDP accumulates while it does not reduce."""
    sizes = section_bytes(sheet.profile, trainable_only=True)
    ep = sheet.dims.ep if sheet.profile.num_experts else 1

    def compute() -> float:
        total = 0.0
        for s in set(busiest_sections(sheet)):
            split, whole, experts = sizes.get(s, (0.0, 0.0, 0.0))
            experts *= sheet.profile.expert_tp_share(sheet.tp)
            total += split / sheet.tp + whole - experts + experts / ep
        return total

    return per_cut(sheet, ("trainable_units", sheet.tp, ep), compute)


def section_bytes(profile: Any, trainable_only: bool = False) -> dict[str, tuple[float, float, float]]:
    """Per section of the profile: (bytes tensor parallelism splits, bytes it leaves whole, of the latter the
    experts'), of every parameter or the trainable ones only, computed once."""
    cache = profile.__dict__.setdefault("_section_bytes", {}).setdefault(trainable_only, {})
    if not cache:
        for p in profile.params:
            if trainable_only and not p.trainable:
                continue
            split, whole, experts = cache.get(p.section, (0.0, 0.0, 0.0))
            nbytes = p.numel * p.itemsize
            experts += nbytes if p.expert else 0.0
            cache[p.section] = (split + nbytes, whole, experts) if p.tp_dim is not None else (split, whole + nbytes,
                                                                                           experts)
    return cache


def register_step_methods(module: nn.Module) -> None:
    """Lightning calls ``training_step`` etc., not ``forward``: FSDP's root hooks must run around them."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in _STEP_METHODS:
        if hasattr(module, name):
            register_fsdp_forward_method(module, name)

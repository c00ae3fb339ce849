"""Pipeline parallelism as a technique of the engine: first in the recipe, it keeps only this rank's stages and
narrows what every later technique acts on; while training, a step's forward and backward run inside the schedule
(``techniques/pipeline/pipeline_adapter``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Any

import torch
from torch import nn

from lightning_par.checks import check_identifier, check_positive_int, check_str_list
from lightning_par.costs.sheet import CostSheet, Transfer
from lightning_par.dims import ParallelDims
from lightning_par.parallel.token_loss import TokenLoss
from lightning_par.techniques.pipeline.pipeline import SCHEDULES, even_cut, stage_ids, validate_pipeline
from lightning_par.techniques.pipeline.pipeline_adapter import PipelineAdapter
from lightning_par.techniques.pipeline.pipeline_live import LivePipeline, materialize_local
from lightning_par.techniques.technique import Options, Target, Technique, planned

ZERO_BUBBLE = ("interleaved_zb", "zbv")


@dataclass(frozen=True)
class PipelineOptions(Options):
    """Pipeline parallelism's options, under the names ``NDParallelStrategy`` takes them (the one source of their
    defaults; ``docs/strategies.md``'s option table names each)."""

    # the planner decides the schedule, its micro-batches and stages per rank, and cuts the blocks evenly
    pp_schedule: str = planned("1f1b")
    pp_microbatches: int | None = planned(None)
    pp_stages_per_rank: int | None = planned(None)
    pp_split_points: list[str] | None = planned(None)
    pp_loss_method: str = "loss"

    LEGEND = (
        (r"\bpp\d", "the name before vN or mM is the pipeline schedule (pp_schedule)"),
        (r" v\d+ m\d+", "vN mM = N pipeline stages per rank, M micro-batches per step"),
        (r"(?<! v\d)(?<! v\d\d) m\d+", "mM = M pipeline micro-batches per step (the schedule's own stages per rank: "
                                        "2 for the interleaved ones)"),
    )

    def label(self, dims: ParallelDims) -> list[str]:
        if dims.pp == 1:
            return []
        stages = f" v{self.pp_stages_per_rank}" if self.pp_stages_per_rank is not None else ""
        return [f"{self.pp_schedule}{stages} m{self.pp_microbatches}"]

    def layout_kwargs(self, dims: ParallelDims) -> dict[str, Any]:
        """Under a pipeline, its schedule and micro-batches, whatever their values (and the stages per rank where
        not the schedule's own); nothing without one."""
        if dims.pp == 1:
            return {}
        out = {"pp_schedule": self.pp_schedule, "pp_microbatches": self.pp_microbatches}
        if self.pp_stages_per_rank is not None:
            out["pp_stages_per_rank"] = self.pp_stages_per_rank
        return out

    def step_microbatches(self, pp: int) -> int:
        """Micro-batches per step under a pipeline of ``pp`` stages (without ``pp_microbatches``: one per stage)."""
        return self.pp_microbatches or pp

    @staticmethod
    def shapes(schedules: tuple[str, ...], blocks: int, pp: int, data_ranks: int, local_batch: int,
                uneven: bool, stages_per_rank: Callable, microbatches: Callable,
                skip: Callable[[str], None]) -> list[dict[str, Any]]:
        """The pipeline options the planner weighs for ``pp`` stages: each schedule with the stages per rank and
        micro-batch counts ``stages_per_rank`` and ``microbatches`` give, those the engine accepts (``skip``
        counts the others, by reason)."""
        out = []
        for schedule in schedules:
            if schedule in ZERO_BUBBLE and data_ranks > 1:
                skip("zero-bubble schedule with FSDP")
                continue
            for v, m in product(stages_per_rank(schedule, blocks, pp, uneven), microbatches(pp, local_batch)):
                try:
                    validate_pipeline(schedule, pp, m, blocks, v, local_batch)
                except ValueError:
                    skip("pipeline does not fit the blocks or the batch")
                    continue
                out.append({"pp_schedule": schedule, "pp_microbatches": m, "pp_stages_per_rank": v})
        return out

    def build(self) -> PipelineParallel:
        return PipelineParallel(self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank,
                                self.pp_split_points, self.pp_loss_method)


class PipelineParallel(Technique):
    def __init__(self, schedule: str = "1f1b", microbatches: int | None = None, stages_per_rank: int | None = None,
                 split_points: list[str] | None = None, loss_method: str = "loss") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={schedule!r} is not a pipeline schedule; choose one of "
                             f"{sorted(SCHEDULES)}.")
        self.schedule = schedule
        self.microbatches = check_positive_int("pp_microbatches", microbatches, allow_none=True)
        self.stages_per_rank = check_positive_int("pp_stages_per_rank", stages_per_rank, allow_none=True)
        self.split_points = check_str_list("pp_split_points", split_points, "block FQNs", ["model.blocks.2"])
        self.loss_method = check_identifier("pp_loss_method", loss_method, "a method of the LightningModule")
        self.pipeline: LivePipeline | None = None
        self.adapter: PipelineAdapter | None = None
        self.token_loss: TokenLoss | None = None  # whose ranks a batch's count of tokens spans (setup_environment)

    def check(self, dims: ParallelDims) -> None:
        if dims.resolved and dims.pp > 1 and dims.fsdp_enabled and self.schedule in ZERO_BUBBLE:
            raise ValueError(
                f"pp_schedule={self.schedule!r} with dp_shard={dims.dp_shard}, dp_replicate={dims.dp_replicate}: "
                f"zero-bubble schedules compute weight gradients apart from input gradients, which FSDP's sharded "
                f"parameters do not support (torch 2.13). With data parallelism use pp_schedule='1f1b' or "
                f"'interleaved_1f1b'; or use dp_shard=1 and dp_replicate=1.")

    def setup_environment(self, dims: ParallelDims) -> None:
        """A batch's tokens are counted over the cp ranks (a sequence split over them is one sequence); the engine
        widens that to the data-parallel ranks with ``loss_normalization="tokens"`` (:meth:`count_tokens_with`)."""
        if dims.pp > 1:
            self.token_loss = TokenLoss(dims.mesh("cp").get_group() if dims.cp > 1 else None)

    def count_tokens_with(self, token_loss: TokenLoss | None) -> None:
        if token_loss is not None and self.token_loss is not None:
            self.token_loss = token_loss

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if dims.pp == 1:
            return
        module = target.module
        pp_mesh = dims.mesh("pp")
        self.pipeline = LivePipeline(
            module, schedule=self.schedule, pp_rank=pp_mesh.get_local_rank(), pp=dims.pp,
            n_microbatches=self.microbatches, group=pp_mesh.get_group(), device=target.device,
            stages_per_rank=self.stages_per_rank, split_points=self.split_points, block_list=target.block_list,
            share=(getattr(module, "_trainer", None), getattr(module, "device_mesh", None)))
        assert self.token_loss is not None  # setup_environment ran
        self.adapter = PipelineAdapter(module, self.pipeline, self.loss_method, self.token_loss)
        materialize_local(module, self.pipeline.plan, self.pipeline.stage_ids, target.device,
                          seed=torch.initial_seed())
        local = [name for owners in self.pipeline.local_owners for name in owners]
        blocks = [name for name in local if name in set(self.pipeline.plan.blocks)]
        target.narrow(keep=local, blocks=blocks, whole=self.pipeline.template)

    @contextmanager
    def training_step_context(self, module: nn.Module) -> Iterator[None]:
        """Around Lightning's ``training_step``: the schedule runs forward and backward inside it."""
        if self.adapter is None:
            yield
            return
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches
        first = trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0  # Lightning's own zero_grad rule
        self.adapter.begin_training_step(accumulate, first)
        try:
            yield
        except BaseException:
            self.adapter.abort_training_step()
            raise
        self.adapter.end_training_step()

    def describe(self, dims: ParallelDims) -> str | None:
        p = self.pipeline
        if p is None:
            return None
        return (f"pipeline ({p.name}, {p.n_microbatches} micro-batches, {p.plan.num_stages} stages, split before "
                f"{p.plan.split_points})")

    def describe_rank(self) -> str:
        if self.pipeline is None:
            return ""
        blocks = [name.rpartition(".")[2] for owners in self.pipeline.local_owners for name in owners
                  if name in self.pipeline.plan.blocks]
        return f"stages {self.pipeline.stage_ids} (blocks {', '.join(blocks)})"

    def account(self, sheet: CostSheet) -> None:
        """Which sections each pp rank runs (the blocks cut evenly, the first stage also runs what comes before them,
        the last what comes after), how many micro-batches' activations each holds at once under the schedule, the
        schedule's bubble, and the stage-to-stage sends (activations forward, their gradients backward)."""
        blocks = sheet.profile.blocks
        p = sheet.dims.pp
        if p == 1:  # sheet.microbatches: gradient accumulation's, one micro-batch's activations at a time
            sheet.rank_sections, sheet.inflight = whole_model(tuple(blocks)), (1.0,)
            return
        v = SCHEDULES[self.schedule].stages_per_rank or self.stages_per_rank or 2
        m = self.microbatches or p * v
        sheet.microbatches = m
        sheet.split_backward = self.schedule in ZERO_BUBBLE
        sheet.rank_sections, sheet.inflight, sheet.bubble, boundaries = pipeline_shape(self.schedule, tuple(blocks),
                                                                                       p, v, m)
        # the residual stream: in half precision where FSDP casts the parameters, in the traced dtype under autocast
        # alone (its adds take the fp32 embedding's dtype)
        scale = 1.0 if sheet.autocast_only else sheet.activation_scale
        activation = sheet.microbatch_tokens * sheet.profile.hidden_bytes * scale
        sheet.transfers.append(Transfer("pp_send_recv", "pp", "send_recv", activation, 2 * boundaries * m, False))

    def restore_gradients(self) -> None:
        """In the strategy's ``backward``: hand back the gradients the schedule computed inside training_step."""
        assert self.adapter is not None
        self.adapter.restore_gradients()


@lru_cache(maxsize=64)
def whole_model(blocks: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The one rank's sections without a pipeline, shared by every such layout (see ``pipeline_shape``)."""
    return (("first", *blocks, "last"),)


@lru_cache(maxsize=4096)
def pipeline_shape(schedule: str, blocks: tuple[str, ...], pp: int, v: int,
                   m: int) -> tuple[tuple[tuple[str, ...], ...], tuple[float, ...], float, int]:
    """(the sections each pp rank runs, the micro-batches' activations each holds at once, the bubble, the stage
    boundaries the busiest rank sends across) of one pipeline shape. The same for every layout of that shape, so
    worked out once (tuples: shared): a plan at thousands of GPUs asks it for tens of thousands of layouts."""
    stages = even_cut(list(blocks), pp * v)
    style = SCHEDULES[schedule].style
    # the warm-up and cool-down take (pp - 1) of the largest stage's turns: where the blocks do not cut evenly,
    # more than (pp - 1) / v of a rank's work (the bubble as if each rank ran busiest / largest equal stages)
    largest = max(len(s) for s in stages)
    busiest = max(sum(len(stages[sid]) for sid in stage_ids(r, pp, v, style)) for r in range(pp))
    stages[0].insert(0, "first")
    stages[-1].append("last")
    rank_sections = tuple(tuple(s for sid in stage_ids(r, pp, v, style) for s in stages[sid]) for r in range(pp))
    inflight = tuple(in_flight(schedule, r, pp, v, m) for r in range(pp))
    boundaries = max(sum(sid < pp * v - 1 for sid in stage_ids(r, pp, v, style)) for r in range(pp))
    return rank_sections, inflight, bubble_fraction(schedule, pp, busiest / largest, m), boundaries


def in_flight(schedule: str, rank: int, pp: int, v: int, m: int) -> float:
    """Micro-batches whose activations ``rank`` holds at once, in units of all its stages' activations of one
    micro-batch: GPipe keeps all m; 1F1B at most pp - rank (the warm-up); the interleaved and zero-bubble
    schedules run (v - 1) * pp + 2 * (pp - 1 - rank) stage-chunks ahead (torch's warm-up), out of m * v."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)
    return chunks / v


def bubble_fraction(schedule: str, pp: int, v: float, m: int) -> float:
    """Share of the step a rank waits, textbook: (p - 1) / (m + p - 1) for GPipe and 1F1B, the interleaved
    schedule divides the warm-up by v (its stages per rank, where they are equal), the zero-bubble ones fill most
    of the rest with weight gradients (a third of 1F1B's, the figure of their paper for a schedule whose weight
    and input gradients cost alike)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    interleaved = ((pp - 1) / v) / (m + (pp - 1) / v)
    return interleaved if schedule == "interleaved_1f1b" else interleaved / 3

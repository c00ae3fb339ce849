"""Pipeline parallelism, the plain torch.distributed parts: schedules, layout checks, the split, the trace.

1. :func:`validate_pipeline` checks the layout (schedule name, stages, micro-batches, batch size) before anything
   is traced or sent, so a bad configuration fails on every rank alike with a ``ValueError`` that says the fix.
2. :func:`plan_split` cuts the block list evenly (or at the user's split points).
3. :func:`trace_pipeline` traces a *meta* clone of the model with torch's frontend
   (``torch.distributed.pipelining.pipeline`` + ``SplitPoint.BEGINNING`` at the first block of each stage). Tracing
   rather than module surgery because the split must work on a model whose ``forward`` we do not control: surgery
   (keep this stage's blocks, replace the others) only works when ``forward`` tolerates missing modules, and the
   GPT's ``tok_emb(idx) + pos_emb(pos)`` does not (a middle stage would embed hidden states). The tracer keeps the
   original parameter FQNs (``blocks.3.attn.q.weight`` stays that), which :func:`stage_fqns` checks.
4. :func:`build_schedule` picks the torch schedule by name.

:class:`lightning_par.techniques.pipeline.pipeline_live.LivePipeline` puts these together over the model's own modules.
Limits of the tracer: ``forward`` must be capturable by ``torch.export`` (no data-dependent control flow), and
parameters shared between stages (tied embeddings across stages) are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    SplitPoint,
    pipeline,
)
from torch.distributed.pipelining._IR import Pipe

from lightning_par.parallel.init import initialize
from lightning_par.parallel.modules import find_block_list


@dataclass(frozen=True)
class ScheduleSpec:
    cls: type
    stages_per_rank: int | None  # None: several, chosen by the user (default 2)
    style: str  # "loop": rank r holds stages r, r+pp, ...; "v": rank r holds r and 2*pp-1-r


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(ScheduleGPipe, 1, "loop"),
    "1f1b": ScheduleSpec(Schedule1F1B, 1, "loop"),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, None, "loop"),
    "interleaved_zb": ScheduleSpec(ScheduleInterleavedZeroBubble, None, "loop"),
    "zbv": ScheduleSpec(ScheduleZBVZeroBubble, 2, "v"),
}


def validate_pipeline(schedule: str, pp: int, n_microbatches: int, num_blocks: int,
                      stages_per_rank: int | None = None, batch_size: int | None = None) -> int:
    """Check a pipeline layout without touching the model or the network; return ``stages_per_rank``.

    Mirrors the requirements of torch 2.13's schedules so that they fail here, with the fix spelled out, instead
    of inside a schedule after some ranks have started talking.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; choose one of {sorted(SCHEDULES)}.")
    spec = SCHEDULES[schedule]
    for name, value in (("pp", pp), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int.")
    if stages_per_rank is None:
        stages_per_rank = spec.stages_per_rank or 2
    elif spec.stages_per_rank is not None and stages_per_rank != spec.stages_per_rank:
        raise ValueError(f"stages_per_rank={stages_per_rank} does not fit schedule={schedule!r}, which runs exactly "
                         f"{spec.stages_per_rank} stage(s) per rank; leave stages_per_rank unset.")
    elif stages_per_rank < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank} must be >= 1 (2 is the usual interleaving).")
    num_stages = pp * stages_per_rank
    if num_stages > num_blocks:
        per_rank = f" x {stages_per_rank} stages per rank (schedule={schedule!r})" if stages_per_rank > 1 else ""
        raise ValueError(
            f"pp={pp}{per_rank} needs {num_stages} stages but the model has only {num_blocks} blocks (a stage holds "
            f"at least one block). Use pp <= {num_blocks // stages_per_rank}"
            + (", fewer stages_per_rank, or a one-stage-per-rank schedule ('gpipe', '1f1b')" if stages_per_rank > 1
               else "") + ", or a model with more blocks.")
    if schedule == "1f1b" and n_microbatches < num_stages:
        raise ValueError(f"n_microbatches={n_microbatches}: schedule '1f1b' needs at least as many micro-batches as "
                         f"stages ({num_stages}). Use n_microbatches >= {num_stages}, or 'gpipe' for fewer.")
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, n_microbatches // pp)  # torch 2.13's flexible interleaving: micro-batches in equal rounds
        if n_microbatches % rounds != 0:
            raise ValueError(
                f"n_microbatches={n_microbatches}: schedule {schedule!r} runs micro-batches in rounds of pp={pp} "
                f"({rounds} rounds here) and needs n_microbatches divisible by the number of rounds. Use "
                f"n_microbatches <= {pp} or a multiple of {pp}.")
    if batch_size is not None and batch_size % n_microbatches != 0:
        raise ValueError(f"batch size {batch_size} is not divisible by n_microbatches={n_microbatches}. Use a batch "
                         f"size that is a multiple of {n_microbatches}, or a micro-batch count that divides "
                         f"{batch_size}.")
    return stages_per_rank


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, style: str = "loop") -> list[int]:
    """The stages a rank holds: round-robin ("loop", interleaved) or V-shape ("v", ZBV: the first and the last
    stage on rank 0, so the turn of the V stays local)."""
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def block_fqns(model: nn.Module, block_list: str | None = None) -> tuple[str, list[str]]:
    """The block list's FQN and its blocks' FQNs: the only places the pipeline may cut."""
    try:
        block_fqn, container = find_block_list(model, block_list)
    except ValueError as e:
        raise ValueError(f"pipeline parallelism cuts {type(model).__name__} between the blocks of its block list, "
                         f"and none was found: {e} For the pipeline, pass `block_list='<dotted name of the "
                         f"nn.ModuleList of blocks>'` (e.g. 'model.layers').") from None
    return block_fqn, [f"{block_fqn}.{name}" for name in container._modules]


def even_cut(items: Sequence[str], parts: int) -> list[list[str]]:
    """``items`` in ``parts`` consecutive runs as even as can be, the first runs taking the remainder."""
    base, extra = divmod(len(items), parts)
    out, i = [], 0
    for k in range(parts):
        n = base + (1 if k < extra else 0)
        out.append(list(items[i:i + n]))
        i += n
    return out


def plan_split(model: nn.Module, num_stages: int, split_points: Sequence[str] | None = None,
               block_list: str | None = None) -> list[str]:
    """FQNs of the blocks that begin stages 1..S-1: an even cut of the block list (the first stages take the
    remainder), or the given ``split_points`` checked against it."""
    block_fqn, blocks = block_fqns(model, block_list)
    if num_stages > len(blocks):
        raise ValueError(f"num_stages={num_stages} is more than the {len(blocks)} blocks of {block_fqn!r}; "
                         f"use at most {len(blocks)} stages.")
    if split_points is None:
        return [stage[0] for stage in even_cut(blocks, num_stages)[1:]]
    split_points = list(split_points)
    if len(split_points) != num_stages - 1:
        raise ValueError(f"split_points={split_points} gives {len(split_points) + 1} stages, but the layout needs "
                         f"{num_stages}; give {num_stages - 1} block FQNs, each the first block of a stage.")
    bad = [p for p in split_points if p not in blocks[1:]]
    if bad:
        raise ValueError(f"split_points: {bad} are not blocks of {block_fqn!r} (other than the first); give FQNs "
                         f"such as {blocks[len(blocks) // 2]!r}.")
    if [blocks.index(p) for p in split_points] != sorted({blocks.index(p) for p in split_points}):
        raise ValueError(f"split_points={split_points} must be distinct and in model order.")
    return split_points


def meta_clone(model: nn.Module, share: Sequence[Any] = ()) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device: free to trace and to mutate
    (``pipeline()`` patches the forward of the split modules in place). Objects in ``share`` are referenced, not
    copied (e.g. the Trainer a LightningModule points to)."""
    memo: dict[int, Any] = {id(obj): obj for obj in share if obj is not None}
    for t in list(model.parameters()) + list(model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def trace_pipeline(model: nn.Module, example_args: tuple[Any, ...], split_points: Sequence[str]) -> Pipe:
    """Trace a meta clone of ``model`` on one micro-batch's inputs and cut it before each split point."""
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in example_args)
    pipe = pipeline(meta_clone(model), mb_args=meta_args,
                    split_spec={fqn: SplitPoint.BEGINNING for fqn in split_points})
    _check_stage_dataflow(pipe)
    return pipe


def _check_stage_dataflow(pipe: Pipe) -> None:
    """``PipelineStage`` feeds stage i's outputs, in order, to stage i+1: refuse graphs where a stage reads a
    value from further back (e.g. a mask made by the embeddings and used by every block)."""
    produced: dict[torch.fx.Node, int] = {}
    for node in pipe.split_gm.graph.nodes:
        if node.op == "placeholder":
            produced[node] = -1
        elif node.op == "call_module" and str(node.target).startswith("submod_"):
            i = int(str(node.target).rpartition("_")[2])  # submod_pp_3 (the name differs between torch versions)
            sources = [produced.get(n) for n in node.args if isinstance(n, torch.fx.Node)]
            ordered = [n.args[1] for n in node.args if isinstance(n, torch.fx.Node) and n.op == "call_function"]
            if any(s != i - 1 for s in sources) or ordered != sorted(ordered):
                raise ValueError(
                    f"stage {i} reads values that stage {i - 1} does not hand on in order (sources {sources}); the "
                    f"model's forward passes a tensor past a stage boundary. Pass it through every block instead, "
                    f"or choose split points that do not cross it.")
            produced[node] = i
        elif node.op != "output":
            srcs = [produced[n] for n in node.all_input_nodes if n in produced]
            produced[node] = max(srcs) if srcs else -1


def stage_fqns(pipe: Pipe, model: nn.Module) -> list[list[str]]:
    """Original parameter FQNs per stage. The tracer keeps each parameter's name, so a stage module's names *are*
    the original FQNs; checked here (every name of ``model`` in exactly one stage) rather than assumed, and
    parameters shared by two stages are refused (they would need a gradient all-reduce between stages, which
    torch's schedules do not do)."""
    per_stage = [[n for n, _ in pipe.get_stage_module(i).named_parameters()] for i in range(pipe.num_stages)]
    original = {n for n, _ in model.named_parameters()}
    renamed = [n for names in per_stage for n in names if n not in original]
    if renamed or original != {n for names in per_stage for n in names}:
        raise RuntimeError(f"the traced stages do not hold the model's parameters under their own names (e.g. "
                           f"{renamed[:3]}); this torch version's tracer renames them, so checkpoints would not "
                           f"map back to the unsplit model.")
    seen: dict[str, int] = {}
    for i, names in enumerate(per_stage):
        for n in names:
            if n in seen:
                raise ValueError(f"parameter {n!r} is used by stages {seen[n]} and {i} (tied weights?); untie it or "
                                 f"choose split points that keep its users in one stage.")
            seen[n] = i
    return per_stage


def init_weights(model: nn.Module, seed: int = 0, fqns: set[str] | None = None) -> None:
    """Initialize every module that owns parameters (those in ``fqns`` if given), seeded by ``(seed, module FQN)``:
    the initial weights then do not depend on how the model is split over ranks."""
    names = [name for name, module in model.named_modules()
             if (own := [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)])
             and (fqns is None or fqns.intersection(own))]
    missing = initialize(model, names, seed)
    if missing:
        raise ValueError(f"modules of type {missing} own parameters but have no reset_parameters(); create the model "
                         f"with real weights (not on the meta device).")


def build_schedule(name: str, stages: Sequence[PipelineStage], n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, *,
                   scale_grads: bool = True, **kwargs: Any):
    """The torch schedule called ``name`` over this rank's ``stages``. ``n_microbatches=1`` with ``"gpipe"`` is
    plain layer-split model parallelism. ``loss_fn(output, target)`` should average over its micro-batch: with
    ``scale_grads=True`` the gradients are then those of the mean over the whole batch."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a pipeline schedule; choose one of {sorted(SCHEDULES)}.")
    spec = SCHEDULES[name]
    stages = list(stages)
    pp = stages[0].group_size
    validate_pipeline(name, pp, n_microbatches, num_blocks=len(stages) * pp, stages_per_rank=len(stages))
    if spec.stages_per_rank == 1:
        return spec.cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads, **kwargs)
    return spec.cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads, **kwargs)


def last_stage_rank(pp: int, style: str) -> int:
    """The pp rank that computes the loss: the last rank, or rank 0 for the V-shape."""
    return 0 if style == "v" else pp - 1

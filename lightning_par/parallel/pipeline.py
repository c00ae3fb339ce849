"""Pipeline parallelism: cut a model into stages over its block list and run them with torch's schedules.

Plain torch.distributed, usable without Lightning. The recipe:

1. :func:`validate_pipeline` checks the layout (schedule name, stages, micro-batches, batch size) before anything
   is traced or sent, so a bad configuration fails on every rank alike with a ``ValueError`` that says the fix.
2. :func:`trace_pipeline` traces a *meta* clone of the model with torch's frontend
   (``torch.distributed.pipelining.pipeline`` + ``SplitPoint.BEGINNING`` at the first block of each stage). Tracing
   rather than module surgery because the split must work on a model whose ``forward`` we do not control: surgery
   (keep this stage's blocks, replace the others) only works when ``forward`` tolerates missing modules, and the
   GPT's ``tok_emb(idx) + pos_emb(pos)`` does not (a middle stage would embed hidden states). The tracer keeps the
   original parameter FQNs (``blocks.3.attn.q.weight`` stays that), so checkpoints written through
   torch.distributed.checkpoint use the names of the unsplit model and load under any ``pp``.
3. :func:`build_stages` materializes only this rank's stages (``to_empty`` + per-module seeded
   ``reset_parameters``, or a copy from a real model) and wraps them in ``PipelineStage``.
4. :func:`build_schedule` picks the torch schedule by name.

Limits of the tracer: ``forward`` must be capturable by ``torch.export`` (no data-dependent control flow), shapes
are those of the example micro-batch (keep the batch size fixed, e.g. ``drop_last=True``), and parameters shared
between stages (tied embeddings across stages) are refused.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
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
from torch.distributed.pipelining._IR import Pipe, _modify_graph_op_device

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


def plan_split(model: nn.Module, num_stages: int, split_points: Sequence[str] | None = None,
               block_list: str | None = None) -> list[str]:
    """FQNs of the blocks that begin stages 1..S-1: an even cut of the block list (the first stages take the
    remainder), or the given ``split_points`` checked against it."""
    block_fqn, blocks = block_fqns(model, block_list)
    if num_stages > len(blocks):
        raise ValueError(f"num_stages={num_stages} is more than the {len(blocks)} blocks of {block_fqn!r}; "
                         f"use at most {len(blocks)} stages.")
    if split_points is None:
        base, extra = divmod(len(blocks), num_stages)
        starts, i = [], 0
        for s in range(num_stages - 1):
            i += base + (1 if s < extra else 0)
            starts.append(blocks[i])
        return starts
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
    """``reset_parameters()`` of every module that owns parameters (those in ``fqns`` if given), seeded by
    ``(seed, module FQN)``: the initial weights then do not depend on how the model is split over ranks."""
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if not own or (fqns is not None and not fqns.intersection(own)):
            continue
        if not hasattr(module, "reset_parameters"):
            raise ValueError(f"module {name!r} ({type(module).__name__}) owns parameters but has no "
                             f"reset_parameters(); pass `init_fn` to build_stages to initialize it.")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            module.reset_parameters()


@dataclass
class PipelineStages:
    """This rank's part of the pipeline: its stages, their modules and the original FQNs of all stages."""

    stages: list[PipelineStage]
    stage_ids: list[int]
    num_stages: int
    split_points: list[str]
    fqns: list[list[str]] = field(repr=False)  # per stage (all stages): parameter FQNs in the original model

    @property
    def modules(self) -> list[nn.Module]:
        return [s.submod for s in self.stages]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under their names in the unsplit model (stage modules keep those names)."""
        return {n: p for m in self.modules for n, p in m.named_parameters()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Original-FQN state dict of the local stages: the torch.distributed.checkpoint unit for this rank."""
        return {k: v for m in self.modules for k, v in m.state_dict().items()}

    def fqn_map(self) -> dict[int, dict[str, str]]:
        """Per local stage: stage-module parameter name -> original FQN (the identity, checked by stage_fqns)."""
        return {sid: {n: n for n, _ in s.submod.named_parameters()} for sid, s in zip(self.stage_ids, self.stages)}

    def bind_to(self, model: nn.Module) -> None:
        """Make ``model`` (the unsplit, usually meta, model) hold exactly this rank's parameters and buffers: the
        stage modules' own objects under their original FQNs; all others are removed. Its ``parameters()`` and
        ``state_dict()`` are then this rank's share of the pipeline, so optimizers, LR schedulers and DCP
        checkpoints written for the unsplit model work unchanged (its ``forward`` is never called: the schedule
        runs the stage modules)."""
        local = {n: p for m in self.modules for n, p in m.named_parameters()}
        local_buffers = {n: b for m in self.modules for n, b in m.named_buffers()}
        for table, values in (("_parameters", local), ("_buffers", local_buffers)):
            named = model.named_parameters if table == "_parameters" else model.named_buffers
            for fqn, _ in list(named(remove_duplicate=False)):
                owner, _, leaf = fqn.rpartition(".")
                store = getattr(model.get_submodule(owner), table)
                if fqn in values:
                    store[leaf] = values[fqn]
                else:
                    del store[leaf]

    def stage_of(self, fqn: str) -> int:
        return next(i for i, names in enumerate(self.fqns) if fqn in names)


def build_stages(model: nn.Module, example_args: tuple[Any, ...], pp_rank: int, pp: int, *,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 stages_per_rank: int = 1, style: str = "loop", split_points: Sequence[str] | None = None,
                 block_list: str | None = None, seed: int = 0, pipe: Pipe | None = None,
                 init_fn: Callable[[nn.Module, set[str]], None] | None = None) -> PipelineStages:
    """Split ``model`` and build this rank's ``PipelineStage`` objects; only local stages get memory.

    ``model`` may live on the meta device (then each local module is initialized by ``init_fn(original_model,
    local_fqns)``, default :func:`init_weights`) or hold real weights (then they are copied by FQN).
    Buffers of a meta model get whatever ``init_fn`` leaves in them (``reset_parameters`` of a norm resets its
    running stats; tables built in ``__init__``, such as RoPE's, need an ``init_fn`` that rebuilds them).
    ``example_args`` are one micro-batch of the model's inputs. ``pipe`` reuses an earlier trace.
    """
    num_stages = pp * stages_per_rank
    points = plan_split(model, num_stages, split_points, block_list)
    pipe = pipe if pipe is not None else trace_pipeline(model, example_args, points)
    fqns = stage_fqns(pipe, model)
    device = torch.device(device)
    real = not any(p.is_meta for p in model.parameters())
    stages = []
    for sid in stage_ids(pp_rank, pp, stages_per_rank, style):
        submod = copy.deepcopy(pipe.get_stage_module(sid))  # the trace stays reusable for other layouts
        _modify_graph_op_device(submod, device)  # ops traced on meta (torch.arange(..., device=meta))
        submod.to_empty(device=device)
        with torch.no_grad():
            if real:
                source = dict(model.named_parameters()) | dict(model.named_buffers())
                for name, t in list(submod.named_parameters()) + list(submod.named_buffers()):
                    t.copy_(source[name])
            else:
                _init_local(model, submod, set(fqns[sid]), init_fn or (lambda m, f: init_weights(m, seed, f)),
                            device)
        stages.append(PipelineStage(submod, sid, num_stages, device, group=group))
    return PipelineStages(stages, [s.stage_index for s in stages], num_stages, list(points), fqns)


def _init_local(meta_model: nn.Module, submod: nn.Module, local: set[str], init_fn: Callable,
                device: torch.device) -> None:
    """Materialize the owners of this stage's parameters and buffers in a meta clone, initialize them there, copy
    into ``submod``: memory for this stage only, and the same values whatever the split."""
    clone = meta_clone(meta_model)
    tensors = [n for n, _ in submod.named_parameters()] + [n for n, _ in submod.named_buffers()]
    for name in {n.rpartition(".")[0] for n in tensors}:
        clone.get_submodule(name).to_empty(device=device, recurse=False)
    init_fn(clone, local)
    values = dict(clone.named_parameters()) | dict(clone.named_buffers())
    for name, t in list(submod.named_parameters()) + list(submod.named_buffers()):
        t.copy_(values[name])


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


class PipelineRunner:
    """One object per rank that runs training and evaluation steps of a pipelined model.

    ``step`` returns the mean micro-batch loss on every rank (broadcast from the last stage), which is what a
    trainer logs. Set ``recorder`` (:class:`lightning_par.parallel.pipeline_timeline.ScheduleRecorder`) to time
    every action of the next steps.
    """

    def __init__(self, model: nn.Module, example_batch_args: tuple[Any, ...], *, schedule: str, pp_rank: int,
                 pp: int, n_microbatches: int, loss_fn: Callable, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", stages_per_rank: int | None = None,
                 split_points: Sequence[str] | None = None, block_list: str | None = None, seed: int = 0,
                 pipe: Pipe | None = None) -> None:
        batch = example_batch_args[0].shape[0]
        _, blocks = block_fqns(model, block_list)
        self.stages_per_rank = validate_pipeline(schedule, pp, n_microbatches, len(blocks), stages_per_rank, batch)
        self.name, self.pp, self.pp_rank, self.n_microbatches = schedule, pp, pp_rank, n_microbatches
        self.group, self.style = group, SCHEDULES[schedule].style
        mb_args = tuple(a[: batch // n_microbatches] for a in example_batch_args)
        self.parts = build_stages(model, mb_args, pp_rank, pp, group=group, device=device,
                                  stages_per_rank=self.stages_per_rank, style=self.style, split_points=split_points,
                                  block_list=block_list, seed=seed, pipe=pipe)
        self.schedule = build_schedule(schedule, self.parts.stages, n_microbatches, loss_fn)

    @property
    def has_last_stage(self) -> bool:
        return self.parts.num_stages - 1 in self.parts.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.parts.modules for p in m.parameters()]

    def _check_batch(self, args: tuple[Any, ...]) -> None:
        size = args[0].shape[0] if args else None
        if size is not None and size % self.n_microbatches != 0:
            raise ValueError(f"batch size {size} is not divisible by n_microbatches={self.n_microbatches}. Use a "
                             f"batch size that is a multiple of {self.n_microbatches} (drop_last=True).")

    def _run(self, args: tuple[Any, ...], target: torch.Tensor | None, train: bool) -> torch.Tensor:
        self._check_batch(args)
        first = 0 in self.parts.stage_ids
        losses: list[torch.Tensor] = []
        call = self.schedule.step if train else self.schedule.eval
        call(*(args if first else ()), target=target if self.has_last_stage else None, losses=losses)
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros(())
        loss = loss.float()
        dist.broadcast(loss, dist.get_global_rank(self.group, last_stage_rank(self.pp, self.style))
                       if self.group is not None else last_stage_rank(self.pp, self.style), group=self.group)
        return loss

    def step(self, *args: Any, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one batch (gradients accumulate into the local stages' ``.grad``)."""
        return self._run(args, target, train=True)

    @torch.no_grad()
    def eval(self, *args: Any, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only through all stages; the mean micro-batch loss on every rank."""
        return self._run(args, target, train=False)

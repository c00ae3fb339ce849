"""Pipeline stages that run the model's *own* modules: what the strategy trains under ``pp > 1``.

:mod:`~.pipeline` builds stages that own traced copies of the weights. A trainer needs more:
the optimizer, the LR scheduler, checkpoints and the other techniques (FSDP units, activation checkpointing,
``torch.compile``) all work on the user's modules. So here the trace supplies only the *glue* of each stage (the
ops of ``forward`` between modules, e.g. ``tok_emb(idx) + pos_emb(arange(T))``), and each traced module that
holds weights is swapped for the user's own object:

* every block of the block list, and
* outside the blocks, every module that directly owns parameters or buffers (embeddings, final norm, head).

The partition is decided once, before anything is traced, by registration order (what comes before the block
list goes to the first stage, what comes after it to the last) and is then checked against every trace. The
model (``LightningModule``) keeps exactly this rank's tensors under their original names, so its
``parameters()`` and ``state_dict()`` are this rank's share.

Traces are cached by the micro-batch's shapes: a validation batch of another size, or a last short batch, gets
its own trace and schedule over the same modules. No example input is needed at setup.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from lightning_par._compat import move_graph_to_device, pipeline_stage_class, without_function_modes
from lightning_par.parallel.init import materialize
from lightning_par.techniques.pipeline.pipeline import (
    SCHEDULES,
    block_fqns,
    build_schedule,
    last_stage_rank,
    meta_clone,
    plan_split,
    stage_fqns,
    stage_ids,
    trace_pipeline,
    validate_pipeline,
)
from lightning_par.techniques.pipeline.pipeline_hf import (
    HFPipelineModel,
    HFStage,
    check_forward_contract,
    find_hf_pipeline_model,
    shared_buffer_modules,
)
from lightning_par.techniques.pipeline.schedule_recorder import ScheduleRecorder


@dataclass(frozen=True)
class StagePlan:
    """Which of the model's modules and tensors each stage runs, by FQN."""

    split_points: list[str]
    owners: list[list[str]]  # per stage: modules run as the user's objects (blocks, then weight-owning glue)
    tensors: list[set[str]]  # per stage: FQNs of its parameters and buffers
    blocks: list[str]  # FQNs of the block list's blocks, in order
    shared: list[str] = field(default_factory=list)  # buffer-only modules every stage keeps (rotary embeddings)

    @property
    def num_stages(self) -> int:
        return len(self.owners)


def plan_stages(model: nn.Module, num_stages: int, split_points: Sequence[str] | None = None,
                block_list: str | None = None) -> StagePlan:
    """Cut the block list into ``num_stages`` stages; glue owners before the block list go to the first stage,
    those after it to the last."""
    block_fqn, blocks = block_fqns(model, block_list)
    points = plan_split(model, num_stages, split_points, block_list)
    owners: list[list[str]] = [[] for _ in range(num_stages)]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    stage = 0
    for name, module in model.named_modules():
        if name in blocks:
            stage += name in points
            owners[stage].append(name)
            continue
        if name.startswith(block_fqn + "."):
            continue  # inside a block
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, _ in module.named_buffers(recurse=False)]
        if not own:
            continue
        if name == "" or block_fqn.startswith(name + "."):
            raise ValueError(
                f"{type(module).__name__} at {name or 'the root'!r} owns {own[:3]} directly and also contains the "
                f"block list {block_fqn!r}; pipeline stages can only hold weights that live in their own modules. "
                f"Move them into a submodule (e.g. an nn.Embedding, or a small nn.Module with the parameter).")
        owners[0 if order[name] < order[block_fqn] else num_stages - 1].append(name)
    tensors = [set() for _ in range(num_stages)]
    for s, names in enumerate(owners):
        for name in names:
            sub = model.get_submodule(name)
            tensors[s].update(f"{name}.{n}" for n, _ in sub.named_parameters())
            tensors[s].update(f"{name}.{n}" for n, _ in sub.named_buffers())
    return StagePlan(list(points), owners, tensors, blocks)


def plan_hf_stages(model: nn.Module, hf: HFPipelineModel, num_stages: int,
                   split_points: Sequence[str] | None = None) -> StagePlan:
    """The stage plan of a transformers model from its pipeline plan: the entries before the layers on the first
    stage, the layers cut like any block list, the entries after them on the last stage; buffer-only modules
    (rotary embeddings) on every stage."""
    _, blocks = block_fqns(model, hf.layers)
    points = plan_split(model, num_stages, split_points, hf.layers)
    owners: list[list[str]] = [[] for _ in range(num_stages)]
    owners[0].extend(hf.first)
    stage = 0
    for name in blocks:
        stage += name in points
        owners[stage].append(name)
    owners[-1].extend(hf.last)
    shared = shared_buffer_modules(model, hf)
    tensors = [set() for _ in range(num_stages)]
    for s, names in enumerate(owners):
        for name in [*names, *shared]:
            sub = model.get_submodule(name)
            tensors[s].update(f"{name}.{n}" for n, _ in sub.named_parameters())
            tensors[s].update(f"{name}.{n}" for n, _ in sub.named_buffers())
    return StagePlan(list(points), owners, tensors, blocks, shared)


def keep_local(model: nn.Module, plan: StagePlan, local_stages: Sequence[int]) -> None:
    """Remove every parameter and buffer of ``model`` that no local stage holds (freeing them)."""
    keep = set().union(*(plan.tensors[s] for s in local_stages))
    for kind in ("_parameters", "_buffers"):
        named = model.named_parameters if kind == "_parameters" else model.named_buffers
        for fqn, _ in list(named(remove_duplicate=False)):
            if fqn not in keep:
                owner, _, leaf = fqn.rpartition(".")
                del getattr(model.get_submodule(owner), kind)[leaf]


def materialize_local(model: nn.Module, plan: StagePlan, local_stages: Sequence[int], device: torch.device,
                      seed: int = 0) -> None:
    """Give memory to the local owners (and the buffers every stage keeps) still on the meta device and initialize
    them, seeded by (seed, module FQN): the initial weights are the same under any pp size or split."""
    names = [name for s in local_stages for name in plan.owners[s]] + plan.shared
    missing = materialize(model, device, names, seed)
    if missing:
        raise ValueError(f"modules of type {missing} own tensors but have no reset_parameters(); create the model with "
                         f"real weights (not on the meta device), or give them a reset_parameters().")


_STAGE = pipeline_stage_class()


@dataclass
class _Compiled:
    stages: list[PipelineStage]
    schedule: Any


class LivePipeline:
    """This rank's stages over ``model``'s own modules, and the schedules that run them.

    Build it *before* any other technique touches ``model`` (it records the model's structure on the meta device
    and removes the tensors of other ranks' stages); wrap the local owners afterwards (FSDP, checkpointing,
    compile): the stages look them up by FQN each time a schedule is built.
    """

    def __init__(self, model: nn.Module, *, schedule: str, pp_rank: int, pp: int, n_microbatches: int | None,
                 group: dist.ProcessGroup, device: torch.device, stages_per_rank: int | None = None,
                 split_points: Sequence[str] | None = None, block_list: str | None = None,
                 share: Sequence[Any] = ()) -> None:
        self.hf = find_hf_pipeline_model(model)
        if self.hf is not None:
            if block_list not in (None, self.hf.layers):
                raise ValueError(f"block_list={block_list!r}: {type(self.hf.model).__name__} is pipelined from its own "
                                 f"pipeline plan, which cuts {self.hf.layers!r}. Leave block_list unset.")
            block_list = self.hf.layers
        _, blocks = block_fqns(model, block_list)
        if n_microbatches is None:  # one per stage: the least that keeps every stage busy at some point
            spec = SCHEDULES.get(schedule)
            n_microbatches = pp * (stages_per_rank or (spec.stages_per_rank if spec else None) or 2)
        self.stages_per_rank = validate_pipeline(schedule, pp, n_microbatches, len(blocks), stages_per_rank)
        self.name, self.pp, self.pp_rank, self.n_microbatches = schedule, pp, pp_rank, n_microbatches
        self.group, self.device, self.model = group, device, model
        self.style = SCHEDULES[schedule].style
        num_stages = pp * self.stages_per_rank
        self.plan = (plan_stages(model, num_stages, split_points, block_list) if self.hf is None
                     else plan_hf_stages(model, self.hf, num_stages, split_points))
        self.stage_ids = stage_ids(pp_rank, pp, self.stages_per_rank, self.style)
        if self.hf is not None:
            self._check_tied_across_ranks()
        self.template = meta_clone(model, share=share)
        keep_local(model, self.plan, self.stage_ids)
        self.loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self.record_next = False  # set to time the next training step (see techniques/pipeline/schedule_recorder.py)
        self.last_recording: ScheduleRecorder | None = None
        self._cache: dict[tuple, _Compiled] = {}
        self._calls: dict[tuple, dict[str, tuple[int, bool]]] = {}
        #: the rows' tables of the batch running now (``ROW_TABLES``), one dict per micro-batch: every pp rank reads
        #: the same batch, so each stage takes its micro-batch's own (no communication)
        self.row_tables: RowTables = RowTables()

    def _check_tied_across_ranks(self) -> None:
        """A parameter used by two stages (tied input and output embeddings) must stay on one rank: torch's
        schedules do not add up gradients across stages of different ranks. The V-shaped schedule keeps the first
        and the last stage on rank 0, so tied embeddings work there."""
        rank_of = {s: r for r in range(self.pp) for s in stage_ids(r, self.pp, self.stages_per_rank, self.style)}
        users: dict[int, tuple[str, int]] = {}
        for stage, names in enumerate(self.plan.owners):
            for name in names:
                for pname, param in self.model.get_submodule(name).named_parameters():
                    seen = users.setdefault(id(param), (f"{name}.{pname}", stage))
                    if rank_of[seen[1]] != rank_of[stage]:
                        raise ValueError(
                            f"{seen[0]!r} (stage {seen[1]}) and {f'{name}.{pname}'!r} (stage {stage}) are one tied "
                            f"parameter, on different pipeline ranks. Untie them (Hugging Face: "
                            f"tie_word_embeddings=False), or use pp_schedule='zbv', which keeps the first and the "
                            f"last stage on rank 0.")

    @property
    def has_last_stage(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_ids

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def local_owners(self) -> list[list[str]]:
        return [self.plan.owners[s] for s in self.stage_ids]

    @property
    def last_rank(self) -> int:
        """Global rank of the pp rank that computes the loss."""
        return dist.get_global_rank(self.group, last_stage_rank(self.pp, self.style))

    # ---- building stages for one micro-batch shape ---------------------------------------------------------
    def _compiled(self, args: tuple[Any, ...], train: bool) -> _Compiled:
        size = args[0].shape[0]
        if size % self.n_microbatches != 0:
            raise ValueError(f"batch size {size} is not divisible by n_microbatches={self.n_microbatches}. Use a "
                             f"batch size that is a multiple of {self.n_microbatches}, e.g. with drop_last=True.")
        mb_args = tuple(a[: size // self.n_microbatches] if isinstance(a, torch.Tensor) else a for a in args)
        shapes = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in mb_args)
        key = (train, shapes)
        if key not in self._cache:
            self._cache[key] = self._build(mb_args, train)
        return self._cache[key]

    def _build(self, mb_args: tuple[Any, ...], train: bool) -> _Compiled:
        if self.hf is not None:
            check_forward_contract(self.template, self.hf, mb_args, self.row_tables.micro_batches[0]
                                   if self.row_tables.micro_batches else {})
            stages = self._hf_stages(mb_args[0].shape[1])
        else:
            stages = self._traced_stages(mb_args)
        if train and self.loss_fn is None:
            raise RuntimeError("LivePipeline.loss_fn must be set before a training step.")
        # each micro-batch's loss is divided by the micro-batch count here, rather than the gradients afterwards
        # (the schedules' scale_grads), which would also shrink gradients accumulated over earlier batches
        loss_fn = self._micro_batch_loss if train else None
        return _Compiled(stages, build_schedule(self.name, stages, self.n_microbatches, loss_fn, scale_grads=False))

    def _hf_stages(self, seq_len: int) -> list[PipelineStage]:
        """Stages of a transformers model from its pipeline plan: nothing to trace, one per local stage id."""
        assert self.hf is not None
        index = {name: i for i, name in enumerate(self.plan.blocks)}
        stages = []
        for sid in self.stage_ids:
            layer_ids = [index[name] for name in self.plan.owners[sid] if name in index]
            submod = HFStage(self.model, self.hf, layer_ids, first=sid == 0, last=sid == self.plan.num_stages - 1,
                             shared=self.plan.shared, seq_len=seq_len, tables=self.row_tables)
            stages.append(_STAGE(submod, sid, self.plan.num_stages, self.device, group=self.group))
        return stages

    def _traced_stages(self, mb_args: tuple[Any, ...]) -> list[PipelineStage]:
        """Stages whose glue is traced from the model's forward, with the model's own modules swapped in."""
        with without_function_modes():  # e.g. context-parallel attention routing: not while tracing on meta
            pipe = trace_pipeline(self.template, mb_args, self.plan.split_points)
            self._check_partition(stage_fqns(pipe, self.template))
            calls = self._owner_calls(mb_args)
        stages = []
        for sid in self.stage_ids:
            submod = copy.deepcopy(pipe.get_stage_module(sid))
            for name in self.plan.owners[sid]:
                _swap_in(submod, name, self.model.get_submodule(name), calls)
            move_graph_to_device(submod, self.device)
            stages.append(_STAGE(submod, sid, self.plan.num_stages, self.device, group=self.group))
        return stages

    def _micro_batch_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        assert self.loss_fn is not None
        return self.loss_fn(outputs, targets) / self.n_microbatches

    def _check_partition(self, traced: list[list[str]]) -> None:
        """The trace must put every parameter in the stage the plan gave its module."""
        for s, names in enumerate(traced):
            wrong = sorted(set(names) - self.plan.tensors[s])
            if wrong:
                where = next(t for t, tensors in enumerate(self.plan.tensors) if wrong[0] in tensors)
                raise ValueError(
                    f"{wrong[0]!r} is used by stage {s} but registered for stage {where}: the pipeline puts modules "
                    f"registered before the block list on the first stage and those after it on the last. Register "
                    f"modules in the order forward uses them, or move the split points.")

    def _owner_calls(self, mb_args: tuple[Any, ...]) -> dict[str, tuple[int, bool]]:
        """How forward calls each owner (positional count, any keyword), recorded on the meta template: the
        traced graph passes flattened positional inputs, which only match the module's own signature for calls
        with tensors as positional arguments."""
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in mb_args)
        if shapes in self._calls:
            return self._calls[shapes]
        calls: dict[str, tuple[int, bool]] = {}
        handles = []
        for name in {n for owners in self.plan.owners for n in owners}:
            def record(mod: nn.Module, args: tuple, kwargs: dict, _name: str = name) -> None:
                ok = all(isinstance(a, torch.Tensor) for a in args) and not kwargs
                calls[_name] = (len(args), ok)
            handles.append(self.template.get_submodule(name).register_forward_pre_hook(record, with_kwargs=True))
        try:
            with torch.no_grad():
                self.template(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in mb_args))
        finally:
            for h in handles:
                h.remove()
        self._calls[shapes] = calls
        return calls

    # ---- running -----------------------------------------------------------------------------------------
    def train_step(self, args: tuple[Any, ...], target: Any, status: torch.Tensor | None = None,
                   tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one batch through all stages; the mean micro-batch loss on every pp rank.
        ``status``: a 0-dim tensor the last stage's loss function wrote during the step, broadcast with the loss
        (in place) so every pp rank reads the last stage's. ``tables``: the batch's ``position_ids`` /
        ``attention_mask`` (``ROW_TABLES``), handed to every stage of a Hugging Face model per micro-batch."""
        args = _contiguous(args)
        self._load_tables(tables)
        compiled = self._compiled(args, train=True)
        losses: list[torch.Tensor] = []
        call_args = args if self.has_first_stage else ()
        if self.record_next:
            self.record_next = False
            with ScheduleRecorder(compiled.stages) as self.last_recording:
                compiled.schedule.step(*call_args, target=target if self.has_last_stage else None, losses=losses)
        else:
            compiled.schedule.step(*call_args, target=target if self.has_last_stage else None, losses=losses)
        # under loss parallelism each loss is a replicated DTensor: its local value is the loss
        losses = [x.to_local() if isinstance(x, DTensor) else x for x in losses]
        loss = (torch.stack([x.detach().float() for x in losses]).sum() if losses  # the mean: each is 1/m of one
                else torch.zeros((), device=self.device))
        if status is not None:
            loss = torch.stack([loss, status.float()])
        with torch.profiler.record_function("PP::loss_broadcast"):  # counted as pipeline traffic by the monitors
            dist.broadcast(loss, self.last_rank, group=self.group)
        if status is not None:
            status.copy_(loss[1])
            loss = loss[0]
        return loss

    def _load_tables(self, tables: dict[str, torch.Tensor] | None) -> None:
        if tables and self.hf is None:
            raise ValueError(f"forward got {sorted(tables)}: under pipeline parallelism only a Hugging Face model's "
                             f"stages take the rows' position_ids or attention_mask (the traced stages of other "
                             f"models pass the hidden states only). Pass the inputs alone.")
        self.row_tables.load(tables or {}, self.n_microbatches)

    @torch.no_grad()
    def forward(self, args: tuple[Any, ...], tables: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward only; the last stage's output (micro-batches concatenated) on every pp rank."""
        args = _contiguous(args)
        self._load_tables(tables)
        compiled = self._compiled(args, train=False)
        out = compiled.schedule.step(*(args if self.has_first_stage else ()))
        if not isinstance(out, torch.Tensor) and self.has_last_stage:
            raise TypeError(f"under pipeline parallelism forward must return one tensor; it returned "
                            f"{type(out).__name__}.")
        meta = [(tuple(out.shape), out.dtype) if self.has_last_stage else None]
        with torch.profiler.record_function("PP::output_broadcast"):
            dist.broadcast_object_list(meta, self.last_rank, group=self.group)
            if not self.has_last_stage:
                out = torch.empty(meta[0][0], dtype=meta[0][1], device=self.device)
            dist.broadcast(out, self.last_rank, group=self.group)
        return out


#: the per-row tables a pipelined Hugging Face model's forward may pass besides its inputs
ROW_TABLES = ("position_ids", "attention_mask")


class RowTables:
    """A batch's row tables cut into its micro-batches; each stage's module takes those of the micro-batch it runs
    (``submod.chunk_id``, which the stage sets: ``_compat.pipeline_stage_class``)."""

    def __init__(self) -> None:
        self.micro_batches: list[dict[str, torch.Tensor]] = []

    def load(self, tables: dict[str, torch.Tensor], n_microbatches: int) -> None:
        cut = {name: t.contiguous().tensor_split(n_microbatches) for name, t in tables.items()}
        self.micro_batches = [{name: parts[i] for name, parts in cut.items()} for i in range(n_microbatches)] \
            if cut else []

    def of(self, stage: nn.Module) -> dict[str, torch.Tensor]:
        """The tables of the micro-batch ``stage`` runs now (the first during shape inference; {} without any)."""
        if not self.micro_batches:
            return {}
        return self.micro_batches[getattr(stage, "chunk_id", 0)]


def _contiguous(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Stage inputs in contiguous memory: torch 2.11's stages compare the strides of the inputs they receive with
    those they recorded (contiguous), and a batch's ``ids[:, :-1]`` is a strided view."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def _swap_in(stage_module: nn.Module, name: str, real: nn.Module, calls: dict[str, tuple[int, bool]]) -> None:
    """Replace the traced copy of module ``name`` by the model's own ``real`` module."""
    n_args, positional_tensors = calls.get(name, (0, False))
    if name not in calls:
        raise ValueError(f"module {name!r} holds weights of this stage but forward never calls it; pipeline "
                         f"stages run modules through their forward.")
    if not positional_tensors:
        raise ValueError(f"forward calls {name!r} with keyword or non-tensor arguments; under pipeline "
                         f"parallelism blocks and weight-owning modules must be called with tensors as positional "
                         f"arguments (e.g. block(x, mask), not block(x, mask=mask)).")
    forward = getattr(real, "_checkpoint_wrapped_module", real).forward
    try:
        inspect.signature(forward).bind(*range(n_args))
    except TypeError as e:
        raise ValueError(f"{name!r} cannot take the {n_args} positional inputs forward passes it: {e}") from None
    stage_module.set_submodule(name, real, strict=True)

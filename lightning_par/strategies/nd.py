"""NDParallelStrategy: the one engine. Every lightning_par strategy is this class with some sizes fixed.

The recipe, in the order it is applied (each step wraps what the earlier ones produced, as in torchtitan):

1. pipeline split (pp): cut the block list into stages; this rank keeps only its stages' modules and tensors, and
   its LightningModule's ``forward``/loss method are routed through the schedule (``strategies/pipeline_adapter``).
   First, because every later step wraps only the modules this rank keeps
2. tensor parallelism: ``parallelize_module`` with the plan (FQN globs -> styles) over the tp mesh, after the
   weights are broadcast within the tp group so every rank starts from the same values
3. context parallelism: nothing to change in the module; at run time every batch's sequence dimension is sharded
   (``batch_to_device``) and ``F.scaled_dot_product_attention`` is routed to ring/all-gather attention over the
   cp group (``step_context``)
4. activation checkpointing of each block: before FSDP, so FSDP's all-gather hooks run around the recompute
5. ``torch.compile`` of each block (``compile=True``): per block, so every block reuses one compiled graph, and
   before FSDP, whose hooks stay outside the compiled region
6. FSDP2 ``fully_shard`` of each shard unit, then of the root (the LightningModule): last, because it shards
   whatever parameters (plain or already DTensor) the earlier steps left
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_par.dims import ParallelDims
from lightning_par.parallel.checkpointing import apply_activation_checkpointing
from lightning_par.parallel.context import ALGORITHMS as CP_ALGORITHMS
from lightning_par.parallel.context_routing import ContextParallelScope, recompute_in_active_scope, shard_batch
from lightning_par.parallel.fsdp import apply_fsdp
from lightning_par.parallel.modules import find_block_list, match_modules
from lightning_par.parallel.pipeline import SCHEDULES
from lightning_par.parallel.pipeline_live import LivePipeline, materialize_local
from lightning_par.parallel.tensor import apply_tp, broadcast_replicated_parameters
from lightning_par.parallel.tensor_plan import resolve_tp_plan, validate_tp_plan
from lightning_par.strategies.base import BaseParallelStrategy
from lightning_par.strategies.pipeline_adapter import PipelineAdapter


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")
    return value


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``configure_model`` already parallelized by hand (FSDP2 modules or DTensor parameters)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


class NDParallelStrategy(BaseParallelStrategy):
    """Pipeline, sharded data (FSDP2/HSDP), tensor and context parallelism on one DeviceMesh.

    Args:
        dp_replicate: replicas of the sharded model (HSDP when > 1 together with ``dp_shard``).
        dp_shard: ranks each parameter is sharded over (FSDP2). ``-1``: the rest of the world size.
        cp, tp, pp: context, tensor and pipeline parallel sizes.
        cp_algorithm: ``"ring"`` (K/V passed around the cp group point to point) or ``"allgather"``.
        cp_load_balance: split each sequence into 2*cp chunks, rank i holding chunks i and 2*cp-1-i, so causal
            attention costs every rank the same (the sequence length must then be divisible by 2*cp).
        cp_seq_dim: the sequence dimension of the batch's tensors (tensors with fewer dims are not sharded).
        tp_plan: FQN globs (relative to the LightningModule) -> style names or torch ``ParallelStyle`` objects.
            Default: the LightningModule's ``tp_plan`` attribute, else the plan a Hugging Face model carries.
        sequence_parallel: run norms and dropout on sequence shards between tensor-parallel regions.
        loss_parallel: keep the head's output sharded over the vocabulary; the loss (``F.cross_entropy`` inside
            the step) is computed without gathering the logits.
        block_list: dotted name of the model's ``nn.ModuleList`` of blocks; found automatically if omitted.
        shard_units: FSDP units as class names or FQN globs (``"Block"``, ``"model.blocks.*"``); default: every
            block of the block list. The LightningModule itself is always the root unit.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them until backward
            (ZeRO-2-like: less communication, more memory).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy).
        activation_checkpointing: recompute each block's activations in backward.
        compile: ``torch.compile`` each block (not with context parallelism yet: its attention routing is a
            TorchFunctionMode that compiled graphs have not been validated with).
        pp_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zb"`` or ``"zbv"``.
        pp_microbatches: micro-batches per batch (default: the number of stages). ``1`` with ``"gpipe"`` is plain
            layer-split model parallelism.
        pp_stages_per_rank: stages per rank for the interleaved schedules (default 2; ``"zbv"`` always 2).
        pp_split_points: FQNs of the blocks that begin stages 1..S-1 (uneven splits); default: an even cut.
        pp_loss_method: the LightningModule's method ``(outputs, targets) -> loss`` that the steps call as
            ``self.<name>(self(inputs), targets)``; the last stage runs it per micro-batch.
        process_group_backend, timeout: see :class:`BaseParallelStrategy`.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        *,
        block_list: str | None = None,
        shard_units: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        compile: bool = False,
        cp_algorithm: str = "ring",
        cp_load_balance: bool = True,
        cp_seq_dim: int = 1,
        tp_plan: Mapping[str, Any] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int | None = None,
        pp_split_points: list[str] | None = None,
        pp_loss_method: str = "loss",
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        **lightning_kwargs: Any,
    ) -> None:
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp)
        _check_pipeline_options(dims, pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split_points,
                                pp_loss_method, sequence_parallel, loss_parallel)
        if shard_units is not None and (
            isinstance(shard_units, str) or not all(isinstance(u, str) for u in shard_units)
        ):
            raise TypeError(f"shard_units={shard_units!r} must be a list of class names or FQN globs, e.g. ['Block'].")
        if block_list is not None and not isinstance(block_list, str):
            raise TypeError(
                f"block_list={block_list!r} must be the dotted name of an nn.ModuleList, e.g. 'model.blocks'."
            )
        super().__init__(dims, process_group_backend=process_group_backend, timeout=timeout, **lightning_kwargs)
        self.block_list = block_list
        self.shard_units = list(shard_units) if shard_units is not None else None
        self.reshard_after_forward = _check_bool("reshard_after_forward", reshard_after_forward)
        self.cpu_offload = _check_bool("cpu_offload", cpu_offload)
        self.activation_checkpointing = _check_bool("activation_checkpointing", activation_checkpointing)
        self.compile = _check_bool("compile", compile)
        if self.compile and dims.cp not in (1,):
            raise ValueError(
                f"compile=True with cp={dims.cp}: compiling blocks together with context-parallel attention is not "
                f"supported yet. Use compile=False with context parallelism."
            )
        if cp_algorithm not in CP_ALGORITHMS:
            raise ValueError(f"cp_algorithm={cp_algorithm!r} is not one of {CP_ALGORITHMS}.")
        self.cp_algorithm = cp_algorithm
        self.cp_load_balance = _check_bool("cp_load_balance", cp_load_balance)
        if isinstance(cp_seq_dim, bool) or not isinstance(cp_seq_dim, int) or cp_seq_dim < 1:
            raise ValueError(f"cp_seq_dim={cp_seq_dim!r} must be the batch tensors' sequence dimension (>= 1), e.g. 1.")
        self.cp_seq_dim = cp_seq_dim
        self._cp_scope: ContextParallelScope | None = None
        if tp_plan is not None and not isinstance(tp_plan, Mapping):
            raise TypeError(f"tp_plan must map FQN globs to style names, e.g. {{'model.blocks.*.attn.q': 'colwise'}}; "
                            f"got {type(tp_plan).__name__}.")
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None
        self.sequence_parallel = _check_bool("sequence_parallel", sequence_parallel)
        self.loss_parallel = _check_bool("loss_parallel", loss_parallel)
        self.pp_schedule, self.pp_microbatches = pp_schedule, pp_microbatches
        self.pp_stages_per_rank = pp_stages_per_rank
        self.pp_split_points = list(pp_split_points) if pp_split_points is not None else None
        self.pp_loss_method = pp_loss_method
        self.pipeline: LivePipeline | None = None
        self._pipeline_adapter: PipelineAdapter | None = None

    def _validate_configuration(self) -> None:
        super()._validate_configuration()  # resolves -1 sizes against the world size
        if self.dims.pp > 1 and self.dims.fsdp_enabled and self.pp_schedule in ("interleaved_zb", "zbv"):
            raise ValueError(
                f"pp_schedule={self.pp_schedule!r} with dp_shard={self.dims.dp_shard}, dp_replicate="
                f"{self.dims.dp_replicate}: zero-bubble schedules compute weight gradients apart from input "
                f"gradients, which FSDP's sharded parameters do not support (torch 2.13). With data parallelism use "
                f"pp_schedule='1f1b' or 'interleaved_1f1b'; or use dp_shard=1 and dp_replicate=1.")

    def parallelize(self, module: pl.LightningModule) -> None:
        if self.dims.pp > 1:
            self._parallelize_pipeline(module)
            return
        if is_parallelized(module):
            # configure_model parallelized by hand (Lightning's ModelParallelStrategy way): respect it; setup then
            # checks that nothing was left unsharded over the data-parallel ranks.
            self._register_step_methods(module)
            return
        unit_fqns = self._shard_unit_fqns(module)
        if self.dims.tp > 1:
            self._apply_tensor_parallel(module, whole_model=module)
        blocks = self._block_fqns(module) if self.activation_checkpointing or self.compile else []
        self._wrap_blocks(module, blocks, unit_fqns, root=module)
        if self.dims.fsdp_enabled:
            self._register_step_methods(module)

    def _parallelize_pipeline(self, module: pl.LightningModule) -> None:
        """The recipe for ``pp > 1``: split first, then every technique wraps only the modules this rank's stages
        run (context parallelism acts at run time, inside the schedule's step)."""
        if is_parallelized(module):
            raise ValueError("pp > 1 with a configure_model that parallelizes by hand: the pipeline split must come "
                             "first. Leave configure_model free of parallelization and let the strategy apply it.")
        pp_mesh = self.dims.mesh("pp")
        device = self._materialization_device()
        self.pipeline = LivePipeline(
            module, schedule=self.pp_schedule, pp_rank=pp_mesh.get_local_rank(), pp=self.dims.pp,
            n_microbatches=self.pp_microbatches, group=pp_mesh.get_group(), device=device,
            stages_per_rank=self.pp_stages_per_rank, split_points=self.pp_split_points, block_list=self.block_list,
            share=(module._trainer, getattr(module, "_device_mesh", None)))
        self._pipeline_adapter = PipelineAdapter(module, self.pipeline, self.pp_loss_method)
        materialize_local(module, self.pipeline.plan, self.pipeline.stage_ids, device, seed=torch.initial_seed())
        blocks = set(self.pipeline.plan.blocks)
        local = [name for owners in self.pipeline.local_owners for name in owners]
        if self.dims.tp > 1:  # checked on the whole (meta) model; applied to the modules this rank's stages run
            self._apply_tensor_parallel(module, whole_model=self.pipeline.template, keep=local)
        # FSDP units: every module a stage runs as the user's object (blocks, embeddings, head), each its own root:
        # the LightningModule, whose forward is not what runs the stages, cannot be the root unit
        self._wrap_blocks(module, [name for name in local if name in blocks], local, root=None)

    def _apply_tensor_parallel(self, module: nn.Module, whole_model: nn.Module,
                               keep: list[str] | None = None) -> None:
        """Step 2: check the plan on ``whole_model`` before the first collective, then apply it to ``module``
        (only to the modules under the FQNs in ``keep``, if given: this rank's pipeline stages)."""
        plan = resolve_tp_plan(module, self.tp_plan)
        resolved = validate_tp_plan(whole_model, plan, self.dims.tp, sequence_parallel=self.sequence_parallel,
                                    loss_parallel=self.loss_parallel)
        if keep is not None:
            plan = {fqn: style for fqn, style in resolved.items()
                    if any(fqn == owner or fqn.startswith(owner + ".") for owner in keep)}
        broadcast_replicated_parameters(module, self.dims.mesh("tp"))
        apply_tp(module, self.dims.mesh("tp"), plan, sequence_parallel=self.sequence_parallel,
                 loss_parallel=self.loss_parallel)

    def _wrap_blocks(self, module: nn.Module, blocks: list[str], fsdp_units: list[str],
                     root: nn.Module | None) -> None:
        """Steps 4-6 on the named blocks and FSDP units (FQNs resolved before any wrapping)."""
        if self.activation_checkpointing:
            apply_activation_checkpointing(module, blocks,
                                           context_fn=recompute_in_active_scope if self.dims.cp > 1 else None)
        if self.compile:
            for name in blocks:
                module.get_submodule(name).compile()
        if self.dims.fsdp_enabled:
            bf16_mixed = getattr(self.precision_plugin, "precision", None) == "bf16-mixed"
            apply_fsdp(
                root,
                self.dims.fsdp_mesh(),
                [module.get_submodule(fqn) for fqn in fsdp_units],
                reshard_after_forward=self.reshard_after_forward,
                param_dtype=torch.bfloat16 if bf16_mixed else None,
                reduce_dtype=torch.float32 if bf16_mixed else None,
                cpu_offload=self.cpu_offload,
            )

    def describe(self) -> str:
        parts = []
        if self.pipeline is not None:
            p = self.pipeline
            parts.append(f"pipeline ({p.name}, {p.n_microbatches} micro-batches, {p.plan.num_stages} stages, split "
                         f"before {p.plan.split_points})")
        if self.dims.fsdp_enabled:
            zero = "ZeRO-3" if self.reshard_after_forward else "ZeRO-2-like"
            parts.append(f"FSDP2 ({zero}{', HSDP' if self.dims.dp_replicate > 1 else ''}"
                         f"{', CPU offload' if self.cpu_offload else ''})")
        if self.dims.tp > 1:
            parts.append(f"tensor parallel (sequence parallel {self.sequence_parallel}, loss parallel "
                         f"{self.loss_parallel})")
        if self.dims.cp > 1:
            parts.append(f"context parallel ({self.cp_algorithm}, load balance {self.cp_load_balance})")
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        if self.compile:
            parts.append("torch.compile per block")
        return ", ".join(parts) or "no parallelism (one process)"

    def describe_rank(self) -> str:
        if self.pipeline is None:
            return ""
        blocks = [name.rpartition(".")[2] for owners in self.pipeline.local_owners for name in owners
                  if name in self.pipeline.plan.blocks]
        return f"stages {self.pipeline.stage_ids} (blocks {', '.join(blocks)})"

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.dims.cp > 1:
            self._cp_scope = ContextParallelScope(self.dims.mesh("cp").get_group(), self.cp_algorithm,
                                                  self.cp_load_balance)

    @contextmanager
    def step_context(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self._cp_scope is not None:
                stack.enter_context(self._cp_scope)
            if self.loss_parallel and self.dims.tp > 1:
                stack.enter_context(loss_parallel())  # around backward too: its ops must see the DTensor grads
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline_adapter is None:
            return super().training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        first = trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0  # Lightning's own zero_grad rule
        self._pipeline_adapter.begin_training_step(accumulate, first)
        try:
            output = super().training_step(*args, **kwargs)
        except BaseException:
            self._pipeline_adapter.abort_training_step()
            raise
        self._pipeline_adapter.end_training_step()
        return output

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline_adapter is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the schedule ran backward inside training_step; the hooks around it still run, once per step
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline_adapter.restore_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._cp_scope is not None:
            batch = shard_batch(batch, self._cp_scope, self.cp_seq_dim)
        return batch

    def _shard_unit_fqns(self, module: nn.Module) -> list[str]:
        """Resolved before any wrapping, so class names match the user's classes (not checkpoint wrappers)."""
        if self.shard_units is not None:
            return [fqn for fqn, _ in match_modules(module, self.shard_units, "shard_units")]
        return self._block_fqns(module)

    def _block_fqns(self, module: nn.Module) -> list[str]:
        block_fqn, container = find_block_list(module, self.block_list)
        return [f"{block_fqn}.{name}" for name in container._modules]

    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded shards live in CPU memory; FSDP copies them to the device per unit
            super().model_to_device()

    def _materialization_device(self) -> torch.device:
        return torch.device("cpu") if self.cpu_offload else self.root_device


def _check_pipeline_options(dims: ParallelDims, schedule: Any, microbatches: Any, stages_per_rank: Any,
                            split_points: Any, loss_method: Any, sequence_parallel: Any, loss_parallel: Any) -> None:
    """What can be checked without the model; the rest (blocks, batch size) when the stages are built."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not a pipeline schedule; choose one of {sorted(SCHEDULES)}.")
    for name, value in (("pp_microbatches", microbatches), ("pp_stages_per_rank", stages_per_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int (or None for the default).")
    if split_points is not None and (
        isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points)
    ):
        raise TypeError(f"pp_split_points={split_points!r} must be a list of block FQNs, e.g. ['model.blocks.2'].")
    if not isinstance(loss_method, str) or not loss_method.isidentifier():
        raise ValueError(f"pp_loss_method={loss_method!r} must be the name of a method of the LightningModule.")
    if dims.pp != 1 and dims.tp != 1 and (sequence_parallel or loss_parallel):
        raise ValueError(f"pp={dims.pp} with tp={dims.tp} and sequence_parallel={sequence_parallel}, loss_parallel="
                         f"{loss_parallel}: stages hand full activations and full logits on; sequence and loss "
                         f"parallelism across pipeline stages are not supported yet. Set both to False with pp > 1.")

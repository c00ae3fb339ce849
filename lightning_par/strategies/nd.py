"""NDParallelStrategy: the one engine. Every lightning_par strategy is this class with some sizes fixed.

The recipe, in the order it is applied (each step wraps what the earlier ones produced, as in torchtitan):

1. pipeline split (pp): cut the block list into stages; this rank keeps only its stages' modules and tensors, and
   its LightningModule's ``forward``/loss method are routed through the schedule (``pipeline/pipeline_adapter``).
   First, because every later step wraps only the modules this rank keeps
2. tensor parallelism: ``parallelize_module`` with the plan (FQN globs -> styles) over the tp mesh, after the
   weights are broadcast within the tp group so every rank starts from the same values
3. context parallelism: nothing to change in the module; at run time every batch's sequence dimension is sharded
   (``batch_to_device``) and ``F.scaled_dot_product_attention`` is routed to ring/all-gather attention over the
   cp group (``step_context``)
4. expert parallelism (ep, borrowed from dp_shard x cp): the ``ep_plan``'s experts modules split over the ep
   mesh, their tokens dispatched to their expert's rank by all-to-all and back
5. activation checkpointing of each block: before FSDP, so FSDP's all-gather hooks run around the recompute
6. ``torch.compile`` of each block (``compile=True``): per block, so every block reuses one compiled graph, and
   before FSDP, whose hooks stay outside the compiled region
7. FSDP2 ``fully_shard`` of each shard unit, then of the root (the LightningModule): last, because it shards
   whatever parameters (plain or already DTensor) the earlier steps left; experts modules over their own mesh
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_par.checks import check_optional_str
from lightning_par.dims import ParallelDims
from lightning_par.parallel.fault_tolerance import FaultTolerance
from lightning_par.strategies.accumulation import AccumulationWindow
from lightning_par.strategies.base import BaseParallelStrategy
from lightning_par.strategies.fault_tolerant import CHECKPOINT_KEY, FaultTolerantTraining
from lightning_par.strategies.startup_summary import describe_hand_parallelization
from lightning_par.techniques import Target, Technique, build_recipe
from lightning_par.techniques.pipeline.pipeline_live import LivePipeline
from lightning_par.techniques.recipe import Recipe
from lightning_par.techniques.sharding.fsdp import hold_reductions, sync_gradients
from lightning_par.techniques.sharding.fully_sharded import register_step_methods
from lightning_par.techniques.tensor.tensor_check import check_whole_parameters_agree
from lightning_par.techniques.tensor.tensor_parallel import (
    check_async_tp_device,
    check_async_tp_with_compile,
    check_regather_with_compile,
)


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``configure_model`` already parallelized by hand (FSDP2 modules or DTensor parameters)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


class NDParallelStrategy(BaseParallelStrategy):
    """Pipeline, sharded data (FSDP2/HSDP), tensor, context and expert parallelism on one DeviceMesh.

    Args:
        dp_replicate: replicas of the sharded model (HSDP when > 1 together with ``dp_shard``).
        dp_shard: ranks each parameter is sharded over (FSDP2). ``-1``: the rest of the world size.
        cp, tp, pp: context, tensor and pipeline parallel sizes.
        ep: expert parallel size: each expert group of ``ep`` ranks splits the experts of every mixture-of-experts
            layer (``num_experts / ep`` each) and sends tokens to their expert by all-to-all. Borrowed from the
            data/context-parallel ranks (it must divide ``dp_shard x cp``); the experts are FSDP-sharded over the
            ranks left. Needs an ``ep_plan``.
        ep_plan: FQN globs or class names of the experts modules (called as ``experts(x, num_tokens_per_expert)``
            with tokens grouped by expert; parameters with the experts on dim 0). Default: the LightningModule's
            ``ep_plan`` attribute.
        ep_ranks_per_node: how many ranks of an ep group share a node. Where an ep group spans nodes with more than
            one of its ranks in each, transformers' experts get their tokens in two steps: each token crosses to a
            node holding one of its experts once, then goes once to each rank there holding one (fewer bytes on the
            links between nodes; two host syncs per layer instead of one). Default: found from the hosts' names;
            ``ep`` or 1: one step.
        cp_algorithm: ``"ring"`` (K/V passed around the cp group point to point), ``"allgather"``, or
            ``"ulysses"`` (all-to-all: every rank attends over the whole sequence for ``heads / cp`` of the heads;
            cp must divide the heads, after tp).
        cp_ulysses_size: the hybrid: all-to-all inside groups of this many consecutive cp ranks (a node's, by
            default placement), then ``cp_algorithm`` (ring or all-gather) over the ``cp / cp_ulysses_size``
            groups; scales past the head count. Default None (no all-to-all unless ``cp_algorithm="ulysses"``).
        cp_load_balance: split each sequence into 2*cp chunks, rank i holding chunks i and 2*cp-1-i, so causal
            attention costs every rank the same (the sequence length must then be divisible by 2*cp).
        cp_seq_dim: the sequence dimension of the batch's tensors (tensors with fewer dims are not sharded).
        tp_plan: FQN globs (relative to the LightningModule) -> style names or torch ``ParallelStyle`` objects.
            Default: the LightningModule's ``tp_plan`` attribute, else the plan a Hugging Face model carries.
        sequence_parallel: run norms and dropout on sequence shards between tensor-parallel regions.
        regather_sequence: with ``sequence_parallel``, a layer that gathers its input from the sequence shards
            saves its own shard for backward and gathers it again there (Megatron-LM's way): the saved input is
            1/tp of the whole, for one more all-gather per gathered input in backward. Outside activation
            checkpointing only; no effect under autocast without FSDP (autocast saves its own copy). Not with
            ``compile``.
        async_tp: with ``sequence_parallel`` and ``compile``, on CUDA: Inductor's async tensor parallelism (as
            torchtitan's ``enable_async_tensor_parallel``): each all-gather before a column-parallel matmul and
            reduce-scatter after a row-parallel one is cut into tp chunks over symmetric memory, the next chunk in
            flight while the current one is multiplied (what Megatron-LM's ``--tp-comm-overlap`` does by hand).
        loss_parallel: keep the head's output sharded over the vocabulary; the loss (``F.cross_entropy`` inside
            the step) is computed without gathering the logits.
        block_list: dotted name of the model's ``nn.ModuleList`` of blocks; found automatically if omitted.
        shard_units: FSDP units as class names or FQN globs (``"Block"``, ``"model.blocks.*"``); default: every
            block of the block list. The LightningModule itself is always the root unit.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them until backward
            (ZeRO-2-like: less communication, more memory).
        accumulate_unsharded: across the micro-batches of one optimizer step (the pipeline schedule's and
            ``Trainer(accumulate_grad_batches=...)``'s), keep FSDP's gradients unsharded and its units gathered,
            and reduce once, after the last: one reduce-scatter per step instead of one per micro-batch, for the
            memory of every unit gathered and its unsharded gradients. With ``reshard_after_forward=False`` also one
            all-gather per step: ZeRO-1-like (torch's schedules do this for a stage that is an FSDP module).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy).
        loss_normalization: how a mean ``F.cross_entropy`` (the ``loss`` method's, ``ignore_index=-100``) is
            normalized across the data-parallel ranks and the micro-batches of ``Trainer(accumulate_grad_batches=...)``:
            ``"mean"`` (default, DDP's convention): each rank's and micro-batch's own mean over its counted tokens,
            averaged; ``"tokens"``: one mean over the counted tokens of the whole global batch of the optimizer step,
            as one process computes it (torchtitan's normalization), where labels of -100 (prompt masking, padding,
            packing boundaries) leave the parts with different counts. The sequence parts of context parallelism and
            the micro-batches of a pipeline are always counted as one batch.
        activation_checkpointing: recompute each block's activations in backward: ``True`` (or ``"full"``) all of
            them; ``"selective"`` all but the outputs of every other matmul and of attention (less memory saved,
            far less recomputed: torchtitan's op-level policy).
        compile: ``torch.compile`` each block (with context parallelism, the attention runs eagerly between the
            block's compiled graphs).
        float8: ``"tensorwise"`` or ``"rowwise"``: the blocks' linear layers compute in float8 (torchao's
            ``Float8LinearConfig`` recipes; not the head, the embeddings or the experts); with FSDP on CUDA the
            tensorwise recipe all-gathers the weights in float8. Fast only with ``compile`` on a GPU of compute
            capability 8.9+; not with tensor parallelism yet. Default None.
        quantize_base: ``"nf4"``: QLoRA's 4-bit base weights: the frozen weights of the blocks' linear layers stored
            as torchao NF4 (double quantization), dequantized per layer; tensor parallelism cuts their codes into
            each rank's rows or columns exactly, FSDP shards and gathers them as NF4. Not with float8; the model's
            weights must exist (not meta) unless ``pretrained=`` fills them. Default None (``techniques/quantize/``).
        pp_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zb"`` or ``"zbv"``.
        pp_microbatches: micro-batches per batch (default: the number of stages). ``1`` with ``"gpipe"`` is plain
            layer-split model parallelism.
        pp_stages_per_rank: stages per rank for the interleaved schedules (default 2; ``"zbv"`` always 2).
        pp_split_points: FQNs of the blocks that begin stages 1..S-1 (uneven splits); default: an even cut.
        pp_loss_method: the LightningModule's method ``(outputs, targets) -> loss`` that the steps call as
            ``self.<name>(self(inputs), targets)``; the last stage runs it per micro-batch.
        fault_tolerance: make ``dp_replicate`` torchft replica groups (:class:`FaultTolerance`): each group is its
            own job of ``dp_shard x cp x tp x pp`` processes, launched with its ``replica_id``; the others go on
            training while a group is down, and it rejoins without a restart (``strategies/fault_tolerant.py``).
        process_group_backend, timeout, pretrained, save_trainable_only: see :class:`BaseParallelStrategy`.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        *,
        block_list: str | None = None,
        shard_units: list[str] | None = None,
        reshard_after_forward: bool = True,
        accumulate_unsharded: bool = False,
        cpu_offload: bool = False,
        loss_normalization: str = "mean",
        activation_checkpointing: bool | str = False,
        compile: bool = False,
        cp_algorithm: str = "ring",
        cp_load_balance: bool = True,
        cp_seq_dim: int = 1,
        cp_ulysses_size: int | None = None,
        tp_plan: Mapping[str, Any] | None = None,
        ep_plan: list[str] | None = None,
        ep_ranks_per_node: int | None = None,
        sequence_parallel: bool = False,
        regather_sequence: bool = False,
        async_tp: bool = False,
        loss_parallel: bool = False,
        float8: str | None = None,
        quantize_base: str | None = None,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int | None = None,
        pp_split_points: list[str] | None = None,
        pp_loss_method: str = "loss",
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        pretrained: str | None = None,
        save_trainable_only: bool = False,
        fault_tolerance: FaultTolerance | None = None,
        **lightning_kwargs: Any,
    ) -> None:
        self.fault_tolerant: FaultTolerantTraining | None = None
        if fault_tolerance is not None:
            if not isinstance(fault_tolerance, FaultTolerance):
                raise TypeError(f"fault_tolerance={fault_tolerance!r} must be a lightning_par.FaultTolerance, e.g. "
                                f"FaultTolerance(replica_id=0, lighthouse='http://host:29510').")
            if dp_replicate == -1:
                raise ValueError("dp_replicate=-1 with fault_tolerance: dp_replicate is the number of replica groups, "
                                 "each its own job; give it explicitly, e.g. dp_replicate=2.")
            ParallelDims(dp_replicate=dp_replicate)  # the same checks of the size as without torchft
            self.fault_tolerant = FaultTolerantTraining(fault_tolerance, dp_replicate)
            dp_replicate = 1  # inside a group; the groups are torchft's
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep)
        # the recipe, in the order it is applied (see the module docstring)
        self._use_recipe(build_recipe(
            pp_schedule=pp_schedule, pp_microbatches=pp_microbatches, pp_stages_per_rank=pp_stages_per_rank,
            pp_split_points=pp_split_points, pp_loss_method=pp_loss_method, tp_plan=tp_plan,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, cp_algorithm=cp_algorithm,
            cp_load_balance=cp_load_balance, cp_seq_dim=cp_seq_dim, cp_ulysses_size=cp_ulysses_size,
            activation_checkpointing=activation_checkpointing,
            compile=compile, shard_units=shard_units, reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload, ep_plan=ep_plan, ep_ranks_per_node=ep_ranks_per_node,
            accumulate_unsharded=accumulate_unsharded, loss_normalization=loss_normalization,
            regather_sequence=regather_sequence, async_tp=async_tp, float8=float8,
            quantize_base=quantize_base))
        self.block_list = check_optional_str("block_list", block_list, "model.blocks")
        self._tp_gradients_checked = False
        #: where the step stands in gradient accumulation (Lightning's hook order: see ``strategies/accumulation``)
        self._accumulation = AccumulationWindow()
        for technique in self.techniques:
            technique.check(dims)
        check_regather_with_compile(self.tensor_parallel.regather_sequence, self.compile.enabled)
        check_async_tp_with_compile(self.tensor_parallel.async_tp, self.compile.enabled)
        super().__init__(dims, process_group_backend=process_group_backend, timeout=timeout, pretrained=pretrained,
                         save_trainable_only=save_trainable_only, **lightning_kwargs)

    def _use_recipe(self, recipe: Recipe) -> None:
        """The layout's techniques: in the order they are applied (``techniques``) and each by its name."""
        self.recipe = recipe
        self.techniques: tuple[Technique, ...] = tuple(recipe)
        self.pipeline_parallel, self.tensor_parallel = recipe.pipeline_parallel, recipe.tensor_parallel
        self.context_parallel, self.expert_parallel = recipe.context_parallel, recipe.expert_parallel
        self.activation_checkpointing, self.compile = recipe.activation_checkpointing, recipe.compile
        self.fully_sharded, self.float8 = recipe.fully_sharded, recipe.float8
        self.quantize_base = recipe.quantize_base
        self.activation_checkpointing.compiled = self.compile.enabled
        self.quantize_base.check_with_float8(self.float8.recipe)

    @property
    def fill_quantized(self) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """How ``pretrained=`` fills the NF4 base weights (``quantize_base``) from the checkpoint's whole tensors."""
        return self.quantize_base.fill

    @property
    def pipeline(self) -> LivePipeline | None:
        """This rank's pipeline stages and schedules (``pp > 1``, after setup), e.g. for the timeline monitor."""
        return self.pipeline_parallel.pipeline

    def _validate_configuration(self) -> None:
        super()._validate_configuration()  # resolves -1 sizes against the world size
        for technique in self.techniques:
            technique.check(self.dims)
        check_async_tp_device(self.tensor_parallel.async_tp, self.root_device.type)

    def build_mesh(self) -> None:
        super().build_mesh()
        for technique in self.techniques:
            technique.setup_environment(self.dims)
        # a pipeline counts a batch's tokens over the ranks loss_normalization names
        self.pipeline_parallel.count_tokens_with(self.fully_sharded.token_loss)

    def parallelize(self, module: pl.LightningModule) -> None:
        if is_parallelized(module):
            if self.dims.pp > 1:
                raise ValueError("pp > 1 with a configure_model that parallelizes by hand: the pipeline split must "
                                 "come first. Leave configure_model free of parallelization and let the strategy "
                                 "apply it.")
            # configure_model parallelized by hand (Lightning's ModelParallelStrategy way): respect it; setup then
            # checks that nothing was left unsharded over the data-parallel ranks.
            self._parallelized_by_hand = True
            register_step_methods(module)
            return
        target = Target(module, self._materialization_device(), str(getattr(self.precision_plugin, "precision", "")),
                        block_list=self.block_list, pretrained=self.pretrained)
        for technique in self.techniques:
            technique.apply(target, self.dims)
        self.float8.warn_if_slow(self.root_device, self.compile.enabled)

    def describe(self) -> str:
        if self._parallelized_by_hand:
            return describe_hand_parallelization(self.lightning_module)
        parts = [d for t in self.techniques if (d := t.describe(self.dims))]
        return ", ".join(parts) or "no parallelism (one process)"

    def describe_rank(self) -> str:
        return self.pipeline_parallel.describe_rank()

    @contextmanager
    def step_context(self) -> Iterator[None]:
        with ExitStack() as stack:
            for technique in self.techniques:
                context = technique.step_context(self.dims)
                if context is not None:
                    stack.enter_context(context)
            yield

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning enters this around each micro-batch of gradient accumulation but the last. With
        ``accumulate_unsharded`` FSDP's units keep their gradients unsharded and stay gathered meanwhile; the last
        micro-batch's backward reduces them (under a pipeline: the last of the schedule's micro-batches in the
        step's last batch)."""
        with self._accumulation.holding_back():
            if not self.fully_sharded.accumulate_unsharded:
                with super().block_backward_sync():
                    yield
            elif self.dims.pp > 1:  # the stages' own switch (_compat) does the rest
                with hold_reductions():
                    yield
            else:
                with sync_gradients(self.lightning_module, False):
                    yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._takes_back_unused_gradients():
            # one window of micro-batches whose gradients FSDP reduces together: with accumulate_unsharded, the
            # micro-batches of an accumulation; else each micro-batch alone
            first = self._accumulation.start_micro_batch(spans_accumulation=self.fully_sharded.accumulate_unsharded)
            self.fully_sharded.unused_parameters.before_backward(self.lightning_module, first=first)
        token_loss = self.fully_sharded.token_loss
        if token_loss is None:
            with self.pipeline_parallel.training_step_context(self.lightning_module):
                return super().training_step(*args, **kwargs)
        token_loss.start_micro_batch(self.lightning_module.trainer.accumulate_grad_batches)
        try:
            with self.pipeline_parallel.training_step_context(self.lightning_module):
                return super().training_step(*args, **kwargs)
        finally:
            token_loss.end_micro_batch()

    def _takes_back_unused_gradients(self) -> bool:
        """FSDP zero-fills gradients a rank's forward left out (``sharding/fsdp.py``); with dp x cp > 1 the ones no
        rank had are taken back after backward. Not under a pipeline: torch's schedules compute weight gradients
        after input gradients, so every parameter is zero-filled first and "filled" no longer means "unused"."""
        return (self.dims.dp_replicate * self.dims.dp_shard * self.dims.cp > 1 and self.dims.pp == 1
                and self.fully_sharded.unused_parameters is not None  # only the engine's FSDP units zero-fill
                and self.fully_sharded.unused_parameters.active)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.pipeline is None:
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        else:  # the schedule ran backward inside training_step; the hooks around it still run, once per step
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self.pipeline_parallel.restore_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
        if self.fully_sharded.token_loss is not None and not self._accumulation.accumulating:
            # loss_normalization="tokens": the accumulated gradients over the whole window's count, before clipping
            self.fully_sharded.token_loss.end_window(self.lightning_module.parameters())
        if self._takes_back_unused_gradients():
            last = self._accumulation.end_backward()
            self.fully_sharded.unused_parameters.after_backward(self.lightning_module,
                                                                self.dims.mesh("dp_cp").get_group(), self.root_device,
                                                                last=last)
        if self.dims.tp > 1 and not self._tp_gradients_checked:
            self._tp_gradients_checked = True
            check_whole_parameters_agree(self.lightning_module, self.dims.mesh("tp"))
        return closure_loss

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        for technique in self.techniques:
            batch = technique.shard_batch(batch)
        return batch

    def model_to_device(self) -> None:
        if not self.fully_sharded.cpu_offload:  # offloaded shards live in CPU memory; FSDP copies them per unit
            super().model_to_device()

    def _materialization_device(self) -> torch.device:
        return torch.device("cpu") if self.fully_sharded.cpu_offload else self.root_device

    # ---- fault-tolerant replica groups (no-ops without them) ------------------------------------------------
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.fault_tolerant is None:
            return super().distributed_sampler_kwargs
        return self.fault_tolerant.sampler_kwargs(self.dims)

    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if self.fault_tolerant is not None:  # loggers write on replica group 0's rank 0 only
            rank_zero_only.rank = utils_rank_zero_only.rank = (
                self.fault_tolerant.replica_id * self.world_size + self.global_rank)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.fault_tolerant is not None and trainer.state.fn == TrainerFn.FITTING:
            layout = {"strategy": self.describe(), "processes": self.world_size}
            self.fault_tolerant.start(trainer, self, layout)

    def process_dataloader(self, dataloader: Any) -> Any:
        if self.fault_tolerant is not None and self.lightning_module.trainer.training:
            self.fault_tolerant.join()  # before the sampler is told which batches are done
        return super().process_dataloader(dataloader)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fault_tolerant is not None:
            self.fault_tolerant.before_batch()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.fault_tolerant is not None:
            plain = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            closure = self.fault_tolerant.wrap_closure(closure, plain)
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.float8.after_optimizer_step()
        if self._frees_gradients_after_step():
            plain = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            plain.zero_grad(set_to_none=True)
        return result

    def _frees_gradients_after_step(self) -> bool:
        """Whether the gradients are freed right after the optimizer step. Lightning zeroes them after the next
        ``training_step``, so the last step's gradients (fp32, 4 bytes a parameter of the rank's shard) stay through
        that forward, on top of its activations; torchtitan frees them before its forward. Done only where nothing
        can tell the difference: automatic optimization (the next step starts from zero gradients anyway), and no
        LightningModule or callback that overrides ``on_before_zero_grad`` or ``optimizer_zero_grad``."""
        module = self.lightning_module
        if module is None or not module.automatic_optimization:
            return False
        if any(is_overridden(hook, module) for hook in ("on_before_zero_grad", "optimizer_zero_grad")):
            return False
        trainer = module._trainer
        callbacks = trainer.callbacks if trainer is not None else []
        return not any(is_overridden("on_before_zero_grad", cb, pl.Callback) for cb in callbacks)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.fault_tolerant is not None:
            if not self.fault_tolerant.writes_checkpoints:
                return
            assert self.fault_tolerant.groups is not None
            checkpoint[CHECKPOINT_KEY] = self.fault_tolerant.groups.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.fault_tolerant is None or self.fault_tolerant.writes_checkpoints:
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        meta = super().load_checkpoint(checkpoint_path, weights_only)
        if self.fault_tolerant is not None and self.fault_tolerant.groups is not None and CHECKPOINT_KEY in meta:
            self.fault_tolerant.groups.load_state_dict(meta[CHECKPOINT_KEY])
        return meta

    def teardown(self) -> None:
        if self.fault_tolerant is not None:
            self.fault_tolerant.teardown()
        super().teardown()

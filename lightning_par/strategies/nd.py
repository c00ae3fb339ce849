"""NDParallelStrategy: the one engine. Every lightning_par strategy is this class with some sizes fixed.

The recipe, in the order it is applied (each step wraps what the earlier ones produced, as in torchtitan):

1. pipeline split: cut the block list into stages      (pp)   -- planned, see README "Status"
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
from lightning_par.parallel.tensor import apply_tp, broadcast_replicated_parameters
from lightning_par.parallel.tensor_plan import resolve_tp_plan, validate_tp_plan
from lightning_par.strategies.base import BaseParallelStrategy


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
    """Sharded data parallelism (FSDP2/HSDP), tensor parallelism and context parallelism, in any combination, on
    one DeviceMesh (pipeline parallelism is next: ``pp`` must be 1 for now).

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
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        **lightning_kwargs: Any,
    ) -> None:
        dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp)
        if dims.pp != 1:
            raise ValueError(
                f"pp={dims.pp}: this version of lightning_par has no pipeline parallelism yet; pp must be 1 "
                f"(data, tensor and context parallelism: dp_replicate x dp_shard x cp x tp)."
            )
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

    def parallelize(self, module: pl.LightningModule) -> None:
        if is_parallelized(module):
            # configure_model parallelized by hand (Lightning's ModelParallelStrategy way): respect it; setup then
            # checks that nothing was left unsharded over the data-parallel ranks.
            self._register_step_methods(module)
            return
        unit_fqns = self._shard_unit_fqns(module)
        if self.dims.tp > 1:
            plan = resolve_tp_plan(module, self.tp_plan)
            validate_tp_plan(module, plan, self.dims.tp, sequence_parallel=self.sequence_parallel,
                             loss_parallel=self.loss_parallel)  # before the first collective below
            broadcast_replicated_parameters(module, self.dims.mesh("tp"))
            apply_tp(module, self.dims.mesh("tp"), plan, sequence_parallel=self.sequence_parallel,
                     loss_parallel=self.loss_parallel)
        if self.activation_checkpointing:
            block_fqn, container = find_block_list(module, self.block_list)
            apply_activation_checkpointing(
                module,
                [f"{block_fqn}.{name}" for name in container._modules],
                context_fn=recompute_in_active_scope if self.dims.cp > 1 else None,
            )
        if self.compile:
            block_fqn, container = find_block_list(module, self.block_list)
            for name in list(container._modules):
                container.get_submodule(name).compile()
        if self.dims.fsdp_enabled:
            bf16_mixed = getattr(self.precision_plugin, "precision", None) == "bf16-mixed"
            apply_fsdp(
                module,
                self.dims.fsdp_mesh(),
                [module.get_submodule(fqn) for fqn in unit_fqns],
                reshard_after_forward=self.reshard_after_forward,
                param_dtype=torch.bfloat16 if bf16_mixed else None,
                reduce_dtype=torch.float32 if bf16_mixed else None,
                cpu_offload=self.cpu_offload,
            )
            self._register_step_methods(module)

    def describe(self) -> str:
        parts = []
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

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._cp_scope is not None:
            batch = shard_batch(batch, self._cp_scope, self.cp_seq_dim)
        return batch

    def _shard_unit_fqns(self, module: nn.Module) -> list[str]:
        """Resolved before any wrapping, so class names match the user's classes (not checkpoint wrappers)."""
        if self.shard_units is not None:
            return [fqn for fqn, _ in match_modules(module, self.shard_units, "shard_units")]
        block_fqn, container = find_block_list(module, self.block_list)
        return [f"{block_fqn}.{name}" for name in container._modules]

    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded shards live in CPU memory; FSDP copies them to the device per unit
            super().model_to_device()

    def _materialization_device(self) -> torch.device:
        return torch.device("cpu") if self.cpu_offload else self.root_device

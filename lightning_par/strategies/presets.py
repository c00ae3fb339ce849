"""Named presets of NDParallelStrategy: fixed sizes, no logic of their own, one code path."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.strategies.nd import NDParallelStrategy


class FSDP2Strategy(NDParallelStrategy):
    """Fully sharded data parallelism (FSDP2, ZeRO-3; ZeRO-2-like with ``reshard_after_forward=False``; HSDP with
    ``dp_replicate > 1``). Registered as ``"fsdp2"``. See :class:`NDParallelStrategy` for the arguments."""

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        *,
        block_list: str | None = None,
        shard_units: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        **lightning_kwargs: Any,
    ) -> None:
        super().__init__(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            block_list=block_list,
            shard_units=shard_units,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **lightning_kwargs,
        )


class ContextParallelStrategy(NDParallelStrategy):
    """Context parallelism: every sequence split over ``cp`` ranks, attention computed exactly by ring or
    all-gather attention; composes with FSDP2 (``dp_shard``) and HSDP (``dp_replicate``). Registered as
    ``"context_parallel"``. Parameters are sharded by FSDP2 over ``dp_shard x cp`` (cp ranks hold the same
    weights). See :class:`NDParallelStrategy` for the arguments."""

    def __init__(
        self,
        cp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
        *,
        cp_algorithm: str = "ring",
        cp_load_balance: bool = True,
        cp_seq_dim: int = 1,
        block_list: str | None = None,
        shard_units: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        **lightning_kwargs: Any,
    ) -> None:
        super().__init__(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            cp=cp,
            cp_algorithm=cp_algorithm,
            cp_load_balance=cp_load_balance,
            cp_seq_dim=cp_seq_dim,
            block_list=block_list,
            shard_units=shard_units,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **lightning_kwargs,
        )


class TensorParallelStrategy(NDParallelStrategy):
    """Tensor parallelism (DTensor ``parallelize_module`` from a plan), optionally with sequence parallelism and
    loss parallelism; composes with FSDP2 over ``dp_shard``. Registered as ``"tensor_parallel"``. The plan defaults
    to the LightningModule's ``tp_plan`` attribute, else a Hugging Face model's own plan. See
    :class:`NDParallelStrategy` for the arguments."""

    def __init__(
        self,
        tp: int = -1,
        dp_shard: int = 1,
        dp_replicate: int = 1,
        *,
        tp_plan: Mapping[str, Any] | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        block_list: str | None = None,
        shard_units: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        **lightning_kwargs: Any,
    ) -> None:
        super().__init__(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            tp_plan=tp_plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            block_list=block_list,
            shard_units=shard_units,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **lightning_kwargs,
        )


def register_strategies() -> None:
    """Make the strategies available by name: ``Trainer(strategy="fsdp2")``, ``--trainer.strategy=fsdp2``."""
    for name, cls, description in (
        ("fsdp2", FSDP2Strategy, "lightning_par FSDP2 (fully_shard) over all ranks"),
        ("tensor_parallel", TensorParallelStrategy, "lightning_par tensor parallelism (DTensor, from a plan)"),
        ("context_parallel", ContextParallelStrategy, "lightning_par context parallelism (ring attention)"),
        ("nd_parallel", NDParallelStrategy, "lightning_par N-D parallelism on one DeviceMesh"),
    ):
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description)

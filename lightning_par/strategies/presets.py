"""Named presets of NDParallelStrategy: fixed sizes, no logic of their own, one code path.

Each preset names only the sizes it is about; every other option (FSDP, activation checkpointing, the technique's
own options, process group, timeout) passes through to :class:`NDParallelStrategy`, whose docstring lists them.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.strategies.auto import AutoParallelStrategy
from lightning_par.strategies.lightning_compat import ModelParallelStrategy
from lightning_par.strategies.nd import NDParallelStrategy


def _refuse_other_sizes(preset: str, kwargs: dict[str, Any], *allowed: str) -> None:
    for size in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        if size in kwargs and size not in allowed and kwargs[size] != 1:  # LightningCLI passes every default
            raise ValueError(
                f"{preset} does not take {size}={kwargs[size]!r}: it sets only {', '.join(allowed)}. "
                f"Use NDParallelStrategy to combine other dimensions."
            )


class FSDP2Strategy(NDParallelStrategy):
    """Fully sharded data parallelism (FSDP2, ZeRO-3; ZeRO-2-like without resharding after forward; HSDP with
    ``dp_replicate > 1``). Registered as ``"fsdp2"``. Its options are ``NDParallelStrategy``'s (FSDP2's:
    ``techniques/sharding/fully_sharded.FullyShardedOptions``)."""

    def __init__(self, dp_replicate: int = 1, dp_shard: int = -1, **kwargs: Any) -> None:
        _refuse_other_sizes("FSDP2Strategy", kwargs, "dp_replicate", "dp_shard")
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, **kwargs)


class TensorParallelStrategy(NDParallelStrategy):
    """Tensor parallelism (DTensor ``parallelize_module`` from a plan), optionally with sequence parallelism and
    loss parallelism; composes with FSDP2 over ``dp_shard``. Registered as ``"tensor_parallel"``. The plan defaults
    to the LightningModule's plan attribute, else a Hugging Face model's own plan (the options:
    ``techniques/tensor/tensor_parallel.TensorParallelOptions``)."""

    def __init__(self, tp: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Any) -> None:
        _refuse_other_sizes("TensorParallelStrategy", kwargs, "tp", "dp_shard", "dp_replicate")
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, **kwargs)


class ContextParallelStrategy(NDParallelStrategy):
    """Context parallelism: every sequence split over ``cp`` ranks, attention computed exactly by ring or
    all-gather attention; composes with FSDP2 (``dp_shard``) and HSDP (``dp_replicate``). Registered as
    ``"context_parallel"``. Parameters are sharded by FSDP2 over ``dp_shard x cp`` (cp ranks hold the same
    weights)."""

    def __init__(self, cp: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Any) -> None:
        _refuse_other_sizes("ContextParallelStrategy", kwargs, "cp", "dp_shard", "dp_replicate")
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, **kwargs)


class PipelineParallelStrategy(NDParallelStrategy):
    """Pipeline parallelism: the block list cut into ``pp`` stages (more per rank for interleaved schedules), run
    by a torch.distributed.pipelining schedule (its options: ``PipelineOptions`` in
    ``techniques/pipeline/pipeline_parallel.py``; GPipe over one micro-batch is plain layer-split model
    parallelism); composes with FSDP2 over ``dp_shard`` and HSDP. Registered as ``"pipeline_parallel"``. The
    LightningModule's contract is in ``docs/strategies.md`` ("Pipeline parallelism")."""

    def __init__(self, pp: int = -1, dp_shard: int = 1, dp_replicate: int = 1, **kwargs: Any) -> None:
        _refuse_other_sizes("PipelineParallelStrategy", kwargs, "pp", "dp_shard", "dp_replicate")
        super().__init__(dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp, **kwargs)


def register_strategies() -> None:
    """Make the strategies available by name: ``Trainer(strategy="fsdp2")``, ``--trainer.strategy=fsdp2``."""
    for name, cls, description in (
        ("fsdp2", FSDP2Strategy, "lightning_par FSDP2 (fully_shard) over all ranks"),
        ("tensor_parallel", TensorParallelStrategy, "lightning_par tensor parallelism (DTensor, from a plan)"),
        ("context_parallel", ContextParallelStrategy, "lightning_par context parallelism (ring attention)"),
        ("pipeline_parallel", PipelineParallelStrategy, "lightning_par pipeline parallelism (torch pipelining)"),
        ("nd_parallel", NDParallelStrategy, "lightning_par N-D parallelism on one DeviceMesh"),
        ("auto_parallel", AutoParallelStrategy, "lightning_par: the layout the planner predicts fastest"),
        ("model_parallel", ModelParallelStrategy, "lightning_par's drop-in for Lightning's ModelParallelStrategy"),
    ):
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description)

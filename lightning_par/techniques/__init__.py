"""The parallel techniques, each one object: its options, its checks, how it applies itself to the modules of this
rank, and what it needs while a step runs. ``NDParallelStrategy`` is their ordered list."""

from collections.abc import Mapping
from typing import Any

from lightning_par.techniques.activation_checkpointing import ActivationCheckpointing, Compile
from lightning_par.techniques.context_parallel import ContextParallel
from lightning_par.techniques.expert_parallel import ExpertParallel
from lightning_par.techniques.float8 import Float8Training
from lightning_par.techniques.fully_sharded import FullySharded
from lightning_par.techniques.pipeline_parallel import PipelineParallel
from lightning_par.techniques.quantize import QuantizeBase
from lightning_par.techniques.technique import Target, Technique
from lightning_par.techniques.tensor_parallel import TensorParallel


def build_recipe(*, pp_schedule: str = "1f1b", pp_microbatches: int | None = None,
                 pp_stages_per_rank: int | None = None, pp_split_points: list[str] | None = None,
                 pp_loss_method: str = "loss", tp_plan: Mapping[str, Any] | None = None,
                 sequence_parallel: bool = False, loss_parallel: bool = False, cp_algorithm: str = "ring",
                 cp_load_balance: bool = True, cp_seq_dim: int = 1, activation_checkpointing: bool | str = False,
                 compile: bool = False, shard_units: list[str] | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, ep_plan: list[str] | None = None,
                 ep_ranks_per_node: int | None = None, accumulate_unsharded: bool = False,
                 regather_sequence: bool = False, async_tp: bool = False,
                 float8: str | None = None, quantize_base: str | None = None) -> tuple[Technique, ...]:
    """The engine's recipe: every technique with its options, in the order they are applied (and accounted)."""
    return (
        PipelineParallel(pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split_points, pp_loss_method),
        QuantizeBase(quantize_base, float8),
        Float8Training(float8),
        TensorParallel(tp_plan, sequence_parallel, loss_parallel, regather_sequence, async_tp),
        ContextParallel(cp_algorithm, cp_load_balance, cp_seq_dim),
        ExpertParallel(ep_plan, ep_ranks_per_node),
        ActivationCheckpointing(activation_checkpointing),
        Compile(compile),
        FullySharded(shard_units, reshard_after_forward, cpu_offload, accumulate_unsharded),
    )


__all__ = [
    "ActivationCheckpointing",
    "Compile",
    "ContextParallel",
    "ExpertParallel",
    "Float8Training",
    "FullySharded",
    "PipelineParallel",
    "QuantizeBase",
    "Target",
    "Technique",
    "TensorParallel",
    "build_recipe",
]

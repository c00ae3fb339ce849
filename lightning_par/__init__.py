"""lightning_par: PyTorch Lightning strategies for models too big or too slow for one GPU."""

from lightning_par.checkpoint import consolidate_checkpoint
from lightning_par.collectives import full_state_dict
from lightning_par.dims import ParallelDims
from lightning_par.expert_balance import ExpertBiasBalancer
from lightning_par.lightning_checkpoints import to_lightning_checkpoint
from lightning_par.moved_modules import install as _install_moved_modules  # noqa: F401 - old paths of moved modules
from lightning_par.parallel.documents import packed_documents
from lightning_par.parallel.fault_tolerance import FaultTolerance
from lightning_par.parallel.sequence_scope import context_positions, local_sequence, whole_sequence
from lightning_par.planner.search import plan_layouts
from lightning_par.pretrained import load_hf_weights, save_hf_pretrained
from lightning_par.strategies.auto import AutoParallelStrategy
from lightning_par.strategies.base import BaseParallelStrategy
from lightning_par.strategies.lightning_compat import ModelParallelStrategy
from lightning_par.strategies.nd import NDParallelStrategy
from lightning_par.strategies.presets import (
    ContextParallelStrategy,
    FSDP2Strategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    register_strategies,
)
from lightning_par.techniques.experts.experts import (
    attach_auxiliary_loss,
    auxiliary_loss_scale,
    count_dropped_choices,
    local_experts,
)

register_strategies()

__all__ = [
    "AutoParallelStrategy",
    "BaseParallelStrategy",
    "ContextParallelStrategy",
    "ExpertBiasBalancer",
    "FSDP2Strategy",
    "FaultTolerance",
    "ModelParallelStrategy",
    "NDParallelStrategy",
    "ParallelDims",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
    "attach_auxiliary_loss",
    "auxiliary_loss_scale",
    "consolidate_checkpoint",
    "count_dropped_choices",
    "context_positions",
    "full_state_dict",
    "local_experts",
    "local_sequence",
    "load_hf_weights",
    "packed_documents",
    "plan_layouts",
    "save_hf_pretrained",
    "to_lightning_checkpoint",
    "whole_sequence",
]
__version__ = "0.1.0"

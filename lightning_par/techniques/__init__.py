"""The parallel techniques, each one object: its options, its checks, how it applies itself to the modules of this
rank, and what it needs while a step runs. ``NDParallelStrategy`` is their ordered list."""

from lightning_par.techniques.activation_checkpointing import ActivationCheckpointing, Compile
from lightning_par.techniques.context_parallel import ContextParallel
from lightning_par.techniques.fully_sharded import FullySharded
from lightning_par.techniques.pipeline_parallel import PipelineParallel
from lightning_par.techniques.technique import Target, Technique
from lightning_par.techniques.tensor_parallel import TensorParallel

__all__ = [
    "ActivationCheckpointing",
    "Compile",
    "ContextParallel",
    "FullySharded",
    "PipelineParallel",
    "Target",
    "Technique",
    "TensorParallel",
]

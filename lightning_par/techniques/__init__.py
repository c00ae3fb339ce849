"""The parallel techniques, one folder each (``tensor/``, ``context/``, ``pipeline/``, ``experts/``, ``sharding/``,
``recompute/``, ``float8/``, ``quantize/``): its torch-level code (usable without Lightning), its technique object
(its options, its checks, how it applies itself to the modules of this rank, what it needs while a step runs, and
its cost account).
``technique.py`` is what they share; ``recipe.py`` puts them in the engine's order (``NDParallelStrategy``).

The names below are imported when first asked for: the cost model (``costs/``) reads the torch-level modules of
these folders, and importing the package must not pull in the technique objects, which import the cost model."""

from __future__ import annotations

import importlib
from typing import Any

#: name -> the module that defines it
_WHERE = {
    "ActivationCheckpointing": "recompute.activation_checkpointing",
    "Compile": "recompute.activation_checkpointing",
    "ContextParallel": "context.context_parallel",
    "ExpertParallel": "experts.expert_parallel",
    "Float8Training": "float8.float8_training",
    "FullySharded": "sharding.fully_sharded",
    "PipelineParallel": "pipeline.pipeline_parallel",
    "QuantizeBase": "quantize.quantize_base",
    "Recipe": "recipe",
    "Target": "technique",
    "Technique": "technique",
    "TensorParallel": "tensor.tensor_parallel",
    "build_recipe": "recipe",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "ActivationCheckpointing",
    "Compile",
    "ContextParallel",
    "ExpertParallel",
    "Float8Training",
    "FullySharded",
    "PipelineParallel",
    "QuantizeBase",
    "Recipe",
    "Target",
    "Technique",
    "TensorParallel",
    "build_recipe",
]

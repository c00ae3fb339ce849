"""The engine's recipe: every technique with its options, in the order they are applied (and accounted).

Each technique's options are one dataclass in its folder (``TensorParallelOptions``, ...), under the names
``NDParallelStrategy`` takes them; :data:`OPTIONS` lists them in the order of application and :func:`build_recipe`
builds the techniques from those names into a :class:`Recipe`, whose fields name each technique.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, fields
from typing import Any

from lightning_par.techniques.context.context_parallel import ContextParallel, ContextParallelOptions
from lightning_par.techniques.experts.expert_parallel import ExpertParallel, ExpertParallelOptions
from lightning_par.techniques.float8.float8_training import Float8Options, Float8Training
from lightning_par.techniques.pipeline.pipeline_parallel import PipelineOptions, PipelineParallel
from lightning_par.techniques.quantize.quantize_base import QuantizeBase, QuantizeOptions
from lightning_par.techniques.recompute.activation_checkpointing import (
    ActivationCheckpointing,
    ActivationCheckpointingOptions,
    Compile,
    CompileOptions,
)
from lightning_par.techniques.sharding.fully_sharded import FullySharded, FullyShardedOptions
from lightning_par.techniques.technique import Options, Technique
from lightning_par.techniques.tensor.tensor_parallel import TensorParallel, TensorParallelOptions

#: every technique's options dataclass, in the order of application
OPTIONS = (PipelineOptions, QuantizeOptions, Float8Options, TensorParallelOptions, ContextParallelOptions,
           ExpertParallelOptions, ActivationCheckpointingOptions, CompileOptions, FullyShardedOptions)


def option_names() -> list[str]:
    """Every technique option's name, as ``NDParallelStrategy`` and :func:`build_recipe` take it."""
    return [f.name for options in OPTIONS for f in fields(options)]


def planned_options() -> dict[str, Any]:
    """The options the planner decides (``techniques.technique.planned``), with their defaults, in the recipe's
    order: what every layout carries."""
    return {f.name: f.default for options in OPTIONS for f in fields(options) if f.metadata.get("planned")}


def weighed_options() -> dict[str, Field]:
    """The planned options whose values ``plan_layouts`` weighs as asked (its keyword arguments; the planner's
    command-line flags), each with its field (``metadata``: the values weighed by default, the flag's help)."""
    return {f.name: f for options in OPTIONS for f in fields(options) if f.metadata.get("weigh") is not None}


def options_of(values: Mapping[str, Any]) -> tuple[Options, ...]:
    """Every technique's options dataclass, in the recipe's order, from ``values`` by name (the others keep their
    defaults)."""
    return tuple(cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values}) for cls in OPTIONS)


@dataclass
class Recipe:
    """The techniques of one layout, named; iterating gives them in the order they are applied (pipeline split,
    4-bit base weights, float8, tensor parallel, context parallel, expert parallel, activation checkpointing, compile,
    FSDP)."""

    pipeline_parallel: PipelineParallel
    quantize_base: QuantizeBase
    float8: Float8Training
    tensor_parallel: TensorParallel
    context_parallel: ContextParallel
    expert_parallel: ExpertParallel
    activation_checkpointing: ActivationCheckpointing
    compile: Compile
    fully_sharded: FullySharded

    def __iter__(self) -> Iterator[Technique]:
        return iter(tuple(getattr(self, name) for name in _RECIPE_FIELDS))

    def __len__(self) -> int:
        return len(_RECIPE_FIELDS)

    def __getitem__(self, index: int) -> Technique:
        return tuple(self)[index]


#: the recipe's technique names, in order (a plan iterates some 100,000 recipes: ``fields`` each time is slow)
_RECIPE_FIELDS = tuple(f.name for f in fields(Recipe))


def build_recipe(**options: Any) -> Recipe:
    """The engine's recipe from technique options by name (those of :data:`OPTIONS`; the others keep their
    defaults)."""
    unknown = sorted(set(options) - set(option_names()))
    if unknown:
        raise TypeError(f"build_recipe() got unexpected keyword arguments {unknown}; technique options: "
                        f"{option_names()}")

    def chosen(cls: type) -> Any:
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})

    return Recipe(
        pipeline_parallel=chosen(PipelineOptions).build(),
        quantize_base=chosen(QuantizeOptions).build(),
        float8=chosen(Float8Options).build(),
        tensor_parallel=chosen(TensorParallelOptions).build(),
        context_parallel=chosen(ContextParallelOptions).build(),
        expert_parallel=chosen(ExpertParallelOptions).build(),
        activation_checkpointing=chosen(ActivationCheckpointingOptions).build(),
        compile=chosen(CompileOptions).build(),
        fully_sharded=chosen(FullyShardedOptions).build(),
    )

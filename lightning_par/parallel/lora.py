"""LoRA adapters (Hugging Face PEFT) under the parallel techniques: how they follow their base layer's tensor-parallel
style, and how they are initialized on the meta device.

PEFT wraps an adapted ``nn.Linear`` as a LoRA layer: ``base_layer`` (the original weights), ``lora_A[adapter]``
(in -> r) and ``lora_B[adapter]`` (r -> out), with ``out = base_layer(x) + scaling * lora_B(lora_A(x))``. Under tensor
parallelism the adapter must produce its output in the base layer's layout, so the adapter math stays exact (the
same rule PEFT applies to models transformers shards itself, ``peft.tuners.lora.model.add_lora_tp_hooks_dtensor``;
that path needs transformers to own the mesh, so here it is a plan):

* base ``colwise`` (output sharded on features): ``lora_B`` colwise from a replicated input (each rank computes its
  output features), ``lora_A`` replicated (its input is the full ``x``; its gradient arrives all-reduced through
  ``lora_B``'s input, so every rank keeps the same copy).
* base ``rowwise`` (input sharded on features, output reduced): ``lora_A`` rowwise (its r outputs reduced),
  ``lora_B`` replicated; under sequence parallelism B's output is then cut to this rank's sequence chunk, the layout
  of the base's reduce-scattered output.

Anything else (adapters on embeddings, on layers with a gathered or vocabulary-parallel style, DoRA's magnitude
vector) is refused, naming the layer.

LoRA on a mixture of experts' stacked parameters (PEFT's ``target_parameters``) wraps the experts module in one
``ParamWrapper`` per parameter, whose adapters stack every expert's rank: ``lora_A`` (r x experts, in) expert-major,
``lora_B`` (out, r x experts) with the expert index fastest. Expert parallelism keeps them whole and computes each
rank's experts' adapted weights from their slice (:func:`expert_lora_factors`), the way PEFT's ``get_delta_factors``
computes all of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (duck-typed: PEFT is an optional dependency)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def is_param_wrapper(module: nn.Module) -> bool:
    """PEFT's LoRA on a parameter (``target_parameters``): a LoRA layer naming the parameter it adapts."""
    return is_lora_layer(module) and isinstance(getattr(module, "parameter_name", None), str)


def unwrap_param_wrappers(module: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The ``ParamWrapper`` chain around a module (outermost first; one per adapted parameter) and the module."""
    wrappers = []
    while is_param_wrapper(module):
        wrappers.append(module)
        module = module.base_layer
    return wrappers, module


def active_expert_adapters(wrapper: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """``(lora_A weight, lora_B weight, scaling)`` of each adapter that changes ``wrapper``'s parameter now: none
    while adapters are disabled or merged into the weights (then PEFT runs the base layer alone)."""
    if wrapper.disable_adapters or wrapper.merged:
        return []
    return [(wrapper.lora_A[a].weight, wrapper.lora_B[a].weight, wrapper.scaling[a])
            for a in wrapper.active_adapters if a in wrapper.lora_A]


def expert_lora_factors(wrapper: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, first: int,
                        count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lhs, rhs)`` with ``lhs @ rhs`` the update of experts ``first .. first + count`` of ``wrapper``'s stacked
    parameter (before ``scaling``), shaped like that parameter's slice: PEFT's ``ParamWrapper.get_delta_factors``
    for a slice of the experts (``tests/test_expert_parallel`` checks them against PEFT's ``get_delta_weight``)."""
    experts = wrapper.num_experts
    a = lora_a.view(experts, -1, lora_a.shape[-1])[first:first + count]  # (experts, r, in)
    b = lora_b.view(lora_b.shape[0], -1, experts)[..., first:first + count].permute(2, 0, 1)  # (experts, out, r)
    # PEFT stores (experts, out, in) parameters "swapped" (in/out features exchanged): all but those transformers
    # marks is_transposed; the attribute says which it chose (a private one, hence the fallback to its rule)
    swapped = getattr(wrapper, "_did_swap_in_out_features", not getattr(wrapper.get_base_layer(), "is_transposed",
                                                                           False))
    return (b, a) if swapped else (a.transpose(-2, -1), b.transpose(-2, -1))


def lora_tp_entries(name: str, layer: nn.Module, style: Any, sequence_parallel: bool) -> dict[str, Any]:
    """The plan entries that replace ``{name: style}`` for a LoRA layer: its base layer keeps the style, its
    adapters follow it (see the module docstring). Raises for what adapters cannot follow."""
    adapters = list(layer.lora_A.keys())
    if len(getattr(layer, "lora_embedding_A", {})) or len(getattr(layer, "lora_magnitude_vector", {})):
        raise ValueError(
            f"tp_plan: {name!r} carries embedding or DoRA adapters, which cannot follow the tensor-parallel style "
            f"{style!r} of its base layer. Leave this layer out of the LoRA target_modules, or drop its plan entry "
            f"(it then stays replicated), or use dp_shard instead of tp.")
    entries: dict[str, Any] = {f"{name}.base_layer": style}
    if style == "colwise":
        for a in adapters:
            entries[f"{name}.lora_A.{a}"] = _replicated_input()
            entries[f"{name}.lora_B.{a}"] = ColwiseParallel(input_layouts=Replicate())
    elif style == "rowwise":
        for a in adapters:
            if sequence_parallel:
                # A's r outputs all-reduced (not reduce-scattered), B on the whole sequence, its output cut to this
                # rank's chunk ("replicate": backward all-gathers the gradient, so B's copies stay equal). Cheap:
                # r is small; and no sequence-sharded DTensor goes through a Linear (torch 2.11 cannot view it)
                entries[f"{name}.lora_A.{a}"] = RowwiseParallel(output_layouts=Replicate())
                entries[f"{name}.lora_B.{a}"] = "replicate"
            else:
                entries[f"{name}.lora_A.{a}"] = "rowwise"
    else:
        raise ValueError(
            f"tp_plan: {name!r} is a LoRA layer whose base layer is {style!r}; LoRA adapters can follow 'colwise' and "
            f"'rowwise' base layers only (their output must come out in the base layer's layout). Leave {name!r} "
            f"out of the LoRA target_modules, or drop its plan entry so it stays replicated.")
    return entries


def _replicated_input() -> ParallelStyle:
    """A replicated module fed by a replicated input that may arrive as a DTensor (under sequence parallelism the
    sequence is gathered for the whole attention block): compute on the plain local copy."""
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                              use_local_output=True)


def lora_initializers(root: nn.Module) -> dict[str, Any]:
    """``{FQN of lora_A/lora_B module: function initializing it}`` for every adapter in ``root``, following the
    adapter's ``init_lora_weights`` (PEFT's own ``reset_lora_parameters``: A as nn.Linear, B zero by default), for
    models created on the meta device. Initializations that read the base weights (PiSSA, OLoRA, LoftQ, ...) cannot
    run before the weights exist: refused."""
    configs: dict[str, Any] = {}
    for module in root.modules():
        peft_config = getattr(module, "peft_config", None)
        if isinstance(peft_config, dict):
            configs.update(peft_config)
    found: dict[str, Any] = {}
    for name, layer in root.named_modules():
        if not is_lora_layer(layer):
            continue
        for adapter in layer.lora_A.keys():
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if init not in (True, False, "gaussian"):
                raise ValueError(
                    f"LoRA adapter {adapter!r} at {name!r} uses init_lora_weights={init!r}, which reads the base "
                    f"weights; on the meta device (trainer.init_module(empty_init=True)) they do not exist yet. Use "
                    f"init_lora_weights=True or 'gaussian', or create the model with real weights.")

            def run(layer: nn.Module = layer, adapter: str = adapter, init: Any = init) -> None:
                if init is False:  # PEFT's "no special init": the nn.Linear defaults, B not zero
                    layer.lora_A[adapter].reset_parameters()
                    layer.lora_B[adapter].reset_parameters()
                else:
                    layer.reset_lora_parameters(adapter, init)

            found[f"{name}.lora_A.{adapter}"] = run  # initializes A and B together
            found[f"{name}.lora_B.{adapter}"] = _done
    return found


def _done() -> None:
    """lora_B is initialized together with its lora_A."""

"""Recognizing Hugging Face transformers models, and their experts modules, inside a user's module (transformers is
an optional dependency: nothing here imports it; a model can only exist if the user imported it)."""

from __future__ import annotations

import sys

from torch import nn

from lightning_par._compat import is_transformers_experts
from lightning_par.parallel.lora import unwrap_param_wrappers
from lightning_par.parallel.modules import clean_name


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def outermost_hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, model)`` of the transformers models in ``root`` that no other transformers model contains: a
    ``...ForCausalLM``, not the base model inside it (a PEFT wrapper's inner model counts: PEFT is no
    ``PreTrainedModel``)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if is_hf_model(module) and not any(f == "" or name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    return found


def hf_ep_plan(root: nn.Module) -> list[str]:
    """The experts modules of the Hugging Face models in ``root``: their config's ``base_model_ep_plan`` entries of
    style ``ep_dispatch_experts`` (the others name the parameters inside them), relative to ``root``; for a config
    without such entries (transformers 5.17's plans name the experts ``moe_tp_experts``), the model's transformers
    experts modules themselves (the outermost, where LoRA wraps them)."""
    plan: list[str] = []
    for fqn, sub in outermost_hf_models(root):
        base = sub.base_model_prefix if isinstance(getattr(sub, sub.base_model_prefix, None), nn.Module) else ""
        ep_plan = getattr(sub.config, "base_model_ep_plan", None) or {}
        keys = [key for key, style in ep_plan.items() if style == "ep_dispatch_experts"]
        plan += [".".join(p for p in (fqn, base, key) if p) for key in keys]
        if keys:
            continue
        found: list[str] = []
        for name, module in sub.named_modules():  # parents first: a LoRA wrapper before what it wraps
            path = clean_name(".".join(p for p in (fqn, name) if p))
            if name and is_hf_experts(module) and not any(path.startswith(done + ".") for done in found):
                found.append(path)
        plan += found
    return plan


def experts_core(module: nn.Module) -> nn.Module:
    """The experts module itself, inside PEFT's ``ParamWrapper``s when LoRA adapts its parameters."""
    return unwrap_param_wrappers(module)[1]


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module (decorated with ``@use_experts_implementation``), also inside PEFT's LoRA
    wrappers."""
    return is_transformers_experts(experts_core(module))

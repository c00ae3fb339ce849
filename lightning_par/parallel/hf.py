"""Recognizing Hugging Face transformers models inside a user's module (transformers is an optional dependency:
nothing here imports it; a model can only exist if the user imported it)."""

from __future__ import annotations

import sys

from torch import nn


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

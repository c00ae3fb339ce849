"""Giving memory and initial values to a model created on the meta device, one module at a time.

A module is initialized by its own ``reset_parameters()``, except inside a Hugging Face transformers model, where the
model's ``_init_weights(module)`` is used: transformers' own initialization (its std, zeroed biases, norms at one,
rotary ``inv_freq`` recomputed), which its norms and rotary embeddings need (they have no ``reset_parameters``); and
PEFT LoRA adapters, which get PEFT's own initialization (B at zero, so the adapted model starts as the base).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from lightning_par._compat import inner_tensor_names, is_quantized, local_tensor
from lightning_par.parallel.hf import outermost_hf_models
from lightning_par.parallel.lora import lora_initializers


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _initializers(root: nn.Module) -> dict[str, nn.Module]:
    """For each module FQN inside a transformers model: that model (whose ``_init_weights`` initializes it)."""
    owners: dict[str, nn.Module] = {}
    for fqn, model in outermost_hf_models(root):
        for name, _ in model.named_modules():
            owners[".".join(p for p in (fqn, name) if p)] = model
    return owners


def initialize(root: nn.Module, modules: Sequence[str] | None = None, seed: int | None = None) -> list[str]:
    """(Re-)initialize the modules of ``root`` named in ``modules`` (default: every module that owns tensors).

    ``seed``: each module is seeded by ``(seed, its FQN)``, so its values do not depend on which rank holds it
    (pipeline stages) or on what was initialized before. Returns the class names of modules that have no way to be
    initialized (neither ``reset_parameters`` nor a transformers model around them): the caller decides."""
    owners = _initializers(root)
    adapters = lora_initializers(root)
    if modules is None:
        modules = [name for name, module in root.named_modules() if _owns_tensors(module)]
    missing: set[str] = set()
    for fqn in modules:
        module = root.get_submodule(fqn) if fqn else root
        with torch.random.fork_rng(devices=[]) if seed is not None else nullcontext(), _quantized_set_aside(module):
            if seed is not None:
                torch.manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
            if fqn in adapters:
                adapters[fqn]()  # PEFT's initialization of the adapter (B zero: the model starts as the base)
            elif fqn in owners:
                owners[fqn]._init_weights(module)  # transformers' per-module initializer
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            else:
                missing.add(type(module).__name__)
    return sorted(missing)


@contextmanager
def _quantized_set_aside(module: nn.Module) -> Iterator[None]:
    """While a module is initialized, its quantized weights are replaced by meta tensors of their shape (init
    functions on them do nothing); they are put back after. Their values come from the checkpoint."""
    held = {name: p for name, p in module._parameters.items() if p is not None and is_quantized(p)}
    for name, p in held.items():
        module._parameters[name] = nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False)
    try:
        yield
    finally:
        module._parameters.update(held)


def _inner_tensors_to(module: nn.Module, device: torch.device) -> None:
    """Give memory to the inner tensors ``to_empty`` left on the meta device: torchao's NF4 ``empty_like`` keeps
    its scale mean and 16-value table where they were (the codes and scales it does allocate)."""
    for p in module.parameters(recurse=False):
        local = local_tensor(p)
        if not is_quantized(local):
            continue
        for name in inner_tensor_names(local):
            inner = getattr(local, name)
            if inner.is_meta:
                setattr(local, name, torch.empty_like(inner, device=device))


def materialize(root: nn.Module, device: torch.device, subtrees: Sequence[str] = ("",),
                seed: int | None = None) -> list[str]:
    """Give the meta-device tensors under the modules ``subtrees`` of ``root`` memory on ``device``, then
    :func:`initialize` every module there that owns tensors. Subtrees already holding real tensors are left as they
    are. Returns what :func:`initialize` could not initialize."""
    modules = []
    for top in subtrees:
        sub = root.get_submodule(top) if top else root
        for name, module in sub.named_modules():
            # module by module, never the whole tree: ``to_empty`` on a parent would also reach the states of any
            # torchmetrics Metric below it (Metric._apply maps its states and reset values) and leave them garbage
            if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
                module.to_empty(device=device, recurse=False)
                _inner_tensors_to(module, device)
                modules.append(".".join(p for p in (top, name) if p))
    return initialize(root, modules, seed) if modules else []

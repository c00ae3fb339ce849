"""float8 training through torchao, at the torch level (no Lightning): the blocks' linear layers compute their
matmuls in float8 with dynamic scales.

What torchtitan's float8 converter does, as a technique of the engine: ``torchao.float8.convert_to_float8_training``
swaps each chosen ``nn.Linear`` for a ``Float8Linear`` that keeps its weight in high precision (so optimizers,
gradient clipping and checkpoints see the same parameters under the same names: a checkpoint resumes with float8
on or off) and casts the weight, the input and the output gradient to float8 per matmul. Applied first after the
pipeline split, before everything that wraps the blocks.

Which layers: the linear layers inside the blocks whose two dimensions are multiples of 16 (the float8 matmul's
alignment); not the embeddings, not the head (outside the blocks: its logits are the least robust to float8, as
torchtitan leaves them), not the experts of a mixture of experts (grouped matmuls, not ``nn.Linear``: they stay in
the training precision). With FSDP on CUDA the tensorwise recipe all-gathers the weights in float8 with their
scales computed once after each optimizer step for every unit (torchao's ``enable_fsdp_float8_all_gather`` and
``precompute_float8_dynamic_scale_for_fsdp``); gloo cannot all-gather float8, so on CPUs the gathers stay in the
weights' dtype. On a CPU float8 runs for correctness only (``torch._scaled_mm`` there is slower than fp32 matmuls);
on a GPU it needs compute capability 8.9+ (H100, L4, ...) and is fast only compiled (``compile=True``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_par.parallel.modules import inside_any

#: the scaling recipes (torchao's ``Float8LinearConfig.from_recipe_name``): one scale per tensor, or per row
RECIPES = ("tensorwise", "rowwise")
#: a float8 matmul's dimensions must be multiples of this
ALIGNMENT = 16


def check_float8(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value in RECIPES):
        return value
    raise ValueError(f"float8={value!r} is not a float8 recipe: choose one of {list(RECIPES)} (torchao's "
                     f"Float8LinearConfig recipes), or None for no float8.")


def float8_layer_filter(blocks: list[str], skip: list[str]) -> Callable[[nn.Module, str], bool]:
    """``module_filter_fn`` for torchao: the ``nn.Linear`` layers inside ``blocks`` (FQN prefixes), outside ``skip``
    (the experts), with both dimensions multiples of ``ALIGNMENT``."""

    def keep(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and inside_any(fqn, blocks) and not inside_any(fqn, skip)
                and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0)

    return keep


def convert_to_float8(module: nn.Module, recipe: str, blocks: list[str], skip: list[str] = (),
                      fsdp_float8_all_gather: bool = False) -> list[str]:
    """Swap the chosen linear layers of ``module`` for torchao's ``Float8Linear`` in place; return their FQNs.
    Plain torch + torchao: usable without Lightning."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"float8={recipe!r} needs torchao: pip install torchao (the 'float8' extra of "
                          f"lightning_par). ({e})") from e
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = _replace(config, enable_fsdp_float8_all_gather=True)
    keep = float8_layer_filter(list(blocks), list(skip))
    chosen = [fqn for fqn, m in module.named_modules() if keep(m, fqn)]
    if chosen:
        convert_to_float8_training(module, config=config, module_filter_fn=keep)
    return chosen


def _replace(config: Any, **changes: Any) -> Any:
    from dataclasses import replace

    return replace(config, **changes)

"""FLOPs per op from its shapes: torch's ``FlopCounterMode`` table, plus the kernels it has no entry for (torch
2.13): the fused CPU and out-of-tree attention kernels (the same arithmetic as the CUDA flash kernel) and grouped
matmuls (mixture-of-experts experts: ``torch._grouped_mm`` / ``F.grouped_mm``). One table for the planner's profile
and the FLOPs monitor, so they count alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry  # FlopCounterMode's table; public name, not in __all__ (2.13)

_aten = torch.ops.aten


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """``_grouped_mm(a, b, offs)``: every output element is one dot product over its group's share of the shared
    dimension. 2-D x 3-D (tokens of each expert x that expert's weight, forward), 3-D x 3-D (batched), 2-D x 2-D
    (groups along the shared dimension: a weight gradient), 3-D x 2-D (groups along the output columns)."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * a.shape[1] * a.shape[2] * b.shape[1]  # 3-D x 2-D


#: the fused attention kernels: their FLOPs grow with the square of the sequence
ATTENTION_OPS = {
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_fused_attention_overrideable,
}
#: op (overload packet) -> FLOPs formula, called as ``formula(*args, **kwargs, out_val=out)``
FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_fused_attention_overrideable: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._grouped_mm: grouped_mm_flops,
}

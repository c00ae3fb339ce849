"""FLOPs per op from its shapes: torch's ``FlopCounterMode`` table, plus the kernels it has no entry for (torch
2.13): the fused CPU and out-of-tree attention kernels (the same arithmetic as the CUDA flash kernel; all the fused
SDPA kernels take ``sdpa_flops``, which counts grouped-query shapes on torch 2.11 as well) and grouped
matmuls (mixture-of-experts experts: ``torch._grouped_mm`` / ``F.grouped_mm``, and transformers' own loop of matmuls
``transformers::grouped_mm_fallback``, an opaque custom op whose inner matmuls no dispatch mode sees). One table for
the planner's profile and the FLOPs monitor, so they count alike.

A grouped matmul is priced by the rows it is given, i.e. the (token, expert) pairs the router chose: the experts'
weights of every expert are an operand, but only the routed tokens multiply them (Hugging Face's ``grouped_mm``
experts pass all ``E`` weights and offsets over the ``T x top_k`` routed rows)."""

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
    a, b = getattr(a, "shape", a), getattr(b, "shape", b)  # tensors or their shapes (FlopCounterMode's custom_mapping)
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[1] * a[2] * b[1]  # 3-D x 2-D


def sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """A fused attention kernel's forward, operands ``(batch, heads, sequence, width)``: the scores ``Q K^T`` and
    ``P V`` over the whole score matrix, for every query head. Grouped-query attention (fewer key and value heads,
    SDPA's ``enable_gqa``) shares keys and values between query heads but does the same arithmetic per query head.
    The formula of torch 2.13's table, which torch 2.11's refuses (an assertion) when the heads differ: SDPA with
    ``enable_gqa=True`` is what transformers 5 calls for grouped-query models."""
    q, k, v = (getattr(t, "shape", t) for t in (query, key, value))
    batch, heads, queries, width = q
    return 2 * batch * heads * queries * k[-2] * (width + v[-1])


#: the fused attention kernels: their FLOPs grow with the square of the sequence
ATTENTION_OPS = {
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_fused_attention_overrideable,
}
#: op (overload packet) -> FLOPs formula, called as ``formula(*args, **kwargs, out_val=out)``
FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    **dict.fromkeys(ATTENTION_OPS, sdpa_flops),
    _aten._grouped_mm: grouped_mm_flops,
}

#: custom ops of other libraries, by qualified name: they exist only once that library registered them (transformers
#: registers its grouped-matmul fallback when its MoE integration is imported), so they cannot be keyed by op
NAMED_FORMULAS: dict[str, Callable[..., int]] = {
    "transformers::grouped_mm_fallback": grouped_mm_flops,  # (routed rows, weights[E, in, out], offsets)
}


def formula_for(key: Any) -> Callable[..., int] | None:
    """The FLOPs formula of an op (overload packet or higher-order op), or None when it does no counted work."""
    found = FORMULAS.get(key)
    if found is None:
        found = NAMED_FORMULAS.get(getattr(key, "_qualified_op_name", ""))
    return found

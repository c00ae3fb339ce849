"""How a quantized weight is cut into tensor-parallel shards: the contract between the technique that quantizes
weights (QLoRA's NF4, ``techniques/quantize``) and tensor parallelism (``techniques/tensor``).

DTensor splits a plain tensor itself. A quantized tensor subclass holds codes and scales per block of values, so
only its own format knows how to cut it exactly (every rank's piece dequantizing to the same values as the same
rows or columns of the whole weight). The quantizing technique hands such a :class:`QuantizedCut` down the recipe
(``Target.quantized_cut``) and tensor parallelism cuts each quantized weight with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedCut:
    """The two questions tensor parallelism asks of a quantized weight's format."""

    #: ``(weight, dim, parts, shards_after)``: why the weight cannot be cut into ``parts`` exact pieces along
    #: ``dim`` (and each piece then into ``shards_after`` FSDP row shards); None if it can
    why_not: Callable[[torch.Tensor, int, int, int], str | None]
    #: ``(weight, dim, parts, index, shards_after)``: piece ``index`` of ``parts`` along ``dim``, as torch.chunk
    #: would cut the values, in the weight's own quantized format (one FSDP can then cut into ``shards_after`` rows)
    cut: Callable[[torch.Tensor, int, int, int, int], torch.Tensor]

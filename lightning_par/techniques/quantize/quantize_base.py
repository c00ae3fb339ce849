"""QLoRA's 4-bit base weights as a technique of the engine: its option (:class:`QuantizeOptions`), its checks
(not with float8; meta weights only with a ``pretrained=`` checkpoint), and its place in the recipe (first after
the pipeline split, so tensor parallelism cuts the NF4 weights, with the cut this technique hands it, and FSDP
shards and gathers them). The quantization itself: ``nf4_weights``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_par._compat import nf4_gathers_into_dtensors
from lightning_par.collectives import raise_on_every_rank
from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import inside_any
from lightning_par.techniques.quantize.nf4_weights import (
    NF4_CUT,
    check_quantize_base,
    fill_nf4,
    quantize_base_weights,
    refuse_bitsandbytes,
)
from lightning_par.techniques.technique import Options, Target, Technique


@dataclass(frozen=True)
class QuantizeOptions(Options):
    """QLoRA's option, under the name ``NDParallelStrategy`` takes it: ``"nf4"`` or None."""

    quantize_base: str | None = None

    def build(self) -> QuantizeBase:
        return QuantizeBase(self.quantize_base)

    def before_trace(self, module: nn.Module, blocks: list[str]) -> None:
        if self.quantize_base:  # NF4 placeholders of the frozen block weights: the profile counts their bytes
            quantize_base_weights(module, blocks, values_later=True)


class QuantizeBase(Technique):
    """``quantize_base``: the blocks' frozen linear weights as NF4, before tensor parallelism and FSDP wrap them."""

    def __init__(self, value: str | None = None) -> None:
        self.format = check_quantize_base(value)
        self.layers: list[str] = []
        self.left: dict[str, str] = {}

    @property
    def fill(self) -> Callable[[Tensor, Tensor], None] | None:
        """How a checkpoint's whole tensor fills one NF4 placeholder (``pretrained=``); None without NF4."""
        return fill_nf4 if self.format is not None else None

    def check_with_float8(self, float8: str | None) -> None:
        """Not with float8 (the recipe asks, as it builds both)."""
        if self.format is not None and float8 is not None:
            raise ValueError(
                f"quantize_base={self.format!r} with float8={float8!r}: the NF4 base weights are dequantized to the "
                f"compute dtype per layer, and torchao's float8 layers cast their own high-precision weight, which "
                f"an NF4 weight is not. Choose one: quantize_base for memory (QLoRA), float8 for speed.")

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if self.format is None:
            refuse_bitsandbytes(target.module, dims)
            return
        # with pipeline stages each rank sees its own layers: every rank raises what any rank found
        problems = []
        try:
            refuse_bitsandbytes(target.module, dims)
        except ValueError as e:
            problems.append(str(e))
        meta = [f"{fqn}.weight" for fqn, m in target.module.named_modules() if isinstance(m, nn.Linear)
                and inside_any(fqn, target.blocks) and m.weight.is_meta and not m.weight.requires_grad]
        if meta and target.pretrained is None:
            problems.append(
                f"quantize_base={self.format!r}: the frozen linear weights of the blocks are on the meta device "
                f"({meta[0]!r} and {len(meta) - 1} more) and no pretrained= checkpoint gives them values; NF4 codes "
                f"are computed from the values. Pass pretrained=<the Hugging Face checkpoint directory> (each rank "
                f"then quantizes one whole weight at a time and keeps its shard), or create the model with real "
                f"weights (trainer.init_module(empty_init=False)) and load them before fit, or quantize_base=None.")
        raise_on_every_rank(problems)
        target.quantized_cut = NF4_CUT  # tensor parallelism cuts the NF4 weights with it, exactly
        shards = dims.mesh_size("dp_shard_cp")  # FSDP's row shards of each weight
        if shards > 1 and dims.tp > 1:  # FSDP2 then gathers tensor-parallel NF4 pieces
            nf4_gathers_into_dtensors()
        # with a checkpoint to read, the weights become NF4 placeholders now, filled from it shard by shard later
        self.layers, self.left = quantize_base_weights(target.module, target.blocks, target.experts, shards,
                                                       values_later=target.pretrained is not None)
        if self.left:
            some = ", ".join(f"{k} ({v})" for k, v in list(self.left.items())[:3])
            warnings.warn(f"quantize_base={self.format!r} left {len(self.left)} frozen linear weights unquantized: "
                          f"{some}{', ...' if len(self.left) > 3 else ''}.", stacklevel=2)
        if not self.layers:
            warnings.warn(f"quantize_base={self.format!r} quantized no weight: no frozen nn.Linear weight inside the "
                          f"blocks ({len(target.blocks)} of them) could be cut into NF4 blocks. QLoRA quantizes "
                          f"frozen base weights: freeze them, or wrap the model with PEFT's LoRA.", stacklevel=2)

    def describe(self, dims: ParallelDims) -> str | None:
        if self.format is None:
            return None
        return f"{self.format} base weights ({len(self.layers)} frozen linear weights)"

"""QLoRA's 4-bit base weights as a technique of the engine: its option (:class:`QuantizeOptions`), its checks
(not with tensor parallelism or float8, not on meta weights), and its place in the recipe (first after the pipeline
split, so FSDP shards and gathers the NF4 weights). The quantization itself: ``nf4_weights``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn

from lightning_par.collectives import raise_on_every_rank
from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import inside_any
from lightning_par.techniques.quantize.nf4_weights import (
    check_quantize_base,
    quantize_base_weights,
    refuse_bitsandbytes,
)
from lightning_par.techniques.technique import Options, Target, Technique


@dataclass(frozen=True)
class QuantizeOptions(Options):
    """QLoRA's option, under the name ``NDParallelStrategy`` takes it: ``"nf4"`` or None."""

    quantize_base: str | None = None

    def restrict(self) -> dict[str, list[int]]:
        return {"tp": [1]} if self.quantize_base else {}  # not with tensor parallelism yet

    def build(self) -> QuantizeBase:
        return QuantizeBase(self.quantize_base)


class QuantizeBase(Technique):
    """``quantize_base``: the blocks' frozen linear weights as NF4, before tensor parallelism and FSDP wrap them."""

    def __init__(self, value: str | None = None) -> None:
        self.format = check_quantize_base(value)
        self.layers: list[str] = []
        self.left: dict[str, str] = {}

    def check_with_float8(self, float8: str | None) -> None:
        """Not with float8 (the recipe asks, as it builds both)."""
        if self.format is not None and float8 is not None:
            raise ValueError(
                f"quantize_base={self.format!r} with float8={float8!r}: the NF4 base weights are dequantized to the "
                f"compute dtype per layer, and torchao's float8 layers cast their own high-precision weight, which "
                f"an NF4 weight is not. Choose one: quantize_base for memory (QLoRA), float8 for speed.")

    def check(self, dims: ParallelDims) -> None:
        if self.format is not None and dims.tp > 1:
            raise ValueError(
                f"quantize_base={self.format!r} with tp={dims.tp}: torchao's NF4Tensor can be cut along its rows "
                f"only as FSDP2 does (each shard whole blocks of scales), not into the column- and row-parallel "
                f"shards of tensor parallelism (its ops under DTensor's sharding propagation are not implemented). "
                f"Use tp=1 with quantize_base (dp_shard, pp, cp compose with it), or quantize_base=None.")

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
        if meta:
            problems.append(
                f"quantize_base={self.format!r}: the frozen linear weights of the blocks are on the meta device "
                f"({meta[0]!r} and {len(meta) - 1} more): empty_init=True or pretrained= give them values only after "
                f"the model is sharded, and NF4 codes are computed from the values. Create the model with real "
                f"weights (trainer.init_module(empty_init=False)) and load them before fit, or quantize_base=None.")
        raise_on_every_rank(problems)
        shards = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
        self.layers, self.left = quantize_base_weights(target.module, target.blocks, target.experts, shards)
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

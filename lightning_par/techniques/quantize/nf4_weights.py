"""QLoRA's 4-bit base weights (``quantize_base="nf4"``): the frozen weights of the blocks' linear layers stored as
NF4 (torchao's ``NF4Tensor``), dequantized per layer in forward and backward, the trainable adapters beside them.

What the QLoRA paper does, as a technique of the engine: every frozen (``requires_grad=False``) weight of an
``nn.Linear`` inside the blocks, PEFT's ``base_layer`` included, becomes an ``nn.Parameter`` holding
``torchao``'s ``to_nf4(weight)``: 4-bit NormalFloat codes in blocks of 64 values with one absmax scale each, the
scales themselves quantized to int8 in blocks of 256 around their mean (double quantization): 0.516 bytes per
parameter instead of bf16's 2. ``F.linear`` on such a weight runs torchao's ``linear_nf4``: the weight is
dequantized to the input's dtype for the matmul and again in backward (it never gets a gradient), so only one layer
is ever dequantized at a time. LoRA adapters (PEFT), biases, norms, embeddings, the head, and every trainable
weight stay as they are.

Applied first after the pipeline split, so every later technique wraps NF4 parameters: FSDP2 shards them as NF4
(the shard of an NF4 tensor is an NF4 tensor: its codes, scales and scale factors cut at the same rows) and
all-gathers them as NF4 (torchao's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``: the per-rank saving holds
in the gathered copy too); activation checkpointing recomputes through ``linear_nf4``; CPU offload moves the NF4
shards. A layer is left in its dtype, and named, when its weight cannot be cut into whole blocks: torchao needs
``numel % (64 * 256) == 0`` (a block of scales covers 16384 weights), and under FSDP each shard must hold whole
blocks of scales too (``numel % (16384 * shards) == 0``, the rows divisible by the shards).

Refused, naming why: tensor parallelism (torchao's NF4 has no DTensor sharding rule but FSDP's dim-0 split: a
column- or row-parallel NF4 weight would need the scales re-cut along the other dimension), float8 (the NF4 weight
is dequantized to the compute dtype; float8 would cast a weight it cannot own), and a model whose weights are still
on the meta device (``empty_init=True``) with no checkpoint to read them from: NF4 codes are computed from values.

With ``pretrained=`` the weights become NF4 placeholders on the meta device before FSDP shards them; once the shards
have memory each rank reads one whole weight at a time from the checkpoint, quantizes it exactly as one process
does and keeps its rows (:func:`fill_nf4`): no rank ever holds the model unquantized, nor more than one whole
weight beside its own NF4 shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_par._compat import local_tensor, meta_nf4
from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import inside_any

#: the 4-bit formats ``quantize_base`` takes
FORMATS = ("nf4",)
#: the QLoRA paper's block sizes: 64 weights per absmax scale, 256 scales per second-level (double) scale
BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256


def check_quantize_base(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value in FORMATS):
        return value
    raise ValueError(f"quantize_base={value!r} is not a 4-bit format: choose one of {list(FORMATS)} (QLoRA's "
                     f"NormalFloat-4 base weights, through torchao), or None to keep the base weights as they are.")


def _nf4() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise ImportError(f"quantize_base='nf4' needs torchao's NF4Tensor: pip install torchao (>= 0.18). ({e})") from e
    return nf4_tensor


def is_nf4(tensor: Any) -> bool:
    """An NF4 weight, plain or as the local shard of a DTensor."""
    local = local_tensor(tensor)
    return type(local).__name__ == "NF4Tensor"


def why_not_quantizable(weight: torch.Tensor, shards: int = 1, block_size: int = BLOCK_SIZE,
                        scaler_block_size: int = SCALER_BLOCK_SIZE, need_values: bool = True) -> str | None:
    """Why ``to_nf4`` cannot take ``weight`` (or FSDP could not cut it into ``shards`` NF4 shards); None if it can.
    ``need_values=False``: its values come later (:func:`fill_nf4`), so a meta weight is fine."""
    if weight.dim() != 2:
        return f"{weight.dim()}-D weight (NF4 weights are 2-D)"
    if need_values and weight.is_meta:
        return "on the meta device (no values to quantize)"
    if not weight.is_floating_point():
        return f"dtype {weight.dtype}"
    unit = block_size * scaler_block_size
    if weight.numel() % (unit * shards) or weight.shape[0] % shards:
        whole = f"{unit}" if shards == 1 else f"{unit} x {shards} shards, rows divisible by {shards}"
        return f"{tuple(weight.shape)} = {weight.numel()} weights, not whole blocks of {whole}"
    return None


def quantize_base_weights(module: nn.Module, blocks: list[str], skip: list[str] = (), shards: int = 1,
                          block_size: int = BLOCK_SIZE, scaler_block_size: int = SCALER_BLOCK_SIZE,
                          values_later: bool = False) -> tuple[list[str], dict[str, str]]:
    """Replace, in place, every frozen weight of an ``nn.Linear`` inside ``blocks`` (FQN prefixes; not under
    ``skip``) by an NF4 parameter (torchao ``to_nf4``, double quantization). Returns the FQNs of the weights
    quantized and ``{FQN: why}`` of the frozen linear weights left as they were. Plain torch + torchao: usable
    without Lightning (quantize a model once, then train its adapters in any loop).

    ``values_later``: the weights' values come from a checkpoint read after the model is sharded (``pretrained=``):
    each becomes an NF4 placeholder on the meta device, of its shape and dtype (its own values, if any, are freed),
    which :func:`fill_nf4` fills from the checkpoint's whole weight once the shards have memory."""
    to_nf4 = _nf4().to_nf4
    done: list[str] = []
    left: dict[str, str] = {}
    for fqn, layer in module.named_modules():
        if not (isinstance(layer, nn.Linear) and inside_any(fqn, list(blocks)) and not inside_any(fqn, list(skip))):
            continue
        weight = layer.weight
        if weight.requires_grad or is_nf4(weight):
            continue  # trainable (an adapter, a layer the user trains): stays; already NF4: once is enough
        why = why_not_quantizable(weight, shards, block_size, scaler_block_size, need_values=not values_later)
        if why is not None:
            left[f"{fqn}.weight"] = why
            continue
        with torch.no_grad():
            nf4 = meta_nf4(tuple(weight.shape), weight.dtype, block_size, scaler_block_size) if values_later or \
                weight.is_meta else to_nf4(weight.detach().contiguous(), block_size, scaler_block_size)
        layer.weight = nn.Parameter(nf4, requires_grad=False)
        done.append(f"{fqn}.weight")
    return done, left


def fill_nf4(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Fill an NF4 weight (a placeholder of :func:`quantize_base_weights`, plain or this rank's FSDP shard as a
    DTensor) from the whole weight ``whole``: quantized whole, exactly as one process quantizes it (the double
    quantization's mean is over every block of the weight), then this rank's rows taken as FSDP2 cuts them
    (``torch.chunk`` along dim 0, each chunk whole blocks of scales) and written into the shard's codes, scales,
    factors and mean in place. Only ``whole`` and its NF4 copy are ever held in full, one weight at a time."""
    local = local_tensor(tensor)
    with torch.no_grad():
        source = whole.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
        quantized = _nf4().to_nf4(source, local.block_size, local.scaler_block_size)
        chunks, index = _row_chunk(tensor)
        mine = torch.chunk(quantized, chunks, dim=0)[index] if chunks > 1 else quantized
        if tuple(mine.shape) != tuple(local.shape):
            raise ValueError(f"fill_nf4: this rank's rows of the whole weight {tuple(whole.shape)} are "
                             f"{tuple(mine.shape)}, its shard is {tuple(local.shape)}.")
        for name in local.__tensor_flatten__()[0]:  # codes, scales, factors, mean, the 16-value table
            getattr(local, name).copy_(getattr(mine, name))


def _row_chunk(tensor: torch.Tensor) -> tuple[int, int]:
    """How many row chunks a DTensor weight is cut into and which one this rank holds (1, 0 for a plain tensor):
    FSDP2 shards along dim 0 over one mesh dimension (replicated over the others under HSDP)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return 1, 0
    sharded = [i for i, p in enumerate(placements) if p.is_shard()]
    if not sharded:
        return 1, 0
    if len(sharded) > 1 or placements[sharded[0]].dim != 0:
        raise ValueError(f"fill_nf4: an NF4 weight sharded as {placements}; only FSDP2's rows over one mesh "
                         f"dimension are supported.")
    mesh = tensor.device_mesh
    return mesh.size(sharded[0]), mesh.get_local_rank(sharded[0])


def nf4_bytes(tensor: torch.Tensor) -> int:
    """Bytes an NF4 weight (or this rank's NF4 shard of one) holds: codes, int8 scales, their scale factors and
    mean (the 16-entry lookup table shared by the format left out)."""
    local = local_tensor(tensor)
    return sum(t.numel() * t.element_size() for t in (local.quantized_data, local.quantized_scalers,
                                                        local.quantization_factor, local.scaler_mean))


def dequantized(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The NF4 weight's values as a plain tensor (its own dtype unless ``dtype``); other tensors as they are."""
    local = local_tensor(tensor)
    if not is_nf4(local):
        return tensor
    return local.get_original_weight().to(dtype or local.dtype)


#: bitsandbytes' quantized layers and parameters (by name: bitsandbytes is no dependency)
BITSANDBYTES = ("Linear4bit", "LinearNF4", "LinearFP4", "Linear8bitLt", "Params4bit", "Int8Params")


def refuse_bitsandbytes(module: nn.Module, dims: ParallelDims) -> None:
    """A model already quantized by bitsandbytes trains where nothing cuts its weights (one process, a pipeline: a
    stage moves whole layers); sharded (FSDP over ``dp_shard x cp``) or tensor-parallel it is refused: its packed
    4-bit or 8-bit data would be cut apart from its quantization state (one per whole weight), which FSDP2 and
    DTensor know nothing of."""
    if dims.dp_shard * dims.cp == 1 and dims.tp == 1:
        return
    found = next((f"{fqn} ({type(t).__name__})" for fqn, t in [*module.named_modules(), *module.named_parameters()]
                  if type(t).__name__ in BITSANDBYTES), None)
    if found is not None:
        raise ValueError(
            f"{found} is quantized by bitsandbytes, whose packed weights and quantization state cannot be sharded by "
            f"FSDP2 or tensor parallelism (dp_shard={dims.dp_shard}, cp={dims.cp}, tp={dims.tp}). Load the model "
            f"unquantized (no BitsAndBytesConfig) and pass quantize_base='nf4' to the strategy: the same QLoRA "
            f"4-bit NF4 base weights, sharded and gathered as NF4; or train it on one process or under pp alone.")

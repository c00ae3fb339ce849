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

Under tensor parallelism each rank keeps its piece of a weight in NF4, cut from the whole weight's codes exactly
(:func:`nf4_cut`): a column-parallel weight's rows, a row-parallel weight's columns, each piece dequantizing to
the same values as those rows or columns of the whole NF4 weight. torchao's format cuts rows only (its scales
follow the flattened values); a row-parallel piece takes whole 64-value blocks from every row, so its second-level
scale blocks are re-cut to the largest size that keeps each within one of the whole weight's (down to 8 scales a
factor for a Llama MLP's 14336 columns over 4 ranks: 0.004 bytes more per weight). Tensor parallelism receives
the cut from the recipe (``Target.quantized_cut``): it knows no NF4.

Refused, naming why: float8 (the NF4 weight is dequantized to the compute dtype; float8 would cast a weight it
cannot own), a tensor-parallel style other than column- and row-parallel on an NF4 weight, and a model whose
weights are still on the meta device (``empty_init=True``) with no checkpoint to read them from: NF4 codes are
computed from values.

With ``pretrained=`` the weights become NF4 placeholders on the meta device before FSDP shards them; once the shards
have memory each rank reads one whole weight at a time from the checkpoint, quantizes it exactly as one process
does and keeps its rows (:func:`fill_nf4`): no rank ever holds the model unquantized, nor more than one whole
weight beside its own NF4 shards.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_par._compat import inner_tensor_names, local_tensor, meta_nf4
from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import inside_any
from lightning_par.parallel.quantized_cut import QuantizedCut

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
    """Fill an NF4 weight (a placeholder of :func:`quantize_base_weights`, plain or this rank's shard as a DTensor)
    from the whole weight ``whole``: quantized whole, exactly as one process quantizes it (the double
    quantization's mean is over every block of the weight), then cut as the shard was (:func:`nf4_cut` along each
    sharded mesh dimension, the last first: tensor parallelism's piece, then FSDP2's rows of it) and written into
    the shard's codes, scales, factors and mean in place. Only ``whole`` and its NF4 copy are ever held in full,
    one weight at a time."""
    local = local_tensor(tensor)
    with torch.no_grad():
        source = whole.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
        # the whole weight's scale blocks: quantize_base_weights' (a cut piece's own may be smaller)
        mine = _nf4().to_nf4(source, local.block_size, SCALER_BLOCK_SIZE)
        placements = getattr(tensor, "placements", ())
        # a sharded placement names its dim: Shard, and FSDP2's rows over tensor-parallel rows (``_StridedShard``,
        # a Shard subclass in some torch versions, not in 2.13)
        dims = [getattr(p, "dim", None) for p in placements]
        for i in reversed(range(len(placements))):
            if dims[i] is not None:
                mesh = tensor.device_mesh
                after = math.prod(mesh.size(j) for j in range(i) if dims[j] is not None)
                mine = nf4_cut(mine, dims[i], mesh.size(i), mesh.get_local_rank(i), after)
        if tuple(mine.shape) != tuple(local.shape) or mine.scaler_block_size != local.scaler_block_size:
            raise ValueError(f"fill_nf4: this rank's piece of the whole weight {tuple(whole.shape)} is "
                             f"{tuple(mine.shape)} in scale blocks of {mine.scaler_block_size}, its shard is "
                             f"{tuple(local.shape)} in blocks of {local.scaler_block_size} (placements "
                             f"{placements}).")
        for name in inner_tensor_names(local):  # codes, scales, factors, mean, the 16-value table
            getattr(local, name).copy_(getattr(mine, name))


def _block_pieces(shape: tuple[int, int], block_size: int, scaler_block_size: int, dim: int, parts: int,
                  shards_after: int = 1) -> tuple[torch.Tensor, int]:
    """The blocks (indices into the whole weight's row-major 64-value blocks) of each of ``parts`` pieces along
    ``dim``, a row per piece in the piece's own row-major order, and the size of the pieces' scale blocks: the
    largest that divides every piece into runs from one scale block of the whole (the same on every piece), and
    each piece into ``shards_after`` shards of whole scale blocks (FSDP's rows of it, which torchao cuts so)."""
    rows, cols = shape
    blocks = torch.arange(rows * cols // block_size)
    if dim == 0:
        pieces = blocks.view(parts, -1)
    else:
        pieces = blocks.view(rows, parts, cols // block_size // parts).transpose(0, 1).reshape(parts, -1)
    groups = pieces // scaler_block_size
    changes = ((groups[:, 1:] != groups[:, :-1]).any(0).nonzero().flatten() + 1).numpy()
    count = pieces.shape[1]
    return pieces, int(np.gcd.reduce(np.append(changes, [count, count // shards_after])))


def why_not_cut(weight: torch.Tensor, dim: int, parts: int, shards_after: int = 1) -> str | None:
    """Why an NF4 weight cannot be cut into ``parts`` exact pieces along ``dim`` (tensor parallelism), each then
    into ``shards_after`` FSDP row shards; None if it can."""
    nf4 = local_tensor(weight)
    rows, cols = nf4.shape
    size = (rows, cols)[dim]
    piece = (rows // parts * cols) if dim == 0 else cols // parts
    if size % parts or piece % nf4.block_size:
        what = "rows (each piece whole" if dim == 0 else "columns (each row's piece whole"
        return (f"{tuple(nf4.shape)} cut into {parts} pieces of its {what} {nf4.block_size}-value NF4 blocks) is "
                f"not possible")
    local_rows = rows // parts if dim == 0 else rows
    local_cols = cols if dim == 0 else cols // parts
    if local_rows % shards_after or (local_rows // shards_after * local_cols) % nf4.block_size:
        return (f"{tuple(nf4.shape)} cut into {parts} pieces of {local_rows} rows, each then into {shards_after} "
                f"FSDP row shards of whole {nf4.block_size}-value blocks, is not possible")
    return None


def nf4_cut(weight: torch.Tensor, dim: int, parts: int, index: int, shards_after: int = 1) -> torch.Tensor:
    """Piece ``index`` of ``parts`` along ``dim`` of an NF4 weight, as torch.chunk cuts its values, itself NF4:
    the whole weight's codes and int8 scales of the piece's blocks, each second-level factor repeated for the
    piece's scale blocks (:func:`_block_pieces`; small enough for ``shards_after`` FSDP row shards), the same mean
    and table. Its values equal the same rows or columns of the whole weight's, bit for bit. Works on meta
    placeholders too (their shapes only)."""
    nf4 = local_tensor(weight)
    module = _nf4()
    if (why := why_not_cut(nf4, dim, parts, shards_after)) is not None:
        raise ValueError(f"nf4_cut: {why}.")
    pieces, scale_block = _block_pieces(tuple(nf4.shape), nf4.block_size, nf4.scaler_block_size, dim, parts,
                                        shards_after)
    blocks = pieces[index]
    device = nf4.quantized_data.device
    rows, cols = nf4.shape
    shape = torch.Size((rows // parts, cols) if dim == 0 else (rows, cols // parts))
    codes = nf4.quantized_data.view(-1, nf4.block_size // 2)[blocks.to(device)].flatten()
    factors = nf4.quantization_factor[(blocks[::scale_block] // nf4.scaler_block_size).to(device)]
    meta = module.SubclassTensorArgs(shape, (shape[1], 1), 0, nf4.dtype, nf4.device, False)
    return module.NF4Tensor(meta, nf4.block_size, blocks.numel(), scale_block, nf4.quantized_scalers[
        blocks.to(device)], factors, nf4.scaler_mean, codes, nf4.nf4)


#: how tensor parallelism cuts an NF4 weight (handed down the recipe by ``quantize_base``)
NF4_CUT = QuantizedCut(why_not=why_not_cut, cut=nf4_cut)


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

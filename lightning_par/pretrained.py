"""Start fine-tuning from a Hugging Face checkpoint, read straight into the sharded model.

``load_hf_weights(module, path)`` fills ``module`` from a directory that ``save_pretrained`` wrote
(``model.safetensors``, or ``model.safetensors.index.json`` and its shards) under any layout: parameters that are
FSDP2 or tensor-parallel DTensors, plain tensors, or only this rank's pipeline stages (the others are absent and
skipped). Each rank reads only the slices it holds: torch.distributed.checkpoint plans the reads from each tensor's
local shard (offsets and lengths in the global tensor) and its ``HuggingFaceStorageReader`` copies
``safe_open(...).get_slice(key)[slices]`` into the shard. With ``trainer.init_module(empty_init=True)`` the model
is built on the meta device, sharded, given memory shard by shard, and then loaded, so no rank ever holds the whole
model in its own memory (the safetensors files are memory-mapped: the pages a rank reads are page cache, shared
by the ranks of a node and released when the file is closed).

Keys: a checkpoint's keys are the Hugging Face model's own (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``); the LightningModule's are longer (``model.model.layers...`` when the Hugging Face model is
``self.model``). The Hugging Face model is found inside the module (the outermost ``PreTrainedModel``), or named by
``prefix``. Non-persistent buffers (rotary ``inv_freq``) are not in a checkpoint: they are recomputed by the
model's own ``_init_weights``, the hook transformers itself uses for them after a meta-device load. A model adapted
with PEFT LoRA loads its base weights (``q_proj.base_layer.weight`` from ``q_proj.weight``); the adapters keep their
initialization. A mixture of experts whose model stacks the experts (``mlp.experts.gate_up_proj``) while its
checkpoint keeps a tensor per expert (``mlp.experts.3.gate_proj.weight``) is filled by the model's own transformers
converters read backwards (``hf_conversions.py``): a rank reads only the experts its shard holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

from lightning_par._compat import is_quantized, local_tensor
from lightning_par.collectives import full_state_dict, raise_on_every_rank
from lightning_par.hf_conversions import Piece, shard_view, stored_names
from lightning_par.parallel.hf import outermost_hf_models
from lightning_par.parallel.lora import is_lora_layer
from lightning_par.parallel.modules import clean_name

__all__ = ["check_hf_checkpoint", "find_hf_model", "load_hf_weights", "recompute_non_persistent_buffers",
           "save_hf_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def check_hf_checkpoint(path: str | os.PathLike, name: str = "path") -> Path:
    """The safetensors files of a ``save_pretrained`` directory, checked; raises a clear error otherwise.
    Reads only the directory listing and the index (no communication): every rank can call it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}={path!r} must be the directory a Hugging Face `save_pretrained` wrote (a str or "
                        f"os.PathLike), got {type(path).__name__}.")
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"{name}={str(directory)!r} does not exist. Pass the directory a Hugging Face "
                                f"`model.save_pretrained(directory)` wrote.")
    if not directory.is_dir():
        raise ValueError(f"{name}={str(directory)!r} is a file, not a Hugging Face checkpoint directory. Pass the "
                         f"directory that holds {SINGLE_FILE} or {INDEX_FILE} (a Lightning .ckpt file resumes "
                         f"through `trainer.fit(ckpt_path=...)` instead).")
    present = sorted(p.name for p in directory.glob("*.safetensors"))
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{name}={str(directory)!r}: {INDEX_FILE} has no 'weight_map'. Re-save the model with "
                             f"`save_pretrained`.")
        expected = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        expected = [SINGLE_FILE]
    else:
        bins = sorted(p.name for p in directory.glob("*.bin"))
        hint = (f" It holds {bins}: PyTorch pickles, which are read whole; re-save with "
                f"`model.save_pretrained(directory, safe_serialization=True)`." if bins else "")
        raise ValueError(f"{name}={str(directory)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}, so it is not a "
                         f"Hugging Face safetensors checkpoint.{hint}")
    absent = sorted(set(expected) - set(present))
    stray = sorted(set(present) - set(expected))
    if absent or stray:
        raise ValueError(
            f"{name}={str(directory)!r}: the checkpoint's files do not match its index: missing {absent}, not in the "
            f"index {stray}. Every *.safetensors file in the directory is read, so keep only the files "
            f"`save_pretrained` wrote (move other weights, e.g. adapters, to their own directory).")
    return directory


def find_hf_model(module: nn.Module) -> tuple[str, nn.Module | None]:
    """The FQN prefix (``"model."``, or ``""`` for the module itself) and object of the outermost Hugging Face
    ``PreTrainedModel`` inside ``module``; raises if there is none or more than one."""
    outer = outermost_hf_models(module)
    if len(outer) != 1:
        what = "no Hugging Face PreTrainedModel" if not outer else f"several: {[n for n, _ in outer]}"
        raise ValueError(f"{_class_name(module)} holds {what}, so the checkpoint's keys cannot be matched to its "
                         f"parameters automatically. Pass prefix='<FQN of the model>.' (e.g. prefix='model.' for "
                         f"a Hugging Face model at self.model).")
    name, model = outer[0]
    kept = clean_name(name)
    return (kept + "." if kept else ""), model


def _class_name(module: nn.Module) -> str:
    """The user's class name (FSDP2 swaps a module's class for an ``FSDP<name>`` subclass)."""
    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def recompute_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute the buffers a checkpoint does not hold (rotary ``inv_freq``...) with the owning Hugging Face
    model's ``_init_weights`` (transformers' own hook for them after a meta-device load). Returns their names.

    Needed after meta-device init: ``to_empty`` gives them memory but not values. A module owning both such a
    buffer and parameters has its parameters re-initialized too, so call this before loading the weights."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    done: list[str] = []

    def visit(prefix: str, module: nn.Module, owner: Any) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if names and owner is not None:
            owner._init_weights(module)
            done.extend(prefix + n for n in names)
        for child_name, child in module.named_children():
            visit(f"{prefix}{child_name}.", child, owner)

    visit("", model, None)
    return done


def _tied_sources(model: nn.Module | None) -> dict[str, str]:
    """Hugging Face's ``{tied key: key it is tied to}`` (``lm_head.weight -> model.embed_tokens.weight``); a
    checkpoint holds only the second one."""
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers >= 5
    return dict(tied) if isinstance(tied, dict) else {}


def _checkpoint_key(key: str, adapted: list[str]) -> str | None:
    """The checkpoint key of a model key: a PEFT LoRA layer keeps the original weights under ``base_layer`` (its
    ``q_proj.base_layer.weight`` is the checkpoint's ``q_proj.weight``); its adapters are no checkpoint key (None)."""
    for layer in adapted:
        if key.startswith(layer):
            rest = key[len(layer):]
            return layer + rest[len("base_layer."):] if rest.startswith("base_layer.") else None
    return key


def _plan_pieces(fqn: str, tensor: Tensor, converted: tuple[list[Piece], list[str], list[str]],
                 reads: dict[str, Tensor], missing: list[str], mismatched: list[str]) -> None:
    """Plan the reads of a tensor that the checkpoint stores in pieces (a tensor per expert): only those that fall
    in this rank's shard, each into its view of the shard."""
    pieces, lacking, wrong = converted
    missing.extend(lacking)
    mismatched.extend(wrong)
    if lacking or wrong:
        return
    for piece in pieces:
        try:
            view = shard_view(tensor, piece, fqn)
        except ValueError as error:
            mismatched.append(str(error))
            return
        if view is not None:
            reads[piece.key] = view


def _read_whole(reader: HuggingFaceStorageReader, key: str, like: Tensor) -> Tensor:
    """One checkpoint tensor, whole, in ``like``'s dtype on its device: a local read (no collective), through the
    same storage reader as the sharded reads (only the tensor's bytes are read)."""
    local = local_tensor(like)
    device = getattr(local, "quantized_data", local).device
    whole = torch.empty(like.shape, dtype=like.dtype, device=device)
    dcp.load({key: whole}, storage_reader=reader, no_dist=True)
    return whole


def load_hf_weights(module: nn.Module, path: str | os.PathLike, prefix: str | None = None,
                    fill_quantized: Callable[[Tensor, Tensor], None] | None = None) -> list[str]:
    """Collective (every rank of the default group): load a Hugging Face safetensors checkpoint into ``module``.

    Args:
        module: the model, as the strategy left it (sharded, tensor-parallel, this rank's pipeline stages), or a
            plain single-process model.
        path: the directory ``save_pretrained`` wrote.
        prefix: the FQN prefix of the Hugging Face model inside ``module`` (``"model."`` for ``self.model``);
            default: found automatically. Parameters outside it are left as they are.
        fill_quantized: how a quantized weight (QLoRA's NF4 placeholders, ``quantize_base="nf4"``) is filled from
            the checkpoint's whole tensor, e.g. ``lightning_par.techniques.quantize.nf4_weights.fill_nf4``. Each
            such weight is read whole, one at a time, quantized and cut to this rank's shard: no rank holds more
            than one unquantized weight at a time. Local reads, no collective: pipeline stages may hold different
            numbers of them.

    Every parameter and persistent buffer of the Hugging Face model that this rank holds must be in the checkpoint
    with its global shape (tied weights are read from the key they are tied to); otherwise a ``ValueError`` lists
    them on every rank before any tensor is read. The checkpoint's dtype is converted to the model's.

    Returns: this rank's FQNs outside the Hugging Face model, which were not loaded.
    """
    directory = check_hf_checkpoint(path)
    if prefix is None:
        prefix, hf_model = find_hf_model(module)
    else:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix={prefix!r} must be a str such as 'model.' (or '' for the module itself).")
        prefix = prefix + "." if prefix and not prefix.endswith(".") else prefix
        try:
            hf_model = module.get_submodule(prefix[:-1]) if prefix else module
        except AttributeError:
            hf_model = None

    stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    lora = (clean_name(n) for n, m in module.named_modules() if is_lora_layer(m))
    adapted = [name[len(prefix):] + "." for name in lora if name.startswith(prefix)]
    tied = _tied_sources(hf_model)
    naming = stored_names(hf_model)  # renamed keys, per-expert checkpoint tensors stacked in the model
    state = get_model_state_dict(module)
    reads: dict[str, Tensor] = {}  # checkpoint key -> this rank's tensor to fill
    whole: list[tuple[str, str, Tensor]] = []  # quantized weights: (FQN, checkpoint key, tensor), read whole
    copies: list[tuple[Tensor, Tensor]] = []  # tied in the checkpoint, separate tensors here: (copy, source)
    planned: set[int] = set()
    outside, missing, mismatched = [], [], []
    for fqn, tensor in state.items():
        if not isinstance(tensor, Tensor):
            continue
        if not fqn.startswith(prefix):
            outside.append(fqn)
            continue
        if id(tensor) in planned:  # one tensor under two names (tied weights still shared)
            continue
        key = _checkpoint_key(fqn[len(prefix):], adapted)
        if key is None:  # a LoRA adapter's own weight: not in the base checkpoint, keeps its initialization
            outside.append(fqn)
            continue
        source = next((name for name in naming.names(key) if name in stored), tied.get(key))
        if source not in stored:
            converted = naming.pieces(key, tuple(tensor.shape), stored)
            if converted is None:
                missing.append(key)
            else:
                planned.add(id(tensor))
                _plan_pieces(fqn, tensor, converted, reads, missing, mismatched)
            continue
        md = stored[source]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(tensor.shape):
            found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            mismatched.append(f"{source}: checkpoint {found} vs model {tuple(tensor.shape)}")
            continue
        planned.add(id(tensor))
        if is_quantized(tensor):
            whole.append((fqn, source, tensor))
        elif source in reads:
            copies.append((tensor, reads[source]))
        else:
            reads[source] = tensor
    problems = []
    if len(outside) == len(state):
        problems.append(f"No parameter of {_class_name(module)} starts with prefix={prefix!r}: nothing would be "
                        f"loaded. Pass the FQN prefix of the Hugging Face model inside the module, e.g. 'model.'.")
    if missing or mismatched:
        problems.append(
            f"The Hugging Face checkpoint {str(directory)!r} does not fit the model at prefix {prefix!r}: "
            f"missing {sorted(missing)[:8]}{'...' if len(missing) > 8 else ''} ({len(missing)}), shape mismatch "
            f"{sorted(mismatched)[:8]}{'...' if len(mismatched) > 8 else ''} ({len(mismatched)}). Build the model "
            f"from the checkpoint's own config (`AutoConfig.from_pretrained(path)`), or pass the prefix under which "
            f"the checkpoint's keys sit in your module (prefix=...).")
    if whole and fill_quantized is None:
        problems.append(f"{len(whole)} weights of {_class_name(module)} are quantized ({whole[0][0]!r}, ...): their "
                        f"codes are computed from the whole weight. Pass fill_quantized= (for QLoRA's NF4: "
                        f"lightning_par.techniques.quantize.nf4_weights.fill_nf4), as quantize_base= does.")
    raise_on_every_rank(problems)

    recompute_non_persistent_buffers(hf_model if hf_model is not None else module)  # before: may re-init params
    dcp.load(reads, storage_reader=HuggingFaceStorageReader(str(directory)))
    with torch.no_grad():
        for tensor, source in copies:
            tensor.copy_(source)
    reader = HuggingFaceStorageReader(str(directory))
    for fqn, key, tensor in whole:  # one whole weight at a time, filled in place (the state dict's tensor aliases it)
        fill_quantized(tensor, _read_whole(reader, key, tensor))
        del state[fqn]
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    return outside



def _peft_root(module: nn.Module) -> tuple[str, nn.Module | None]:
    """The outermost PEFT model (``get_peft_model``'s result) inside ``module``: its FQN prefix and object."""
    for name, sub in module.named_modules():
        if isinstance(getattr(sub, "peft_config", None), dict) and hasattr(sub, "merge_and_unload"):
            return (clean_name(name) + "." if name else ""), sub
    return "", None


def save_hf_pretrained(module: nn.Module, directory: str | os.PathLike) -> None:
    """Collective: write the Hugging Face model inside ``module`` as ``save_pretrained`` does (config and
    safetensors), so that ``AutoModelForCausalLM.from_pretrained(directory)`` loads it; LoRA adapters are merged
    into the base weights (PEFT's own ``merge_and_unload``). Works under any layout: the full weights are gathered on
    rank 0 (``full_state_dict``), which alone writes; the copy it builds starts on the meta device and takes the
    gathered tensors as they are (no second copy)."""
    prefix, hf_model = find_hf_model(module)
    peft_prefix, peft_model = _peft_root(module)
    state = full_state_dict(module)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    source = peft_prefix if peft_model is not None else prefix
    # NF4 base weights (quantize_base="nf4") dequantized to the dtype they were quantized from, for the merge
    weights = {k[len(source):]: v.get_original_weight() if hasattr(v, "get_original_weight") else v
               for k, v in state.items() if k.startswith(source)}
    with torch.device("meta"):
        copy = type(hf_model)(hf_model.config)
    if peft_model is not None:
        from peft import get_peft_model

        adapter = peft_model.active_adapter
        copy = get_peft_model(copy, deepcopy(peft_model.peft_config[adapter]), adapter_name=adapter)
    copy.load_state_dict(weights, strict=False, assign=True)
    if getattr(hf_model.config, "tie_word_embeddings", False):
        copy.tie_weights()  # assign=True loaded the two names as two tensors
    if peft_model is not None:
        copy = copy.merge_and_unload()
    missing = [k for k, v in copy.state_dict().items() if v.is_meta]
    if missing:
        raise RuntimeError(f"save_hf_pretrained: {missing[:4]} were not gathered from {_class_name(module)}.")
    copy.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()

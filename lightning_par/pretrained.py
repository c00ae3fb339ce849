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
model's own ``_init_weights``, the hook transformers itself uses for them after a meta-device load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

from lightning_par.checkpoint import raise_on_every_rank
from lightning_par.parallel.hf import outermost_hf_models

__all__ = ["check_hf_checkpoint", "find_hf_model", "load_hf_weights", "recompute_non_persistent_buffers"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# wrappers that state-dict FQNs leave out (activation checkpointing, torch.compile of the whole model)
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


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
    kept = [seg for seg in name.split(".") if seg and seg not in _WRAPPER_SEGMENTS]
    return (".".join(kept) + "." if kept else ""), model


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


def load_hf_weights(module: nn.Module, path: str | os.PathLike, prefix: str | None = None) -> list[str]:
    """Collective (every rank of the default group): load a Hugging Face safetensors checkpoint into ``module``.

    Args:
        module: the model, as the strategy left it (sharded, tensor-parallel, this rank's pipeline stages), or a
            plain single-process model.
        path: the directory ``save_pretrained`` wrote.
        prefix: the FQN prefix of the Hugging Face model inside ``module`` (``"model."`` for ``self.model``);
            default: found automatically. Parameters outside it are left as they are.

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
    tied = _tied_sources(hf_model)
    state = get_model_state_dict(module)
    reads: dict[str, Tensor] = {}  # checkpoint key -> this rank's tensor to fill
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
        key = fqn[len(prefix):]
        source = key if key in stored else tied.get(key)
        if source not in stored:
            missing.append(key)
            continue
        md = stored[source]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(tensor.shape):
            found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            mismatched.append(f"{source}: checkpoint {found} vs model {tuple(tensor.shape)}")
            continue
        planned.add(id(tensor))
        if source in reads:
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
    raise_on_every_rank(problems)

    recompute_non_persistent_buffers(hf_model if hf_model is not None else module)  # before: may re-init params
    dcp.load(reads, storage_reader=HuggingFaceStorageReader(str(directory)))
    with torch.no_grad():
        for tensor, source in copies:
            tensor.copy_(source)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    return outside


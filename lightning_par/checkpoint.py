"""Sharded checkpoints through torch.distributed.checkpoint (DCP), published atomically, and their consolidation.

A checkpoint is a directory: DCP's shard files and ``.metadata``, ``meta.pt`` (the Lightning checkpoint minus the
model and optimizer tensors: loops, epoch, LR schedulers, hyper-parameters, callbacks), and ``COMPLETE``. Every rank
writes into a hidden ``.<name>.partial`` directory; only after all ranks finished does rank 0 add ``COMPLETE`` and
rename it into place. A save interrupted at any point therefore leaves no directory under the final name, and a
directory without ``COMPLETE`` is refused on load. Keys are parameter FQNs and tensors carry global shapes, so a
checkpoint resumes under any other layout (DCP reshards on load).

A single-file Lightning checkpoint (what one process's ``trainer.save_checkpoint`` writes, or
:func:`consolidate_checkpoint`) resumes into the sharded model too (:func:`load_single_file`): the file is
memory-mapped and each rank copies only its slices, through the same DCP load plans.

Frozen quantized weights (QLoRA's NF4 base weights, ``quantize_base``) are left out of a checkpoint: they never
change while training, every layout cuts them differently, and their values come back as they came the first time
(``pretrained=``, or the model's own initialization). The checkpoint keeps a fingerprint of each instead
(:func:`quantized_fingerprints`), and resuming compares the model's against it, so other base weights are refused
rather than silently trained on.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lightning_par._compat import is_quantized, local_tensor
from lightning_par.collectives import is_rank_zero, raise_on_every_rank
from lightning_par.parallel.modules import clean_name

META_FILE = "meta.pt"  # the name Lightning's ModelParallelStrategy uses for the same content
COMPLETE_FILE = "COMPLETE"
FORMAT = "lightning_par-dcp-1"
TRAINABLE_ONLY = "lightning_par_trainable_only"  # meta key: the checkpoint holds the trainable parameters only
#: meta key: the frozen quantized weights left out of the checkpoint, by state-dict name, with their fingerprints
QUANTIZED = "lightning_par_quantized"
#: how close two fingerprints of the same weights are (float64 sums of the same values in another order)
FINGERPRINT_RTOL = 1e-9


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sibling(path: Path, kind: str) -> Path:
    # a hashed name: Lightning's ckpt_path="last" picks any entry whose name contains "last", partial ones included
    return path.parent / f".lightning_par-{kind}-{hashlib.sha1(path.name.encode()).hexdigest()[:12]}"


def partial_path(path: Path) -> Path:
    return _sibling(path, "partial")


def save_sharded(tensors: dict[str, Any], meta: dict[str, Any], path: str | os.PathLike) -> None:
    """Collective: every rank writes its shards of ``tensors``; rank 0 writes ``meta``; then publish atomically."""
    path = Path(path)
    staging = partial_path(path)
    if is_rank_zero():
        shutil.rmtree(staging, ignore_errors=True)  # left over by an interrupted save
        staging.mkdir(parents=True)
    _barrier()
    dcp.save(tensors, checkpoint_id=staging)
    if is_rank_zero():
        torch.save(meta, staging / META_FILE)
        (staging / COMPLETE_FILE).write_text(json.dumps({"format": FORMAT, "keys": len(tensors)}))
        replace_dir(staging, path)
    _barrier()


def replace_dir(src: Path, dst: Path) -> None:
    if dst.is_file() or dst.is_symlink():
        dst.unlink()
    elif dst.exists():
        old = _sibling(dst, "old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(src, dst)


def is_complete(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / COMPLETE_FILE).is_file() and (path / ".metadata").is_file() and (path / META_FILE).is_file()


def check_complete(path: str | os.PathLike) -> Path:
    """Raise a clear error unless ``path`` holds a complete lightning_par checkpoint. No communication."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist. Pass the directory of a saved checkpoint.")
    if not path.is_dir():
        raise ValueError(
            f"ckpt_path={str(path)!r} is a file, not a lightning_par sharded checkpoint directory. A single-file "
            f"checkpoint already is what consolidation produces: resume from it with `trainer.fit(ckpt_path=...)` or "
            f"load its weights with `LightningModule.load_from_checkpoint`."
        )
    if not is_complete(path) and not _written_by_lightning(path):
        missing = [f for f in (COMPLETE_FILE, ".metadata", META_FILE) if not (path / f).is_file()]
        raise ValueError(
            f"ckpt_path={str(path)!r} holds no complete checkpoint (missing {missing}): its save was interrupted, or "
            f"it is neither a lightning_par nor a Lightning ModelParallelStrategy checkpoint (those need .metadata "
            f"and {META_FILE}). Resume from an earlier complete checkpoint."
        )
    return path


def _written_by_lightning(path: Path) -> bool:
    """A complete checkpoint of Lightning's ModelParallelStrategy: it writes meta.pt after DCP's .metadata, which
    DCP writes after every shard. A lightning_par checkpoint without its marker (its meta.pt says lightning_par
    wrote it) is not one: lightning_par never publishes a directory before the marker is in it."""
    if (path / COMPLETE_FILE).exists() or not (path / ".metadata").is_file() or not (path / META_FILE).is_file():
        return False
    return TRAINABLE_ONLY not in read_meta(path)


def stored_shapes(path: str | os.PathLike, prefix: str) -> dict[str, torch.Size]:
    """Global shapes of the tensors stored under ``prefix`` (e.g. ``"state_dict."``), read from DCP metadata."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key[len(prefix):]: md.size
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def compare_shapes(path: Path, stored: Mapping[str, torch.Size], model_shapes: dict[str, torch.Size]) -> None:
    """Raise unless ``stored`` (a checkpoint's FQNs and global shapes) and ``model_shapes`` are the same."""
    missing = sorted(set(model_shapes) - set(stored))
    unexpected = sorted(set(stored) - set(model_shapes))
    mismatched = sorted(
        f"{k}: checkpoint {tuple(stored[k])} vs model {tuple(model_shapes[k])}"
        for k in set(stored) & set(model_shapes)
        if tuple(stored[k]) != tuple(model_shapes[k])
    )
    if missing or unexpected or mismatched:
        raise ValueError(
            f"ckpt_path={str(path)!r} was saved from a different model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}, "
            f"shape mismatch {mismatched[:5]}. Resume with the model configuration that wrote it."
        )


def quantized_fingerprints(state: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Collective: ``{name: (sum, sum of squares)}`` of the dequantized values of every quantized weight in a model
    state dict (each rank's piece of it), over the whole weight in float64: the same under every layout up to the
    order of summation (each piece counted once; replicas, which hold the same piece, scaled out by the elements
    counted against the weight's own). Under a pipeline each rank contributes its stages' weights."""
    local: dict[str, tuple[float, float, int, int]] = {}
    for name, value in state.items():
        if isinstance(value, Tensor) and is_quantized(value):
            piece = local_tensor(value)
            values = piece.get_original_weight().float()
            local[name] = (float(values.sum(dtype=torch.float64)), float(values.square().sum(dtype=torch.float64)),
                           piece.numel(), value.numel())
    parts = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    totals: dict[str, list[float]] = {}
    for part in parts:
        for name, (total, squares, counted, whole) in part.items():
            entry = totals.setdefault(name, [0.0, 0.0, 0, whole])
            entry[0], entry[1], entry[2] = entry[0] + total, entry[1] + squares, entry[2] + counted
    return {name: (total * whole / counted, squares * whole / counted)
            for name, (total, squares, counted, whole) in totals.items()}


def check_quantized_weights(path: Path, stored: Mapping[str, tuple[float, float]], model: Mapping[str, tuple[float,
                            float]], plain_in_checkpoint: set[str]) -> None:
    """Raise, naming the weights and the fix, unless the model's quantized weights are the ones the checkpoint left
    out (its fingerprints) and the checkpoint stores none of them unquantized. No communication (the fingerprints
    are the same on every rank)."""
    problems = []
    plain = sorted(plain_in_checkpoint & set(model))
    if plain:
        problems.append(
            f"{plain[0]!r} and {len(plain) - 1} more are quantized in this run (quantize_base) and stored unquantized "
            f"in the checkpoint: quantized weights are frozen and read from pretrained=. Resume without "
            f"quantize_base, or start the QLoRA run from the base weights (pretrained=) and the adapters only "
            f"(a save_trainable_only checkpoint).")
    missing = sorted(set(stored) - set(model))
    if missing:
        problems.append(
            f"{missing[0]!r} and {len(missing) - 1} more were 4-bit base weights (quantize_base) when the checkpoint "
            f"was saved, left out of it, and are not quantized in this run: quantize_base is off, or this layout's "
            f"FSDP shards cannot hold whole NF4 blocks of them (a warning named the weights left unquantized). "
            f"Resume with the same quantize_base on a layout that quantizes them (e.g. the one it was saved from).")
    differ = sorted(name for name in set(stored) & set(model) if any(
        abs(a - b) > FINGERPRINT_RTOL * max(abs(a), abs(b), 1.0) for a, b in zip(stored[name], model[name])))
    if differ:
        name = differ[0]
        problems.append(
            f"the checkpoint was saved from other base weights: {name!r} (and {len(differ) - 1} more) sums to "
            f"{stored[name][0]!r} there and {model[name][0]!r} in this model. Its 4-bit base weights (quantize_base) "
            f"are not in the checkpoint: they come from pretrained= or the model's initialization, which must give "
            f"the weights the run started from. Pass the same pretrained= (or build the model as it was built).")
    if problems:
        raise ValueError(f"ckpt_path={str(path)!r}: " + " ".join(problems))


def trainable_names(module: torch.nn.Module) -> set[str]:
    """State-dict names of the trainable parameters."""
    return {clean_name(name) for name, p in module.named_parameters() if p.requires_grad}


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The non-tensor part of a sharded checkpoint (loops, hyper-parameters, lightning_par's own flags)."""
    return torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=False)


def check_same_trainable(path: Path, stored: Mapping[str, torch.Size], model_shapes: dict[str, torch.Size]) -> None:
    """For a checkpoint of the trainable weights only (adapters): the model must train exactly those."""
    unexpected = sorted(set(stored) - set(model_shapes))
    missing = sorted(set(model_shapes) - set(stored))
    if unexpected or missing:
        raise ValueError(
            f"ckpt_path={str(path)!r} holds only the trainable weights of its model (save_trainable_only=True: "
            f"e.g. LoRA adapters), and they do not match what this model trains: the checkpoint has "
            f"{unexpected[:4]}{'...' if len(unexpected) > 4 else ''} ({len(unexpected)}) that this model lacks or "
            f"keeps frozen, and this model trains {missing[:4]}{'...' if len(missing) > 4 else ''} ({len(missing)}) "
            f"that the checkpoint lacks. Build the model with the same adapters (the same peft LoraConfig) and the "
            f"same frozen weights before resuming; the frozen weights come from pretrained=...")
    compare_shapes(path, stored, model_shapes)


def load_sharded(tensors: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """Collective: fill ``tensors`` (this rank's shards, any layout) in place; return the stored ``meta``."""
    dcp.load(tensors, checkpoint_id=Path(path))
    return torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=False)


def consolidate_checkpoint(path: str | os.PathLike, output_file: str | os.PathLike | None = None) -> dict[str, Any]:
    """Assemble a sharded checkpoint into one Lightning checkpoint dict with full (unsharded) weights.

    Runs in a single process, no process group needed. The result has ``state_dict`` (full tensors, keys as in the
    LightningModule) plus the metadata Lightning stores (``hyper_parameters``, ``global_step``, ...), so
    ``MyModule.load_from_checkpoint(output_file)`` works for inference. Optimizer state is left out.
    """
    path = check_complete(path)
    shapes = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state_dict = {
        key[len("state_dict."):]: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in shapes.items()
        if key.startswith("state_dict.") and isinstance(md, TensorStorageMetadata)
    }
    dcp.load({"state_dict": state_dict}, checkpoint_id=path, no_dist=True)
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    if meta.get(QUANTIZED):
        left_out = sorted(meta[QUANTIZED])
        warnings.warn(
            f"consolidate_checkpoint({str(path)!r}): the checkpoint leaves out its {len(left_out)} frozen 4-bit base "
            f"weights (quantize_base; {left_out[0]!r}, ...), so the consolidated state_dict lacks them and a strict "
            f"load_from_checkpoint refuses it. For a whole model export the live run with save_hf_pretrained "
            f"(adapters merged into the dequantized weights), or load it non-strictly over the base weights.",
            stacklevel=2)
    checkpoint = {**meta, "state_dict": state_dict}
    if output_file is not None:
        torch.save(checkpoint, output_file)
    return checkpoint


# ---- single-file Lightning checkpoints into a sharded model ----------------------------------------------------


class MappedTensorsReader(StorageReader):
    """A DCP storage reader over values this process already addresses, e.g. the tensors of a ``torch.load(...,
    mmap=True)`` file: each rank copies only the slices its load plan asks for, nothing is broadcast, and a tensor's
    pages are read from disk only where a rank's slice lies. Keys are flat (``"state_dict.model.head.weight"``)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__()
        self.values = values

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self) -> Metadata:
        entries: dict[str, Any] = {}
        for key, value in self.values.items():
            if isinstance(value, Tensor):
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())
                entries[key] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.size(), [chunk])
            else:
                entries[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=entries)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            value = self.values[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                value = value.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(value)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _model_shapes(model_state: Mapping[str, Any], pipeline: bool) -> dict[str, torch.Size]:
    """Global shapes of the model's tensors; under pipeline parallelism the union over all ranks (collective)."""
    shapes = {k: v.shape for k, v in model_state.items() if isinstance(v, Tensor)}
    if pipeline:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, shapes)
        shapes = {k: v for part in parts for k, v in part.items()}
    return shapes


def _optimizer_sources(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any],
                       name: str, pipeline: bool) -> tuple[dict[str, Any], list[str]]:
    """A single-process optimizer state (keyed by parameter index, in param-group order) keyed by FQN, in the
    flattened form of :func:`get_optimizer_state_dict` (``state.<fqn>.<name>``, ``param_groups.<fqn>.<option>``).
    The indices map to this run's parameters through the param groups: same groups, same order."""
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]  # FQNs, in each group's order
    saved_groups = saved.get("param_groups", [])
    sizes, saved_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        hint = (" Under pipeline parallelism each rank's optimizer holds only its stages' parameters, so an "
                "index-keyed optimizer state cannot be mapped: resume the file under a layout without pp, save a "
                "sharded checkpoint, and resume that under pp." if pipeline else "")
        return {}, [f"{name}: the checkpoint's optimizer has param groups of sizes {saved_sizes}, this run's "
                    f"{sizes}: configure_optimizers must build the optimizer the checkpoint was saved with (same "
                    f"parameters, groups and order).{hint}"]
    sources: dict[str, Any] = {}
    for group, saved_group in zip(groups, saved_groups):
        for fqn, index in zip(group["params"], saved_group["params"]):
            for key, value in saved.get("state", {}).get(index, {}).items():
                sources[f"state.{fqn}.{key}"] = value
            for key, value in saved_group.items():
                if key != "params":
                    sources[f"param_groups.{fqn}.{key}"] = value
    return sources, []


def load_single_file(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], path: str | os.PathLike,
                     optimizer_options: StateDictOptions, pipeline: bool,
                     weights_only: bool | None = None) -> dict[str, Any]:
    """Collective: resume a single-file Lightning checkpoint into the sharded ``model`` and its ``optimizers``.

    The file (``Trainer(strategy="auto").save_checkpoint``, or :func:`consolidate_checkpoint`'s output) is
    memory-mapped on every rank, and each rank copies only the slices of the full tensors it holds. Optimizer
    state, keyed by parameter index in such a file, is mapped to FQNs through the param groups; a file without it
    (consolidated, or saved with ``save_weights_only``) restores the weights and loops, and the optimizers start
    fresh. Returns the rest of the checkpoint (loops, epoch, global_step, LR schedulers...) for Lightning.
    """
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(f"ckpt_path={str(path)!r} is not a checkpoint torch.load can read ({type(e).__name__}: "
                         f"{e}). Pass a Lightning .ckpt file or a lightning_par checkpoint directory.") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("state_dict"), Mapping):
        raise ValueError(f"ckpt_path={str(path)!r} is not a Lightning checkpoint (no 'state_dict' entry). Pass what "
                         f"`trainer.save_checkpoint` or `lightning_par.consolidate_checkpoint` wrote.")
    full = raw.pop("state_dict")
    saved_optimizers = raw.pop("optimizer_states", None)
    model_state = get_model_state_dict(model)
    compare_shapes(path, {k: v.shape for k, v in full.items() if isinstance(v, Tensor)},
                   _model_shapes(model_state, pipeline))

    targets: dict[str, Any] = {f"state_dict.{k}": v for k, v in model_state.items()}
    sources: dict[str, Any] = {f"state_dict.{k}": v for k, v in full.items()}
    optimizer_states: list[dict[str, Any]] = []
    problems: list[str] = []
    if optimizers and not saved_optimizers:
        if is_rank_zero():
            warnings.warn(f"ckpt_path={str(path)!r} holds no optimizer state (a consolidated or weights-only "
                          f"checkpoint): the weights and loops are restored, the optimizers start fresh.", stacklevel=2)
    elif optimizers:
        if len(saved_optimizers) != len(optimizers):
            problems.append(f"ckpt_path={str(path)!r} holds {len(saved_optimizers)} optimizer states, this run has "
                            f"{len(optimizers)} optimizers: configure_optimizers must return the same optimizers.")
        for i, (optimizer, saved) in enumerate(zip(optimizers, saved_optimizers)):
            state = get_optimizer_state_dict(model, optimizer, options=optimizer_options)
            mapped, mapping_problems = _optimizer_sources(model, optimizer, saved, f"optimizer_states[{i}]", pipeline)
            problems += mapping_problems
            if mapping_problems:
                continue
            saved_fqns = {key.split(".", 1)[1].rsplit(".", 1)[0] for key in mapped if key.startswith("state.")}
            for key, value in state.items():
                kind, _, rest = key.partition(".")
                fqn = rest.rsplit(".", 1)[0]
                if kind == "param_groups" and key not in mapped:
                    continue  # an option the saving run's optimizer did not have: keep this run's value
                if kind == "state" and fqn not in saved_fqns:
                    continue  # no state saved for this parameter (it never stepped): it starts fresh, as it would
                targets[f"optimizer_{i}.{key}"] = value
            sources.update({f"optimizer_{i}.{k}": v for k, v in mapped.items()})
            optimizer_states.append(state)
    missing = sorted(k for k in targets if k not in sources)
    mismatched = sorted(f"{k}: checkpoint {tuple(sources[k].shape)} vs this run {tuple(v.shape)}"
                        for k, v in targets.items()
                        if isinstance(v, Tensor) and isinstance(sources.get(k), Tensor) and sources[k].shape != v.shape)
    if missing or mismatched:
        problems.append(f"ckpt_path={str(path)!r}: the optimizer state does not match this run's optimizers: "
                        f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, shape mismatch {mismatched[:5]}. "
                        f"configure_optimizers must build the optimizer the checkpoint was saved with.")
    raise_on_every_rank(problems)

    dcp.load(targets, storage_reader=MappedTensorsReader(sources))
    set_model_state_dict(model, model_state)
    for i, (optimizer, state) in enumerate(zip(optimizers, optimizer_states)):
        state = {k: targets.get(f"optimizer_{i}.{k}", v) for k, v in state.items()}  # loaded non-tensor options
        set_optimizer_state_dict(model, optimizer, state, options=optimizer_options)
    return raw


def check_hf_directory(path: str | os.PathLike) -> Path:
    """The strategies' ``pretrained`` option, checked at construction on every rank (a missing directory, or one
    without safetensors, fails there, not at setup)."""
    from lightning_par.pretrained import check_hf_checkpoint

    return check_hf_checkpoint(path, name="pretrained")


def load_pretrained(module: torch.nn.Module, path: str | os.PathLike | None,
                    fill_quantized: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
    """A strategy's setup step after materializing the model: load the Hugging Face checkpoint at ``path`` (the
    strategy's ``pretrained`` option) into the sharded model, if set. Resuming (``trainer.fit(ckpt_path=...)``)
    restores the checkpoint afterwards, over these weights: the checkpoint wins."""
    if path is None:
        return
    from lightning_par.pretrained import check_hf_checkpoint, load_hf_weights  # only when asked for

    load_hf_weights(module, check_hf_checkpoint(path, name="pretrained"), fill_quantized=fill_quantized)

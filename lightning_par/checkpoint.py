"""Sharded checkpoints through torch.distributed.checkpoint (DCP), published atomically, and their consolidation.

A checkpoint is a directory: DCP's shard files and ``.metadata``, ``meta.pt`` (the Lightning checkpoint minus the
model and optimizer tensors: loops, epoch, LR schedulers, hyper-parameters, callbacks), and ``COMPLETE``. Every rank
writes into a hidden ``.<name>.partial`` directory; only after all ranks finished does rank 0 add ``COMPLETE`` and
rename it into place. A save interrupted at any point therefore leaves no directory under the final name, and a
directory without ``COMPLETE`` is refused on load. Keys are parameter FQNs and tensors carry global shapes, so a
checkpoint resumes under any other layout (DCP reshards on load).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

META_FILE = "meta.pt"  # the name Lightning's ModelParallelStrategy uses for the same content
COMPLETE_FILE = "COMPLETE"
FORMAT = "lightning_par-dcp-1"


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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
    if _is_rank_zero():
        shutil.rmtree(staging, ignore_errors=True)  # left over by an interrupted save
        staging.mkdir(parents=True)
    _barrier()
    dcp.save(tensors, checkpoint_id=staging)
    if _is_rank_zero():
        torch.save(meta, staging / META_FILE)
        (staging / COMPLETE_FILE).write_text(json.dumps({"format": FORMAT, "keys": len(tensors)}))
        _replace_dir(staging, path)
    _barrier()


def _replace_dir(src: Path, dst: Path) -> None:
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
            f"checkpoint loads with `LightningModule.load_from_checkpoint` for weights, not with this strategy."
        )
    if not is_complete(path):
        missing = [f for f in (COMPLETE_FILE, ".metadata", META_FILE) if not (path / f).is_file()]
        raise ValueError(
            f"ckpt_path={str(path)!r} holds no complete checkpoint (missing {missing}): its save was interrupted or "
            f"it is not a lightning_par checkpoint. Resume from an earlier complete checkpoint."
        )
    return path


def stored_shapes(path: str | os.PathLike, prefix: str) -> dict[str, torch.Size]:
    """Global shapes of the tensors stored under ``prefix`` (e.g. ``"state_dict."``), read from DCP metadata."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {
        key[len(prefix):]: md.size
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def check_same_model(path: Path, model_shapes: dict[str, torch.Size], prefix: str = "state_dict.") -> None:
    """Refuse, before any collective, a checkpoint whose parameter names or global shapes differ from the model's."""
    stored = stored_shapes(path, prefix)
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
    checkpoint = {**meta, "state_dict": state_dict}
    if output_file is not None:
        torch.save(checkpoint, output_file)
    return checkpoint


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the module's full (unsharded) weights on CPU, on rank 0; an empty dict on other ranks.

    Keys are the module's own parameter names (activation-checkpoint wrappers stripped), whatever the layout;
    under pipeline parallelism each rank holds only its stages, and rank 0 merges them.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    keys: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized() and len(keys) > 1:
        dist.all_gather_object(keys, sorted(module.state_dict().keys()))
    if all(k == keys[0] for k in keys):  # every rank holds the whole model (sharded or replicated)
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # pipeline stages: each rank gathers its own stages' full tensors, rank 0 merges them
    local = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    parts: list[Any] | None = [None] * len(keys) if _is_rank_zero() else None
    dist.gather_object({k: v.cpu() for k, v in local.items()}, parts, dst=0)
    return {k: v for part in parts or [] for k, v in part.items()}

"""Lightning's ``ModelParallelStrategy`` checkpoint layout: recognised on load, written on request, converted to.

Both layouts are a DCP directory with ``meta.pt`` beside it, model tensors under ``state_dict.<fqn>`` and optimizer
state tensors under ``optimizer_<i>.state.<fqn>.<name>``. They differ in two ways:

* the optimizer's param groups: Lightning stores torch's nested form (``optimizer_<i>.param_groups.<g>.<option>``,
  the group's parameter FQNs in ``...param_groups.<g>.params``); lightning_par stores the flattened form
  (``optimizer_<i>.param_groups.<fqn>.<option>``), which stays meaningful when pipeline ranks hold different
  parameters;
* lightning_par adds ``COMPLETE`` after every rank finished and publishes atomically; Lightning has no marker, but
  it writes ``meta.pt`` only after DCP wrote ``.metadata``, which it writes after every shard: a directory with both
  is a complete Lightning checkpoint.

Loading maps the nested groups onto the flattened ones by FQN (:func:`nested_param_groups`,
:func:`fill_flat_param_groups`); :func:`to_lightning_checkpoint` writes any lightning_par checkpoint in Lightning's
layout, offline, from the group membership lightning_par stores in ``meta.pt`` (:data:`PARAM_GROUPS`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_par import checkpoint as ckpt

#: meta key: per optimizer, per param group, the FQNs of its parameters (all pipeline stages), in group order
PARAM_GROUPS = "lightning_par_param_groups"
_OWN_META_KEYS = (PARAM_GROUPS, ckpt.TRAINABLE_ONLY)


def stores_nested_groups(path: str | os.PathLike, optimizer_key: str) -> bool:
    """Whether the checkpoint holds ``optimizer_key``'s param groups in torch's nested form (Lightning's)."""
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return f"{optimizer_key}.param_groups.0.params" in keys


def _placeholders(path: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
    """Every stored entry under ``prefix``, keyed by its flat DCP key: empty tensors of the stored shape, ``None``
    for pickled values (DCP replaces both on load)."""
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
            for key, md in keys.items() if key.startswith(prefix)}


def nested_param_groups(path: str | os.PathLike, optimizer_key: str) -> list[dict[str, Any]]:
    """Collective (a DCP load): the nested param groups stored under ``optimizer_key``, as torch's
    ``get_optimizer_state_dict`` gives them (``params`` are FQNs)."""
    prefix = f"{optimizer_key}.param_groups."
    flat = _placeholders(path, prefix)
    dcp.load(flat, checkpoint_id=Path(path))
    groups: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        index, _, option = key[len(prefix):].partition(".")
        groups.setdefault(int(index), {})[option] = value
    return [groups[i] for i in sorted(groups)]


def fill_flat_param_groups(flat_state: dict[str, Any], groups: list[dict[str, Any]], where: str) -> list[str]:
    """Set the ``param_groups.<fqn>.<option>`` entries of a flattened optimizer state from nested ``groups`` (each
    parameter takes its group's options); options the saved groups lack keep this run's values. Returns problems:
    parameters of this run that no saved group holds."""
    group_of = {fqn: group for group in groups for fqn in group.get("params", [])}
    missing = set()
    for key in [k for k in flat_state if k.startswith("param_groups.")]:
        fqn, _, option = key[len("param_groups."):].rpartition(".")
        if fqn not in group_of:
            missing.add(fqn)
        elif option in group_of[fqn]:
            flat_state[key] = group_of[fqn][option]
    if not missing:
        return []
    return [f"{where}: the checkpoint's optimizer has no param group holding {sorted(missing)[:4]}: "
            f"configure_optimizers must build the optimizer the checkpoint was saved with."]


def param_group_names(model: nn.Module, optimizers: list[Optimizer], pipeline: bool) -> list[list[list[str]]]:
    """Per optimizer, per param group, the state-dict FQNs of its parameters; under pipeline parallelism the union
    over all ranks in rank order (collective), so a checkpoint knows its whole groups."""
    names = {id(p): ckpt.clean_name(n) for n, p in model.named_parameters()}
    local = [[[names[id(p)] for p in group["params"] if id(p) in names] for group in o.param_groups]
             for o in optimizers]
    if not pipeline:
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged = [[list(dict.fromkeys(f for part in parts for f in part[i][g])) for g in range(len(groups))]
              for i, groups in enumerate(local)]
    return merged


def index_keyed(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by FQN (torch's ``get_optimizer_state_dict(full_state_dict=True)``) keyed by
    parameter index instead, as ``Optimizer.state_dict()`` and Lightning's single-file checkpoints have it."""
    order = [fqn for group in state["param_groups"] for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    groups = [{**group, "params": [index[f] for f in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[fqn]: value for fqn, value in state["state"].items()}, "param_groups": groups}


def to_lightning_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the lightning_par checkpoint directory ``src`` in Lightning's ``ModelParallelStrategy`` layout at
    ``dst``, which Lightning's strategy resumes (``trainer.fit(ckpt_path=dst)``) and lightning_par does too.

    Runs in one process, without a process group, holding the whole model and optimizer state in memory (like
    :func:`~lightning_par.consolidate_checkpoint`). Published atomically, like every lightning_par save.
    """
    src = ckpt.check_complete(src)
    meta = ckpt.read_meta(src)
    values = _placeholders(src)
    dcp.load(values, checkpoint_id=src, no_dist=True)
    nested: dict[str, Any] = {"state_dict": {}}
    for key, value in values.items():
        top, _, rest = key.partition(".")
        if top == "state_dict":
            nested["state_dict"][rest] = value
        elif top.startswith("optimizer_"):
            _add_optimizer_entry(nested.setdefault(top, {"state": {}, "param_groups": {}}), rest, value)
    groups = meta.get(PARAM_GROUPS)
    for top, state in nested.items():
        if top.startswith("optimizer_"):
            state["param_groups"] = _nested_groups(state["param_groups"], groups, int(top.split("_")[1]), src)
    staging = ckpt.partial_path(Path(dst))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    dcp.save(nested, checkpoint_id=staging, no_dist=True)
    torch.save({k: v for k, v in meta.items() if k not in _OWN_META_KEYS}, staging / ckpt.META_FILE)
    (staging / ckpt.COMPLETE_FILE).write_text('{"format": "lightning-model-parallel"}')
    ckpt.replace_dir(staging, Path(dst))
    return Path(dst)


def _add_optimizer_entry(state: dict[str, Any], rest: str, value: Any) -> None:
    kind, _, path = rest.partition(".")
    owner, _, name = path.rpartition(".")
    if kind == "state":
        state["state"].setdefault(owner, {})[name] = value
    else:  # param_groups: flat "<fqn>.<option>" or nested "<g>.<option>"
        state["param_groups"].setdefault(owner, {})[name] = value


def _nested_groups(entries: Mapping[str, dict[str, Any]], groups: list | None, i: int, src: Path) -> list[dict]:
    if all(owner.isdigit() for owner in entries):  # already nested (a checkpoint in Lightning's layout)
        return [entries[g] for g in sorted(entries, key=int)]
    if groups is None or i >= len(groups):
        raise ValueError(f"{str(src)!r} does not record its optimizer's param groups (written before lightning_par "
                         f"stored them): resume it under lightning_par.ModelParallelStrategy and save again, which "
                         f"writes Lightning's layout directly.")
    return [{**entries[fqns[0]], "params": list(fqns)} for fqns in groups[i] if fqns]

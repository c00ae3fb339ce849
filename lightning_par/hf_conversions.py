"""Model tensors that a Hugging Face checkpoint stores as several tensors: experts, above all.

transformers 5 builds a mixture of experts with one stacked tensor per projection (``mlp.experts.gate_up_proj``,
experts x 2*intermediate x hidden), while the checkpoints people download keep one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``, ``...up_proj.weight``); ``from_pretrained`` merges them through the model's
list of ``WeightConverter`` (``transformers.conversion_mapping.get_model_conversion_mapping``, an API PEFT uses too).
Here the same list is read backwards, as *pieces*: each stored tensor is the region of the stacked tensor it fills,
and a rank copies into its own shard only the pieces that fall in it, so under expert parallelism or FSDP each rank
reads only its experts. The operations transformers uses for experts (``MergeModulelist``, then ``Concatenate``)
are the ones understood; a converter with any other operation is not used, and the loader reports its keys as
missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par._compat import local_chunk

__all__ = ["Converter", "Piece", "StoredNames", "pieces_of", "shard_view", "stored_names"]

_MERGE, _CONCAT = "MergeModulelist", "Concatenate"
_UNDERSTOOD = ((_MERGE,), (_MERGE, _CONCAT), (_CONCAT,))


@dataclass(frozen=True)
class Converter:
    """One of transformers' converters, as far as loading needs it: the model-side name, the stored names (``*``
    standing for the expert index), and the dims it stacks the experts along and concatenates the names along
    (``None``: it does not)."""

    target: str
    sources: tuple[str, ...]
    stack_dim: int | None
    concat_dim: int | None
    scope: str = ""


@dataclass(frozen=True)
class Piece:
    """A stored tensor and the region of the model's (global) tensor it fills; ``stack_dim`` is the dim the
    stored tensor lacks (its extent in the region is 1)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stack_dim: int | None


def _plain(pattern: str) -> str | None:
    """A converter's pattern as a plain string (``\\.`` is a dot); None when it is a real regular expression."""
    text = pattern.replace("\\.", ".")
    return None if any(c in text for c in "^$()[]|+?{}\\") else text


@dataclass(frozen=True)
class StoredNames:
    """How a model's keys are named in its checkpoints: transformers' renamings (``.mlp.`` stored as
    ``.block_sparse_moe.`` in Mixtral's) and its stacking converters, both read backwards."""

    renamings: tuple[tuple[str, str, str], ...] = ()  # (model side, stored side, scope)
    converters: tuple[Converter, ...] = ()

    def names(self, key: str) -> list[str]:
        """``key`` itself, then as transformers would have found it stored (renamings undone)."""
        renamed = key
        for target, source, scope in self.renamings:
            if renamed.startswith(scope) and target in renamed:
                renamed = renamed.replace(target, source)
        return [key] if renamed == key else [key, renamed]

    def pieces(self, key: str, shape: tuple[int, ...], stored: dict[str, Any]
               ) -> tuple[list[Piece], list[str], list[str]] | None:
        """``pieces_of`` under the name of ``key`` whose stored pieces the checkpoint lacks fewest of (none: it holds
        them all); None when no converter names ``key``."""
        found = [r for name in self.names(key) if (r := pieces_of(name, shape, stored, self.converters))]
        return min(found, key=lambda r: len(r[1])) if found else None


def stored_names(hf_model: nn.Module | None) -> StoredNames:
    """The renamings and stacking converters transformers applies when it loads ``hf_model`` (none before
    transformers 5, whose models keep a module per expert, nor for a model that is not a ``PreTrainedModel``)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return StoredNames()
    if not isinstance(hf_model, PreTrainedModel):
        return StoredNames()
    renamings, converters = [], []
    for transform in get_model_conversion_mapping(hf_model):
        scope = getattr(transform, "scope_prefix", None) or ""
        if len(transform.target_patterns) != 1:
            continue
        target = _plain(transform.target_patterns[0])
        sources = tuple(_plain(s) for s in transform.source_patterns)
        if target is None or None in sources:
            continue
        if isinstance(transform, WeightRenaming) and not isinstance(transform, WeightConverter):
            if len(sources) == 1 and "*" not in sources[0] + target:
                renamings.append((target, sources[0], scope))
            continue
        operations = tuple(type(op).__name__ for op in transform.operations)
        if not isinstance(transform, WeightConverter) or operations not in _UNDERSTOOD:
            continue
        dims = {type(op).__name__: op.dim for op in transform.operations}
        stack_dim = dims.get(_MERGE)
        if (stack_dim is None) == any("*" in s for s in sources):  # experts <=> an index in the stored names
            continue
        converters.append(Converter(target, sources, stack_dim, dims.get(_CONCAT), scope))
    return StoredNames(tuple(renamings), tuple(converters))


def pieces_of(key: str, shape: tuple[int, ...], stored: dict[str, Any], converters: tuple[Converter, ...]
              ) -> tuple[list[Piece], list[str], list[str]] | None:
    """How the checkpoint ``stored`` (key -> metadata with ``.size``) fills the model tensor ``key`` of global
    ``shape``: its pieces, the stored keys it lacks, and shape mismatches; None when no converter names ``key``."""
    for conv in converters:
        at = key.rfind(conv.target)
        head, tail = key[:at], key[at + len(conv.target):]
        if at < 0 or not key.startswith(conv.scope) or tail:
            continue
        if head and not (head.endswith(".") or conv.target.startswith(".")):
            continue
        experts = shape[conv.stack_dim] if conv.stack_dim is not None else 1
        pieces, missing, mismatched, start = [], [], [], 0
        for source in conv.sources:
            names = [head + source.replace("*", str(e)) + tail for e in range(experts)]
            absent = [n for n in names if n not in stored]
            if absent:
                missing.extend(absent)
                continue
            sizes = [list(shape) for _ in names]
            for e, (name, region) in enumerate(zip(names, sizes)):
                found = tuple(stored[name].size)
                if conv.stack_dim is not None:
                    region[conv.stack_dim] = 1
                if conv.concat_dim is not None:
                    stored_dim = conv.concat_dim - (conv.stack_dim is not None and conv.stack_dim < conv.concat_dim)
                    region[conv.concat_dim] = found[stored_dim] if stored_dim < len(found) else -1
                expected = tuple(s for d, s in enumerate(region) if d != conv.stack_dim)
                if found != expected:
                    mismatched.append(f"{name}: checkpoint {found} vs {expected} in model {key} {tuple(shape)}")
                    continue
                offsets = [0] * len(shape)
                if conv.stack_dim is not None:
                    offsets[conv.stack_dim] = e
                if conv.concat_dim is not None:
                    offsets[conv.concat_dim] = start
                pieces.append(Piece(name, tuple(offsets), tuple(region), conv.stack_dim))
            if conv.concat_dim is not None and not mismatched:
                start += sizes[0][conv.concat_dim]
        if conv.concat_dim is not None and not missing and not mismatched and start != shape[conv.concat_dim]:
            mismatched.append(f"{key}: the stored {', '.join(conv.sources)} add up to {start} along dim "
                              f"{conv.concat_dim}, the model has {shape[conv.concat_dim]}")
        return pieces, missing, mismatched
    return None


def _local_region(tensor: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's part of ``tensor``: the local tensor, its offsets and its sizes in the global tensor (a DTensor's
    chunk, as torch.distributed.checkpoint plans it)."""
    if isinstance(tensor, DTensor):
        return tensor.to_local(), *local_chunk(tensor)
    return tensor, (0,) * tensor.dim(), tuple(tensor.shape)


def shard_view(tensor: Tensor, piece: Piece, name: str) -> Tensor | None:
    """The view of this rank's shard of ``tensor`` (the model tensor ``name``) that ``piece`` fills, shaped as the
    stored tensor; None when the piece lies in another rank's shard. A shard that holds part of a piece (a layout
    cutting one expert's rows) is refused: a stored tensor is read whole."""
    local, offsets, sizes = _local_region(tensor)
    view = local.detach()
    for dim, (start, size, own_start, own_size) in enumerate(zip(piece.offsets, piece.sizes, offsets, sizes)):
        lo, hi = max(start, own_start), min(start + size, own_start + own_size)
        if hi <= lo:
            return None
        if (lo, hi) != (start, start + size):
            raise ValueError(
                f"{name}: this rank holds [{own_start}, {own_start + own_size}) of dim {dim}, which cuts "
                f"{piece.key} (stored whole, [{start}, {start + size}) there). Shard the experts along the "
                f"experts dim only (expert parallelism or FSDP2's default dim 0) to load per-expert checkpoints.")
        view = view.narrow(dim, start - own_start, size)
    return view.squeeze(piece.stack_dim) if piece.stack_dim is not None else view


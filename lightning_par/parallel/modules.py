"""Finding the parts of a user's model that the techniques act on: the block list and shard units."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

from torch import nn


def find_block_list(model: nn.Module, fqn: str | None = None) -> tuple[str, nn.ModuleList | nn.ModuleDict]:
    """Return ``(fqn, container)`` of the model's main list of blocks.

    With ``fqn`` given, that module (a ``ModuleList`` or ``ModuleDict``). Otherwise the container of repeated blocks
    holding the most parameters: the transformer layers in every common model. Raises a ``ValueError`` that says
    what to pass when there is none.
    """
    if fqn is not None:
        try:
            container = model.get_submodule(fqn)
        except AttributeError:
            raise ValueError(
                f"block_list={fqn!r} names no submodule of {type(model).__name__}. Pass the dotted name of the "
                f"nn.ModuleList that holds the model's blocks, e.g. {_candidates_hint(model)}."
            ) from None
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"block_list={fqn!r} is a {type(container).__name__}, not an nn.ModuleList or nn.ModuleDict. "
                f"Pass the dotted name of the container of blocks."
            )
        return fqn, container
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if best is None or numel > best[0]:
                best = (numel, name, module)
    if best is None or best[0] == 0:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict of blocks with parameters, so lightning_par"
            f" cannot find its blocks. Keep the model's layers in an nn.ModuleList, or name the shard units with "
            f"`shard_units=[...]` (class names or FQN globs)."
        )
    return best[1], best[2]  # type: ignore[return-value]


def _candidates_hint(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    return ", ".join(repr(n) for n in names[:3]) if names else "'model.layers'"


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """``*`` matches within one dotted segment (``blocks.*`` is each block, not each block's submodules);
    ``**`` crosses segments."""
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": "[^.]*", "?": "[^.]"}.get(part, re.escape(part)))
    return re.compile("".join(out) + r"\Z")


def fqn_matches(name: str, pattern: str) -> bool:
    return _glob_regex(pattern).match(name) is not None


def inside_any(fqn: str, prefixes: Sequence[str]) -> bool:
    """Whether module ``fqn`` is one of ``prefixes`` or inside one of them (``blocks.0.mlp`` is inside ``blocks.0``,
    ``blocks.01`` is not)."""
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def match_modules(model: nn.Module, patterns: Sequence[str], parameter: str) -> list[tuple[str, nn.Module]]:
    """Modules whose class name equals a pattern or whose FQN matches it as a glob (``model.blocks.*``).

    Every pattern must match at least one module: a pattern that matches nothing is almost always a typo that would
    otherwise silently change what is sharded, so it raises a ``ValueError`` naming ``parameter``.
    """
    matched: dict[str, nn.Module] = {}
    for pattern in patterns:
        hits = [
            (name, module)
            for name, module in model.named_modules()
            if name and (type(module).__name__ == pattern or fqn_matches(name, pattern))
        ]
        if not hits:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"{parameter}: {pattern!r} matches no module of {type(model).__name__}. Give a class name "
                f"(one of {classes[:8]}{'...' if len(classes) > 8 else ''}) or an FQN glob such as "
                f"'model.blocks.*'."
            )
        matched.update(hits)
    # keep model order; a module matched by two patterns is one unit
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(matched.items(), key=lambda item: order[item[0]])


#: wrappers that put themselves into module names: activation checkpointing and ``torch.compile``
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")

#: the module attribute listing the (hook, handle) of input hooks that shrink the input (tensor parallelism's
#: sequence split): activation checkpointing moves them onto its wrapper, so that it saves the block's chunk, not
#: the whole input
SHRINKING_INPUT_HOOKS = "_lightning_par_shrinking_input_hooks"


def clean_name(name: str) -> str:
    """A module's or parameter's name as the model had it (and as state dicts name it): the segments of the
    wrappers of activation checkpointing and compile left out."""
    return ".".join(seg for seg in name.split(".") if seg not in WRAPPER_SEGMENTS)


@contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's own DTensor parameters as their local shards (differentiable views of what FSDP gathered) while
    the block runs, for code that mixes them with plain tensors; put back afterwards."""
    params = module._parameters
    saved = dict(params)
    for name, p in saved.items():
        if p is not None and hasattr(p, "to_local"):
            params[name] = p.to_local()  # nn.Module reads _parameters as they are
    try:
        yield
    finally:
        params.update(saved)

"""Errors a user migrating a model meets, caught where they can be recognised and explained with the fix."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

#: attributes that hold a head count in the common model codes (Llama, GPT, nanoGPT, transformers)
HEAD_COUNT_ATTRIBUTES = ("n_heads", "n_head", "n_kv_heads", "num_heads", "num_attention_heads",
                         "num_key_value_heads", "n_local_heads")
_VIEW_ERROR = re.compile(r"shape '\[[-\d, ]+\]' is invalid for input of size \d+")


def head_count_modules(module: nn.Module) -> list[str]:
    """``"fqn.attr=value"`` for modules that keep a head count and hold tensor-parallel (DTensor) weights."""
    found = []
    for fqn, sub in module.named_modules():
        counts = {a: getattr(sub, a) for a in HEAD_COUNT_ATTRIBUTES if isinstance(getattr(sub, a, None), int)}
        if counts and any(isinstance(p, DTensor) for p in sub.parameters()):
            found += [f"{fqn}.{a}={v}" for a, v in counts.items()]
    return found


@contextmanager
def explain_head_count_errors(module: nn.Module | None, tp: int) -> Iterator[None]:
    """Under tensor parallelism a reshape with the model's whole head count fails with torch's bare
    ``shape '[...]' is invalid for input of size N``: add what to change."""
    try:
        yield
    except RuntimeError as e:
        if tp == 1 or module is None or not _VIEW_ERROR.search(str(e)):
            raise
        found = head_count_modules(module)
        where = (f" Head counts found on tensor-parallel modules: {found[:4]}{'...' if len(found) > 4 else ''}."
                 if found else "")
        raise RuntimeError(
            f"{e}\nUnder tensor parallelism (tp={tp}) each rank holds 1/{tp} of the attention heads, so a reshape "
            f"with the model's whole head count fails.{where} Divide the head counts by tp where the model is "
            f"parallelized (Lightning's example: `attention.n_heads //= tp_mesh.size()`), or reshape with -1 "
            f"(`x.view(batch, seq, -1, head_dim)`)."
        ) from e


def foreach_problems(model: nn.Module, optimizers: list[Optimizer]) -> list[str]:
    """A ``foreach`` optimizer step over a parameter group mixing DTensor and plain tensors fails at the first
    step with torch's ``got mixed torch.Tensor and DTensor``: found here, at setup, with the parameters named."""
    names = {id(p): n for n, p in model.named_parameters()}
    problems = []
    for i, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            params = group["params"]
            foreach = group.get("foreach")
            on_gpu = any(p.device.type != "cpu" for p in params)
            if not (foreach or (foreach is None and on_gpu)):  # None: torch picks foreach on accelerators
                continue
            plain = [names.get(id(p), "?") for p in params if not isinstance(p, DTensor)]
            if plain and len(plain) < len(params):
                problems.append(
                    f"optimizer {i} ({type(optimizer).__name__}) param group {g} steps with foreach=True over DTensor "
                    f"and plain parameters together, which torch's foreach kernels refuse at the first step (mixed "
                    f"torch.Tensor and DTensor); plain: {plain[:4]}{'...' if len(plain) > 4 else ''}. Pass "
                    f"foreach=False, or give the plain parameters their own param group, or parallelize them too "
                    f"(fully_shard the module that holds them, or add them to the tensor-parallel plan).")
    return problems


"""Parameters a rank's forward left out, under FSDP2: zero-filled so that every rank reduces the same tensors, taken
back where no rank used them, and paid for only by the shard units that can leave parameters out.

FSDP2 reduce-scatters only the parameters that got a gradient on this rank, so when ranks use different parameters
(a mixture of experts whose routing left an expert without tokens on one rank) their reduce-scatters differ in size
and the job aborts or hangs (pytorch/pytorch#158719, open in torch 2.13). With a zero gradient for each unused
parameter every rank reduces the same tensors, and the average is the one-process gradient of the whole batch. A
parameter no rank used gets its gradient taken back after backward (one small all-reduce of flags), as in one
process, so the optimizer skips it (AdamW would otherwise decay it and move it by its momentum).

Whether a unit can leave parameters out is read from its first training forward: only a forward that decides
something from tensor values can (a router's ``nonzero``/``where``/boolean mask, ``.item()``, ``.tolist()``, a
data-dependent shape). Units whose first forward did none of that (every dense block) lose their hook after the first
backward, and a model with none of them pays nothing from the second step on: no hook, no all-reduce, no host sync.
Written by hand because torch has no option for it (DDP's ``find_unused_parameters`` has no FSDP2 counterpart).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_par._compat import torch_dispatch_mode

#: aten ops whose output shape or Python result depends on tensor values: what routing decisions are made of
_DATA_DEPENDENT_OPS = frozenset({
    "nonzero", "_local_scalar_dense", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "bincount", "repeat_interleave", "equal", "argwhere",
})
#: Tensor methods that read values into Python without an aten op
_VALUE_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy})
_bookkeeping_depth = 0


@contextmanager
def not_a_routing_decision() -> Iterator[None]:
    """Around value reads that decide no parameter's use (expert parallelism's split sizes, which move tokens but
    leave every expert weight used): the probe does not count them."""
    global _bookkeeping_depth
    _bookkeeping_depth += 1
    try:
        yield
    finally:
        _bookkeeping_depth -= 1


class _Watched:
    """One shard unit under watch: its fill hook, and whether its forward can leave parameters out."""

    def __init__(self, unit: nn.Module) -> None:
        self.unit = unit
        self.handle: RemovableHandle | None = None  # the fill hook; None once removed
        self.seen = False  # its forward ran with gradients enabled before the first decision
        self.data_dependent = False
        self.probe: _DataDependenceProbe | None = None
        self.probe_end: RemovableHandle | None = None  # the hook that ends a probe, until the first decision


class UnusedParameterGuard:
    """The zero-fill hooks of a model's FSDP units and the take-back after each backward (see the module docstring).

    ``record=False`` (pipeline stages, whose schedules compute weight gradients after input gradients, so "filled"
    no longer means "unused"): fill only, always, nothing taken back.
    """

    def __init__(self, record: bool) -> None:
        self.record = record
        self.watched: list[_Watched] = []
        self.decided = not record  # until the first backward's decision, every unit keeps its hook and is probed
        self.filled: list[tuple[nn.Module, str]] = []  # (unit, parameter name) zero-filled since the last take-back
        self._no_gradient_before: list[str] = []
        self._window_filled: set[str] | None = None  # zero-filled in every micro-batch of the window so far

    def watch(self, unit: nn.Module) -> None:
        watched = _Watched(unit)
        watched.handle = unit.register_forward_pre_hook(
            lambda module, args, kwargs: self._wrap_inputs(watched, args, kwargs), with_kwargs=True)
        self.watched.append(watched)
        if not self.decided:
            watched.probe_end = unit.register_forward_hook(lambda module, args, output: self._end_probe(watched),
                                                           always_call=True)

    @property
    def active(self) -> bool:
        """Whether anything can be left to take back: the first step is still deciding, or some unit can leave
        parameters out."""
        return self.record and (not self.decided or any(w.handle is not None for w in self.watched))

    def before_backward(self, root: nn.Module, first: bool = True) -> None:
        """Note which parameters have no gradient yet (the same on every data-parallel rank), at the ``first``
        micro-batch of a window whose gradients are reduced together (see ``after_backward``)."""
        if not self.active:
            return
        if first:
            self._no_gradient_before = [name for name, p in root.named_parameters()
                                        if p.requires_grad and p.grad is None]
        elif self._window_filled:
            # the gradients zero-filled in every micro-batch so far are exactly zero: drop them from the (gathered,
            # unsharded) parameters, so that this backward fills them again only if it leaves them out again
            params = dict(root.named_parameters())
            for name in self._window_filled:
                if name in params:
                    params[name].grad = None

    def after_backward(self, root: nn.Module, group: dist.ProcessGroup, device: torch.device,
                       last: bool = True) -> None:
        """Take back the zero gradients no rank of ``group`` needed; after the first backward, also decide (the same
        on every rank) which units keep their hook. Where FSDP reduces once for several micro-batches (its
        gradients kept unsharded meanwhile), only at the ``last`` of them, and for the parameters zero-filled in
        every one of them: a parameter one micro-batch used keeps its gradient."""
        if not self.active:
            return
        filled, self.filled = self.filled, []
        names: set[str] = set()
        if filled:
            fqn_of = {id(module): fqn for fqn, module in root.named_modules()}
            names = {f"{fqn_of[id(unit)]}.{name}".lstrip(".") for unit, name in filled if id(unit) in fqn_of}
        names = names if self._window_filled is None else self._window_filled & names
        if not last:
            self._window_filled = names
            return
        self._window_filled = None
        had_none, self._no_gradient_before = self._no_gradient_before, []
        undecided = [] if self.decided else self.watched
        # one all-reduce (MIN: true on every rank) of two kinds of flags: "this rank zero-filled the parameter" and,
        # at the first backward, "this rank saw the unit's forward and it decided nothing from tensor values"
        flags = [name in names for name in had_none] + [w.seen and not w.data_dependent for w in undecided]
        if not flags:
            return
        agreed = torch.tensor(flags, dtype=torch.uint8).to(device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        agreed_list = [bool(a) for a in agreed.tolist()]
        if undecided:
            self._decide(static=agreed_list[len(had_none):])
        dropped = [name for name, every_rank_filled in zip(had_none, agreed_list) if every_rank_filled]
        if dropped:
            params = dict(root.named_parameters())
            for name in dropped:
                params[name].grad = None

    def _decide(self, static: list[bool]) -> None:
        for watched, is_static in zip(self.watched, static):
            if watched.probe_end is not None:
                watched.probe_end.remove()
                watched.probe_end = None
            if is_static and watched.handle is not None:
                watched.handle.remove()
                watched.handle = None
        self.decided = True

    def _wrap_inputs(self, watched: _Watched, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        if not self.decided:
            self._start_probe(watched)
        flat = [(i, x) for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        keys = [k for k, x in kwargs.items() if isinstance(x, torch.Tensor) and x.requires_grad]
        tensors = [x for _, x in flat] + [kwargs[k] for k in keys]
        if not tensors:
            return None
        wrapped = _FillMissingGradients.apply(watched.unit, self, *tensors)
        args = list(args)
        for (i, _), x in zip(flat, wrapped):
            args[i] = x
        kwargs = {**kwargs, **dict(zip(keys, wrapped[len(flat):]))}
        return tuple(args), kwargs

    def _start_probe(self, watched: _Watched) -> None:
        watched.seen = True
        if torch.compiler.is_compiling():  # a compiled block is not probed: it keeps its hook
            watched.data_dependent = True
            return
        watched.probe = _DataDependenceProbe(watched)
        watched.probe.enter()

    @staticmethod
    def _end_probe(watched: _Watched) -> None:
        probe, watched.probe = watched.probe, None
        if probe is not None:
            probe.exit()


class _FillMissingGradients(torch.autograd.Function):
    """Identity on a unit's inputs; in backward (just before FSDP's own post-backward, which wraps the inputs
    first), gives every trainable parameter of the unit that got no gradient a zero one."""

    @staticmethod
    def forward(ctx: Any, unit: nn.Module, guard: UnusedParameterGuard, *inputs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.guard = unit, guard
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None | torch.Tensor, ...]:
        for name, param in ctx.unit.named_parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
                if ctx.guard.record:
                    ctx.guard.filled.append((ctx.unit, name))
        return (None, None, *grads)


class _DataDependenceProbe:
    """Both kinds of mode over one unit's forward: the dispatch mode sees every aten op (also those called from C++,
    such as a boolean mask's index), the function mode the value reads that have no aten op (``tolist``)."""

    def __init__(self, watched: _Watched) -> None:
        self.watched = watched
        probe = self

        class Ops(torch_dispatch_mode()):  # type: ignore[misc]
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                name = func._overloadpacket.__name__
                if _bookkeeping_depth:
                    pass
                elif name in _DATA_DEPENDENT_OPS or (name == "index" and _has_mask(args)):
                    probe.watched.data_dependent = True
                return func(*args, **(kwargs or {}))

        class Reads(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                if func in _VALUE_READS and not _bookkeeping_depth:
                    probe.watched.data_dependent = True
                return func(*args, **(kwargs or {}))

        self.modes = [Ops(), Reads()]

    def enter(self) -> None:
        for mode in self.modes:
            mode.__enter__()

    def exit(self) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(None, None, None)


def _has_mask(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())

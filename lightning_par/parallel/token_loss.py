"""Token-weighted losses: a mean cross-entropy over every counted token of the global batch, as in one process.

Labels of -100 (``ignore_index``: prompt masking, padding, packing boundaries) leave ranks and micro-batches with
different numbers of counted tokens. Averaging each part's own mean (what averaging gradients over ranks does to
per-rank means) is then not one process's mean over all counted tokens. Here each part's ``F.cross_entropy``
(mean reduction, the default; the contract users already follow) is answered by its *sum* over the whole count:

* context parallelism (always): the cp ranks' halves of a sequence are one sequence (``techniques/context``);
* pipeline micro-batches (always): the micro-batches of a batch are one batch (``techniques/pipeline``);
* data-parallel ranks and gradient accumulation with ``loss_normalization="tokens"`` (:class:`TokenLoss`); the
  default ``"mean"`` keeps DDP's convention there: each rank's (micro-batch's) own mean, averaged.

A rank's answer is ``sum * parts / count``: the mean of the ``parts`` ranks' answers (what gradient averaging
computes) is ``sum of sums / count``. Counts are summed in fp32 (bf16 holds integers exactly only to 256) and
all-reduced as tensors: no host synchronization.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

LOSS_NORMALIZATIONS = ("mean", "tokens")


def cross_entropy_parts(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                        size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                        reduction: str = "mean", label_smoothing: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``F.cross_entropy``'s arguments -> (the sum over the counted tokens, their count), both fp32, the count
    detached: the two halves of torch's mean (the count weighted by ``weight`` where given, as torch's mean is).
    None for a call that is not a mean over counted tokens (other reductions; class-probability targets, one per
    token)."""
    if reduction != "mean" or size_average is not None or reduce is not None or target.is_floating_point():
        return None
    # summed in fp32, as torch's mean accumulates (a bf16 sum of thousands of losses would round by 2**-8)
    total = F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction="none",
                            label_smoothing=label_smoothing).float().sum()
    counted = target != ignore_index
    if weight is None:
        count = counted.sum(dtype=torch.float32)
    else:
        count = (weight[target.masked_fill(~counted, 0)].float() * counted).sum()
    if isinstance(count, DTensor):
        count = count.full_tensor()
    return total, count.detach().clone()


def token_mean_cross_entropy(group: dist.ProcessGroup, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.cross_entropy(*args, **kwargs)`` of this rank's part of a batch split over ``group``, such that the mean
    of the ranks' values (what averaging gradients over them computes) is the mean over all the parts' counted
    tokens, as in one process: this rank's sum, times the group's size, over the group's count. With an equal count
    on every rank it is the plain mean. Other reductions, and class-probability targets, are torch's own."""
    return TokenLoss(group).cross_entropy(*args, **kwargs)


class TokenLoss:
    """One mean over the counted tokens of every rank of ``group`` and, within a training step of Lightning's
    gradient accumulation, of every micro-batch of the accumulation (``loss_normalization="tokens"``, where
    ``group`` is the ``dp_cp`` ranks; pipelines without the option count over the cp ranks only).

    Across accumulation the later micro-batches' counts are not known when the first runs backward, so each answer
    keeps its value (that micro-batch's mean over its global count, what is logged) while its gradient is taken
    over the window's first count; after the window's last backward every gradient is multiplied by
    ``accumulate * first / total`` (:meth:`end_window`): exact, as the factor is the same on every rank.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.accumulate = 0  # Lightning's accumulate_grad_batches while a training micro-batch runs, else 0
        self._window: list[Any] | None = None  # [first count, total count, accumulate] of the open window
        self._counted = False  # this micro-batch's count has joined the window

    def start_micro_batch(self, accumulate: int) -> None:
        """A training micro-batch's forward begins (``accumulate``: Lightning's ``accumulate_grad_batches``)."""
        self.accumulate, self._counted = accumulate, False

    def end_micro_batch(self) -> None:
        self.accumulate = 0

    def global_count(self, count: torch.Tensor) -> torch.Tensor:
        """``count`` summed over the group (fp32, a new tensor)."""
        count = count.detach().float().clone()
        if self.group is not None:
            dist.all_reduce(count, group=self.group)  # a number per rank: no host synchronization
        return count

    def gradient_count(self, count: torch.Tensor) -> torch.Tensor:
        """The count a training micro-batch's gradient is taken over, given its global ``count``: ``count`` itself
        outside accumulation; within one, ``count`` joins the window and the window's first count is returned."""
        if self.accumulate <= 1:
            return count
        if self._counted:
            raise ValueError(
                "loss_normalization='tokens' with accumulate_grad_batches > 1 weighs one mean cross-entropy per "
                "micro-batch across the accumulation, and this training step computed a second one. Compute the "
                "second loss with reduction='sum' over a count of your own, or use loss_normalization='mean'.")
        self._counted = True
        if self._window is None:
            self._window = [count, count.clone(), self.accumulate]
        else:
            self._window[1] += count
        return self._window[0]

    def cross_entropy(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``F.cross_entropy`` answered as this rank's sum times the group's size over the global count."""
        parts = cross_entropy_parts(*args, **kwargs)
        if parts is None:
            return F.cross_entropy(*args, **kwargs)
        total, count = parts
        count = self.global_count(count)
        dtype = (args[0] if args else kwargs["input"]).dtype
        return weigh(total * self.size, count, self.gradient_count(count)).to(dtype)

    def end_window(self, parameters: Any) -> None:
        """After the accumulation window's last backward (before clipping): every gradient times
        ``accumulate * first / total``. Nothing outside accumulation."""
        if self._window is None:
            return
        first, total, accumulate = self._window
        self._window = None
        scale_gradients(parameters, first * accumulate / total)


def weigh(total: torch.Tensor, value_count: torch.Tensor, gradient_count: torch.Tensor) -> torch.Tensor:
    """``total / value_count``, with the gradient of ``total / gradient_count``."""
    value = total / value_count
    if gradient_count is value_count:
        return value
    scaled = total / gradient_count
    return value.detach() + (scaled - scaled.detach())


def scale_gradients(parameters: Any, factor: torch.Tensor) -> None:
    """Multiply every gradient (plain or DTensor) by the 0-dim tensor ``factor`` in place."""
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    with torch.no_grad():
        for device_grads in _by_device(local).values():
            torch._foreach_mul_(device_grads, factor.to(device_grads[0].device))


def _by_device(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


class TokenMeanScope(TorchFunctionMode):
    """While active, every mean ``F.cross_entropy`` is answered by ``token_loss`` (:meth:`TokenLoss.cross_entropy`)."""

    def __init__(self, token_loss: TokenLoss) -> None:
        super().__init__()
        self.token_loss = token_loss

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.cross_entropy:
            return self.token_loss.cross_entropy(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

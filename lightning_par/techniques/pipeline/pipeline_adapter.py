"""How a plain LightningModule's steps run through a pipeline schedule, unchanged.

The contract (``docs/strategies.md``, "Pipeline parallelism"): in a step, the module calls ``self(*inputs)`` once
and passes what it returned to ``self.loss(outputs, targets)`` (the method's name is the strategy's ``pp_loss_method``).

* In ``training_step`` a pipeline fuses forward and backward over micro-batches, so ``forward`` cannot return
  logits yet: it returns :class:`PipelineOutputs`, a placeholder holding the inputs. ``self.loss(placeholder,
  targets)`` runs the whole schedule (the user's loss method is the schedule's per-micro-batch loss) and returns
  the mean loss, the same value on every rank, which ``self.log`` and Lightning's loop take as usual. The strategy's
  ``backward`` then only hands the gradients back: the schedule computed them inside ``training_step``, and
  Lightning's loop zeroes gradients between ``training_step`` and ``backward``, so they are set aside meanwhile.
* The micro-batches of a batch are one batch: a mean ``F.cross_entropy`` in the loss method is the mean over the
  counted tokens (targets other than -100) of the whole batch, not the mean of the micro-batches' means. As in
  torchtitan, the targets are counted before the schedule runs, on every pp rank (summed over the cp ranks, and
  over the data-parallel ranks with ``loss_normalization="tokens"``); inside the loss method each micro-batch's
  cross-entropy is its sum over that count (:class:`_MicroBatchTokens`). The counts the cross-entropy saw are
  checked against the targets' after the step, on every pp rank: a loss method that shifts or masks the targets
  itself is refused, naming the fix.
* Everywhere else (validation, test, predict, the model summary) ``forward`` runs the stages forward-only and
  returns the last stage's output on every rank, so metrics on the outputs work as without pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.token_loss import TokenLoss, cross_entropy_parts, weigh
from lightning_par.techniques.pipeline.pipeline_live import ROW_TABLES, LivePipeline

_CONTRACT = ("under pipeline parallelism, training_step must pass what `self(...)` returns straight to "
             "`self.{loss}(outputs, targets)`: the outputs only exist on the last stage, inside the schedule. "
             "Compute metrics on the outputs in validation_step, where `self(...)` returns them on every rank.")


class PipelineOutputs:
    """What ``forward`` returns inside ``training_step``: the inputs, waiting for the loss method."""

    __slots__ = ("args", "tables", "used", "_loss_name")

    def __init__(self, args: tuple[Any, ...], loss_name: str, tables: dict[str, torch.Tensor] | None = None) -> None:
        self.args, self.used, self._loss_name = args, False, loss_name
        self.tables = tables or {}  # the rows' position_ids / attention_mask (ROW_TABLES)

    def __getattr__(self, name: str) -> Any:
        raise TypeError(f"outputs.{name}: " + _CONTRACT.format(loss=self._loss_name))

    def __repr__(self) -> str:
        return f"PipelineOutputs(pending {self._loss_name}(outputs, targets))"


_MISCOUNTED = (
    "under pipeline parallelism a mean F.cross_entropy in `{loss}` is the mean over the counted tokens of the whole "
    "batch, counted from the targets passed to `self.{loss}(outputs, targets)` (those other than -100) before the "
    "schedule runs; the cross-entropy in `{loss}` counted other tokens than those targets hold ({off:g} in all this "
    "step's micro-batches). Shift or mask the targets before calling `self.{loss}` (in training_step or in the "
    "data), and keep ignore_index=-100 and weight=None there; or compute such a loss with reduction='sum' divided "
    "by a count of your own.")


class _MicroBatchTokens(TorchFunctionMode):
    """Around the loss method for one micro-batch: a mean ``F.cross_entropy`` is its sum times ``parts`` (micro-batches
    x ranks of the count) over the batch's count, with the gradient over ``gradient_count`` (the count of the
    accumulation window's first batch under ``loss_normalization="tokens"``); how far the counts it saw are from the
    micro-batch's targets' own is added to ``miscount``."""

    def __init__(self, expected: torch.Tensor, parts: float, count: torch.Tensor, gradient_count: torch.Tensor,
                 miscount: torch.Tensor) -> None:
        super().__init__()
        self.expected, self.parts, self.count, self.gradient_count = expected, parts, count, gradient_count
        self.miscount = miscount

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        parts = cross_entropy_parts(*args, **kwargs) if func is F.cross_entropy else None
        if parts is None:
            return func(*args, **kwargs)
        total, seen = parts
        self.miscount += (seen - self.expected).abs()
        dtype = (args[0] if args else kwargs["input"]).dtype
        return weigh(total * self.parts, self.count, self.gradient_count).to(dtype)


def counted_tokens(targets: Any) -> torch.Tensor | None:
    """The targets other than -100 (fp32), or None for targets that are not one tensor of class indices."""
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        return None
    return (targets != -100).sum(dtype=torch.float32)


class PipelineAdapter:
    """Installs the pipelined ``forward`` and loss method on one LightningModule instance."""

    def __init__(self, module: nn.Module, pipeline: LivePipeline, loss_method: str, token_loss: TokenLoss) -> None:
        user_loss = getattr(module, loss_method, None)
        if not callable(user_loss):
            raise ValueError(
                f"pp_loss_method={loss_method!r}: {type(module).__name__} has no such method. Pipeline parallelism "
                f"needs the loss as a method `def {loss_method}(self, outputs, targets) -> Tensor` (the mean over the "
                f"batch) that training_step calls as `self.{loss_method}(self(inputs), targets)`; add it or set "
                f"pp_loss_method to the name of yours.")
        self.module, self.pipeline, self.loss_method = module, pipeline, loss_method
        self._grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.user_loss: Callable[..., torch.Tensor] = user_loss
        self.training_step_active = False
        self.loss_scale = 1.0  # 1 / accumulate_grad_batches: the schedule's backward must see Lightning's scaling
        self.grad_scaler: torch.amp.GradScaler | None = None  # 16-mixed: the loss scaler, inside the schedule too
        self.pending: PipelineOutputs | None = None
        self.token_loss = token_loss  # the ranks (and accumulation window) a batch's count spans
        self._counts: tuple[torch.Tensor, torch.Tensor] | None = None  # this batch's (count, gradient's count)
        self._miscount = torch.zeros((), device=pipeline.device)
        pipeline.loss_fn = self._micro_batch_loss
        module.forward = self.forward  # instance attributes: nn.Module.__call__ and the loop find these
        setattr(module, loss_method, self.loss)

    def _micro_batch_loss(self, outputs: torch.Tensor, targets: Any) -> torch.Tensor:
        expected = counted_tokens(targets)
        if self._counts is None or expected is None:
            loss = self.user_loss(outputs, targets)
        else:
            parts = self.pipeline.n_microbatches * self.token_loss.size
            with _MicroBatchTokens(expected, parts, *self._counts, self._miscount):
                loss = self.user_loss(outputs, targets)
        loss = loss * self.loss_scale
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        other = sorted(k for k in kwargs if k not in ROW_TABLES)
        if other:
            raise TypeError(f"under pipeline parallelism forward takes positional inputs, and the rows' "
                            f"{' / '.join(ROW_TABLES)} by keyword (packed or padded rows); got keywords {other}.")
        tables = {k: v for k, v in kwargs.items() if v is not None}
        if self.training_step_active:
            if self.pending is not None:
                raise RuntimeError("training_step called forward twice: " + _CONTRACT.format(loss=self.loss_method))
            self.pending = PipelineOutputs(args, self.loss_method, tables)
            return self.pending
        return self.pipeline.forward(args, tables)

    def loss(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(outputs, PipelineOutputs):
            return self.user_loss(outputs, targets, *args, **kwargs)
        if args or kwargs or outputs.used:
            raise TypeError(f"{self.loss_method}(outputs, targets) takes exactly those two arguments, once per "
                            f"training_step, under pipeline parallelism.")
        outputs.used = True
        counting = counted_tokens(targets) is not None  # alike on every pp rank: each reads the same batch
        status = self._count_batch(targets) if counting else None
        try:
            loss = self.pipeline.train_step(outputs.args, targets, status=status, tables=outputs.tables)
        finally:
            self._counts = None
        if status is not None and float(status) > 0:  # on every pp rank: the last stage's status was broadcast
            raise ValueError(_MISCOUNTED.format(loss=self.loss_method, off=float(status)))
        loss = loss / self.loss_scale
        return loss if self.grad_scaler is None else loss / self.grad_scaler.get_scale()

    def _count_batch(self, targets: torch.Tensor) -> torch.Tensor:
        """Before the schedule: the batch's count over the token loss's ranks (and the count its gradient takes in
        an accumulation window). On every pp rank, each from the same batch: an accumulation window rescales the
        gradients of every stage alike. Returns the step's status, the miscount the loss will add to."""
        self._miscount.zero_()
        count = self.token_loss.global_count(counted_tokens(targets))
        self._counts = (count, self.token_loss.gradient_count(count))
        return self._miscount

    def begin_training_step(self, accumulate_grad_batches: int, first_of_accumulation: bool) -> None:
        """``first_of_accumulation``: Lightning will zero the gradients in this step (after ``training_step``), so
        the ones still held belong to the previous optimizer step and must not be accumulated into."""
        self.training_step_active, self.pending = True, None
        self.loss_scale = 1.0 / accumulate_grad_batches
        self.grad_scaler = getattr(self.module.trainer.precision_plugin, "scaler", None)
        if first_of_accumulation:
            for p in self.module.parameters():
                p.grad = None

    def abort_training_step(self) -> None:
        self.training_step_active, self.pending = False, None

    def end_training_step(self) -> None:
        pending, self.training_step_active, self.pending = self.pending, False, None
        if pending is None or not pending.used:
            raise RuntimeError("training_step did not run the pipeline: " + _CONTRACT.format(loss=self.loss_method))
        self._grads = [(p, p.grad) for p in self.module.parameters()]

    def restore_gradients(self) -> None:
        """Put back the gradients of the last training step (Lightning's ``zero_grad`` ran in between)."""
        for p, grad in self._grads:
            p.grad = grad
        self._grads = []

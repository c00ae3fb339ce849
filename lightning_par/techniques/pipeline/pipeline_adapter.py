"""How a plain LightningModule's steps run through a pipeline schedule, unchanged.

The contract (``docs/strategies.md``, "Pipeline parallelism"): in a step, the module calls ``self(*inputs)`` once
and passes what it returned to ``self.loss(outputs, targets)`` (the method's name is the strategy's ``pp_loss_method``).

* In ``training_step`` a pipeline fuses forward and backward over micro-batches, so ``forward`` cannot return
  logits yet: it returns :class:`PipelineOutputs`, a placeholder holding the inputs. ``self.loss(placeholder,
  targets)`` runs the whole schedule (the user's loss method is the schedule's per-micro-batch loss) and returns
  the mean loss, the same value on every rank, which ``self.log`` and Lightning's loop take as usual. The strategy's
  ``backward`` then only hands the gradients back: the schedule computed them inside ``training_step``, and
  Lightning's loop zeroes gradients between ``training_step`` and ``backward``, so they are set aside meanwhile.
* Everywhere else (validation, test, predict, the model summary) ``forward`` runs the stages forward-only and
  returns the last stage's output on every rank, so metrics on the outputs work as without pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par.techniques.pipeline.pipeline_live import LivePipeline

_CONTRACT = ("under pipeline parallelism, training_step must pass what `self(...)` returns straight to "
             "`self.{loss}(outputs, targets)`: the outputs only exist on the last stage, inside the schedule. "
             "Compute metrics on the outputs in validation_step, where `self(...)` returns them on every rank.")


class PipelineOutputs:
    """What ``forward`` returns inside ``training_step``: the inputs, waiting for the loss method."""

    __slots__ = ("args", "used", "_loss_name")

    def __init__(self, args: tuple[Any, ...], loss_name: str) -> None:
        self.args, self.used, self._loss_name = args, False, loss_name

    def __getattr__(self, name: str) -> Any:
        raise TypeError(f"outputs.{name}: " + _CONTRACT.format(loss=self._loss_name))

    def __repr__(self) -> str:
        return f"PipelineOutputs(pending {self._loss_name}(outputs, targets))"


class PipelineAdapter:
    """Installs the pipelined ``forward`` and loss method on one LightningModule instance."""

    def __init__(self, module: nn.Module, pipeline: LivePipeline, loss_method: str) -> None:
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
        pipeline.loss_fn = self._micro_batch_loss
        module.forward = self.forward  # instance attributes: nn.Module.__call__ and the loop find these
        setattr(module, loss_method, self.loss)

    def _micro_batch_loss(self, outputs: torch.Tensor, targets: Any) -> torch.Tensor:
        loss = self.user_loss(outputs, targets) * self.loss_scale
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"under pipeline parallelism forward takes positional inputs only; got keywords "
                            f"{sorted(kwargs)}.")
        if self.training_step_active:
            if self.pending is not None:
                raise RuntimeError("training_step called forward twice: " + _CONTRACT.format(loss=self.loss_method))
            self.pending = PipelineOutputs(args, self.loss_method)
            return self.pending
        return self.pipeline.forward(args)

    def loss(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(outputs, PipelineOutputs):
            return self.user_loss(outputs, targets, *args, **kwargs)
        if args or kwargs or outputs.used:
            raise TypeError(f"{self.loss_method}(outputs, targets) takes exactly those two arguments, once per "
                            f"training_step, under pipeline parallelism.")
        outputs.used = True
        loss = self.pipeline.train_step(outputs.args, targets) / self.loss_scale
        return loss if self.grad_scaler is None else loss / self.grad_scaler.get_scale()

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

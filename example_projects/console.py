"""What the example CLIs print: our start-up summary, a progress bar and the pointer to the logs, nothing else.

* Lightning 2.6's ``RichProgressBar`` reads ``Epoch 0/-2`` when ``max_steps`` bounds the run (``max_epochs`` is then
  -1); fixed upstream by Lightning PR #21924 (issue #21925), not in a 2.6 release. ``StepsProgressBar`` leaves the
  total out in that case, as the fix does.
* Lightning's model summary prints a FLOPs column of zeros unless the module defines ``example_input_array``, and
  computing it would run a forward on rank 0 alone, which a sharded model cannot do. The start-up summary already
  shows what each rank holds and ``DeviceUtilizationMonitor`` counts the FLOPs, so the examples leave it off
  (``--trainer.enable_model_summary=true`` brings it back).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningCLI


class StepsProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)


class ExampleCLI(LightningCLI):
    """LightningCLI with the examples' console: no model summary by default, the step-bounded progress bar."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.enable_model_summary": False})

    def before_fit(self) -> None:
        callbacks = self.trainer.callbacks
        for i, callback in enumerate(callbacks):
            if type(callback) is RichProgressBar:  # Lightning's default bar; a configured one is left alone
                callbacks[i] = StepsProgressBar(refresh_rate=callback.refresh_rate, leave=callback._leave,
                                                theme=callback.theme)

"""Fine-tune the base model from ``prepare.py`` with LoRA adapters through LightningCLI; the parallel layout comes
from the YAML config.

    python example_projects/finetune/prepare.py
    python example_projects/finetune/train.py fit --config example_projects/finetune/configs/fsdp2_lora.yaml

Lightning re-runs this script once per extra local rank, so everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # make `example_projects` importable as a package

import lightning_par  # noqa: E402, F401  (registers the strategy names: fsdp2, nd_parallel, ...)
from example_projects.console import ExampleCLI  # noqa: E402
from example_projects.finetune.data import DocsDataModule  # noqa: E402
from example_projects.finetune.lit import LoRAFineTuneModule  # noqa: E402


class FineTuneCLI(ExampleCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.max_seq_len")
        parser.link_arguments("trainer.max_steps", "model.max_steps")


def main() -> None:
    cli = FineTuneCLI(LoRAFineTuneModule, DocsDataModule, save_config_kwargs={"overwrite": True})
    trainer = cli.trainer
    if trainer.is_global_zero and trainer.logger is not None and trainer.logger.log_dir is not None:
        log_dir = Path(trainer.logger.log_dir).resolve()
        print(f"\nTensorBoard logs: {log_dir}\n  view with: tensorboard --logdir {log_dir.parent}")


if __name__ == "__main__":
    main()

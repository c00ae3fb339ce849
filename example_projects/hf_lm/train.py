"""Train a Hugging Face causal LM with LightningCLI; the parallel layout comes from the YAML config.

    python example_projects/hf_lm/train.py fit --config example_projects/hf_lm/configs/fsdp2.yaml
    python example_projects/hf_lm/train.py fit --config example_projects/hf_lm/configs/fsdp2.yaml \
        --model.model_type=qwen2

Lightning re-runs this script once per extra local rank, so everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # make `example_projects` importable as a package

import lightning_par  # noqa: E402, F401  (registers the strategy names: fsdp2, nd_parallel, ...)
from example_projects.console import ExampleCLI  # noqa: E402
from example_projects.gpt.data import CharDataModule  # noqa: E402
from example_projects.hf_lm.lit import HFCausalLMModule  # noqa: E402


class HFCLI(ExampleCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.max_seq_len")
        parser.link_arguments("trainer.max_steps", "model.max_steps")


def main() -> None:
    cli = HFCLI(HFCausalLMModule, CharDataModule, save_config_kwargs={"overwrite": True})
    trainer = cli.trainer
    if trainer.is_global_zero and trainer.logger is not None and trainer.logger.log_dir is not None:
        print(f"\nTensorBoard logs: {Path(trainer.logger.log_dir).resolve()}\n"
              f"  view with: tensorboard --logdir {Path(trainer.logger.log_dir).resolve().parent}")


if __name__ == "__main__":
    main()

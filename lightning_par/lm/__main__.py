"""``python -m lightning_par.lm fit --config config.yaml``: :class:`CausalLM` and :class:`TextDataModule` through
LightningCLI (the data's tokenizer is the model's unless ``data.tokenizer`` names another).

Lightning re-runs this module once per extra local rank, so everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_par  # noqa: F401  (registers the strategy names: fsdp2, nd_parallel, ...)
from lightning_par.lm import CausalLM, TextDataModule


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(CausalLM, TextDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()

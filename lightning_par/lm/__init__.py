"""Causal language models from Hugging Face, ready to train: :class:`CausalLM` (the LightningModule: a Hub ID or a
directory, built on the meta device and loaded shard by shard, LoRA or frozen parameters) and
:class:`TextDataModule` (local files or a ``datasets`` name, tokenized once and cached, packed or padded rows).

``python -m lightning_par.lm fit --config config.yaml`` runs them with LightningCLI (``docs/finetuning.md``).
"""

from lightning_par.hub import resolve_pretrained
from lightning_par.lm.adapters import LoRA, freeze
from lightning_par.lm.data import TextDataModule, pack, pad
from lightning_par.lm.module import CausalLM

__all__ = ["CausalLM", "LoRA", "TextDataModule", "freeze", "pack", "pad", "resolve_pretrained"]

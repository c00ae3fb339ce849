"""The LightningModule around a Hugging Face causal LM: a plain one. Parallelism is the strategy's business, chosen
in the YAML config; the model's own plans (``base_model_tp_plan``, ``base_model_pp_plan``) and attention interface
are what lightning_par uses, so nothing here knows about tensor, context or pipeline parallelism.

To fine-tune instead of training from scratch, subclass and override :meth:`HFCausalLMModule.build_model` (e.g.
wrap it with PEFT), and give the strategy ``pretrained=<a save_pretrained directory>``: it loads the weights into
each rank's shards after materializing them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.text import Perplexity
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
)

from example_projects.gpt.lit import padded_vocab_size
from lightning_par import BaseParallelStrategy


class HFCausalLMModule(pl.LightningModule):
    """Next-token training of a ``transformers`` causal LM built from a config (``AutoConfig.for_model``).

    Args:
        model_type: a transformers model type with a causal-LM head: ``llama``, ``qwen2``, ``mistral``, ...
        vocab_size: the tokenizer's vocabulary (linked from the data module by ``train.py``).
        vocab_multiple: the model's vocabulary is padded to a multiple of this (tensor parallelism needs ``tp`` to
            divide it); the extra logits are never targets, so they only learn to stay small.
        max_seq_len: the model's ``max_position_embeddings`` (linked from ``data.seq_len``).
        num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads: the size.
        config_overrides: any other field of the model's config, e.g. ``{"rope_theta": 500000.0}``.
        meta_init: under a lightning_par strategy, build the model on the meta device: the strategy then allocates
            and initializes (with transformers' own ``_init_weights``) only this rank's shards and stages. Other
            strategies get a model built in memory.
        lr, weight_decay, warmup_steps, max_steps, adam_eps: AdamW with linear warmup then cosine decay to lr/10.
    """

    def __init__(self, model_type: str = "llama", vocab_size: int = 97, vocab_multiple: int = 64,
                 max_seq_len: int = 128, num_hidden_layers: int = 4, hidden_size: int = 128,
                 intermediate_size: int = 384, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 config_overrides: dict[str, Any] | None = None, meta_init: bool = True, lr: float = 3e-3,
                 weight_decay: float = 0.1, warmup_steps: int = 20, max_steps: int = 1000,
                 adam_eps: float = 1e-8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_config = self.build_config()  # built now so that a bad option fails before any process starts
        self.model: nn.Module | None = None
        self.val_perplexity = Perplexity()

    def build_config(self) -> PretrainedConfig:
        """The model's config from the options. Override to start from another, e.g. ``AutoConfig.from_pretrained``."""
        hp = self.hparams
        if not isinstance(hp.model_type, str) or hp.model_type not in CONFIG_MAPPING:
            raise ValueError(f"model_type={hp.model_type!r} is not a transformers model type. Use one with a "
                             f"causal-LM head, e.g. 'llama', 'qwen2', 'mistral', 'gemma', 'phi3' (all of them: "
                             f"transformers.CONFIG_MAPPING).")
        fields = dict(vocab_size=padded_vocab_size(hp.vocab_size, hp.vocab_multiple),
                      max_position_embeddings=hp.max_seq_len, num_hidden_layers=hp.num_hidden_layers,
                      hidden_size=hp.hidden_size, intermediate_size=hp.intermediate_size,
                      num_attention_heads=hp.num_attention_heads, num_key_value_heads=hp.num_key_value_heads,
                      tie_word_embeddings=False, use_cache=False)  # no key/value cache: nothing here generates
        config = AutoConfig.for_model(hp.model_type, **{**fields, **(hp.config_overrides or {})})
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"model_type={hp.model_type!r} has no causal-LM model in transformers "
                             f"(AutoModelForCausalLM cannot build it). Use e.g. 'llama', 'qwen2' or 'mistral'.")
        return config

    def build_model(self) -> nn.Module:
        """The Hugging Face model, freshly initialized, from :meth:`build_config`. Override to change the model, e.g.
        to wrap it with PEFT adapters for fine-tuning: it is called once, in ``configure_model``, on the meta device
        under a lightning_par strategy (``meta_init``)."""
        return AutoModelForCausalLM.from_config(self.model_config, attn_implementation="sdpa")

    def configure_model(self) -> None:
        if self.model is not None:
            return
        on_meta = self.hparams.meta_init and isinstance(self.trainer.strategy, BaseParallelStrategy)
        with torch.device("meta") if on_meta else nullcontext():
            self.model = self.build_model()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x).float()
        self.log("val/loss", self.loss(logits, y), sync_dist=True)
        self.val_perplexity.update(logits, y)
        self.log("val/perplexity", self.val_perplexity)

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]  # matrices and embeddings
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]  # norms and biases
        optimizer = torch.optim.AdamW(
            [group for group in ({"params": decay, "weight_decay": hp.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}) if group["params"]],
            lr=hp.lr, betas=(0.9, 0.95), eps=hp.adam_eps,
        )

        def warmup_cosine(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

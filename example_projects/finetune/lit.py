"""LoRA fine-tuning of a pretrained Hugging Face causal LM: the hf_lm example's LightningModule, with the model
wrapped by PEFT and built from the base model's own config.

The parallel layout is the strategy's business (the YAML config), and so is loading the base weights: the strategy's
``pretrained=<dir>`` reads each rank's slices of the ``save_pretrained`` files into the sharded model after it is
built on the meta device. This module only builds the model (config from ``base_model``, adapters from the
``lora_*`` options) and trains what PEFT left trainable: the adapters (``configure_optimizers`` gives AdamW only the
parameters with ``requires_grad``, so no gradient or optimizer state exists for the frozen base).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from example_projects.hf_lm.lit import HFCausalLMModule
from lightning_par import BaseParallelStrategy, save_hf_pretrained
from lightning_par.lm import LoRA
from lightning_par.pretrained import check_hf_checkpoint, load_hf_weights

#: every projection of a Llama/Qwen2/Mistral decoder layer (attention and MLP); the embedding and lm_head stay frozen
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(r: int = 8, alpha: float = 16.0, dropout: float = 0.0, target_modules: list[str] | None = None) -> LoRA:
    return LoRA(r=r, alpha=alpha, dropout=dropout,
                target_modules=list(target_modules) if isinstance(target_modules, (list, tuple)) else target_modules)


def check_lora_options(r: int, alpha: float, dropout: float, target_modules: list[str]) -> None:
    """Raise a clear error for LoRA options PEFT would accept but that make no sense (or fail much later)."""
    if not isinstance(target_modules, (list, tuple)):
        raise ValueError(f"lora_target_modules={target_modules!r} must be a non-empty list of module names, e.g. "
                         f"{DEFAULT_TARGETS}.")
    _lora(r, alpha, dropout, target_modules).check(prefix="lora_")


def check_lora_targets(model: nn.Module, target_modules: list[str]) -> None:
    """Every target must name some module of ``model`` (PEFT's rule: the module's name, or its last dotted segments);
    raises naming the targets that match nothing and the Linear layers there are. Works on the meta device, so a
    typo fails when the LightningModule is constructed, before any process starts."""
    _lora(target_modules=target_modules).check_targets(model, prefix="lora_")


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: list[str]) -> nn.Module:
    """``model`` wrapped by PEFT ``get_peft_model``: LoRA adapters on ``target_modules``, everything else frozen.
    On the meta device too (lightning_par initializes the adapters by PEFT's rule once they have memory)."""
    check_lora_options(r, alpha, dropout, target_modules)
    return _lora(r, alpha, dropout, target_modules).apply(model)


class LoRAFineTuneModule(HFCausalLMModule):
    """Next-token fine-tuning of the model in ``base_model`` with LoRA adapters; the base weights stay frozen.

    Args:
        base_model: the directory ``save_pretrained`` wrote (``prepare.py`` makes one). The model is built from its
            config; its weights are loaded by the strategy's ``pretrained=`` option, which must name the same
            directory (checked). Under a strategy that is not lightning_par's (e.g. one process,
            ``--trainer.strategy=auto``) the module loads them itself.
        lora_r, lora_alpha, lora_dropout, lora_target_modules: PEFT ``LoraConfig``: the adapters' rank, scale
            (the update is ``alpha / r * B @ A``), dropout on their input, and the Linear layers that get them.
        vocab_size, max_seq_len: the data's vocabulary and sequence length (linked by ``train.py``); checked
            against the base model's config.
        lr, weight_decay, warmup_steps, max_steps, adam_eps, meta_init: as :class:`HFCausalLMModule`.
    """

    def __init__(self, base_model: str = "runs/finetune/base", lora_r: int = 8, lora_alpha: float = 16.0,
                 lora_dropout: float = 0.0, lora_target_modules: list[str] | None = None, vocab_size: int = 97,
                 max_seq_len: int = 128, meta_init: bool = True, lr: float = 2e-3, weight_decay: float = 0.0,
                 warmup_steps: int = 10, max_steps: int = 1000, adam_eps: float = 1e-8) -> None:
        super().__init__(vocab_size=vocab_size, max_seq_len=max_seq_len, meta_init=meta_init, lr=lr,
                         weight_decay=weight_decay, warmup_steps=warmup_steps, max_steps=max_steps, adam_eps=adam_eps)
        self.save_hyperparameters()  # this class's options only (the parent's model-size options do not apply)
        self.lora_target_modules = list(lora_target_modules or DEFAULT_TARGETS)
        check_lora_options(lora_r, lora_alpha, lora_dropout, self.lora_target_modules)
        with torch.device("meta"):  # a typo in the targets fails here, before any process starts
            check_lora_targets(super().build_model(), self.lora_target_modules)

    def build_config(self) -> PretrainedConfig:
        """The base model's own config; the data must fit its vocabulary and positions."""
        hp = self.hparams
        config = AutoConfig.from_pretrained(check_hf_checkpoint(hp.base_model, name="base_model"))
        if hp.vocab_size > config.vocab_size:
            raise ValueError(f"The data's vocabulary ({hp.vocab_size} symbols) is larger than the base model's "
                             f"(vocab_size={config.vocab_size} in {hp.base_model}/config.json). Fine-tune on data "
                             f"encoded with the base model's vocabulary.")
        if hp.max_seq_len > config.max_position_embeddings:
            raise ValueError(f"data.seq_len={hp.max_seq_len} is longer than the base model's "
                             f"max_position_embeddings={config.max_position_embeddings}. Use "
                             f"--data.seq_len={config.max_position_embeddings} or less.")
        return config

    def build_model(self) -> nn.Module:
        hp = self.hparams
        return add_lora(super().build_model(), hp.lora_r, hp.lora_alpha, hp.lora_dropout, self.lora_target_modules)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        strategy = self.trainer.strategy
        if isinstance(strategy, BaseParallelStrategy):
            self._check_strategy_loads_base_model(strategy)
            super().configure_model()  # on the meta device; the strategy loads the base weights after sharding
            return
        super().configure_model()  # another strategy: built in memory here, then the weights are read
        load_hf_weights(self, self.hparams.base_model)

    def configure_optimizers(self):
        """AdamW over the trainable parameters only (the adapters), linear warmup then cosine decay to lr/10.

        One parameter group: the parent's second group (norms and biases, without weight decay) would be empty under
        LoRA, and an optimizer with an empty group cannot be resumed from a sharded checkpoint (torch 2.13's
        flattened optimizer state dict indexes each group's first parameter: IndexError)."""
        hp = self.hparams
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=hp.lr, betas=(0.9, 0.95), eps=hp.adam_eps,
                                      weight_decay=hp.weight_decay)

        def warmup_cosine(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _check_strategy_loads_base_model(self, strategy: BaseParallelStrategy) -> None:
        base, given = self.hparams.base_model, strategy.pretrained
        if given is None or Path(given).resolve() != Path(base).resolve():
            raise ValueError(
                f"model.base_model={base!r} but the strategy's pretrained={given!r}: the adapters would be trained on "
                f"other base weights than the model was built for. Give the strategy the same directory: "
                f"`trainer.strategy.init_args.pretrained: {base}` (it reads each rank's slices of the weights after "
                f"sharding).")


class SaveMergedModel(Callback):
    """After fit, write the fine-tuned model with the adapters folded into the base weights, as ``save_pretrained``
    does, so that ``AutoModelForCausalLM.from_pretrained(dirpath)`` loads it without PEFT
    (``lightning_par.save_hf_pretrained``: gathered on rank 0 under any layout, written by rank 0).

    Args:
        dirpath: where to write; default ``<the trainer's log_dir>/merged``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.saved_to: Path | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        directory = Path(self.dirpath) if self.dirpath else Path(trainer.log_dir) / "merged"  # log_dir: every rank
        save_hf_pretrained(pl_module, directory)
        self.saved_to = directory
        rank_zero_info(f"Merged model (AutoModelForCausalLM.from_pretrained): {directory.resolve()}")

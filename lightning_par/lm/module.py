"""A ready LightningModule for Hugging Face causal LMs: ``CausalLM(model="Qwen/Qwen2.5-0.5B")`` fine-tunes (or
trains from its config) any transformers model with a causal-LM head, under every lightning_par layout.

Nothing here knows about parallelism: under a lightning_par strategy the model is built on the meta device in
``configure_model``, the strategy shards it, gives memory to each rank's shards only and loads the safetensors
weights into them slice by slice (its ``pretrained=`` option, which this module sets to the model's directory). Under
any other strategy the model is built in memory and the weights are read with :func:`lightning_par.load_hf_weights`.

Batches are those of :class:`lightning_par.lm.TextDataModule`: dicts of ``input_ids`` and ``labels`` (already
shifted: ``labels[t]`` is the token after ``input_ids[t]``, -100 where nothing is predicted) with the packed rows'
``position_ids`` (restarting at each document) or the padded rows' ``attention_mask``; an ``(input_ids, labels)``
pair works too. The loss is the mean cross-entropy over the labelled tokens (``ignore_index=-100``).
"""

from __future__ import annotations

import inspect
import math
import os
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_par.hub import resolve_pretrained
from lightning_par.lm.adapters import LoRA, freeze
from lightning_par.pretrained import check_hf_checkpoint, load_hf_weights
from lightning_par.strategies.base import BaseParallelStrategy

#: the batch keys passed to the model besides ``input_ids``
MODEL_INPUTS = ("position_ids", "attention_mask")


class CausalLM(pl.LightningModule):
    """Next-token training of a Hugging Face causal LM.

    Args:
        model: a Hub ID (``"Qwen/Qwen2.5-0.5B"``, resolved through the Hugging Face cache; ``HF_HUB_OFFLINE=1``
            reads only the cache) or a directory ``save_pretrained`` wrote.
        revision: the Hub revision (branch, tag or commit); ignored for a directory.
        config_overrides: fields of the model's config to change, e.g. ``{"rope_theta": 500000.0}`` or, for a model
            trained from scratch, its size.
        load_weights: start from the model's weights (its safetensors files); False trains from the config alone,
            initialized by the model's own ``_init_weights``.
        lora: LoRA adapters through PEFT (:class:`lightning_par.lm.LoRA`: ``r``, ``alpha``, ``dropout``,
            ``target_modules``, ``target_parameters``); every other parameter is then frozen.
        freeze: globs of parameter names (as the Hugging Face model names them) to freeze, e.g.
            ``["model.embed_tokens", "model.layers.[0-3].*"]``.
        optimizer: ``"adamw"`` or ``"sgd"`` (with ``momentum``), over the trainable parameters only.
        learning_rate, weight_decay, betas, eps, momentum: the optimizer's options. Weight decay applies to matrices
            and embeddings, not to norms and biases.
        warmup_steps: linear warm-up from ``learning_rate / warmup_steps``.
        lr_schedule: after warm-up, ``"cosine"`` decay to ``min_lr_ratio * learning_rate`` at the run's last step
            (``trainer.estimated_stepping_batches``), or ``"constant"``.
        attn_implementation: the transformers attention (``"sdpa"``, ``"eager"``, ...); context parallelism replaces
            it with its own while a step runs.
        meta_init: under a lightning_par strategy, build the model on the meta device (no rank ever holds the whole
            model). False builds it in each process's memory first.

    Logs ``train/loss``, ``val/loss`` (the mean over every labelled validation token of every rank) and
    ``val/perplexity`` (its exponential).
    """

    def __init__(self, model: str | None = None, revision: str | None = None,
                 config_overrides: dict[str, Any] | None = None, load_weights: bool = True, lora: LoRA | None = None,
                 freeze: list[str] | None = None, optimizer: Literal["adamw", "sgd"] = "adamw",
                 learning_rate: float = 1e-4, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, momentum: float = 0.0, warmup_steps: int = 0,
                 lr_schedule: Literal["cosine", "constant"] = "cosine", min_lr_ratio: float = 0.1,
                 attn_implementation: str = "sdpa", meta_init: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        own = inspect.signature(type(self).__init__).parameters  # a subclass's own options, which rebuild it
        if type(self).__init__ is not CausalLM.__init__ and all(p.kind is not p.VAR_KEYWORD for p in own.values()):
            self.remove_ignored_hparams([name for name in list(self.hparams) if name not in own])
        #: the options this class reads (a subclass may save other hyperparameters of its own)
        self.settings = dict(model=model, config_overrides=config_overrides or {}, load_weights=load_weights,
                             optimizer=optimizer, learning_rate=learning_rate, weight_decay=weight_decay,
                             betas=tuple(betas), eps=eps, momentum=momentum, warmup_steps=warmup_steps,
                             lr_schedule=lr_schedule, min_lr_ratio=min_lr_ratio,
                             attn_implementation=attn_implementation, meta_init=meta_init)
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r} is not one of 'adamw', 'sgd'.")
        if lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"lr_schedule={lr_schedule!r} is not one of 'cosine', 'constant'.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an int >= 0.")
        self.model_dir: Path | None = None if model is None else resolve_pretrained(model, revision)
        if load_weights:
            if self.model_dir is None:
                raise ValueError("load_weights=True needs model=<a Hub ID or a save_pretrained directory>; pass "
                                 "load_weights=False to train from a config of your own (override build_config).")
            check_hf_checkpoint(self.model_dir, name="model")
        self.lora = lora
        self.freeze_patterns = list(freeze) if freeze else []
        self.model_config = self.build_config()  # built now, so that a bad option fails before any process starts
        if lora is not None or self.freeze_patterns:
            if lora is not None:
                lora.check()
            with torch.device("meta"):  # a typo in the targets or patterns fails here too
                self.adapt(self.build_base_model())
        self.model: nn.Module | None = None
        self.val_loss = MeanMetric()  # weighted by each batch's labelled tokens

    # ---- the model -------------------------------------------------------------------------------------------
    def build_config(self):
        """The model's config: ``AutoConfig.from_pretrained(model)`` with ``config_overrides``, and no key/value cache
        (nothing here generates, and without one transformers keeps packed documents apart). Override to build one of
        your own (``load_weights=False``)."""
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

        if self.model_dir is None:
            raise ValueError(f"{type(self).__name__} needs model=<a Hub ID or a save_pretrained directory> (or a "
                             f"subclass whose build_config makes the config).")
        config = AutoConfig.from_pretrained(self.model_dir, **self.settings["config_overrides"])
        config.use_cache = False
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"model={self.settings['model']!r} is a {type(config).__name__}, which has no causal-LM "
                             f"model in transformers (AutoModelForCausalLM cannot build it).")
        return config

    def build_base_model(self) -> nn.Module:
        """The Hugging Face model from :meth:`build_config`, freshly initialized (its weights come later), in torch's
        default dtype, which the Trainer's precision sets while ``configure_model`` runs (float32 under ``32-true``
        and the mixed precisions, bfloat16 under ``bf16-true``), not in the config's ``torch_dtype``: a
        ``bf16-mixed`` run keeps float32 weights and optimizer state, and a model whose router transformers keeps in
        float32 (DeepSeek-V3's) has one dtype per FSDP unit."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.model_config, dtype=torch.get_default_dtype(),
                                                attn_implementation=self.settings["attn_implementation"])

    def adapt(self, model: nn.Module) -> nn.Module:
        """``model`` with the ``freeze`` patterns frozen and the LoRA adapters added."""
        if self.freeze_patterns:
            freeze(model, self.freeze_patterns)
        return self.lora.apply(model) if self.lora is not None else model

    def build_model(self) -> nn.Module:
        """The model this module trains: :meth:`build_base_model` after :meth:`adapt`. Called once, in
        ``configure_model`` (on the meta device under a lightning_par strategy)."""
        return self.adapt(self.build_base_model())

    def configure_model(self) -> None:
        if self.model is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        ours = isinstance(strategy, BaseParallelStrategy)
        with torch.device("meta") if ours and self.settings["meta_init"] else nullcontext():
            self.model = self.build_model()
        if not self.settings["load_weights"]:
            return
        if not ours:  # built in memory: read the weights here
            load_hf_weights(self, self.model_dir)
            return
        given = strategy.pretrained
        if given is None:  # the strategy loads them into each rank's shards once it has sharded the model
            strategy.pretrained = str(self.model_dir)
            rank_zero_info(f"{type(self).__name__}: the strategy loads the weights from {self.model_dir}")
        elif Path(given).resolve() != self.model_dir.resolve():
            raise ValueError(f"model={self.settings['model']!r} ({self.model_dir}) but the strategy's "
                             f"pretrained={given!r}: the model would start from other weights than its own. Leave the "
                             f"strategy's `pretrained` unset (this module sets it), or set load_weights=False.")

    # ---- steps -----------------------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask).logits

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The mean cross-entropy over the labelled tokens (labels -100 are not counted)."""
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)

    def split_batch(self, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``(input_ids, labels, the model's other inputs)`` of a dict batch or an ``(input_ids, labels)`` pair."""
        if isinstance(batch, dict):
            missing = [k for k in ("input_ids", "labels") if k not in batch]
            if missing:
                raise ValueError(f"{type(self).__name__}: the batch has no {missing} (keys: {sorted(batch)}). Give "
                                 f"dicts of input_ids, labels and position_ids or attention_mask (TextDataModule's).")
            # (under a pipeline every stage takes its micro-batch's position_ids / attention_mask from the batch)
            extra = {k: batch[k] for k in MODEL_INPUTS if batch.get(k) is not None}
            return batch["input_ids"], batch["labels"], extra
        input_ids, labels = batch
        return input_ids, labels, {}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels, extra = self.split_batch(batch)
        loss = self.loss(self(input_ids, **extra), labels)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, labels, extra = self.split_batch(batch)
        loss = self.loss(self(input_ids, **extra), labels).detach()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        count = (labels != -100).sum()
        if int(count) > 0:
            self.val_loss.update(loss, count)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # summed over every rank's tokens (each rank's are its own or a copy)
        self.val_loss.reset()
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/perplexity", loss.exp(), sync_dist=True)

    # ---- optimizer -------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        """The chosen optimizer over the trainable parameters, with linear warm-up then the ``lr_schedule``.

        One group where no weight decay applies: an optimizer with an empty group cannot be resumed from a sharded
        checkpoint (torch 2.13's flattened optimizer state dict indexes each group's first parameter)."""
        hp = SimpleNamespace(**self.settings)
        trainable = [p for p in self.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"{type(self).__name__} has no trainable parameter: `freeze` froze them all.")
        groups: list[dict[str, Any]] = [{"params": trainable}]
        if hp.weight_decay:
            decay = [p for p in trainable if p.ndim >= 2]  # matrices and embeddings, not norms and biases
            rest = [p for p in trainable if p.ndim < 2]
            groups = [g for g in ({"params": decay, "weight_decay": hp.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}) if g["params"]]
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=hp.learning_rate, momentum=hp.momentum)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps,
                                          weight_decay=0.0)
        total = self.trainer.estimated_stepping_batches if hp.lr_schedule == "cosine" else math.inf
        schedule = warmup_then_cosine(hp.warmup_steps, total, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Collective: write the model (LoRA adapters merged) as ``save_pretrained`` does, and the tokenizer of
        ``model`` beside it, so that ``AutoModelForCausalLM.from_pretrained(directory)`` loads it."""
        from lightning_par.pretrained import save_hf_pretrained

        save_hf_pretrained(self, directory)
        if self.model_dir is not None and self.global_rank == 0:
            from transformers import AutoTokenizer

            try:
                AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(directory)
            except (OSError, ValueError):  # a model directory without a tokenizer
                pass


def warmup_then_cosine(warmup_steps: int, total_steps: float, min_ratio: float):
    """The learning-rate factor of each step: linear warm-up over ``warmup_steps``, then a cosine from 1 to
    ``min_ratio`` at ``total_steps`` (constant at 1 where ``total_steps`` is infinite)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if not math.isfinite(total_steps):
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor

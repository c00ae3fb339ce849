"""ExpertBiasBalancer: auxiliary-loss-free load balancing of mixtures of experts (DeepSeek-V3), correct in every
layout.

Each MoE layer's router adds a bias per expert to its scores when it chooses experts (not when it weights them).
After the gradients of each optimizer step, every bias moves by ``update_rate`` toward balance: up for the experts
that got fewer than the mean of the layer's tokens, down for the busier ones (torchtitan's rule: the sign of the
deviation, centred). The tokens are counted over the whole global batch of the step: every micro-batch of gradient
accumulation, every data and context rank (one all-reduce of the counts), before expert-parallel dispatch, and not
again in activation checkpointing's recompute; under pipeline parallelism each rank updates its own stages' layers.
So the biases are those of one process on the same global batch (DeepSeek-V3's bias goes wrong under pipeline
parallelism in torchtitan #1689).

The biases: a buffer named ``expert_bias`` (the example GPT's router) or ``e_score_correction_bias`` (transformers'
DeepSeek-V3 family) of one value per expert, in the module around each experts module.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_par.parallel.modules import clean_name
from lightning_par.techniques.experts.experts import TokenCounter, find_experts

BIAS_NAMES = ("expert_bias", "e_score_correction_bias")


class ExpertBiasBalancer(Callback):
    """Move each MoE layer's router bias by ``update_rate`` per optimizer step toward an even load."""

    def __init__(self, update_rate: float = 1e-3) -> None:
        if isinstance(update_rate, bool) or not isinstance(update_rate, (int, float)) or not update_rate > 0:
            raise ValueError(f"ExpertBiasBalancer(update_rate={update_rate!r}) must be a positive number (DeepSeek-V3 "
                             f"used 1e-3).")
        self.update_rate = float(update_rate)
        self.counter: TokenCounter | None = None
        self.biases: list[torch.Tensor] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = getattr(getattr(trainer.strategy, "expert_parallel", None), "plan", None)
        experts = find_experts(pl_module, plan)
        if not experts and not _holds_stages(trainer):
            raise ValueError(f"ExpertBiasBalancer found no experts module in {type(pl_module).__name__}: it needs an "
                             f"`ep_plan` (strategy argument or LightningModule attribute) or a Hugging Face mixture "
                             f"of experts.")
        self.biases = [_bias_of(pl_module, name) for name, _ in experts]
        self.counter = TokenCounter(experts, pl_module.device)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.counter is not None:
            self.counter.remove()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.counter is None:
            return
        dims = getattr(trainer.strategy, "dims", None)  # every rank: the whole global batch's tokens
        counts, _, _ = self.counter.summed(dims.mesh("dp_cp").get_group() if dims is not None else None)
        with torch.no_grad():
            for bias, layer in zip(self.biases, counts):
                layer = layer[: bias.numel()]
                delta = torch.sign(layer.mean() - layer) * self.update_rate
                bias.add_((delta - delta.mean()).to(bias.dtype))
        self.counter.zero_()


def _bias_of(root: torch.nn.Module, experts_name: str) -> torch.Tensor:
    """The router bias of the layer around ``experts_name``: a buffer of ``BIAS_NAMES`` in its parent's tree."""
    parent = experts_name.rsplit(".", 1)[0] if "." in experts_name else ""
    for name, buffer in root.named_buffers():
        clean = clean_name(name)
        if clean.startswith(parent + ".") and clean.rsplit(".", 1)[-1] in BIAS_NAMES:
            return buffer
    raise ValueError(
        f"ExpertBiasBalancer: the mixture-of-experts layer around `{experts_name}` has no router bias: give its router "
        f"a buffer named one of {BIAS_NAMES} (zeros, one per expert) that is added to the scores when choosing "
        f"experts, not when weighting them.")


def _holds_stages(trainer: pl.Trainer) -> bool:
    """A pipeline rank may hold no MoE layer (e.g. a first stage of dense layers)."""
    dims = getattr(trainer.strategy, "dims", None)
    return dims is not None and dims.pp > 1

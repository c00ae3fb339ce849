"""The LightningModule: a plain one. Parallelism is the strategy's business, chosen in the YAML config."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchmetrics.text import Perplexity

from example_projects.gpt.model import GPT, GPT_TP_PLAN, GPTConfig
from example_projects.gpt.moe import check_capacity
from lightning_par import auxiliary_loss_scale
from lightning_par.techniques.tensor.tensor_plan import prefix_plan


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (nanoGPT and Megatron pad theirs): tensor parallelism
    splits the embedding and the head over the vocabulary, so ``tp`` must divide it."""
    for name, value in (("vocab_size", vocab_size), ("vocab_multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (e.g. vocab_multiple=64 lets tp up to 64 "
                             f"divide the vocabulary).")
    return -(-vocab_size // multiple) * multiple


class GPTModule(pl.LightningModule):
    """Character-level GPT. The model is built in ``configure_model`` so that strategies can create it on the meta
    device and materialize only each rank's shards.

    ``vocab_multiple`` pads the model's vocabulary (embedding rows, head outputs) to a multiple of it, so that a
    tensor-parallel size dividing it can split them; the extra logits are never targets and only learn to stay small.
    """

    #: the experts modules expert parallelism splits (``n_experts > 0``)
    ep_plan = ["model.blocks.*.mlp.experts"]

    def __init__(self, vocab_size: int = 97, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 20, max_steps: int = 1000, adam_eps: float = 1e-8,
                 vocab_multiple: int = 1, n_experts: int = 0, moe_top_k: int = 2, moe_hidden: int = 0,
                 moe_router: str = "softmax", moe_shared_expert: bool = False, moe_aux_loss_coef: float = 0.0,
                 moe_aux_loss: str = "global", moe_z_loss_coef: float = 0.0, moe_capacity_factor: float | None = None,
                 moe_token_drop_policy: str = "probs") -> None:
        super().__init__()
        self.save_hyperparameters()
        for name, value in (("n_experts", n_experts), ("moe_hidden", moe_hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0 (n_experts=0: a dense MLP; moe_hidden=0: "
                                 f"2 x n_embd per expert).")
        check_capacity(moe_capacity_factor, moe_token_drop_policy)  # here: every rank, before any collective
        self.padded_vocab_size = padded_vocab_size(vocab_size, vocab_multiple)
        self.model: GPT | None = None
        self.val_perplexity = Perplexity()

    @property
    def tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan lightning_par strategies use when none is given (keys relative to this module).
        A mixture of experts leaves its router and experts whole on every tp rank (expert parallelism splits the
        experts), so its plan has no MLP entries."""
        plan = prefix_plan(GPT_TP_PLAN, "model")
        if self.hparams.n_experts:
            plan = {k: v for k, v in plan.items() if not k.startswith("model.blocks.*.mlp")}
        return plan

    def configure_model(self) -> None:
        if self.model is None:
            hp = self.hparams
            config = GPTConfig(self.padded_vocab_size, hp.block_size, hp.n_layer, hp.n_head, hp.n_embd, hp.dropout,
                               hp.n_experts, hp.moe_top_k, hp.moe_hidden, hp.moe_router, hp.moe_shared_expert,
                               hp.moe_aux_loss_coef, hp.moe_aux_loss, hp.moe_z_loss_coef, hp.moe_capacity_factor,
                               hp.moe_token_drop_policy)
            self.model = GPT(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def on_fit_start(self) -> None:
        """The routers' auxiliary losses count tokens over the global micro-batch: they need the ranks that hold its
        other parts (lightning_par's data/context-parallel groups), and the scale of one forward's loss. Under
        pipeline parallelism the micro-batch is the pipeline's (Megatron's choice): the global loss then equals one
        process accumulating those micro-batches; the per-sequence loss and the z-loss equal one process's on the
        whole batch."""
        dims = getattr(self.trainer.strategy, "dims", None)
        groups = {}
        if dims is not None and dims.has_mesh:
            for scope, mesh in (("global", "dp_cp"), ("sequence", "cp")):
                if dims.mesh_size(mesh) > 1:
                    groups[scope] = dims.mesh(mesh).get_group()
        for router in self._routers_with_losses():
            router.count_groups = groups
            router.loss_scale = auxiliary_loss_scale(self.trainer)

    def _routers_with_losses(self) -> list[torch.nn.Module]:
        return [m for m in self.modules() if hasattr(m, "last_losses") and (m.aux_loss_coef or m.z_loss_coef)]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self._log_routing()
        return loss

    def _log_routing(self) -> None:
        """The mean over the layers of each router loss and of the share of dropped choices (of the last micro-batch
        under a pipeline, whose stages hold different layers: summed over the pp ranks first); averaged over the
        ranks, one process's value."""
        hp = self.hparams
        names = [n for n, on in (("aux_loss", hp.moe_aux_loss_coef), ("z_loss", hp.moe_z_loss_coef),
                                 ("dropped", hp.moe_capacity_factor is not None)) if on]
        if not hp.n_experts or not names:  # the same on every rank: the logging below is collective
            return
        layers = [m for m in self.modules() if hasattr(m, "last_dropped")]
        dims = getattr(self.trainer.strategy, "dims", None)
        for name in names:
            if name == "dropped":
                values = [m.last_dropped for m in layers if m.last_dropped is not None]
            else:
                values = [m.router.last_losses[name] for m in layers if name in m.router.last_losses]
            total = torch.stack(values).sum().float() if values else torch.zeros((), device=self.device)
            sums = torch.stack([total, total.new_tensor(float(len(values)))])
            if dims is not None and dims.pp > 1:
                torch.distributed.all_reduce(sums, group=dims.mesh("pp").get_group())
            self.log(f"train/moe_{name}", sums[0] / sums[1].clamp(min=1), sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x).float()
        self.log("val/loss", self.loss(logits, y), sync_dist=True)
        if isinstance(logits, DTensor):  # split over the vocabulary (loss_parallel=True): the metric needs all of it
            logits = logits.full_tensor()
        self.val_perplexity.update(logits, y)
        self.log("val/perplexity", self.val_perplexity)

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=(0.9, 0.95), eps=hp.adam_eps,
        )

        def warmup_cosine(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

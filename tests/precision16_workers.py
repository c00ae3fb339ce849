"""What test_precision16.py runs: the tiny GPT trained under ``16-mixed`` (fp16 autocast on CPU, loss scaling) in
each layout, with an inf injected into one rank's gradient at one step, recording per step what each rank did.

Lightning turns ``Trainer(precision="16-mixed")`` into bf16 on CPU, so the runs pass Lightning's own plugin,
``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(...))``, in ``plugins``: the strategy converts it
(the scaler's settings carried over) exactly as it converts the plugin Lightning builds from the flag on CUDA. The
reference is Lightning itself on one device with that same plugin: plain torch fp16 autocast + GradScaler.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from workers import GLOBAL_BATCH, SEED, TINY_GPT, RecordLoss, token_dataset

from example_projects.gpt.lit import GPTModule
from lightning_par import full_state_dict

STEPS = 6
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2  # small, so that the scale also grows within a few steps


def fp16_plugin(init_scale: float = INIT_SCALE) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class InjectInf(Callback):
    """At batch ``step``, on the ranks in ``ranks``, write an inf into this rank's part of ``param``'s gradient.

    Before the optimizer step, after backward (``on_after_backward``: gradients still scaled, not yet checked)."""

    def __init__(self, step: int, param: str, ranks: tuple[int, ...] = (0,)) -> None:
        self.step, self.param, self.ranks, self.batch_idx = step, param, ranks, -1
        self.injected = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch_idx = batch_idx

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.batch_idx != self.step or trainer.global_rank not in self.ranks:
            return
        grad = dict(pl_module.named_parameters())[self.param].grad
        local = _local(grad)
        assert local.numel() > 0, f"{self.param}: no elements on rank {trainer.global_rank}"
        local.view(-1)[0] = math.inf
        self.injected = True


class RecordSteps(Callback):
    """Per step on this rank: the scaler's scale after the step, and whether any of its parameters changed."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self._before: list[torch.Tensor] = []
        self.scaler_type = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = [_local(p).detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        after = [_local(p).detach() for p in pl_module.parameters()]
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after)))
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # none: the fp32 runs that size fp16's effect
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)
        self.scaler_type = type(scaler).__name__


class SGDGPT16(GPTModule):
    """Plain SGD: its update is proportional to the gradient, so clipping by a still-scaled norm would show."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def training_step(self, batch, batch_idx):
        device = self.device.type
        self.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return super().training_step(batch, batch_idx)


def fit16(strategy: Any, devices: int, dp_size: int, plugin: Any = None, inject: InjectInf | None = None,
          max_steps: int = STEPS, gradient_clip_val: float | None = None, module_cls: type = GPTModule,
          ckpt_dir: str | None = None, ckpt_every_n_steps: int | None = None, resume_from: str | None = None,
          accelerator: str = "cpu", precision: str | None = None, accumulate_grad_batches: int = 1,
          **model_overrides: Any) -> dict[str, Any]:
    """Train under ``strategy`` (``devices`` ranks); or, with ``strategy=None``, the one-process reference: the
    whole global batch, the sample order a DistributedSampler gives any dp size. ``precision``: use the Trainer's
    flag instead of a plugin (on CUDA, where Lightning builds the fp16 plugin itself)."""
    pl.seed_everything(SEED, verbose=False)
    record, steps = RecordLoss(), RecordSteps()
    callbacks: list[Callback] = [record, steps] + ([inject] if inject else [])
    if ckpt_every_n_steps:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=ckpt_every_n_steps, save_top_k=-1,
                                         filename="{step}"))
    reference = strategy is None
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1 if reference else devices, strategy="auto" if reference else strategy,
        plugins=[] if precision else [plugin or fp16_plugin()], precision=precision, max_steps=max_steps, logger=False,
        enable_checkpointing=bool(ckpt_every_n_steps), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, gradient_clip_val=gradient_clip_val,
        use_distributed_sampler=not reference, default_root_dir=ckpt_dir or os.getcwd(),
        accumulate_grad_batches=accumulate_grad_batches,
    )
    model = module_cls(**{**TINY_GPT, **model_overrides})
    if accelerator == "cuda":
        # Lightning's own strategies run configure_model on the GPU (its CUDA generator draws the initial weights),
        # lightning_par's on the CPU, as Lightning's ModelParallelStrategy (no GPU ever holds the whole model before
        # it is sharded): built here, both start from the same weights (found on the first GPU run: the losses
        # differed from the first step)
        model.configure_model()
    data = token_dataset()
    if reference:
        loader = DataLoader(data, batch_size=GLOBAL_BATCH,
                            sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED))
    else:
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp_size, shuffle=True)
    trainer.fit(model, loader, ckpt_path=resume_from)
    weights = ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if reference
               else full_state_dict(model))
    return {"losses": record.losses, "weights": weights, "scales": steps.scales, "changed": steps.changed,
            "global_step": trainer.global_step, "scaler_type": steps.scaler_type,
            "precision": trainer.precision_plugin.precision, "injected": bool(inject and inject.injected),
            "autocast": getattr(model, "autocast", None),
            "weight_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


SKIP_STEP = 2  # the step whose gradients get an inf on one rank
CLIP = 0.05  # below the tiny GPT's gradient norm, so clipping acts on every step
ACCUMULATE_STEPS = 3  # optimizer steps of the run with accumulate_grad_batches=2 (6 batches)


def run_world2(ckpt_dir: str) -> dict[str, Any]:
    """Every world-2 layout, each with an inf on one rank only: a shard (FSDP2), a tp shard, the first stage (PP)."""
    from lightning_par import FSDP2Strategy, PipelineParallelStrategy, TensorParallelStrategy
    from lightning_par.strategies.precision import ParallelGradScaler, ParallelMixedPrecision

    out = {
        "fsdp2": fit16(FSDP2Strategy(), 2, 2, module_cls=SGDGPT16,
                       inject=InjectInf(SKIP_STEP, "model.blocks.0.mlp.fc.weight", ranks=(1,))),
        "tp2": fit16(TensorParallelStrategy(), 2, 1, module_cls=SGDGPT16,
                     inject=InjectInf(SKIP_STEP, "model.blocks.1.attn.q.weight", ranks=(1,))),
        "pp2_1f1b": fit16(PipelineParallelStrategy(pp_schedule="1f1b", pp_microbatches=4), 2, 1, module_cls=SGDGPT16,
                          inject=InjectInf(SKIP_STEP, "model.tok_emb.weight", ranks=(0,))),
        # two batches per optimizer step: the inf at batch SKIP_STEP skips the second optimizer step
        "pp2_accumulate2": fit16(PipelineParallelStrategy(pp_schedule="1f1b", pp_microbatches=4), 2, 1,
                                 module_cls=SGDGPT16, max_steps=ACCUMULATE_STEPS, accumulate_grad_batches=2,
                                 inject=InjectInf(SKIP_STEP, "model.tok_emb.weight", ranks=(0,))),
    }
    # our plugin given directly; sequence parallelism leaves Partial gradients (norms); clipping after unscaling
    plugin = ParallelMixedPrecision("16-mixed", "cpu", ParallelGradScaler("cpu", init_scale=INIT_SCALE,
                                                                           growth_interval=GROWTH_INTERVAL))
    out["tp2_sp_clipped"] = fit16(TensorParallelStrategy(sequence_parallel=True), 2, 1, plugin=plugin,
                                  module_cls=SGDGPT16, gradient_clip_val=CLIP,
                                  inject=InjectInf(SKIP_STEP, "model.blocks.0.norm1.weight", ranks=(0,)))
    # checkpoint after 4 steps (the scale and growth tracker differ from their initial values), resumed with a
    # plugin whose initial scale is different: only a restored scaler state gives the uninterrupted run's scales
    out["saving"] = fit16(FSDP2Strategy(), 2, 2, inject=InjectInf(SKIP_STEP, "model.blocks.0.mlp.fc.weight"),
                          ckpt_dir=ckpt_dir, ckpt_every_n_steps=4)
    out["resumed"] = fit16(FSDP2Strategy(), 2, 2, plugin=fp16_plugin(init_scale=1024.0),
                           resume_from=f"{ckpt_dir}/step=4.ckpt")
    return out


NATURAL_INIT_SCALE = 2.0**22  # fp16 gradients of the tiny GPT overflow from about 2**20: steps skip by themselves


def run_world4() -> dict[str, Any]:
    """2-D mixes: FSDP2 x TP with an inf in one tp shard of one rank; PP x FSDP2 overflowing by itself."""
    from lightning_par import NDParallelStrategy

    return {
        "dp2_tp2": fit16(NDParallelStrategy(dp_shard=2, tp=2), 4, 2, module_cls=SGDGPT16,
                         inject=InjectInf(SKIP_STEP, "model.blocks.1.attn.q.weight", ranks=(3,))),
        "pp2_dp2_natural": fit16(NDParallelStrategy(pp=2, dp_shard=2), 4, 2, module_cls=SGDGPT16,
                                 plugin=fp16_plugin(NATURAL_INIT_SCALE)),
    }


def run_cuda_world1() -> dict[str, Any]:
    """On one GPU, the way a user writes it: ``Trainer(precision="16-mixed")``, Lightning builds the fp16 plugin for
    CUDA and the strategy converts it; NCCL at world size 1. The reference: Lightning alone, same flag."""
    from lightning_par import NDParallelStrategy

    kw: dict[str, Any] = dict(accelerator="cuda", precision="16-mixed", module_cls=SGDGPT16)
    return {
        "reference": fit16(None, 1, 1, inject=InjectInf(SKIP_STEP, "model.blocks.0.mlp.fc.weight"), **kw),
        "nd": fit16(NDParallelStrategy(), 1, 1, inject=InjectInf(SKIP_STEP, "model.blocks.0.mlp.fc.weight"), **kw),
    }

"""What tests/test_finetune.py runs in each process: fine-tuning a Hugging Face causal LM (tiny configs) with frozen
parameters and with PEFT LoRA, under FSDP2, tensor, context and pipeline parallelism and their mixes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_models import HFCausalLM
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from workers import error_of, fit

from lightning_par import NDParallelStrategy, save_hf_pretrained

STEPS = 4
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PartlyFrozenLM(HFCausalLM):
    """The issue's case: a frozen embedding, a whole frozen block, and one frozen weight inside a trainable block."""

    def __init__(self, arch: str = "llama", **overrides: Any) -> None:
        super().__init__(arch, **overrides)
        base = self.model.model
        base.embed_tokens.weight.requires_grad_(False)
        base.layers[1].requires_grad_(False)
        base.layers[2].mlp.up_proj.weight.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, eps=1e-6)


class ClippedPartlyFrozenLM(PartlyFrozenLM):
    """Plain SGD: a clipping norm that counted the frozen weights (or missed a shard) would show in the updates."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


class LoRALM(HFCausalLM):
    """A user's PEFT fine-tuning module: the base model wrapped by ``get_peft_model``; only the adapters train."""

    def __init__(self, arch: str = "qwen2", targets: tuple[str, ...] = LORA_TARGETS, **overrides: Any) -> None:
        super().__init__(arch, **overrides)
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=list(targets)))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)


class LoRAOnHeadLM(LoRALM):
    def __init__(self, arch: str = "qwen2", **overrides: Any) -> None:
        super().__init__(arch, targets=("q_proj", "lm_head"), **overrides)


class StateBytes(Callback):
    """Per rank: bytes of the gradients after backward and of the optimizer state at the end, and which parameters
    have them (local shards of DTensors)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        self.grad_names = sorted(grads)
        self.grad_bytes = sum(_local(g).numel() * g.element_size() for g in grads.values())

    def on_train_end(self, trainer, pl_module) -> None:
        names = {id(p): n for n, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0]
        self.state_names = sorted(names[id(p)] for p in optimizer.state)
        self.state_bytes = sum(_local(t).numel() * t.element_size() for s in optimizer.state.values()
                               for t in s.values() if isinstance(t, torch.Tensor) and t.ndim > 0)
        self.param_bytes = sum(_local(p).numel() * p.element_size() for p in pl_module.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run(strategy: NDParallelStrategy, world: int, dp: int, module_cls: type = PartlyFrozenLM,
        **kwargs: Any) -> dict[str, Any]:
    measure = StateBytes()
    kwargs.setdefault("max_steps", STEPS)
    out = fit(strategy, devices=world, dp_size=dp, module_cls=module_cls, callbacks=[measure], **kwargs)
    out["bytes"] = {k: getattr(measure, k, None) for k in ("grad_names", "grad_bytes", "state_names", "state_bytes",
                                                           "param_bytes")}
    return out


def nd(**kw: Any) -> NDParallelStrategy:
    kw.setdefault("dp_shard", 1)
    return NDParallelStrategy(**kw)


def world2(tmp: str, base_dir: str) -> dict[str, Any]:
    ckpt = Path(tmp)
    out: dict[str, Any] = {}
    out["frozen"] = {
        "fsdp2": run(nd(dp_shard=2), 2, 2),
        "tp2": run(nd(tp=2), 2, 1),
        "tp2_sp": run(nd(tp=2, sequence_parallel=True), 2, 1),
        "cp2": run(nd(cp=2), 2, 1),
        "pp2": run(nd(pp=2, pp_microbatches=2), 2, 1),
    }
    out["frozen_clipped"] = run(nd(dp_shard=2), 2, 2, module_cls=ClippedPartlyFrozenLM, gradient_clip_val=0.05)
    # frozen weights through a checkpoint: saved under FSDP2 at step 2, resumed under TP (DCP reshards)
    run(nd(dp_shard=2), 2, 2, max_steps=2, ckpt_dir=str(ckpt / "frozen"), ckpt_every_n_steps=2)
    out["frozen_resumed_tp"] = run(nd(tp=2), 2, 1, resume_from=str(ckpt / "frozen" / "step=2.ckpt"))

    lora = dict(module_cls=LoRALM)
    out["lora"] = {
        "fsdp2": run(nd(dp_shard=2), 2, 2, **lora),
        "tp2": run(nd(tp=2), 2, 1, **lora),
        "tp2_sp": run(nd(tp=2, sequence_parallel=True), 2, 1, **lora),
        "pp2": run(nd(pp=2, pp_microbatches=2), 2, 1, **lora),
        "llama_fsdp2": run(nd(dp_shard=2), 2, 2, arch="llama", **lora),
        "llama_tp2": run(nd(tp=2), 2, 1, arch="llama", **lora),
        # the adapters' outputs inside a gathering module are functional collectives' waiting results: not plain
        # tensors, held as they are
        "llama_tp2_sp_regather": run(nd(tp=2, sequence_parallel=True, regather_sequence=True), 2, 1, arch="llama",
                                     **lora),
    }
    # start from pretrained weights on the meta device, adapters only in the checkpoints, resumed under TP
    adapters = str(ckpt / "adapters")
    out["lora_from_pretrained"] = run(nd(dp_shard=2, pretrained=base_dir, save_trainable_only=True), 2, 2,
                                      module_cls=LoRALM, empty_init=True, ckpt_dir=adapters, ckpt_every_n_steps=2)
    out["lora_resumed_tp"] = run(nd(tp=2, pretrained=base_dir), 2, 1, module_cls=LoRALM, empty_init=True,
                                 resume_from=str(Path(adapters) / "step=2.ckpt"))
    full = str(ckpt / "full")
    run(nd(dp_shard=2, pretrained=base_dir), 2, 2, module_cls=LoRALM, max_steps=2, ckpt_dir=full,
        ckpt_every_n_steps=2)
    out["checkpoints"] = {"adapters": str(Path(adapters) / "step=2.ckpt"), "full": str(Path(full) / "step=2.ckpt")}
    out["errors"] = {
        "adapters_into_a_model_without": error_of(lambda: run(
            nd(dp_shard=2, pretrained=base_dir), 2, 2, module_cls=HFCausalLM,
            resume_from=str(Path(adapters) / "step=2.ckpt"))),
        "adapter_on_the_gathered_head": error_of(lambda: run(nd(tp=2), 2, 1, module_cls=LoRAOnHeadLM)),
        "optimizer_with_only_frozen_weights": error_of(lambda: run(nd(dp_shard=2), 2, 2, module_cls=NothingToTrain)),
    }
    return out


class NothingToTrain(PartlyFrozenLM):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if not p.requires_grad], lr=1e-3)


def world4(tmp: str) -> dict[str, Any]:
    out = {
        "frozen_dp2_x_tp2": run(nd(dp_shard=2, tp=2), 4, 2),
        "frozen_hsdp": run(nd(dp_replicate=2, dp_shard=2), 4, 4),
        "frozen_pp2_x_dp2": run(nd(pp=2, dp_shard=2, pp_microbatches=2), 4, 2),
        "lora_dp2_x_tp2": run(nd(dp_shard=2, tp=2), 4, 2, module_cls=LoRALM),
        "lora_pp2_x_tp2": run(nd(pp=2, tp=2, pp_microbatches=2), 4, 1, module_cls=LoRALM),
    }
    # the merged model, written from the dp2 x tp2 run's sharded weights for from_pretrained
    import lightning.pytorch as pl

    pl.seed_everything(1234, verbose=False)
    merged = MergeAtEnd(str(Path(tmp) / "merged"))
    fit(nd(dp_shard=2, tp=2), devices=4, dp_size=2, module_cls=LoRALM, max_steps=STEPS, callbacks=[merged])
    return out


class MergeAtEnd(Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        save_hf_pretrained(pl_module, self.directory)

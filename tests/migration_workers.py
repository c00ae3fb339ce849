"""What the migration tests run: Lightning's own ModelParallelStrategy examples (``tests/lightning_examples``) under
Lightning's strategy and under ``lightning_par.ModelParallelStrategy``, nothing changed but the strategy line."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy as LightningModelParallel
from lightning_examples.train import LitModel, Llama3
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from workers import error_of, max_loss_diff, max_weight_diff

import lightning_par
from lightning_par import full_state_dict

SEED = 1234
STEPS = 4


class OwnLosses(Callback):
    """This rank's loss at every step (ranks of a data-parallel group see different samples)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach()
        self.losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))


def strategy(which: str, dp: int, tp: int, distributed_checkpoint: bool = True) -> Any:
    """The only line a user changes: Lightning's strategy or lightning_par's, same arguments."""
    cls = LightningModelParallel if which == "lightning" else lightning_par.ModelParallelStrategy
    return cls(data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=distributed_checkpoint)


def run(which: Any, module_cls: type, dp: int, tp: int, steps: int = STEPS, save_dir: str | None = None,
        resume: str | None = None, distributed_checkpoint: bool = True) -> dict[str, Any]:
    """Seed, build the Trainer and the module as the examples do, fit; this rank's losses and the full weights."""
    L.seed_everything(SEED, verbose=False)
    losses = OwnLosses()
    callbacks: list[Callback] = [losses]
    if save_dir:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(
        accelerator="cpu", devices=dp * tp, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(save_dir), callbacks=callbacks,
        strategy=strategy(which, dp, tp, distributed_checkpoint) if isinstance(which, str) else which,
    )
    with trainer.init_module(empty_init=issubclass(module_cls, Llama3)):  # as each example builds its module
        model = module_cls()
    trainer.fit(model, ckpt_path=resume)
    described = trainer.strategy.describe() if hasattr(trainer.strategy, "describe") else ""
    return {"losses": losses.losses, "weights": full_state_dict(model), "describe": described}


def compare(a: dict[str, Any], b: dict[str, Any], steps: slice = slice(None)) -> dict[str, float]:
    """Largest loss difference over ``steps`` of ``a`` (``b`` holds just those steps or all) and weight difference;
    the weights are whole on rank 0 only."""
    a_losses = a["losses"][steps]
    b_losses = b["losses"][-len(a_losses):]
    out = {"loss": max_loss_diff(a_losses, b_losses), "steps": float(len(a_losses))}
    if a["weights"]:
        out["weights"] = max_weight_diff(a["weights"], b["weights"])
    return out


def llama_both_ways(tmp: str, dp: int, tp: int, other_layout: tuple[int, int] | None = None) -> dict[str, Any]:
    """Lightning's Llama example under both strategies; each resumes the other's step-2 checkpoint (and, with
    ``other_layout``, lightning_par resumes Lightning's checkpoint under another layout: resharding)."""
    root = Path(tmp) / f"llama_dp{dp}_tp{tp}"
    theirs_ckpt, ours_ckpt = str(root / "lightning" / "step=2.ckpt"), str(root / "lightning_par" / "step=2.ckpt")
    theirs = run("lightning", ResumableLlama3, dp, tp, save_dir=str(root / "lightning"))
    ours = run("lightning_par", ResumableLlama3, dp, tp, save_dir=str(root / "lightning_par"))
    ours_from_theirs = run("lightning_par", ResumableLlama3, dp, tp, resume=theirs_ckpt)
    # Lightning replays a mid-epoch checkpoint's epoch from its first batch, so its resumed steps are compared
    # with Lightning resuming its own checkpoint; lightning_par resumes exactly, so with the uninterrupted run
    theirs_from_ours = run("lightning", ResumableLlama3, dp, tp, resume=ours_ckpt)
    theirs_from_theirs = run("lightning", ResumableLlama3, dp, tp, resume=theirs_ckpt)
    out = {
        "ours_vs_theirs": compare(ours, theirs),
        "ours_resume_theirs": compare(ours_from_theirs, theirs),
        "theirs_resume_ours": compare(theirs_from_ours, theirs_from_theirs),
        "theirs_losses": theirs["losses"], "ours_resumed_losses": ours_from_theirs["losses"],
        "describe": ours["describe"],
    }
    if other_layout is not None:  # another mesh shape: DCP reshards Lightning's shards onto it (restored at step
        odp, otp = other_layout  # 2, no step taken: the weights are what was loaded, checked against the file)
        resharded = run("lightning_par", ResumableLlama3, odp, otp, steps=2, resume=theirs_ckpt)
        if resharded["weights"]:
            stored = lightning_par.consolidate_checkpoint(theirs_ckpt)["state_dict"]
            out["resharded_weights"] = max_weight_diff(resharded["weights"], stored)
    return out


def single_file_both_ways(tmp: str, dp: int, tp: int) -> dict[str, Any]:
    """save_distributed_checkpoint=False: one file, written by either strategy, resumed by the other."""
    root = Path(tmp) / f"file_dp{dp}_tp{tp}"
    theirs = run("lightning", LitModel, dp, tp, save_dir=str(root / "lightning"), distributed_checkpoint=False)
    ours = run("lightning_par", LitModel, dp, tp, save_dir=str(root / "lightning_par"), distributed_checkpoint=False)
    ours_from_theirs = run("lightning_par", LitModel, dp, tp, resume=str(root / "lightning" / "step=2.ckpt"))
    theirs_from_ours = run("lightning", LitModel, dp, tp, resume=str(root / "lightning_par" / "step=2.ckpt"))
    theirs_from_theirs = run("lightning", LitModel, dp, tp, resume=str(root / "lightning" / "step=2.ckpt"))
    return {
        "is_file": (root / "lightning_par" / "step=2.ckpt").is_file(),
        "ours_vs_theirs": compare(ours, theirs),
        "ours_resume_theirs": compare(ours_from_theirs, theirs),
        "theirs_resume_ours": compare(theirs_from_ours, theirs_from_theirs),
    }


class EngineLitModel(LitModel):
    """The docs model left to lightning_par's engine (no parallelization in configure_model)."""

    def configure_model(self):
        pass


def converted_back(tmp: str) -> dict[str, Any]:
    """A checkpoint of lightning_par's own layout (FSDP2Strategy: flattened optimizer state), converted with
    ``to_lightning_checkpoint``, resumed by Lightning's strategy with the docs' hand-parallelized model: the same
    as Lightning resuming the checkpoint its own run wrote at the same step."""
    import torch.distributed as dist

    root = Path(tmp) / "convert"
    ours = run(lightning_par.FSDP2Strategy(), EngineLitModel, 2, 1, save_dir=str(root / "ours"))
    theirs = run("lightning", LitModel, 2, 1, save_dir=str(root / "theirs"))
    if dist.get_rank() == 0:
        lightning_par.to_lightning_checkpoint(root / "ours" / "step=2.ckpt", root / "lightning_layout")
    dist.barrier()
    from_converted = run("lightning", LitModel, 2, 1, resume=str(root / "lightning_layout"))
    from_theirs = run("lightning", LitModel, 2, 1, resume=str(root / "theirs" / "step=2.ckpt"))
    return {"fresh": compare(ours, theirs), "theirs_resume_converted": compare(from_converted, from_theirs)}


class ResumableLlama3(Llama3):
    """Lightning's Llama example re-initializes its weights in ``on_train_start``, which Lightning calls after
    restoring a checkpoint too: a user who resumes keeps that for fresh runs."""

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is None:
            super().on_train_start()


class HardCodedHeads(Llama3):
    """Lightning's Llama example with the head counts left whole under tp (the example divides them by tp)."""

    def configure_model(self):
        super().configure_model()
        for block in self.model.layers.values():
            block.attention.n_heads = block.attention.n_kv_heads = self.model_args.n_heads


class PartlyParallel(LitModel):
    """The docs model with a plan that leaves ``w3`` a plain tensor, stepped by ``AdamW(foreach=True)``."""

    def configure_model(self):
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], {"w1": ColwiseParallel()})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)


def migration_world2(tmp: str) -> dict[str, Any]:
    """Every world-2 case in one launch: errors first (each raised on every rank, so the later runs still work)."""
    errors = {
        "lightning_names_on_fsdp2": error_of(lambda: run(lightning_par.FSDP2Strategy(), LitModel, 2, 1)),
        "hard_coded_heads": error_of(lambda: run("lightning_par", HardCodedHeads, 1, 2)),
        "foreach_mixed": error_of(lambda: run("lightning_par", PartlyParallel, 1, 2)),
    }
    with warnings.catch_warnings(record=True) as seen:  # what an FSDP2 run of ours warns about
        warnings.simplefilter("always")
        no_blocks = run(lightning_par.FSDP2Strategy(), EngineLitModel, 2, 1)
    plan = {"model.w1": "colwise", "model.w2": "rowwise", "model.w3": "colwise"}  # the docs' plan, as data
    engine_tp = run(lightning_par.TensorParallelStrategy(tp=2, tp_plan=plan), EngineLitModel, 1, 2)
    return {
        "errors": errors,
        "plan_instead_of_configure_model": compare(engine_tp, run("lightning", LitModel, 1, 2)),
        "no_blocks_losses": no_blocks["losses"],
        "fsdp_warnings": [str(w.message) for w in seen],
        "dp2": llama_both_ways(tmp, 2, 1, other_layout=(1, 2)),
        "tp2": llama_both_ways(tmp, 1, 2),
        "file_tp2": single_file_both_ways(tmp, 1, 2),
        "converted": converted_back(tmp),
    }


def migration_world4(tmp: str) -> dict[str, Any]:
    """dp2 x tp2: Lightning's Llama example both ways, and the docs' 2-D example."""
    docs_theirs = run("lightning", LitModel, 2, 2)
    docs_ours = run("lightning_par", LitModel, 2, 2)
    return {"dp2xtp2": llama_both_ways(tmp, 2, 2, other_layout=(4, 1)),
            "docs_2d": compare(docs_ours, docs_theirs), "docs_describe": docs_ours["describe"]}

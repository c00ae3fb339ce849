"""What the multi-process tests run: a tiny GPT trained by Lightning under a given strategy.

Shared by the parity, checkpoint and reliability tests so that every one of them compares the same thing: the
loss at each step (averaged over data-parallel ranks) and the full final weights, against one process that sees
the same global batch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from example_projects.gpt.lit import GPTModule
from lightning_par import full_state_dict
from lightning_par.techniques.tensor.sequence_regather import gathered_again

SEED = 1234
GLOBAL_BATCH = 8
# adam_eps: Adam divides each gradient by its running RMS, so for a parameter whose gradient is ~0 (a dead GELU
# unit) it turns summation-order rounding (~1e-9) into O(lr) updates; eps=1e-6 keeps such noise from being
# amplified, as it is in one process, without changing well-conditioned updates
# max_steps is the LR schedule's length, fixed at 10 whatever a run's Trainer(max_steps): a run resumed or cut
# short follows the same schedule as the uninterrupted one
TINY_GPT = dict(vocab_size=32, block_size=16, n_layer=3, n_head=4, n_embd=32, lr=3e-3, weight_decay=0.1,
                warmup_steps=3, max_steps=10, adam_eps=1e-6)


def token_dataset(num_samples: int = 96, seq_len: int = 16, vocab: int = 32) -> TensorDataset:
    """Learnable sequences: x[t+1] = (5 x[t] + 3) mod vocab, from random starts, with 10% random tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (num_samples,), generator=g)
    for t in range(seq_len):
        ids[:, t + 1] = (5 * ids[:, t] + 3) % vocab
    noise = torch.rand(ids.shape, generator=g) < 0.1
    ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class SGDGPT(GPTModule):
    """The tiny GPT with plain SGD: updates scale with the gradient, so a wrong clipping norm shows in the weights
    (Adam would hide it: it is nearly invariant to the gradient's scale)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class RareTokenExpertGPT(GPTModule):
    """The tiny GPT with, in every block, one more layer that only the tokens equal to ``rare_token`` pass through
    (a route per token, as in a mixture of experts). A rank whose batch holds none of them never calls the layer,
    so its parameters get no gradient on that rank while they do on another. A second extra layer is never called:
    no rank gives it a gradient, and AdamW (weight decay 0.1) must skip it as in one process."""

    def __init__(self, rare_token: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rare_token = rare_token

    def configure_model(self) -> None:
        super().configure_model()
        for block in self.model.blocks:
            if not hasattr(block, "rare"):
                block.rare = torch.nn.Linear(self.hparams.n_embd, self.hparams.n_embd)
                block.unused = torch.nn.Linear(self.hparams.n_embd, self.hparams.n_embd)
                block.register_forward_hook(self._through_rare_layer)

    def _through_rare_layer(self, block: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        mask = self._ids == self.rare_token
        if not bool(mask.any()):
            return out
        out = out.clone()
        out[mask] = out[mask] + block.rare(out[mask])
        return out

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self._ids = idx
        return super().forward(idx)


class CollectiveCounts(Callback):
    """The c10d collectives each training batch issued on this rank (the real collectives run; a dispatch mode only
    counts the ``c10d`` ops it sees, as torch's ``CommDebugMode`` does without its module tracker, whose gradient
    hooks the pipeline's ``autograd.grad`` shape inference cannot take), and the FSDP units this rank holds."""

    def __init__(self) -> None:
        self.per_batch: list[dict[str, int]] = []
        self.fsdp_units = 0
        self._mode: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        from lightning_par._compat import torch_dispatch_mode

        counts: dict[str, int] = {}
        self.per_batch.append(counts)

        class Count(torch_dispatch_mode()):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func.namespace == "c10d":
                    name = func._overloadpacket.__name__
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self._mode = Count()
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._mode.__exit__(None, None, None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.fsdp_units = sum(isinstance(m, FSDPModule) for m in pl_module.modules())


class RecordLoss(Callback):
    """The training loss of every step, averaged over ranks (equal per-rank batches: the global-batch loss)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().float()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


def fit(
    strategy: Any,
    devices: int,
    dp_size: int,
    max_steps: int = 10,
    precision: str = "32-true",
    ckpt_dir: str | None = None,
    ckpt_every_n_steps: int | None = None,
    num_samples: int = 96,
    seq_len: int = 16,
    resume_from: str | None = None,
    empty_init: bool = False,
    gradient_clip_val: float | None = None,
    module_cls: type[pl.LightningModule] = GPTModule,
    callbacks: list[Callback] | None = None,
    num_nodes: int = 1,
    accumulate_grad_batches: int = 1,
    logger: Any = False,
    module_loader: bool = False,
    **model_overrides: Any,
) -> dict[str, Any]:
    """Train the tiny GPT; return per-step losses and (rank 0) the full final weights. ``module_loader``: the
    module's own ``train_dataloader`` feeds it instead of the loader made here."""
    pl.seed_everything(SEED, verbose=False)
    record = RecordLoss()
    all_callbacks: list[Callback] = [record, *(callbacks or [])]
    if ckpt_every_n_steps:  # mid-epoch checkpoints, and one at the end of every epoch
        all_callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=ckpt_every_n_steps, save_top_k=-1,
                                             save_last=True, filename="{step}"))
        all_callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1,
                                             filename="epoch_end-{step}", save_on_train_epoch_end=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision,
        max_steps=max_steps, logger=logger, accumulate_grad_batches=accumulate_grad_batches,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in all_callbacks),
        enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=all_callbacks, default_root_dir=ckpt_dir or os.getcwd(),
        gradient_clip_val=gradient_clip_val,
    )
    with trainer.init_module(empty_init=empty_init):
        model = module_cls(**_model_kwargs(module_cls, model_overrides))
    loader = DataLoader(token_dataset(num_samples, seq_len), batch_size=GLOBAL_BATCH // dp_size, shuffle=True)
    before = gathered_again()
    trainer.fit(model, None if module_loader else loader, ckpt_path=resume_from)
    # (regather_sequence: the sequence chunks backward gathered again; 0 without it)
    return {"losses": record.losses, "weights": full_state_dict(model), "global_step": trainer.global_step,
            "gathered_again": gathered_again() - before}


def fit_reference(
    max_steps: int = 10,
    precision: str = "32-true",
    gradient_clip_val: float | None = None,
    module_cls: type[pl.LightningModule] = GPTModule,
    num_samples: int = 96,
    accumulate_grad_batches: int = 1,
    callbacks: list[Callback] | None = None,
    micro_batches: int = 1,
    global_batch: int = GLOBAL_BATCH,
    ranks: int = 1,
    **model_overrides: Any,
) -> dict:
    """One process, the whole global batch, the same sample order as a DistributedSampler over any dp size.
    ``micro_batches``: each global batch as that many consecutive micro-batches, their gradients accumulated (what a
    pipeline's micro-batches are to a loss that is not a mean over samples); a step's loss is then their mean.
    ``ranks``: each global batch's samples reordered rank by rank, as a DistributedSampler over that many ranks deals
    them out: with ``micro_batches=ranks`` each micro-batch is one data-parallel rank's batch."""
    pl.seed_everything(SEED, verbose=False)
    record = RecordLoss()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[record, *(callbacks or [])], use_distributed_sampler=False, gradient_clip_val=gradient_clip_val,
        accumulate_grad_batches=accumulate_grad_batches * micro_batches, precision=precision,
    )
    with trainer.init_module():  # bf16-true builds the weights in bf16, as the parallel run does
        model = module_cls(**_model_kwargs(module_cls, model_overrides))
    data = token_dataset(num_samples)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    if ranks > 1:
        sampler = RankByRank(sampler, global_batch, ranks)
    trainer.fit(model, DataLoader(data, batch_size=global_batch // micro_batches, sampler=sampler))
    # Lightning reports each micro-batch's loss divided by the accumulation: a step's micro-batch losses add up to it
    losses = [sum(record.losses[i:i + micro_batches]) for i in range(0, len(record.losses), micro_batches)]
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class RankByRank(Sampler):
    """``sampler``'s indices, each block of ``batch`` reordered as ``ranks`` DistributedSampler ranks receive it
    (rank r: positions r, r + ranks, ...), rank after rank."""

    def __init__(self, sampler: DistributedSampler, batch: int, ranks: int) -> None:
        self.sampler, self.batch, self.ranks = sampler, batch, ranks

    def __iter__(self) -> Any:
        indices = list(self.sampler)
        for start in range(0, len(indices), self.batch):
            block = indices[start:start + self.batch]
            yield from (i for r in range(self.ranks) for i in block[r::self.ranks])

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def _model_kwargs(module_cls: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """The tiny GPT's sizes for GPT modules; other modules (Hugging Face ones) get only the overrides."""
    return {**TINY_GPT, **overrides} if issubclass(module_cls, GPTModule) else overrides


def error_of(run: Callable[[], Any]) -> str | None:
    """``"Type: message"`` of what ``run()`` raised, or None. Bad-input cases run first in a job whose later runs
    must still succeed: that shows the error was raised on every rank before any collective could hang."""
    try:
        run()
    except Exception as e:  # noqa: BLE001 - the caller inspects type and message
        return f"{type(e).__name__}: {e}"
    return None


def assert_raised_on_every_rank(per_rank_errors: list[dict[str, str | None]], case: str, pattern: str) -> None:
    for rank, errors in enumerate(per_rank_errors):
        message = errors[case]
        assert message is not None, f"rank {rank}: {case} raised nothing"
        assert re.search(pattern, message), f"rank {rank}: {message}"


def assert_parity(result: dict, reference: dict, steps: int = 10, tol: float = 1e-5) -> None:
    """The run's last ``steps`` losses and its final weights equal the one-process reference within ``tol``."""
    assert len(result["losses"]) == steps
    assert max_loss_diff(result["losses"], reference["losses"][-steps:]) <= tol, (result["losses"], reference["losses"])
    assert max_weight_diff(result["weights"], reference["weights"]) <= tol


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_loss_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"step counts differ: {len(a)} vs {len(b)}"
    return max(abs(x - y) for x, y in zip(a, b))

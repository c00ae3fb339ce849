"""Module-level workers for the callbacks' multi-process tests (``launch`` pickles them by name).

The runs are deliberately unequal across ranks so the cross-rank summaries have something to find: rank 1 loads
its data slowly (so rank 0 waits for it inside every gradient all-reduce) and holds a 128 MiB ballast.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

WIDTH = 32
SEQ = 8
VOCAB = 64
BALLAST_BYTES = 128 * 2**20


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class SlowOnRankDataset(Dataset):
    """Random regression data; ``__getitem__`` sleeps ``delay_s`` on the rank ``slow_rank``."""

    def __init__(self, n: int = 512, slow_rank: int | None = 1, delay_s: float = 0.002, tokens: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = tokens
        if tokens:
            self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
            self.y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        else:
            self.x = torch.randn(n, WIDTH, generator=g)
            self.y = torch.randn(n, 1, generator=g)
        self.slow = slow_rank is not None and rank() == slow_rank
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.slow:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def _lightning_module(tokens: bool, manual_fsdp: bool, oom_at_step: int | None = None):
    import lightning.pytorch as L

    class TinyModel(L.LightningModule):
        """A few width-32 blocks in one ModuleList (the layout lightning_par's strategies expect)."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH) if tokens else nn.Linear(WIDTH, WIDTH)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3)])
            self.head = nn.Linear(WIDTH, VOCAB if tokens else 1)

        def configure_model(self) -> None:
            if manual_fsdp:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if oom_at_step is not None and self.trainer.global_step == oom_at_step:
                raise torch.OutOfMemoryError("test: simulated out-of-memory")
            x, y = batch
            out = self(x)
            if tokens:
                return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
            return nn.functional.mse_loss(out, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return TinyModel()


def n_params(tokens: bool) -> int:
    return sum(p.numel() for p in _lightning_module(tokens, False).parameters())


def fsdp2_strategy() -> tuple[Any, bool]:
    """The project's FSDP2 strategy when it imports; else Lightning's ModelParallelStrategy + manual fully_shard.

    Returns (strategy, whether the model must shard itself in ``configure_model``).
    """
    try:
        from lightning_par import FSDP2Strategy

        return FSDP2Strategy(process_group_backend="gloo"), False
    except ImportError:
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), True


def train_run(
    root: str,
    logger_kind: str,
    strategy_kind: str,
    callbacks: list[Any],
    max_steps: int = 10,
    tokens: bool = False,
    slow_rank: int | None = 1,
    ballast_rank: int | None = 1,
) -> dict[str, Any]:
    """Fit the tiny model on world 2 with ``callbacks``; return each callback's local (per-rank) results."""
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
    from lightning.pytorch.strategies import DDPStrategy

    ballast = None
    if ballast_rank is not None and rank() == ballast_rank:
        ballast = torch.ones(BALLAST_BYTES // 4)  # touched: resident, not just reserved
    manual_fsdp = False
    if strategy_kind == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
    elif strategy_kind == "fsdp2":
        strategy, manual_fsdp = fsdp2_strategy()
    else:
        raise ValueError(f"strategy_kind={strategy_kind!r}")
    if logger_kind == "tensorboard":
        logger: Any = TensorBoardLogger(root, name="tb", version=0)
    elif logger_kind == "wandb":
        logger = WandbLogger(project="lp-test", save_dir=root, offline=True)
    elif logger_kind == "csv":
        logger = CSVLogger(root, name="csv", version=0)
    else:
        raise ValueError(f"logger_kind={logger_kind!r}")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    data = SlowOnRankDataset(slow_rank=slow_rank, tokens=tokens)
    trainer.fit(_lightning_module(tokens, manual_fsdp), DataLoader(data, batch_size=8))
    if logger_kind == "wandb" and trainer.is_global_zero:
        import wandb

        wandb.finish()
    out: dict[str, Any] = {"rank": trainer.global_rank, "strategy": type(trainer.strategy).__name__}
    for cb in callbacks:
        for attr in ("last_values", "last_summary", "exported", "last_figure_targets", "snapshots"):
            if hasattr(cb, attr):
                out[f"{type(cb).__name__}.{attr}"] = getattr(cb, attr)
    del ballast
    return out


def summarize_worker(values_by_rank: list[dict[str, float]], names: list[str]) -> dict[str, float]:
    """Init a gloo group, summarize this rank's values across ranks, and return the summary."""
    import torch.distributed as dist

    from lightning_par.callbacks.cross_rank import summarize_across_ranks

    dist.init_process_group("gloo")
    try:
        return summarize_across_ranks(values_by_rank[dist.get_rank()], names)
    finally:
        dist.destroy_process_group()

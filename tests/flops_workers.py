"""Module-level workers for tests/test_flops.py (``launch`` pickles them by name).

Each rank fits the example GPT for a few steps under a lightning_par strategy with a ``DeviceUtilizationMonitor``
that counts the FLOPs itself, and returns the monitor's per-device count and start-up line (rank 0 also the
metrics its CSVLogger wrote).
"""

from __future__ import annotations

import csv
import os
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

#: a GPT small enough for 2 CPU processes, with every size divisible by 2 (tp heads, vocabulary, cp chunks)
GPT_ARGS = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.0)
BATCH, SEQ, STEPS = 4, 16, 6


class TokenData(Dataset):
    """Random next-token pairs; the same on every rank."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, GPT_ARGS["vocab_size"], (n, SEQ), generator=g)
        self.y = torch.randint(0, GPT_ARGS["vocab_size"], (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def read_csv_metrics(path: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v != "":
                    out.setdefault(k, {})[int(row["step"])] = float(v)
    return out


def gpt_fit(root: str, layout: str) -> dict[str, Any]:
    """Fit the example GPT on this rank under ``layout`` (dp2, tp2, pp2, cp2) with a counting monitor."""
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    from example_projects.gpt.lit import GPTModule
    from lightning_par import (
        ContextParallelStrategy,
        FSDP2Strategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
    )
    from lightning_par.callbacks import DeviceUtilizationMonitor

    strategies = {
        "dp2": lambda: FSDP2Strategy(process_group_backend="gloo"),
        "tp2": lambda: TensorParallelStrategy(process_group_backend="gloo"),
        "pp2": lambda: PipelineParallelStrategy(process_group_backend="gloo"),
        "cp2": lambda: ContextParallelStrategy(process_group_backend="gloo"),
    }
    torch.manual_seed(0)
    monitor = DeviceUtilizationMonitor(log_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategies[layout](), max_steps=STEPS, log_every_n_steps=2,
        logger=CSVLogger(root, name="csv", version=0), callbacks=[monitor], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0,
    )
    trainer.fit(GPTModule(**GPT_ARGS), DataLoader(TokenData(), batch_size=BATCH))
    out: dict[str, Any] = {
        "flops": monitor.flops_estimate.flops if monitor.flops_estimate else None,
        "note": monitor.flops_note,
        "source": monitor.flops_source,
    }
    if trainer.is_global_zero:
        trainer.logger.finalize("success")
        out["metrics"] = read_csv_metrics(os.path.join(root, "csv", "version_0", "metrics.csv"))
    return out

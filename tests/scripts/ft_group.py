"""One replica group of a fault-tolerant run, launched by torchrun (tests/test_fault_tolerance.py).

Trains a small MLP with FSDP over the group's 2 processes; records, per step, what every rank saw (loss, whether
the step was committed, how many groups took part) in ``<out>/record_g<group>_r<rank>_<restart>.json`` and the final
weights of rank 0 in ``<out>/weights_g<group>.pt``; logs (with a memory monitor) to ``<out>/logs`` and checkpoints
every 6 steps to ``<out>/checkpoints`` (from whichever groups the strategy lets write). Options come from the
environment:

* ``FT_KILL_AT``: group 1's last rank SIGKILLs itself at this step (or the first one after it that its group
  trains) on its first start; its torchrun then ends the group; the test starts it again with ``FT_RESTART=1`` and
  it rejoins the running job;
* ``FT_SYNC_START``: each group waits for the other to be set up before its first quorum;
* ``FT_WAIT_FOR_REJOIN``: after the kill, group 0 waits at this step until the restarted group is set up, so the
  rejoin happens while it trains, however slow the machine;
* ``FT_WAIT_FOR_LATE_GROUP``: group 0 waits at this step until group 1 (started later) is set up, so that it
  joins a running job;
* ``FT_PP``: pipeline stages inside each group (2: each group's two processes are its two stages, 1F1B);
* ``FT_STEP_SLEEP``: seconds each step sleeps (default 0.1, so that a death is noticed while the others train);
* for ``benchmarks/bench_fault_tolerance.py``: ``FT_DISABLE`` (the same job without torchft, with ``FT_REPLICATE``
  replicas of the FSDP group), ``FT_STEPS``,
  ``FT_CKPT_EVERY``, ``FT_RESUME`` (a checkpoint to resume from).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import FaultTolerance, NDParallelStrategy, full_state_dict
from lightning_par.callbacks import MemoryMonitor

STEPS, BATCH, SAMPLES, WIDTH = 24, 4, 96, 16  # 96 samples / (2 groups x 2 ranks x 4) = 6 steps an epoch
STEPS = int(os.environ.get("FT_STEPS", STEPS))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def build_model(hidden: int = 32) -> nn.ModuleList:
    torch.manual_seed(1)
    return nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, hidden), nn.Tanh()), nn.Sequential(nn.Linear(hidden, 1))])


def run(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


class Regression(pl.LightningModule):
    def __init__(self, out: Path, group: int, restart: int) -> None:
        super().__init__()
        self.blocks = build_model()
        self.out, self.group, self.restart = out, group, restart
        self.records: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run(self.blocks, x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        step = self.trainer.global_step
        kill_at = int(os.environ.get("FT_KILL_AT", -1))  # the first step at or after it (the start is a race)
        last_rank = self.global_rank == self.trainer.world_size - 1
        if self.group == 1 and self.restart == 0 and last_rank and 0 <= kill_at <= step:
            self.save_records()
            (self.out / "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.group == 0 and step == int(os.environ.get("FT_WAIT_FOR_REJOIN", -1)) and \
                (self.out / "killed_at").exists():
            self._wait_for("started_g1_1")
        if self.group == 0 and step == int(os.environ.get("FT_WAIT_FOR_LATE_GROUP", -1)):
            self._wait_for("started_g1_0")
        loss = self.loss(self(x), y)  # the pipeline contract (FT_PP): outputs straight into the loss method
        self.records.append({"step": step, "loss": loss.item(), "start": time.time()})
        if self.ft is not None:  # after this step's quorum (and any recovery)
            self.records[-1]["committed_before"] = self.ft.groups.step
        self.log("loss", loss)
        return loss

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def on_fit_start(self) -> None:
        (self.out / f"started_g{self.group}_{self.restart}").touch()  # the strategy is set up, the quorum is next
        if os.environ.get("FT_SYNC_START") and self.restart == 0:
            self._wait_for(f"started_g{1 - self.group}_0")  # both groups in the first quorum

    def _wait_for(self, flag: str) -> None:
        deadline = time.monotonic() + 120
        while not (self.out / flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    @property
    def ft(self):
        return self.trainer.strategy.fault_tolerant

    def save_records(self) -> None:
        name = f"record_g{self.group}_r{self.global_rank}_{self.restart}.json"
        (self.out / name).write_text(json.dumps(self.records))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.records[-1]["time"] = time.time()
        if self.ft is not None:
            self.records[-1].update(committed_steps=self.ft.groups.step, participants=self.ft.groups.participants)
        time.sleep(float(os.environ.get("FT_STEP_SLEEP", 0.1)))  # a death is noticed while the others train

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)


def start_lighthouse(join_timeout_ms: int = 2000, heartbeat_timeout_ms: int = 1000) -> Any:
    """An in-process torchft Lighthouse on a free port (``.address()``, ``.shutdown()``)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def start_group(out: Path, group: int, lighthouse: str, restart: int = 0, processes: int = 2,
                **extra: str) -> subprocess.Popen:
    """Launch one replica group as its own torchrun job; its output goes to ``<out>/group<group>_<restart>.log``."""
    # PL_GLOBAL_SEED seeds the DistributedSampler Lightning injects: the replays assume 0, whatever the caller set
    env = {**os.environ, **extra, "FT_RESTART": str(restart), "REPLICA_GROUP_ID": str(group), "PL_GLOBAL_SEED": "0",
           "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--monitor-interval=0.1", __file__, str(out)]
    log = open(out / f"group{group}_{restart}.log", "w")  # noqa: SIM115 (the child keeps it; closed at its exit)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_all(jobs: list[subprocess.Popen], timeout: float = 120) -> None:
    """Wait for every job; whatever is still running after ``timeout`` seconds (or an error) is killed."""
    try:
        for job in jobs:
            job.wait(timeout=timeout)
    finally:
        for job in jobs:
            job.kill()


def main() -> None:
    out, group = Path(sys.argv[1]), int(os.environ["REPLICA_GROUP_ID"])
    restart = int(os.environ.get("FT_RESTART", "0"))
    rank = int(os.environ["RANK"])
    module = Regression(out, group, restart)
    processes = int(os.environ["WORLD_SIZE"])
    if os.environ.get("FT_DISABLE"):  # the same job without torchft (benchmarks/bench_fault_tolerance.py)
        replicas = int(os.environ.get("FT_REPLICATE", 1))
        strategy = NDParallelStrategy(dp_replicate=replicas, dp_shard=processes // replicas)
    else:
        pp = int(os.environ.get("FT_PP", 1))  # pipeline stages inside each group (one block each)
        strategy = NDParallelStrategy(dp_replicate=2, dp_shard=processes // pp, pp=pp, pp_schedule="1f1b",
                                      pp_microbatches=2, fault_tolerance=FaultTolerance(timeout=20))
    every = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=int(os.environ.get("FT_CKPT_EVERY", 6)),
                            save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=processes, strategy=strategy, max_steps=STEPS,
                         logger=CSVLogger(out, name="logs"), callbacks=[every, MemoryMonitor(log_every_n_steps=1)],
                         log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    try:
        trainer.fit(module, loader, ckpt_path=os.environ.get("FT_RESUME"))
    finally:
        module.save_records()
    weights = full_state_dict(module)
    if rank == 0:
        torch.save(weights, out / f"weights_g{group}.pt")


if __name__ == "__main__":
    main()

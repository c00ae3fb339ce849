"""The GPT example through LightningCLI and YAML, as the README runs it (Lightning's own launcher, 2 processes)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2",
         "--trainer.log_every_n_steps=1", "--data.max_chars=60000", "--data.seq_len=32", "--data.batch_size=4",
         "--model.n_layer=2", "--model.n_embd=32", "--model.n_head=2", "--model.warmup_steps=2"]


def _train(tmp_path: Path, *extra: str) -> tuple[str, Path]:
    cmd = [sys.executable, "example_projects/gpt/train.py", "fit",
           "--config", "example_projects/gpt/configs/fsdp2.yaml", *SMALL,
           f"--trainer.logger.init_args.save_dir={tmp_path}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"TensorBoard logs: (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    return proc.stdout, Path(match.group(1))


def _scalars(log_dir: Path) -> dict[str, list]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("strategy_args", [[], ["--trainer.strategy=fsdp2"]], ids=["yaml_class_path", "by_name"])
def test_gpt_example_trains_through_lightning_cli(tmp_path, strategy_args):
    _, log_dir = _train(tmp_path, *strategy_args)
    assert log_dir.is_dir() and str(log_dir).startswith(str(tmp_path))
    scalars = _scalars(log_dir)
    assert {"train/loss", "val/loss", "val/perplexity"} <= set(scalars), sorted(scalars)
    # the config's monitoring callbacks log per-rank summaries
    assert {"perf/step_time_s/max", "perf/step_time_s/max_rank", "mem/rss_bytes/max"} <= set(scalars)
    assert all(e.value in (0.0, 1.0) for e in scalars["perf/step_time_s/max_rank"])
    losses = [e.value for e in scalars["train/loss"]]
    assert len(losses) == 6 and all(0 < v < 10 for v in losses)
    assert losses[-1] < losses[0]
    # the sharded checkpoint Lightning's ModelCheckpoint wrote at the end is complete
    (ckpt,) = (log_dir / "checkpoints").iterdir()
    assert (ckpt / "COMPLETE").is_file()


def test_torchrun_launch(tmp_path):
    """The same job under a real torchrun: Lightning picks its TorchElasticEnvironment and launches nothing."""
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "tests/scripts/tiny_job.py", "--max-steps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    import torch

    result = torch.load(out)
    assert result["global_step"] == 3 and len(result["losses"]) == 3

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


def _train(tmp_path: Path, *extra: str, config: str = "fsdp2.yaml") -> tuple[str, Path]:
    cmd = [sys.executable, "example_projects/gpt/train.py", "fit",
           "--config", f"example_projects/gpt/configs/{config}", *SMALL,
           f"--trainer.logger.init_args.save_dir={tmp_path}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"TensorBoard logs: (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    return proc.stdout + proc.stderr, Path(match.group(1))


def _scalars(log_dir: Path) -> dict[str, list]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("strategy_args", [[], ["--trainer.strategy=fsdp2"]], ids=["yaml_class_path", "by_name"])
def test_gpt_example_trains_through_lightning_cli(tmp_path, strategy_args):
    """The README's main job, its overlap monitor profiling steps 1-3: it trains, logs, and its console is quiet."""
    window = ["--trainer.callbacks.init_args.every_n_steps=3", "--trainer.callbacks.init_args.window_steps=2",
              "--trainer.callbacks.init_args.start_step=1"]
    output, log_dir = _train(tmp_path, *window, *strategy_args)
    _assert_quiet(output)
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
    assert {"comm/overlap_ratio/max", "comm/exposed_s_per_step/max"} <= set(scalars)  # the profiler ran
    (ckpt,) = (log_dir / "checkpoints").iterdir()
    assert (ckpt / "COMPLETE").is_file()


def test_mixture_of_experts_example_trains_with_expert_parallelism(tmp_path):
    """configs/moe_ep2.yaml through LightningCLI: 2 of 4 experts per rank, the start-up summary names the ep
    groups, and the loss falls."""
    output, log_dir = _train(tmp_path, config="moe_ep2.yaml")
    assert "expert parallel (ep=2" in output and "ep            groups of 2: [[0, 1]]" in output, output[-3000:]
    losses = [e.value for e in _scalars(log_dir)["train/loss"]]
    assert len(losses) == 6 and losses[-1] < losses[0]


def _assert_quiet(output: str) -> None:
    """What a user reads: the start-up summary, the progress bar, the pointer to the logs; nothing like an error."""
    assert "lightning_par: dp_shard=2 on 2 processes (gloo); FSDP2 (ZeRO-3)" in output
    assert re.search(r"Epoch 0 +━+ 6/6", output), output  # Lightning 2.6 alone reads "Epoch 0/-2"
    assert "TensorBoard logs:" in output
    noise = ["USDT", "Warning", "warn", "deprecated", "FLOPs", "Traceback", "terminate called"]
    assert not [line for line in output.splitlines() if any(word in line for word in noise)], output


@pytest.mark.parametrize("strategy_args", [
    [], ["--trainer.strategy=pipeline_parallel"],
    ["--trainer.strategy=lightning_par.NDParallelStrategy", "--trainer.strategy.pp=2",
     "--trainer.strategy.dp_shard=1", "--trainer.strategy.pp_schedule=gpipe", "--trainer.strategy.pp_microbatches=2"],
], ids=["yaml", "by_name", "class_path_and_options"])
def test_gpt_pipeline_config_trains_and_logs_its_timeline(tmp_path, strategy_args):
    """The README's pipeline config (2 stages, 1F1B, 4 micro-batches); the strategy by registered name (pp fills
    the world); and by class path with options from the command line."""
    output, log_dir = _train(tmp_path, "--model.n_layer=4", "--trainer.callbacks.init_args.every_n_steps=3",
                             *strategy_args, config="pipeline_parallel.yaml")
    # the start-up summary: the pp group, and what each rank holds
    assert "pp            groups of 2: [[0, 1]]" in output
    rows = r"\n +0 +0 .* stages \[0\] \(blocks 0, 1\)\n +1 +1 .* stages \[1\] \(blocks 2, 3\)"
    assert re.search(rows, output), output
    scalars = _scalars(log_dir)
    losses = [e.value for e in scalars["train/loss"]]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert {"val/loss", "val/perplexity", "pipeline/idle_fraction/rank1"} <= set(scalars)
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("pipeline/timeline")] == [1, 4]
    assert sorted(p.name for p in (log_dir / "pipeline_timeline").iterdir()) == ["step000001.png", "step000004.png"]
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


def _slurm_job() -> dict:
    """One rank of an srun-launched job: srun sets SLURM_PROCID / SLURM_LOCALID per task (here from the launcher's
    RANK / LOCAL_RANK)."""
    import os as _os

    from lightning.pytorch.callbacks import Callback
    from workers import fit

    from lightning_par import FSDP2Strategy

    _os.environ["SLURM_PROCID"] = _os.environ["RANK"]
    _os.environ["SLURM_LOCALID"] = _os.environ["LOCAL_RANK"]
    seen = {}

    class Probe(Callback):
        def on_fit_start(self, trainer, pl_module) -> None:
            seen["environment"] = type(trainer.strategy.cluster_environment).__name__

    result = fit(FSDP2Strategy(), devices=2, dp_size=2, max_steps=3, callbacks=[Probe()])
    return {**seen, "losses": result["losses"]}


def test_slurm_environment_is_used_when_slurm_launched_the_processes():
    """What srun sets for a 2-task job on one node: Lightning's SLURMEnvironment takes over (no launcher)."""
    from launch import launch

    env = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
           "SLURM_JOB_NAME": "lightning_par_test", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1"}
    results = launch(2, _slurm_job, env=env)
    assert [r["environment"] for r in results] == ["SLURMEnvironment"] * 2
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "example_projects/gpt/configs").glob("*.yaml")))
def test_every_example_config_builds_a_valid_layout(config):
    """Each YAML's strategy constructs (its options pass validation) and its layout fills its world size."""
    import importlib

    import yaml

    trainer = yaml.safe_load((ROOT / "example_projects/gpt/configs" / config).read_text())["trainer"]
    module, _, name = trainer["strategy"]["class_path"].rpartition(".")
    strategy = getattr(importlib.import_module(module), name)(**trainer["strategy"].get("init_args", {}))
    devices = trainer["devices"] if trainer["devices"] not in (-1, "auto") else 8  # all GPUs: e.g. a node of 8
    world_size = devices * trainer.get("num_nodes", 1)
    assert strategy.dims.resolve(world_size).world_size == world_size

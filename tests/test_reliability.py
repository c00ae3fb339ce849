"""Failures end the job loudly and quickly; a killed job resumes to the same weights; silently-wrong models are
refused. Jobs here are launched like users launch them: a script with Trainer(devices=2), Lightning's launcher."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import launch
from torch.distributed.fsdp import fully_shard
from workers import GPTModule, assert_raised_on_every_rank, error_of, fit, fit_reference, max_loss_diff, max_weight_diff

from lightning_par import FSDP2Strategy

SCRIPT = Path(__file__).parent / "scripts" / "tiny_job.py"


def _run_job(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - start


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_ends_the_whole_job_naming_rank_and_error(fail_rank):
    proc, elapsed = _run_job("--fail-rank", str(fail_rank), "--fail-step", "3", "--timeout", "30")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    expected = f"[lightning_par] rank {fail_rank} failed: RuntimeError: injected failure at step 3"
    assert expected in output, output[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end: the surviving rank waited for its peer"


def test_no_rank_takes_the_group_down_while_a_peer_still_works(tmp_path):
    """A rank that finishes first waits for its peers before destroying the process group (rank 0 holds the
    TCPStore): rank 1 stays busy 4 s after training, and rank 0 (the launching process) must not exit before it is
    done. Without that wait about one small job in 30 ended in SIGABRT ("terminate called without an active
    exception") after a successful run."""
    done = tmp_path / "rank1_done"
    proc, _ = _run_job("--max-steps", "2", "--linger-rank", "1", "--linger", "4", "--linger-file", str(done))
    ended = time.time()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "terminate called" not in proc.stderr
    assert ended >= float(done.read_text()), "rank 0 exited while rank 1 was still working"


def _checkpoints(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.exists() else []


def test_sigkill_mid_training_then_resume_reaches_the_uninterrupted_weights(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    job = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--max-steps", "15", "--ckpt-dir", str(ckpt_dir), "--ckpt-every", "3",
         "--step-sleep", "0.3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while "step=6.ckpt" not in _checkpoints(ckpt_dir):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before its step-6 checkpoint"
        time.sleep(0.05)
    time.sleep(0.5)  # into step 7 or 8, possibly inside a save: no warning, no flush
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert "step=15.ckpt" not in _checkpoints(ckpt_dir)

    resumed_file, full_file = tmp_path / "resumed.pt", tmp_path / "full.pt"
    proc, _ = _run_job("--max-steps", "15", "--ckpt-dir", str(ckpt_dir), "--ckpt-every", "3", "--resume", "last",
                       "--out", str(resumed_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = _run_job("--max-steps", "15", "--out", str(full_file))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, full = torch.load(resumed_file), torch.load(full_file)
    assert resumed["global_step"] == full["global_step"] == 15
    assert 0 < len(resumed["losses"]) < 15  # it did resume, from some step after 0
    assert max_loss_diff(resumed["losses"], full["losses"][15 - len(resumed["losses"]):]) <= 1e-6
    assert max_weight_diff(resumed["weights"], full["weights"]) <= 1e-6


class BlocksOnlyGPT(GPTModule):
    """Parallelizes by hand and forgets the root: embeddings and head stay plain, unsynchronized tensors."""

    def configure_model(self) -> None:
        super().configure_model()
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["dp_shard_cp"])


class HandShardedGPT(GPTModule):
    """Parallelizes by hand, correctly (Lightning's ModelParallelStrategy way)."""

    def configure_model(self) -> None:
        super().configure_model()
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["dp_shard_cp"])
        fully_shard(self.model, mesh=self.device_mesh["dp_shard_cp"])


def _model_checks() -> dict:
    errors = {}
    for name, kwargs in {
        "blocks_only": dict(module_cls=BlocksOnlyGPT),
        "unknown_unit": dict(strategy_kwargs=dict(shard_units=["model.blocks.*", "Nope"])),
        "unknown_block_list": dict(strategy_kwargs=dict(block_list="model.layers")),
    }.items():
        strategy = FSDP2Strategy(**kwargs.pop("strategy_kwargs", {}))
        errors[name] = error_of(lambda s=strategy, kw=kwargs: fit(s, devices=2, dp_size=2, max_steps=2, **kw))
    return {"errors": errors, "by_hand": fit(FSDP2Strategy(), devices=2, dp_size=2, module_cls=HandShardedGPT)}


@pytest.fixture(scope="module")
def model_checks():
    return launch(2, _model_checks)


@pytest.mark.parametrize(
    "case, error",
    [
        ("blocks_only", "ValueError: Parameter 'model.tok_emb.weight' is neither sharded nor replicated over the "
                        "data-parallel ranks [0, 1] (it is a plain tensor)"),
        ("unknown_unit", "ValueError: shard_units: 'Nope' matches no module of GPTModule"),
        ("unknown_block_list", "ValueError: block_list='model.layers' names no submodule"),
    ],
)
def test_models_that_would_train_wrong_are_refused_on_every_rank(model_checks, case, error):
    assert_raised_on_every_rank([r["errors"] for r in model_checks], case, "^" + re.escape(error))


def test_parallelizing_by_hand_in_configure_model_is_respected_and_correct(model_checks):
    reference = fit_reference()
    result = model_checks[0]["by_hand"]
    assert max_loss_diff(result["losses"], reference["losses"]) <= 1e-5
    assert max_weight_diff(result["weights"], reference["weights"]) <= 1e-5

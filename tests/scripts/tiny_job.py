"""A tiny FSDP2 training job launched the way users launch: Lightning's own subprocess launcher (devices=2).

Used by the reliability tests: it can fail on purpose on one rank, run slowly enough to be killed mid-training,
checkpoint, resume, and write rank 0's final weights to a file.
"""

import argparse
import atexit
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from workers import fit  # noqa: E402

from lightning_par import FSDP2Strategy, NDParallelStrategy  # noqa: E402


class Misbehave(Callback):
    def __init__(self, fail_rank: int, fail_step: int, step_sleep: float) -> None:
        self.fail_rank, self.fail_step, self.step_sleep = fail_rank, fail_step, step_sleep

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.fail_rank and trainer.global_step == self.fail_step:
            raise RuntimeError(f"injected failure at step {self.fail_step}")
        time.sleep(self.step_sleep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--layout", default=None, help="NDParallelStrategy sizes as JSON; default FSDP2 over 2")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--linger-rank", type=int, default=-1, help="this rank stays on after training ...")
    parser.add_argument("--linger", type=float, default=0.0, help="... for this many seconds, then writes the time")
    parser.add_argument("--linger-file", default=None)
    args = parser.parse_args()
    if args.layout:
        sizes = json.loads(args.layout)
        strategy = NDParallelStrategy(**sizes, timeout=args.timeout)
        dp_size = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
    else:
        strategy, dp_size = FSDP2Strategy(timeout=args.timeout), 2
    result = fit(
        strategy, devices=2, num_nodes=args.num_nodes, dp_size=dp_size, max_steps=args.max_steps, num_samples=40,
        ckpt_dir=args.ckpt_dir, ckpt_every_n_steps=args.ckpt_every, resume_from=args.resume,
        callbacks=[Misbehave(args.fail_rank, args.fail_step, args.step_sleep)],
    )
    if args.out and result["weights"]:
        torch.save(result, args.out)
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == args.linger_rank:
        # registered after the strategy's exit handler, so it runs before it (atexit is last in, first out): this
        # rank is still busy when its peers reach the end of their script
        atexit.register(_linger, args.linger, args.linger_file)


def _linger(seconds: float, path: str | None) -> None:
    time.sleep(seconds)
    if path:
        Path(path).write_text(repr(time.time()))


if __name__ == "__main__":
    main()

"""What fault tolerance costs and saves: torchft replica groups against the same job without them, and against
restarting the whole job from its last checkpoint.

All runs train the test suite's replica-group job (``tests/scripts/ft_group.py``: a small MLP, FSDP over each group's
2 processes, steps that sleep ``--step-sleep`` seconds to stand for compute), each group its own torchrun job:

1. **quorum cost** (``--rounds`` alternating rounds, their median): the median step time of the same 2 x 2 layout
   (HSDP: 2 replicas of a 2-rank FSDP group) as one job without torchft, and as two replica groups with it (every
   step forms a quorum with the Lighthouse, averages the gradients across groups over torchft's process group and
   votes to commit);
2. **a group dies** (one process SIGKILLed at step ``--kill-at``): the time from the kill to the surviving group's
   next committed step, then the time from relaunching the dead group to its first trained step (its state comes
   from the survivor over the network);
3. **checkpoint-restart**, the alternative: one job (no torchft) checkpointing every ``--ckpt-every`` steps,
   killed at the same step and relaunched with ``ckpt_path``: the time from the relaunch to its first step, plus
   the steps since the checkpoint that are trained again.

Prints a table and writes ``benchmarks/results/fault_tolerance.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, format_table, run_metadata, write_json

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
import ft_group  # noqa: E402


def _wait(jobs, timeout: float = 300) -> None:
    ft_group.wait_all(list(jobs), timeout)


def _records(out: Path, group: int, restart: int = 0) -> list[dict]:
    return json.loads((out / f"record_g{group}_r0_{restart}.json").read_text())


def _step_time(records: list[dict], sleep: float) -> float:
    """Median seconds per step between consecutive step starts, without the sleep that stands for compute."""
    starts = [r["start"] for r in records[2:]]  # the first steps warm up
    return statistics.median(b - a for a, b in zip(starts, starts[1:])) - sleep


def quorum_cost(steps: int, sleep: float, rounds: int) -> dict:
    """Alternating rounds of both configurations (this machine's load drifts); the median over rounds."""
    env = {"FT_STEPS": str(steps), "FT_STEP_SLEEP": str(sleep), "FT_CKPT_EVERY": "100000"}
    plain, with_ft = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as d:
            out = Path(d)
            _wait([ft_group.start_group(out, 0, "http://unused:0", processes=4, FT_DISABLE="1", FT_REPLICATE="2",
                                        **env)])
            plain.append(_step_time(_records(out, 0), sleep))
        with tempfile.TemporaryDirectory() as d:
            out, lighthouse = Path(d), ft_group.start_lighthouse()
            try:
                _wait([ft_group.start_group(out, g, lighthouse.address(), FT_SYNC_START="1", **env) for g in (0, 1)])
            finally:
                lighthouse.shutdown()
            with_ft.append(_step_time(_records(out, 0), sleep))
    a, b = statistics.median(plain), statistics.median(with_ft)
    return {"step_s_without_torchft": a, "step_s_with_torchft": b, "ratio": b / a,
            "rounds_without_torchft": plain, "rounds_with_torchft": with_ft}


def group_failure(steps: int, sleep: float, kill_at: int) -> dict:
    env = {"FT_STEPS": str(steps), "FT_STEP_SLEEP": str(sleep), "FT_KILL_AT": str(kill_at),
           "FT_WAIT_FOR_REJOIN": str(kill_at + 5), "FT_SYNC_START": "1", "FT_CKPT_EVERY": "100000"}
    with tempfile.TemporaryDirectory() as d:
        out, lighthouse = Path(d), ft_group.start_lighthouse()
        try:
            survivor, killed = (ft_group.start_group(out, g, lighthouse.address(), **env) for g in (0, 1))
            _wait([killed])
            relaunched_at = time.time()
            _wait([survivor, ft_group.start_group(out, 1, lighthouse.address(), restart=1, **env)])
        finally:
            lighthouse.shutdown()
        killed_at = float((out / "killed_at").read_text())
        commits = [r for r in _records(out, 0)
                   if r["committed_steps"] > r["committed_before"] and r["time"] > killed_at]
        rejoined = _records(out, 1, restart=1)
        alone = sum(1 for r in _records(out, 0) if r.get("participants") == 1 and r["start"] > killed_at)
    return {"death_to_next_commit_s": commits[0]["time"] - killed_at,
            "relaunch_to_training_s": rejoined[0]["start"] - relaunched_at, "steps_trained_by_survivor_alone": alone}


def checkpoint_restart(steps: int, sleep: float, kill_at: int, every: int) -> dict:
    env = {"FT_STEPS": str(steps), "FT_STEP_SLEEP": str(sleep), "FT_DISABLE": "1", "FT_CKPT_EVERY": str(every)}
    same_size = {"processes": 4, "FT_REPLICATE": "2"}  # the 2 x 2 HSDP job, as one job without torchft
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        # a torchft-less job of the same 4 processes: its last rank kills itself at kill_at, as in group_failure
        _wait([ft_group.start_group(out, 1, "http://unused:0", FT_KILL_AT=str(kill_at), **env, **same_size)])
        killed_at = float((out / "killed_at").read_text())
        last = max((out / "checkpoints").iterdir(), key=lambda p: int(p.name.split("step=")[1].split(".")[0]))
        relaunched_at = time.time()
        _wait([ft_group.start_group(out, 1, "http://unused:0", restart=1, FT_RESUME=str(last), **env, **same_size)])
        resumed = _records(out, 1, restart=1)
    redone = kill_at - resumed[0]["step"]
    return {"kill_to_relaunch_s": relaunched_at - killed_at,
            "relaunch_to_training_s": resumed[0]["start"] - relaunched_at, "steps_trained_again": redone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--ckpt-every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the quorum-cost comparison")
    args = parser.parse_args()
    cost = quorum_cost(args.steps, 0.0, args.rounds)
    failure = group_failure(args.steps, args.step_sleep, args.kill_at)
    restart = checkpoint_restart(args.steps, args.step_sleep, args.kill_at, args.ckpt_every)
    step = args.step_sleep + cost["step_s_without_torchft"]
    restart_total = restart["relaunch_to_training_s"] + restart["steps_trained_again"] * step
    rows = [
        ["step time, HSDP 2x2 as one job without torchft", f"{cost['step_s_without_torchft'] * 1e3:.1f} ms", ""],
        ["step time, the same as two torchft replica groups", f"{cost['step_s_with_torchft'] * 1e3:.1f} ms",
         f"{cost['ratio']:.2f}x"],
        ["a group dies: kill -> survivors' next committed step", f"{failure['death_to_next_commit_s']:.2f} s", ""],
        ["the dead group relaunched -> training again (state from a peer)",
         f"{failure['relaunch_to_training_s']:.2f} s", ""],
        ["checkpoint-restart: relaunch -> training again", f"{restart['relaunch_to_training_s']:.2f} s", ""],
        [f"checkpoint-restart: steps trained again (checkpoint every {args.ckpt_every})",
         str(restart["steps_trained_again"]), f"{restart['steps_trained_again'] * step:.2f} s"],
        ["checkpoint-restart: time lost by the whole job (relaunch + steps again)", f"{restart_total:.2f} s", ""],
    ]
    print(format_table(["", "measured", ""], rows))
    write_json(ROOT / "benchmarks" / "results" / "fault_tolerance.json", {
        "meta": run_metadata(), "args": vars(args), "quorum": cost, "failure": failure,
        "checkpoint_restart": {**restart, "time_lost_s": restart_total}})


if __name__ == "__main__":
    main()

"""Run small jobs many times and count the ones that did not exit cleanly.

A job that trained and then aborted in a destructor (``terminate called without an active exception``, exit code
-6 or 134) fails a CI run at random; the rate is the measure. Each run is the GPT example's CLI at a tiny size,
as a user launches it: FSDP2, tp2 and pp2 through Lightning's own launcher (``devices: 2``), and a SLURM-launched
job (two processes started here with the variables ``srun`` sets, Lightning's SLURMEnvironment, no launcher).
``PYTHONFAULTHANDLER=1`` makes an aborting process print every Python thread's stack, kept for each failure.

    python benchmarks/exit_reliability.py --runs 200            # 4 kinds x 200 runs: hours on 2 CPU cores
    python benchmarks/exit_reliability.py --runs 20 --kinds fsdp2 pp2

Prints the exit codes per kind and writes benchmarks/results/exit_reliability.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, format_table, run_metadata, write_json  # noqa: E402

TINY = ["--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1", "--data.max_chars=30000", "--data.seq_len=32", "--data.batch_size=4",
        "--model.n_layer=2", "--model.n_embd=32", "--model.n_head=2", "--model.warmup_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
CONFIGS = {"fsdp2": "fsdp2.yaml", "tp2": "tensor_parallel.yaml", "pp2": "pipeline_parallel.yaml",
           "slurm": "fsdp2.yaml"}
ABORT_SIGNS = ("terminate called", "Fatal Python error", "Aborted")
SLURM = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
         "SLURM_JOB_NAME": "exit_reliability", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1"}


def _command(kind: str, log_dir: str) -> list[str]:
    extra = ["--model.n_layer=4"] if kind == "pp2" else []
    return [sys.executable, "example_projects/gpt/train.py", "fit", "--config",
            f"example_projects/gpt/configs/{CONFIGS[kind]}", *TINY, *extra,
            f"--trainer.logger.init_args.save_dir={log_dir}"]


def run_once(kind: str, port: int) -> tuple[list[int], str]:
    """Exit codes of the job's processes (one for a launcher job, the launcher's own process; two for SLURM) and
    the stderr tail of a failed run: a non-zero exit, or an abort any process printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryDirectory(prefix="exit_rel_") as log_dir:
        if kind != "slurm":
            proc = subprocess.run(_command(kind, log_dir), cwd=ROOT, capture_output=True, text=True, timeout=300,
                                  env=env)
            # the launcher's children share its stderr; one that aborts after the parent is done shows only there
            failed = proc.returncode != 0 or any(sign in proc.stderr for sign in ABORT_SIGNS)
            return [proc.returncode], proc.stderr[-3000:] if failed else ""
        procs = [subprocess.Popen(_command(kind, log_dir), cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**env, **SLURM, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
                                       "MASTER_PORT": str(port)})
                 for r in range(2)]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        codes = [p.returncode for p in procs]
        return codes, "\n".join(e[-3000:] for c, e in zip(codes, errs) if c or any(s in e for s in ABORT_SIGNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/exit_reliability.json"))
    parser.add_argument("--resume", action="store_true",
                        help="go on from the runs --out already holds (a measurement stopped to free the cores)")
    args = parser.parse_args()
    codes = {kind: Counter() for kind in args.kinds}
    seconds = dict.fromkeys(args.kinds, 0.0)
    failures: dict[str, list] = {}
    done, results = 0, {}
    if args.resume and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())
        done = min(earlier["results"][kind]["runs"] for kind in args.kinds)
        for kind in args.kinds:
            codes[kind].update({int(c): n for c, n in earlier["results"][kind]["exit_codes"].items()})
            seconds[kind] = earlier["results"][kind]["seconds"]
        failures = earlier["failures"]
    # kinds take turns, and the JSON is rewritten after every round: a long measurement stopped early still
    # reports the same number of runs for each kind
    for i in range(done, args.runs):
        for kind in args.kinds:
            started = time.perf_counter()
            exits, stderr = run_once(kind, port=29500 + (i * len(args.kinds) + args.kinds.index(kind)) % 200)
            seconds[kind] += time.perf_counter() - started
            codes[kind].update(exits)
            if stderr:
                failures.setdefault(kind, []).append({"run": i, "exit_codes": exits, "stderr_tail": stderr})
        results = {kind: {"runs": i + 1, "exit_codes": dict(codes[kind]),
                          "failed_runs": len(failures.get(kind, [])), "seconds": round(seconds[kind], 1)}
                   for kind in args.kinds}
        write_json(args.out, {"meta": run_metadata(), "results": results, "failures": failures})
        print(f"round {i + 1}/{args.runs}: " + ", ".join(f"{k} {r['failed_runs']} failed" for k, r in results.items()),
              flush=True)
    rows = [(k, r["runs"], r["failed_runs"], ", ".join(f"{c}: {n}" for c, n in sorted(r["exit_codes"].items())))
            for k, r in results.items()]
    print(format_table(["job", "runs", "failed", "exit codes (processes)"], rows))
    out = write_json(args.out, {"meta": run_metadata(), "results": results, "failures": failures})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

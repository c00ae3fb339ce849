"""The one multi-process launch helper of the test suite.

``launch(world_size, fn, *args)`` runs ``fn(*args)`` in ``world_size`` new processes whose environment is the
test process's, plus what a torchrun launch sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), so
Lightning picks its TorchElasticEnvironment and the processes build one gloo process group.

The processes are forked from a server that imported torch, Lightning, transformers and lightning_par once (a
multiprocessing forkserver, started from a new interpreter, never from the test process): each launch then costs
milliseconds instead of seconds of imports per rank. ``fresh_interpreter=True`` starts new interpreters instead,
for what a process reads when it starts (glibc's ``MALLOC_*``); so does every launch where CUDA is visible (a
process that has asked the driver for its devices must not be forked). Each rank's return value comes back through
a file (tensors die with the process that made them). A rank that raises fails the call with that rank's
traceback; a job that outlives ``timeout`` is killed and fails the call: no test can hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any


class WorkerError(AssertionError):
    """One or more ranks failed; the message holds their tracebacks."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for one rank of a single-node job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


#: what the fork server imports once, when the first launch starts it (its environment and working directory are
#: then the test process's of that moment, which is what these modules see at import). A module that raises
#: ImportError is left to the ranks; any other error at import would take the server down, and every launch with it.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
           "lightning.pytorch", "transformers", "transformers.models.llama.modeling_llama", "lightning_par",
           "lightning_par.strategies", "lightning_par.planner", "workers", "hf_models"]


def _context(fresh_interpreter: bool) -> BaseContext:
    import torch

    if fresh_interpreter or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, parent: tuple[str, dict],
            env: dict[str, str]) -> None:
    # a forked rank starts in the server's state: give it the test process's working directory and environment of
    # now, and numpy a seed of its own (Python's random reseeds itself after a fork; torch's seed is fixed anyway)
    cwd, parent_env = parent
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(torchrun_env(rank, world_size, port))
    os.environ.update(env)
    out = Path(out_dir)
    try:
        import numpy
        import torch

        numpy.random.seed()
        torch.set_num_threads(1)
        result = fn(*args)
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        import torch.distributed as dist

        if dist.is_initialized():
            # as the strategies do at exit: every rank arrives, no gloo worker still holds a tensor when the
            # interpreter finalizes (SIGABRT otherwise), then the groups go down
            from lightning_par.collectives import settle_process_groups

            settle_process_groups()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent, whatever it is
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    # The rank's work is done and its result written: leave without finalizing the interpreter, as forked
    # multiprocessing children always do. A gloo worker thread that frees a tensor's Python object while the
    # interpreter finalizes aborts the process (see lightning_par.strategies.base._destroy_process_group); the
    # settling above makes that rare, leaving this way makes it impossible, so no test fails for torch's race.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, env: dict[str, str] | None = None,
    fresh_interpreter: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the list of per-rank results, rank 0 first.

    ``fn`` must be importable (a module-level function) and return picklable values (CPU tensors are fine).
    ``env``: variables set on top of the test process's and torchrun's. ``fresh_interpreter``: start new
    interpreters instead of forking from the server (for what a process reads only at start).
    """
    ctx = _context(fresh_interpreter)
    port = free_port()
    parent = (os.getcwd(), dict(os.environ))
    with tempfile.TemporaryDirectory(prefix="lp_launch_") as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args, parent, env or {}), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 10:
                break  # peers of a failed rank get 10 s to fail on their own, then they are killed
            time.sleep(0.05)
        timed_out = any(p.is_alive() for p in procs) and failed_at is None
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        out = Path(out_dir)
        errors = {r: (out / f"rank{r}.err").read_text() for r in range(world_size) if (out / f"rank{r}.err").exists()}
        if errors or timed_out or any(p.exitcode != 0 for p in procs):
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            codes = {r: p.exitcode for r, p in enumerate(procs)}
            reason = f"timed out after {timeout:.0f}s" if timed_out else "failed"
            raise WorkerError(f"{world_size}-process job {reason}; exit codes {codes}\n" + "\n".join(parts))
        return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]

"""Tensor parallelism: memory per rank and step time of the GPT at tp = 1, 2, 4.

For each tp and method, one process group of tp ranks trains the GPT (same global batch on every rank) and reports:

- ``params``: bytes of this rank's parameters (local shards): about 1/tp of tp = 1 for the sharded linears and
  embeddings; norms, biases of rowwise layers and ``pos_emb`` stay replicated.
- ``activations``: bytes of the tensors autograd keeps for backward during one forward + loss, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters excluded; for DTensors their local
  shard). Without sequence parallelism the residual stream, norms and (without loss parallelism) the full logits
  stay replicated, so this drops less than 1/tp; sequence + loss parallelism shard them too.
- ``step``: median wall time of forward + backward + AdamW step, slowest rank. On this 2-core CPU machine tp = 4
  runs 4 ranks on 2 cores: the times show the overhead of DTensor TP, not its scaling.

Methods: ``plain`` (tp = 1, no DTensor), ``manual`` (``parallelize_module`` with an inline torchtitan-style plan
and a hand-written loop: what a user writes in ``configure_model``), ``apply_tp`` (lightning_par's plan for the
same layout), ``apply_tp+sp`` and ``apply_tp+sp+lp`` (sequence and loss parallelism).

Usage: python benchmarks/bench_tensor.py [--tps 1 2 4] [--steps 4] [--out benchmarks/results/tensor.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package and the shared launcher (tests/launch.py)

from launch import launch  # noqa: E402

from example_projects.gpt.model import GPT, GPT_TP_PLAN, GPTConfig  # noqa: E402
from lightning_par.parallel.tensor import apply_tp  # noqa: E402

MODEL = dict(vocab_size=2048, block_size=128, n_layer=4, n_head=8, n_embd=256, dropout=0.0)
BATCH, SEQ = 4, 128
METHODS = {  # name -> (sequence_parallel, loss_parallel); "manual" is the inline plan below
    "manual": (False, False),
    "apply_tp": (False, False),
    "apply_tp+sp": (True, False),
    "apply_tp+sp+lp": (True, True),
}
ROW_KEYS = ("tp", "method", "param_bytes", "activation_bytes", "step_s", "step_s_ranks")


def manual_tp(model: GPT, mesh: DeviceMesh) -> None:
    """The hand-written baseline: torch's parallelize_module with an inline plan, no sequence parallelism."""
    parallelize_module(model, mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
        })


def local_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(storage pointer, storage bytes) of a tensor's local data: views of one storage count once."""
    t = t._local_tensor if isinstance(t, DTensor) else t  # not to_local(): no autograd op inside a pack hook
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """With loss parallelism the caller wraps this and the backward in one ``loss_parallel()``: the context is not
    reentrant (leaving a nested one switches it off for the outer backward)."""
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def loss_parallel_if(enabled: bool) -> contextlib.AbstractContextManager:
    return loss_parallel() if enabled else contextlib.nullcontext()


def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, use_loss_parallel: bool) -> int:
    params = {local_bytes(p)[0] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = local_bytes(t)
        if ptr not in params:
            saved[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loss_parallel_if(use_loss_parallel):
        loss_of(model, x, y)
    return sum(saved.values())


def measure(tp: int, method: str, steps: int) -> dict:
    """One configuration on this rank (every rank of the tp group calls it)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    sp, lp = METHODS.get(method, (False, False))
    if tp > 1:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        if method == "manual":
            manual_tp(model, mesh)
        else:
            apply_tp(model, mesh, GPT_TP_PLAN, sequence_parallel=sp, loss_parallel=lp)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))
    act = activation_bytes(model, x, y, lp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):  # the first step warms up (allocations, DTensor sharding-propagation caches)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        with loss_parallel_if(lp):
            loss_of(model, x, y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return {
        "tp": tp,
        "method": method,
        "param_bytes": sum(local_bytes(p)[1] for p in model.parameters()),
        "activation_bytes": act,
        "step_s": statistics.median(times[1:]),
    }


def rank_main(tp: int, methods: list[str], steps: int) -> list[dict]:
    dist.init_process_group("gloo")
    try:
        return [measure(tp, method, steps) for method in methods]
    finally:
        dist.destroy_process_group()


def run_tp(tp: int, steps: int) -> list[dict]:
    """Rows for one tp: the slowest rank's step time; memory from rank 0 (every rank holds the same amount)."""
    if tp == 1:
        row = measure(1, "plain", steps)
        return [{**row, "step_s_ranks": [row["step_s"]]}]
    per_rank = launch(tp, rank_main, tp, list(METHODS), steps, timeout=600)
    rows = []
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i]["step_s"] for r in per_rank]
        rows.append({**row, "step_s": max(ranks), "step_s_ranks": ranks})
    return rows


# ---- extension point: Lightning strategy rows -----------------------------------------------------------------
# A function `time_lightning_strategy(tp: int, steps: int) -> list[dict]` goes here: train the same GPT (MODEL,
# BATCH, SEQ, AdamW) with lightning_par's tensor-parallel strategy and return rows with the keys of ROW_KEYS and
# method="lightning ..." measured the same way (median step, slowest rank). Register it in EXTRA_ROWS; main() calls
# every registered function for every tp and puts its rows in the table and the JSON.
EXTRA_ROWS: list[Callable[[int, int], list[dict]]] = []


def print_table(rows: list[dict]) -> None:
    base = next((r for r in rows if r["tp"] == 1 and r["method"] == "plain"), None)

    def ratio(row: dict, key: str) -> str:
        return f"{row[key] / base[key]:6.2f}" if base else "   n/a"

    print(f"\n{'tp':>3} {'method':<16} {'params/rank':>12} {'ratio':>6} {'activations/rank':>17} {'ratio':>6} "
          f"{'step (s)':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['tp']:>3} {r['method']:<16} {r['param_bytes'] / 2**20:8.2f} MiB {ratio(r, 'param_bytes')} "
              f"{r['activation_bytes'] / 2**20:13.2f} MiB {ratio(r, 'activation_bytes')} {r['step_s']:9.3f} "
              f"{ratio(r, 'step_s')}")
    print("ratios: against tp=1 plain. Step times on a 2-core CPU: tp ranks share 2 cores, so they show overhead, "
          "not scaling.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tensor.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # like each launched rank (OMP_NUM_THREADS=1): tp=1 is one core, as every rank
    rows: list[dict] = []
    start = time.perf_counter()
    for tp in args.tps:
        rows += run_tp(tp, args.steps)
        for extra in EXTRA_ROWS:
            rows += extra(tp, args.steps)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "tensor_parallel",
        "model": MODEL, "batch": BATCH, "seq_len": SEQ, "optimizer": "AdamW", "steps": args.steps,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "backend": "gloo", "device": "cpu"},
        "rows": rows,
        "wall_s": round(time.perf_counter() - start, 1),
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

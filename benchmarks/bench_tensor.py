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

Strategy rows (tp >= 2, one more launch of tp processes per tp): the GPT as ``GPTModule`` (example_projects/gpt,
its ``tp_plan`` = ``GPT_TP_PLAN`` under ``model.``), the batch above on every rank, ``GPTModule.configure_optimizers``
(AdamW + LR schedule), at sequence_parallel False and True, loss_parallel False, three variants:

- ``lightning_par``: ``Trainer(strategy=TensorParallelStrategy(tp=N, sequence_parallel=..., loss_parallel=False),
  accelerator="cpu", devices=N)``; the strategy takes the plan from ``GPTModule.tp_plan``;
- ``hand-written``: a plain loop on the same module, ``apply_tp(module, mesh, module.tp_plan, ...)``, doing per step
  what Lightning's step does: zero_grad, forward, loss, an all-reduce of the loss (``GPTModule`` logs it with
  ``sync_dist=True``), backward, AdamW step, scheduler step;
- ``Lightning MP``: Lightning's ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=N)``, the plan
  applied by the user in ``configure_model`` with ``apply_tp(self, self.device_mesh["tensor_parallel"], ...)``.

The three run step by step interleaved (``benchmarks.common.Lockstep``: A, B, C, A, ...; the sequence-parallel
round uses A, C, B), so neighbouring steps see the same machine load. Step time: ``perf_counter`` at
``on_train_batch_start`` / ``on_train_batch_end`` (the hand-written loop: the same boundaries), the slowest rank per
step, the first ``STRATEGY_WARMUP`` steps left out, the median. Ratios lightning_par / reference: of the medians, and
the median of the paired step ratios (step k of both, taken moments apart). Timings on this shared 2-core machine are
noisy: compare only numbers of one invocation.

Usage: python benchmarks/bench_tensor.py [--tps 1 2 4] [--steps 4] [--out benchmarks/results/tensor.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

from benchmarks.common import (  # noqa: E402
    NOISE_NOTE,
    Lockstep,
    format_table,
    quiet_worker,
    slowest_rank_per_step,
    step_timer,
    summarize,
)
from example_projects.gpt.model import GPT, GPT_TP_PLAN, GPTConfig  # noqa: E402
from lightning_par.techniques.tensor.tensor import apply_tp  # noqa: E402

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


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The one batch every configuration trains on, every step, on every rank: (inputs, targets)."""
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))
    return x, y


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
    x, y = fixed_batch()
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

# ---- Lightning strategy rows: lightning_par's TensorParallelStrategy, the same plan by hand, Lightning's own --------
STRATEGY_VARIANTS = ("lightning_par", "hand-written", "Lightning MP")
STRATEGY_REFERENCES = STRATEGY_VARIANTS[1:]
STRATEGY_SP = (False, True)  # sequence_parallel per round; loss_parallel stays off in all three (see the docstring)
STRATEGY_WARMUP = 1  # steps per run left out of the timing, as in measure()
SEED = 0


def strategy_module_kwargs(steps: int) -> dict[str, Any]:
    """GPTModule arguments: the GPT of MODEL; ``max_steps`` only shapes the LR schedule."""
    return {**MODEL, "max_steps": STRATEGY_WARMUP + steps}


def layout_bytes(module: nn.Module) -> dict[str, int]:
    """This rank's parameter bytes and saved-activation bytes (forward + loss), as measure() counts them; the three
    variants apply one plan, so they must agree."""
    x, y = fixed_batch()
    with torch.enable_grad():
        act = activation_bytes(module, x, y, use_loss_parallel=False)
    return {"param_bytes": sum(local_bytes(p)[1] for p in module.parameters()), "activation_bytes": act}


def run_strategy_handwritten(sp: bool, steps: int, yield_turn: Callable[[], None]) -> tuple[list[float], dict]:
    """The reference: the same GPTModule and plan, apply_tp by hand, a plain torch loop doing the work of
    ``GPTModule.training_step`` under Lightning (the loss all-reduce stands for ``self.log(..., sync_dist=True)``)."""
    from example_projects.gpt.lit import GPTModule

    torch.manual_seed(SEED)
    module = GPTModule(**strategy_module_kwargs(steps))  # the factory of the GPT and its optimizer, nothing else
    module.configure_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    apply_tp(module, mesh, module.tp_plan, sequence_parallel=sp, loss_parallel=False)
    opt_cfg = module.configure_optimizers()
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    x, y = fixed_batch()
    total = STRATEGY_WARMUP + steps
    times = []
    for i in range(total):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss(module(x), y)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        loss.backward()
        optimizer.step()
        scheduler.step()
        times.append(time.perf_counter() - start)
        if i < total - 1:  # after the last step, count the bytes before handing the turn on
            yield_turn()
    return times, layout_bytes(module)


def manual_tp_module_cls(sp: bool) -> type:
    """GPTModule parallelized by the user in ``configure_model``: Lightning's ModelParallelStrategy way. Made by a
    function so that Lightning is imported only in the workers."""
    from example_projects.gpt.lit import GPTModule

    class ManualTPGPT(GPTModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            apply_tp(self, self.device_mesh["tensor_parallel"], self.tp_plan, sequence_parallel=sp,
                     loss_parallel=False)

    return ManualTPGPT


def run_strategy_lightning(
    strategy: Any, module_cls: type, steps: int, yield_turn: Callable[[], None]
) -> tuple[list[float], dict]:
    """Trainer.fit on ``fixed_batch()`` every step; step times from the common timing callback."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    total = STRATEGY_WARMUP + steps

    class YieldTurn(Callback):
        """After the timer (callbacks run in list order): hand the turn on, except after the last step."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step < trainer.max_steps:
                yield_turn()

    timer = step_timer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=total, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer, YieldTurn()],
    )
    x, y = fixed_batch()
    # the same batch every step; both strategies read all samples on every rank (data-parallel size 1)
    loader = DataLoader(TensorDataset(x.repeat(total, 1), y.repeat(total, 1)), batch_size=BATCH)
    torch.manual_seed(SEED)
    module = module_cls(**strategy_module_kwargs(steps))
    trainer.fit(module, loader)
    return timer.times, layout_bytes(module)


def strategy_loops(tp: int, sp: bool, steps: int) -> dict[str, Callable[[Callable[[], None]], Any]]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from example_projects.gpt.lit import GPTModule
    from lightning_par import TensorParallelStrategy

    return {
        "lightning_par": lambda turn: run_strategy_lightning(
            TensorParallelStrategy(tp=tp, sequence_parallel=sp, loss_parallel=False), GPTModule, steps, turn),
        "hand-written": lambda turn: run_strategy_handwritten(sp, steps, turn),
        "Lightning MP": lambda turn: run_strategy_lightning(
            ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=tp), manual_tp_module_cls(sp), steps,
            turn),
    }


def strategy_rotation(rnd: int) -> list[str]:
    """Round 0: A, B, C; round 1: A, C, B (as bench_fsdp), so each reference follows lightning_par once."""
    return list(STRATEGY_VARIANTS) if rnd % 2 == 0 else [STRATEGY_VARIANTS[0], *STRATEGY_VARIANTS[:0:-1]]


def strategy_worker(steps: int) -> list[dict[str, Any]]:
    """Every rank: per sequence_parallel setting, the three variants in lockstep; per-rank times and bytes."""
    quiet_worker()
    dist.init_process_group("gloo")  # both strategies find it initialized and reuse it
    tp = dist.get_world_size()
    results = []
    try:
        for rnd, sp in enumerate(STRATEGY_SP):
            gc.collect()
            dist.barrier()  # start each round together, outside the timed steps
            order = strategy_rotation(rnd)
            outcome = Lockstep(order).run(strategy_loops(tp, sp, steps))
            results.append({"sequence_parallel": sp, "order": order,
                            "variants": {name: {"step_times_s": t, **b} for name, (t, b) in outcome.items()}})
    finally:
        dist.destroy_process_group()
    return results


def time_lightning_strategy(tp: int, steps: int) -> list[dict]:
    """Rows for the three variants at sequence_parallel False and True: the slowest rank per step, warm-up left out,
    the median; memory from rank 0. Only for tp >= 2 (Lightning's ModelParallelStrategy needs a process group)."""
    if tp < 2:
        return []
    per_rank = launch(tp, strategy_worker, steps, timeout=600)
    rows = []
    for rnd, res in enumerate(per_rank[0]):
        sp = res["sequence_parallel"]
        for name in STRATEGY_VARIANTS:
            runs = [rank_results[rnd]["variants"][name] for rank_results in per_rank]
            slowest = slowest_rank_per_step([r["step_times_s"] for r in runs])[STRATEGY_WARMUP:]
            stats = summarize(slowest)
            rows.append({
                "tp": tp, "method": name + ("+sp" if sp else ""),
                "param_bytes": runs[0]["param_bytes"], "activation_bytes": runs[0]["activation_bytes"],
                "step_s": stats["median_s"],
                "step_s_ranks": [statistics.median(r["step_times_s"][STRATEGY_WARMUP:]) for r in runs],
                "variant": name, "sequence_parallel": sp, "loss_parallel": False, "order": res["order"],
                "warmup_steps": STRATEGY_WARMUP, "step_times_s": slowest, "step_stats": stats,
                "bytes_per_rank": [{k: r[k] for k in ("param_bytes", "activation_bytes")} for r in runs],
            })
    return rows


def strategy_ratios(rows: list[dict]) -> list[dict]:
    """Per (tp, sequence_parallel): lightning_par's step time over each reference's, as the ratio of the medians
    and as the median of the paired per-step ratios (step k of both, taken moments apart in lockstep)."""
    by_key = {(r["tp"], r["sequence_parallel"], r["variant"]): r for r in rows if "variant" in r}
    out = []
    for (tp, sp, name), ours in by_key.items():
        if name != "lightning_par":
            continue
        entry: dict[str, Any] = {"tp": tp, "sequence_parallel": sp, "loss_parallel": False}
        for ref in STRATEGY_REFERENCES:
            other = by_key[(tp, sp, ref)]
            paired = [a / b for a, b in zip(ours["step_times_s"], other["step_times_s"], strict=True)]
            entry[f"ours/{ref}"] = {"of_medians": ours["step_s"] / other["step_s"],
                                    "paired_median": statistics.median(paired), "paired_per_step": paired}
        out.append(entry)
    return out


def print_strategy_ratios(ratios: list[dict], rows: list[dict]) -> None:
    step = {(r["tp"], r["sequence_parallel"], r["variant"]): r["step_s"] for r in rows if "variant" in r}
    table = []
    for e in ratios:
        tp, sp = e["tp"], e["sequence_parallel"]
        table.append([tp, "yes" if sp else "no", "no",
                      *(f"{step[(tp, sp, v)] * 1e3:.0f}" for v in STRATEGY_VARIANTS),
                      *(f"{e[f'ours/{ref}'][k]:.3f}" for ref in STRATEGY_REFERENCES
                        for k in ("of_medians", "paired_median"))])
    headers = ["tp", "sp", "lp", "ours ms", "hand ms", "L-MP ms", "ours/hand medians", "ours/hand paired",
               "ours/L-MP medians", "ours/L-MP paired"]
    n = len(next(r for r in rows if "variant" in r)["step_times_s"])
    print(f"\nStrategy overhead: lightning_par TensorParallelStrategy (ours) vs the same plan in a hand-written loop "
          f"(hand) and in Lightning's ModelParallelStrategy (L-MP); medians of {n} steps (slowest rank), "
          f"{STRATEGY_WARMUP} warm-up step(s) left out, the three interleaved step by step")
    print(format_table(headers, table))
    print("medians = ratio of the medians; paired = median over steps k of ours(k)/ref(k), taken moments apart")


EXTRA_ROWS.append(time_lightning_strategy)


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
    print(f"Note: {NOISE_NOTE}")


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
    ratios = strategy_ratios(rows)
    if ratios:
        print_strategy_ratios(ratios, rows)
    wall_s = round(time.perf_counter() - start, 1)
    print(f"wall time {wall_s:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "tensor_parallel",
        "model": MODEL, "batch": BATCH, "seq_len": SEQ, "optimizer": "AdamW", "steps": args.steps,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "lightning": importlib.metadata.version("lightning"), "backend": "gloo", "device": "cpu"},
        "rows": rows,
        "strategy_ratios": ratios,
        "strategy_warmup_steps": STRATEGY_WARMUP,
        "noise_note": NOISE_NOTE,
        "wall_s": wall_s,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

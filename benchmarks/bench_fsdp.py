"""FSDP2: model-state bytes per rank against DDP, and step time of lightning_par against two references.

One launch per world size (tests/launch.py: fresh processes, one gloo process group). In it, every rank:

1. trains one step of plain DDP and counts its model state (parameters + gradients + AdamW state): the full
   model on every rank, the baseline;
2. runs three variants of the same GPT (example_projects/gpt, ``GPTModule``), the same batches, the same AdamW
   and LR schedule (``GPTModule.configure_optimizers``), the same sharding (``fully_shard`` per block, then the
   root; the last block keeps its parameters after forward, as lightning_par's ``apply_fsdp`` does):

   - ``lightning_par``: ``Trainer(strategy=FSDP2Strategy(), accelerator="cpu", devices=N)``;
   - ``hand-written``: a plain torch.distributed loop; per step it does what the Lightning step does: zero_grad,
     forward, loss, an all-reduce of the loss (``GPTModule`` logs it with ``sync_dist=True``), backward, AdamW
     step, scheduler step;
   - ``Lightning MP``: Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` with
     ``fully_shard`` applied by the user in ``configure_model`` on ``self.device_mesh["data_parallel"]``.

   They run step by step interleaved (``benchmarks.common.Lockstep``: one thread per variant, only the one whose
   turn it is runs: A, B, C, A, B, C, ...), so that neighbouring steps of the three see the same machine load;
   round 2 reverses the rotation (A, C, B), so each variant follows each other one equally often.

Bytes: counted from the tensors each rank really holds after the last step: ``DTensor.to_local()`` of every
parameter, gradient and optimizer-state tensor (AdamW's scalar ``step`` counters included). Formula next to it:
P parameters in fp32, T parameter tensors: DDP = 16 P + 4 T bytes; FSDP2 per rank ~ 16 P / N + 4 T (uneven dim-0
splits make some ranks hold a row more). The ratio's limit is 1/N. Not counted: FSDP2's transient all-gathered
parameters during forward/backward and DDP's gradient buckets (another 4 P bytes per rank by default).

Step time: ``perf_counter`` at ``on_train_batch_start`` / ``on_train_batch_end`` (a Callback, no barrier); the
hand-written loop uses the same boundaries (batch already loaded; scheduler step inside, as in Lightning). Per
step the slowest rank counts; the first ``--warmup`` steps of every run are left out. Reported: medians over all
measured steps of all rounds and their ratio; and the median of the paired ratios (step k of ours / step k of the
reference, taken moments apart), the estimate least moved by other jobs' load.

Usage: python benchmarks/bench_fsdp.py [--world-sizes 2,4] [--steps 20] [--warmup 3] [--rounds 2]
       [--n-layer 4 --n-embd 128 --n-head 4 --seq-len 64 --batch-size 8] [--out benchmarks/results/fsdp.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    NOISE_NOTE,
    Lockstep,
    format_table,
    launch,
    quiet_worker,
    run_metadata,
    slowest_rank_per_step,
    step_timer,
    summarize,
    write_json,
)
from lightning_par.planner.measure import state_bytes  # noqa: E402

VARIANTS = ("lightning_par", "hand-written", "Lightning MP")
REFERENCES = VARIANTS[1:]
SEED = 0


# ---------------------------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------------------------
def module_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPTModule arguments; block_size = seq_len so positional embeddings are no bigger than needed."""
    return dict(vocab_size=cfg["vocab_size"], block_size=cfg["seq_len"], n_layer=cfg["n_layer"],
                n_head=cfg["n_head"], n_embd=cfg["n_embd"], max_steps=cfg["warmup"] + cfg["steps"])


def token_loader(cfg: dict[str, Any], rank: int, world: int, sampler: bool) -> Any:
    """Random tokens, exactly ``warmup + steps`` batches of ``batch_size`` per rank. ``sampler=True`` adds the same
    DistributedSampler (shuffle, seed 0) that Lightning puts in, so every variant sees the same batches."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    n = world * cfg["batch_size"] * (cfg["warmup"] + cfg["steps"])
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg["vocab_size"], (n, cfg["seq_len"] + 1), generator=g)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    dist_sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED) if sampler else None
    return DataLoader(data, batch_size=cfg["batch_size"], sampler=dist_sampler)


def shard_blocks_and_root(root: Any, blocks: Iterable[Any], mesh: Any) -> None:
    """The sharding every variant uses: ``fully_shard`` per block (the last one not resharded after forward,
    backward needs it at once), then the root, which takes the embeddings, final norm and head."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(root, mesh=mesh)


def run_ddp_baseline(cfg: dict[str, Any], rank: int, world: int) -> dict[str, int]:
    """One real DDP step of the same model and optimizer: what every DDP rank holds."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from example_projects.gpt.lit import GPTModule

    torch.manual_seed(SEED)
    module = GPTModule(**module_kwargs(cfg))
    module.configure_model()
    ddp = DistributedDataParallel(module.model)
    optimizer = module.configure_optimizers()["optimizer"]
    x, y = next(iter(token_loader(cfg, rank, world, sampler=True)))
    F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    return state_bytes(module.model.parameters(), optimizer)


def run_handwritten(
    cfg: dict[str, Any], rank: int, world: int, yield_turn: Callable[[], None]
) -> tuple[list[float], dict[str, int]]:
    """The reference: torch.distributed FSDP2 by hand, the same work per step as ``GPTModule.training_step``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from example_projects.gpt.lit import GPTModule

    torch.manual_seed(SEED)
    module = GPTModule(**module_kwargs(cfg))  # only a factory: the GPT and its optimizer, built by the same code
    module.configure_model()
    model = module.model
    shard_blocks_and_root(model, model.blocks, init_device_mesh("cpu", (world,)))
    opt_cfg = module.configure_optimizers()
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    times = []
    for x, y in token_loader(cfg, rank, world, sampler=True):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # what self.log(..., sync_dist=True) costs in the Lightning variants
        loss.backward()
        optimizer.step()
        scheduler.step()
        times.append(time.perf_counter() - start)
        if len(times) < cfg["warmup"] + cfg["steps"]:  # after the last step, measure the state before yielding
            yield_turn()
    return times, state_bytes(model.parameters(), optimizer)


def manual_fsdp_module_cls() -> type:
    """GPTModule parallelized by the user in ``configure_model``: Lightning's ModelParallelStrategy way.
    Made by a function so the class (and Lightning) is only imported inside the workers."""
    from example_projects.gpt.lit import GPTModule

    class ManualFSDPGPT(GPTModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            shard_blocks_and_root(self, self.model.blocks, self.device_mesh["data_parallel"])

    return ManualFSDPGPT


def run_lightning(
    cfg: dict[str, Any], world: int, strategy: Any, module_cls: type, yield_turn: Callable[[], None]
) -> tuple[list[float], dict]:
    """Trainer.fit under ``strategy``; step times from the timing callback, bytes after the last step."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    class ProbeAndYield(Callback):
        """After the timer (callbacks run in list order): bytes at the last step, else hand the turn on."""

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            # the last step's, before it: gradients (freed right after the step) and AdamW state all present
            if trainer.global_step == trainer.max_steps - 1:
                self.bytes = state_bytes(pl_module.parameters(), trainer.optimizers[0])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step < trainer.max_steps:
                yield_turn()

    timer, probe = step_timer(), ProbeAndYield()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["warmup"] + cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer, probe],
    )
    torch.manual_seed(SEED)
    model = module_cls(**module_kwargs(cfg))
    trainer.fit(model, token_loader(cfg, 0, 1, sampler=False))  # Lightning adds the DistributedSampler
    return timer.times, probe.bytes


def variant_loops(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Callable[[Callable[[], None]], Any]]:
    """Each variant as a function of ``yield_turn``, for :class:`Lockstep`."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from example_projects.gpt.lit import GPTModule
    from lightning_par import FSDP2Strategy

    return {
        "lightning_par": lambda turn: run_lightning(cfg, world, FSDP2Strategy(), GPTModule, turn),
        "hand-written": lambda turn: run_handwritten(cfg, rank, world, turn),
        "Lightning MP": lambda turn: run_lightning(
            cfg, world, ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            manual_fsdp_module_cls(), turn,
        ),
    }


def rotation(rnd: int) -> list[str]:
    """Even rounds A, B, C; odd rounds A, C, B: each variant's step follows each other variant's equally often."""
    return list(VARIANTS) if rnd % 2 == 0 else [VARIANTS[0], *VARIANTS[:0:-1]]


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every rank: the DDP baseline, then rounds of the three variants in lockstep; per-rank numbers to the parent."""
    quiet_worker()
    import torch.distributed as dist

    dist.init_process_group("gloo")  # Lightning's strategies find it initialized and reuse it
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result: dict[str, Any] = {"rank": rank, "ddp": run_ddp_baseline(cfg, rank, world), "runs": []}
        for rnd in range(cfg["rounds"]):
            gc.collect()
            dist.barrier()  # start each round together (outside the timed steps)
            order = rotation(rnd)
            outcome = Lockstep(order).run(variant_loops(cfg, rank, world))
            for name in order:
                times, nbytes = outcome[name]
                result["runs"].append({"round": rnd, "variant": name, "order": order, "step_times_s": times,
                                       "state_bytes": nbytes})
    finally:
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------------------------------------------
# the parent: launch, combine ranks, report
# ---------------------------------------------------------------------------------------------------------------
def formula_bytes(param_numel: int, param_tensors: int, world: int) -> dict[str, float]:
    """fp32 params + grads + AdamW exp_avg + exp_avg_sq = 16 bytes per element, plus a 4-byte ``step`` per tensor
    (replicated, not sharded)."""
    return {"ddp": 16 * param_numel + 4 * param_tensors, "fsdp_per_rank": 16 * param_numel / world + 4 * param_tensors}


def combine_world(world: int, per_rank: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per variant: slowest-rank step times (warm-up dropped) pooled over rounds; bytes per rank; ratios."""
    ddp = per_rank[0]["ddp"]
    formula = formula_bytes(ddp["param_numel"], ddp["param_tensors"], world)
    variants: dict[str, Any] = {}
    for name in VARIANTS:
        runs = [[r for r in rank_result["runs"] if r["variant"] == name] for rank_result in per_rank]
        rounds = [slowest_rank_per_step([rank_runs[i]["step_times_s"] for rank_runs in runs])
                  for i in range(len(runs[0]))]
        measured = [t for steps in rounds for t in steps[warmup:]]
        last_bytes = [rank_runs[-1]["state_bytes"] for rank_runs in runs]  # per rank, from the last round
        max_total = max(b["total"] for b in last_bytes)
        variants[name] = {
            "time": summarize(measured),
            "slowest_rank_step_times_s_per_round": rounds,
            "per_rank_step_times_s": [[r["step_times_s"] for r in rank_runs] for rank_runs in runs],
            "state_bytes_per_rank": last_bytes,
            "state_bytes_max_rank": max_total,
            "ratio_to_ddp": max_total / ddp["total"],
        }
    return {
        "world_size": world,
        "ddp_state_bytes_per_rank": [r["ddp"] for r in per_rank],
        "formula_bytes": formula,
        "formula_ratio": formula["fsdp_per_rank"] / formula["ddp"],
        "limit_ratio": 1 / world,
        "variants": variants,
        "time_ratios": {f"lightning_par/{ref}": time_ratios(variants, ref, warmup) for ref in REFERENCES},
    }


def time_ratios(variants: dict[str, Any], ref: str, warmup: int) -> dict[str, Any]:
    """ours / ref three ways: ratio of medians; median of paired step ratios (step k of both, run moments apart
    in lockstep: other jobs' load cancels); and that paired median per round (its spread shows the noise)."""
    ours_rounds = variants["lightning_par"]["slowest_rank_step_times_s_per_round"]
    ref_rounds = variants[ref]["slowest_rank_step_times_s_per_round"]
    paired = [[a / b for a, b in zip(o[warmup:], r[warmup:])] for o, r in zip(ours_rounds, ref_rounds)]
    return {
        "of_medians": variants["lightning_par"]["time"]["median_s"] / variants[ref]["time"]["median_s"],
        "paired_median": statistics.median(x for rnd in paired for x in rnd),
        "paired_median_per_round": [statistics.median(rnd) for rnd in paired],
        "paired_per_step": paired,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def memory_table(results: list[dict[str, Any]]) -> str:
    """One row per (world, variant): measured bytes of the largest rank, ratio to DDP, formula, 1/N."""
    rows = []
    for res in results:
        world, ddp = res["world_size"], res["ddp_state_bytes_per_rank"][0]
        rows.append([world, "DDP (every rank)", mib(ddp["params"]), mib(ddp["grads"]), mib(ddp["optim"]),
                     mib(ddp["total"]), "1.000", mib(res["formula_bytes"]["ddp"]), "1.000", "1.000"])
        for name in VARIANTS:
            v = res["variants"][name]
            b = max(v["state_bytes_per_rank"], key=lambda x: x["total"])
            rows.append([world, f"FSDP2 {name}", mib(b["params"]), mib(b["grads"]), mib(b["optim"]),
                         mib(b["total"]), f"{v['ratio_to_ddp']:.3f}", mib(res["formula_bytes"]["fsdp_per_rank"]),
                         f"{res['formula_ratio']:.3f}", f"{res['limit_ratio']:.3f}"])
    headers = ["world", "variant (largest rank)", "params MiB", "grads MiB", "optim MiB", "total MiB", "/DDP",
               "formula MiB", "formula /DDP", "limit 1/N"]
    return format_table(headers, rows)


def time_table(results: list[dict[str, Any]]) -> str:
    """One row per (world, variant): medians and quartiles (ms), and ours / this variant."""
    rows = []
    for res in results:
        for name in VARIANTS:
            t = res["variants"][name]["time"]
            cells = [res["world_size"], name, *(f"{t[k] * 1e3:.1f}" for k in ("median_s", "p25_s", "p75_s"))]
            if name == "lightning_par":
                cells += ["-", "-", "-"]
            else:
                r = res["time_ratios"][f"lightning_par/{name}"]
                rounds = r["paired_median_per_round"]
                cells += [f"{r['of_medians']:.3f}", f"{r['paired_median']:.3f}",
                          f"{min(rounds):.3f}-{max(rounds):.3f}"]
            rows.append([*cells, t["n"]])
    headers = ["world", "variant", "median ms", "p25 ms", "p75 ms", "ours/this medians", "ours/this paired",
               "paired per round", "steps"]
    return format_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4", help="comma-separated process counts (default 2,4)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps per run left out of the timing")
    p.add_argument("--rounds", type=int, default=2, help="repetitions (fresh models), rotation reversed in odd ones")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--vocab-size", type=int, default=97)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fsdp.json"))
    args = p.parse_args(argv)
    args.world_list = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    if not args.world_list or any(w < 2 for w in args.world_list):
        p.error(f"--world-sizes={args.world_sizes!r}: give process counts >= 2, e.g. 2,4")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "n_layer", "n_embd", "n_head", "seq_len",
                                         "batch_size", "vocab_size")}
    meta = run_metadata()
    start = time.perf_counter()
    results, launch_s = [], {}
    for world in args.world_list:
        print(f"world {world}: launching {world} processes ...", flush=True)
        per_rank, launch_s[world] = timed(lambda w=world: launch(w, worker, cfg, timeout=args.timeout))
        results.append(combine_world(world, per_rank, args.warmup))
    total_s = time.perf_counter() - start
    n_params = results[0]["ddp_state_bytes_per_rank"][0]["param_numel"]
    print(f"\nGPT {cfg['n_layer']} layers x {cfg['n_embd']} wide, {n_params:,} parameters (fp32), seq {cfg['seq_len']},"
          f" batch {cfg['batch_size']}/rank, AdamW; CPU, gloo, 1 thread per rank, {meta['cpu_count']} cores")
    print("\nModel state per rank (params + grads + AdamW state), measured from local shards after the last step;"
          " formula: DDP 16P+4T, FSDP2 16P/N+4T bytes")
    print(memory_table(results))
    print(f"\nStep time, slowest rank per step, {args.rounds} rounds x {args.steps} steps per variant, the three run "
          f"step by step in lockstep ({args.warmup} warm-up steps per run left out)")
    print(time_table(results))
    print("ours/this medians = ratio of the medians; paired = median over steps k of ours(k)/this(k), taken moments "
          "apart; paired per round: lowest-highest round, the run-to-run noise")
    print(f"\nNote: {NOISE_NOTE} World sizes above the core count ({meta['cpu_count']}) time-share cores.")
    meta.update(load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None, device="cpu",
                backend="gloo", threads_per_rank=1, total_wall_s=total_s, launch_wall_s=launch_s)
    out = write_json(args.out, {"benchmark": "fsdp", "args": vars(args),
                                "model": {**cfg, "param_numel": n_params}, "metadata": meta, "results": results})
    print(f"Total {total_s:.0f} s; results written to {out}")


if __name__ == "__main__":
    main()

"""Which layout? Every layout NDParallelStrategy supports today, side by side: one model, world 4, one global batch.

The GPT of example_projects/gpt (``GPTModule``: 4 layers x 128 wide, 4 heads, seq 64, vocab 128, AdamW with its LR
schedule) trains under ``Trainer(accelerator="cpu", devices=4, strategy=NDParallelStrategy(...))`` in each layout:

    dp_shard=4 (FSDP2)            dp_replicate=2 x dp_shard=2 (HSDP)     tp=4
    tp=2 x dp_shard=2             tp=2 x dp_shard=2 + sequence parallel  cp=4
    cp=2 x dp_shard=2             tp=2 x cp=2                            pp=4 (1F1B)
    pp=2 x dp_shard=2 (1F1B)

The global batch is the same everywhere (default 8 sequences): a DataLoader of ``global / (dp_replicate * dp_shard)``
sequences per rank, behind the DistributedSampler Lightning injects over the data-parallel ranks (TP and CP ranks of
one replica read the same samples; CP then splits each sequence over its ranks). Vocabulary 128, so that tp = 4
divides it; the sequence is divisible by 2*cp (load-balanced causal CP) and by tp (sequence parallelism).
Pipeline layouts cut the 4 blocks into pp stages (one block per stage at pp=4) and run ``pp_microbatches``
micro-batches per batch (default pp: 1F1B needs at least one per stage); each rank holds only its stages'
parameters (the first stage also the embeddings, the last the final norm and head), and the steps go through the
schedule (``GPTModule.training_step`` unchanged). The first step of a pipelined fit traces the model (seconds):
it falls in the warm-up.

One launch of 4 processes (tests/launch.py) runs every layout one after the other, ``--rounds`` times (odd rounds in
reverse order, so slow drift of the machine's load does not always fall on the same layouts). Per layout and round,
one Trainer.fit of ``warmup + steps + 1 + 1 + window`` optimizer steps:

1. ``--warmup`` steps, not measured;
2. ``--steps`` timed steps: ``perf_counter`` at ``on_train_batch_start`` / ``on_train_batch_end``
   (``benchmarks.common.step_timer``, no barrier), the slowest rank per step, the median over all rounds;
3. one probe step (not timed): the peak bytes of the tensors autograd saves for backward that are alive at
   once, counted with ``torch.autograd.graph.saved_tensors_hooks`` from the start of the batch to its end
   (distinct storages, local shards of DTensors; a storage counts from its first save until autograd releases
   its last saved reference, i.e. after the backward that used it; parameters excluded: ``nn.Parameter`` s and
   views of them, FSDP's all-gathered parameters and DTensor parameters included). Without pipelining every
   saved tensor lives until backward starts, so the peak is the step's total; under a pipeline schedule the
   backward of early micro-batches frees theirs while later ones run forward (1F1B: at most pp micro-batches in
   flight on the first stage), and a stage's received input (a leaf that requires grad, not a parameter)
   counts. After the probe's optimizer step, the model state this rank holds: parameters, gradients and AdamW
   state, each ``DTensor.to_local()`` (``lightning_par.planner.measure.state_bytes``; under pp only this rank's
   stages);
4. a ``CommOverlapMonitor`` window (1 profiled warm-up batch + ``--window`` measured batches, ``torch.profiler``):
   communication time per step by kind, total, exposed (not overlapped with compute) and the overlap ratio. The
   values are read from what the monitor logs (max over ranks, ``comm/.../max``) through an in-memory Logger
   attached to the Trainer; each rank's own values are kept in the JSON too. The window's steps are not timed
   (the profiler slows them). Kinds: FSDP all-gather, FSDP reduce-scatter (with HSDP's all-reduce across
   replicas), TP (DTensor collectives), CP (ring send/recv), PP (the schedule's stage-to-stage send/recv); the
   rest is Lightning's own per-step communication (the ``sync_dist`` all-reduce of the logged loss with its gloo
   barrier, the per-step SIGTERM broadcast; under pp also the broadcast of the loss from the last stage to the
   other pp ranks), which is also where one rank waits for a slower one.

Memory: "peak estimate" = model state + saved activations, per rank, the largest rank. Not in it: transient buffers
(FSDP's all-gathered parameters of the one or two blocks being computed, TP/CP communication buffers, a pipeline
stage's outputs kept for backward and its send/recv buffers, autograd's temporary gradients, the allocator's
slack). The process resident-set peak is not used: it is process-wide,
monotone over the whole launch (every layout runs in the same processes) and dominated by the Python/torch runtime.

Reference row: one process, no parallelism, the whole global batch: its model state and saved activations (the same
counting), so every layout's bytes read as a fraction of the unparallelized model's.

Communication on CPU/gloo: a collective's time is the time gloo's threads spend in it (a ring step's send/recv: the
calling thread's), which includes waiting for the slowest peer. With 4 ranks on 2 cores that waiting includes being
descheduled, so comm times here are upper bounds of the transfer cost and step times reflect the total work +
communication of all 4 ranks, not parallel scaling.

Usage: python benchmarks/bench_layouts.py [--layouts fsdp,hsdp,...] [--steps 8] [--warmup 3] [--window 3]
       [--rounds 2] [--global-batch 8] [--n-layer 4 --n-embd 128 --n-head 4 --seq-len 64 --vocab-size 128]
       [--out benchmarks/results/layouts.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_fsdp import module_kwargs  # noqa: E402
from benchmarks.common import (  # noqa: E402
    NOISE_NOTE,
    format_table,
    launch,
    quiet_worker,
    run_metadata,
    slowest_rank_per_step,
    step_timer,
    summarize,
    write_json,
)
from lightning_par.planner.measure import probe_callback, saved_activations, state_bytes  # noqa: E402

WORLD = 4
SEED = 0

#: key -> (label, NDParallelStrategy sizes and options)
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp": ("dp_shard=4 (FSDP2)", dict(dp_shard=4)),
    "hsdp": ("dp_rep=2 x dp_shard=2 (HSDP)", dict(dp_replicate=2, dp_shard=2)),
    "tp4": ("tp=4", dict(tp=4, dp_shard=1)),
    "tp2_fsdp": ("tp=2 x dp_shard=2", dict(tp=2, dp_shard=2)),
    "tp2sp_fsdp": ("tp=2 +SP x dp_shard=2", dict(tp=2, dp_shard=2, sequence_parallel=True)),
    "cp4": ("cp=4", dict(cp=4, dp_shard=1)),
    "cp2_fsdp": ("cp=2 x dp_shard=2", dict(cp=2, dp_shard=2)),
    "tp2_cp2": ("tp=2 x cp=2", dict(tp=2, cp=2, dp_shard=1)),
    "pp4": ("pp=4 (1F1B, 4 mb)", dict(pp=4, dp_shard=1, pp_schedule="1f1b", pp_microbatches=4)),
    "pp2_x_dp_shard2": ("pp=2 (1F1B, 2 mb) x dp_shard=2",
                        dict(pp=2, dp_shard=2, pp_schedule="1f1b", pp_microbatches=2)),
    "pp2_x_tp2": ("pp=2 (1F1B, 4 mb) x tp=2", dict(pp=2, tp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=4)),
    "pp2_x_cp2": ("pp=2 (1F1B, 4 mb) x cp=2", dict(pp=2, cp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=4)),
}

#: CommOverlapMonitor kinds shown in their own columns; the rest is Lightning's own per-step communication (the
#: ``sync_dist`` all-reduce of the logged loss and its gloo barrier, the per-step SIGTERM broadcast; under pp also
#: the loss broadcast from the last stage), summed
KIND_COLUMNS = {"fsdp_all_gather": "FSDP AG", "fsdp_reduce_scatter": "FSDP RS", "tp": "TP", "cp": "CP",
                "pp_send_recv": "PP"}


def dp_size(spec: dict[str, Any]) -> int:
    return spec.get("dp_replicate", 1) * spec.get("dp_shard", 1)


def pp_stages_and_microbatches(spec: dict[str, Any]) -> tuple[int, int]:
    """A layout's pipeline stage count and micro-batches per batch (NDParallelStrategy's defaults); (1, 1) without
    pipelining."""
    from lightning_par.techniques.pipeline.pipeline import SCHEDULES

    pp = spec.get("pp", 1)
    if pp == 1:
        return 1, 1
    sched = SCHEDULES[spec.get("pp_schedule", "1f1b")]
    stages = pp * (spec.get("pp_stages_per_rank") or sched.stages_per_rank or 2)
    return stages, spec.get("pp_microbatches") or stages


# ---------------------------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------------------------
def memory_logger() -> Any:
    """A Lightning Logger keeping what is logged in a list (rank 0 is the only rank the monitors log on)."""
    from lightning.pytorch.loggers.logger import Logger

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.records.append((step, {k: float(v) for k, v in metrics.items()}))

    return MemoryLogger()


def token_data(cfg: dict[str, Any], steps: int) -> Any:
    """Random tokens, ``global_batch * steps`` sequences: each data-parallel rank reads ``steps`` batches."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg["vocab_size"], (cfg["global_batch"] * steps, cfg["seq_len"] + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def run_layout(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """One Trainer.fit under one layout on this rank: step times, probe bytes, the monitor's window."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from example_projects.gpt.lit import GPTModule
    from lightning_par import NDParallelStrategy
    from lightning_par.callbacks import CommOverlapMonitor

    label, spec = LAYOUTS[key]
    warmup, steps, window = cfg["warmup"], cfg["steps"], cfg["window"]
    probe_step = warmup + steps
    total_steps = probe_step + 1 + 1 + window  # + probe + the monitor's profiled warm-up batch + its window
    timer = step_timer()  # first in the list: its end hook runs before the monitor's analysis and gather
    monitor = CommOverlapMonitor(every_n_steps=10 * total_steps, window_steps=window, warmup_steps=1,
                                 start_step=probe_step + 1)
    probe = probe_callback(probe_step)
    logger = memory_logger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=NDParallelStrategy(**spec), max_steps=total_steps, logger=logger,
        log_every_n_steps=10 * total_steps, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, monitor, probe],
    )
    torch.manual_seed(SEED)
    module = GPTModule(**module_kwargs({**cfg, "steps": total_steps, "warmup": 0}))
    loader = DataLoader(token_data(cfg, total_steps), batch_size=cfg["global_batch"] // dp_size(spec))
    t0 = time.perf_counter()
    trainer.fit(module, loader)  # Lightning adds the DistributedSampler over the data-parallel ranks
    comm_logged = {k: v for _, m in logger.records for k, v in m.items() if k.startswith("comm/")}
    return {
        "layout": key,
        "label": label,
        "fit_wall_s": time.perf_counter() - t0,
        "step_times_s": timer.times,
        "timed": [warmup, warmup + steps],
        "activation_bytes": probe.activation_bytes,
        "state_bytes": probe.state,
        "comm_rank_values": monitor.last_values,  # this rank's own window values
        "comm_logged": comm_logged,  # rank 0 only: the cross-rank summary, as a logger receives it
        "batch_per_rank": cfg["global_batch"] // dp_size(spec),
    }


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every rank: every layout, ``rounds`` times (odd rounds in reverse order); per-rank results to the parent."""
    quiet_worker()
    import torch.distributed as dist

    dist.init_process_group("gloo")  # Lightning's strategies find it initialized and reuse it
    rank = dist.get_rank()
    try:
        runs = []
        for rnd in range(cfg["rounds"]):
            order = cfg["layouts"] if rnd % 2 == 0 else cfg["layouts"][::-1]
            for key in order:
                gc.collect()
                dist.barrier()  # start each layout together (outside the timed steps)
                runs.append({"round": rnd, **run_layout(cfg, key)})
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "runs": runs}


def reference(cfg: dict[str, Any]) -> dict[str, Any]:
    """One process, no parallelism, the whole global batch: one AdamW step, counted like the layouts."""
    import torch
    import torch.nn.functional as F

    from example_projects.gpt.lit import GPTModule

    torch.manual_seed(SEED)
    module = GPTModule(**module_kwargs({**cfg, "warmup": 0}))
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    x, y = token_data(cfg, 1).tensors
    ctx, total = saved_activations()
    with ctx:
        loss = F.cross_entropy(module(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    return {"batch": cfg["global_batch"], "activation_bytes": total(),
            "state_bytes": state_bytes(module.parameters(), optimizer)}


# ---------------------------------------------------------------------------------------------------------------
# the parent: launch, combine ranks, report
# ---------------------------------------------------------------------------------------------------------------
def combine(cfg: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layout: slowest-rank step times pooled over rounds; bytes per rank; comm per kind (max over ranks)."""
    out: dict[str, Any] = {}
    for key in cfg["layouts"]:
        runs = [[r for r in rank["runs"] if r["layout"] == key] for rank in per_rank]  # [rank][round]
        n_rounds = len(runs[0])
        lo, hi = runs[0][0]["timed"]
        slowest = [slowest_rank_per_step([rank_runs[i]["step_times_s"] for rank_runs in runs])
                   for i in range(n_rounds)]
        measured = [t for rnd in slowest for t in rnd[lo:hi]]
        last = [rank_runs[-1] for rank_runs in runs]
        states = [r["state_bytes"] for r in last]
        acts = [r["activation_bytes"] for r in last]
        logged = [runs[0][i]["comm_logged"] for i in range(n_rounds)]  # rank 0's logger, one dict per round
        comm_max = {}
        for name in sorted({k[: -len("/max")] for d in logged for k in d if k.endswith("/max")}):
            values = [d.get(f"{name}/max", 0.0) for d in logged]  # a kind absent from a round: none measured
            comm_max[name] = statistics.mean(values)
        big = max(range(len(states)), key=lambda r: states[r]["total"] + acts[r])
        out[key] = {
            "label": LAYOUTS[key][0],
            "strategy_kwargs": LAYOUTS[key][1],
            "batch_per_rank": last[0]["batch_per_rank"],
            "time": summarize(measured),
            "slowest_rank_step_times_s_per_round": slowest,
            "per_rank_step_times_s": [[r["step_times_s"] for r in rank_runs] for rank_runs in runs],
            "state_bytes_per_rank": states,
            "activation_bytes_per_rank": acts,
            "largest_rank": big,
            "peak_estimate_bytes_largest_rank": states[big]["total"] + acts[big],
            "comm_max_over_ranks_mean_over_rounds": comm_max,
            "comm_logged_per_round": logged,
            "comm_rank_values_per_round": [[r["comm_rank_values"] for r in rank_runs] for rank_runs in runs],
            "fit_wall_s": [[r["fit_wall_s"] for r in rank_runs] for rank_runs in runs][0],
        }
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def memory_table(ref: dict[str, Any], res: dict[str, Any]) -> str:
    full_state, full_act = ref["state_bytes"]["total"], ref["activation_bytes"]
    rows = [["1 process, no parallelism", ref["batch"], mib(ref["state_bytes"]["params"]),
             mib(ref["state_bytes"]["grads"]), mib(ref["state_bytes"]["optim"]), mib(full_state), "1.00",
             mib(full_act), "1.00", mib(full_state + full_act)]]
    for r in res.values():
        b = r["largest_rank"]
        s, a = r["state_bytes_per_rank"][b], r["activation_bytes_per_rank"][b]
        rows.append([r["label"], r["batch_per_rank"], mib(s["params"]), mib(s["grads"]), mib(s["optim"]),
                     mib(s["total"]), f"{s['total'] / full_state:.2f}", mib(a), f"{a / full_act:.2f}",
                     mib(s["total"] + a)])
    headers = ["layout (largest rank)", "seqs/rank", "params MiB", "grads MiB", "AdamW MiB", "state MiB", "/full",
               "saved act MiB", "/full", "state+act MiB"]
    return format_table(headers, rows)


def time_table(res: dict[str, Any]) -> str:
    rows = []
    for r in res.values():
        t, c = r["time"], r["comm_max_over_ranks_mean_over_rounds"]
        kinds = {k[len("comm/time_s/"):]: v for k, v in c.items() if k.startswith("comm/time_s/")}
        other = sum(v for k, v in kinds.items() if k not in KIND_COLUMNS)
        rows.append([r["label"], ms(t["median_s"]), f"{ms(t['p25_s'])}-{ms(t['p75_s'])}",
                     *(ms(kinds.get(k, 0.0)) for k in KIND_COLUMNS), ms(other),
                     ms(c.get("comm/time_s_per_step")), ms(c.get("comm/exposed_s_per_step")),
                     f"{c['comm/overlap_ratio']:.2f}" if "comm/overlap_ratio" in c else "-",
                     ms(c.get("comm/step_time_s"))])
    headers = ["layout", "step ms", "p25-p75", *(f"{v} ms" for v in KIND_COLUMNS.values()), "Lightning ms",
               "comm ms", "exposed ms", "overlap", "prof. step ms"]
    return format_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=8, help="timed steps per layout and round")
    p.add_argument("--warmup", type=int, default=3, help="steps per fit left out of the timing")
    p.add_argument("--window", type=int, default=3, help="steps measured by CommOverlapMonitor (profiled)")
    p.add_argument("--rounds", type=int, default=2, help="repetitions of all layouts (odd rounds reversed)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks together")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=128, help="divisible by tp (vocab-parallel embedding/head)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the launch may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "layouts.json"))
    args = p.parse_args(argv)
    args.layout_list = [k.strip() for k in args.layouts.split(",") if k.strip()]
    unknown = [k for k in args.layout_list if k not in LAYOUTS]
    if unknown or not args.layout_list:
        p.error(f"--layouts={args.layouts!r}: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.steps < 1 or args.warmup < 0 or args.window < 1 or args.rounds < 1:
        p.error("--steps, --window and --rounds must be >= 1, --warmup >= 0")
    for key in args.layout_list:
        spec = LAYOUTS[key][1]
        cp, tp, dp = spec.get("cp", 1), spec.get("tp", 1), dp_size(spec)
        if args.global_batch % dp:
            p.error(f"--global-batch={args.global_batch} is not divisible by {key}'s data-parallel size {dp}")
        if args.seq_len % (2 * cp) or args.seq_len % tp:
            p.error(f"--seq-len={args.seq_len} must be divisible by 2*cp={2 * cp} and tp={tp} ({key})")
        if args.vocab_size % tp or args.n_head % tp:
            p.error(f"--vocab-size={args.vocab_size} and --n-head={args.n_head} must be divisible by tp={tp} ({key})")
        stages, microbatches = pp_stages_and_microbatches(spec)
        if args.n_layer < stages:
            p.error(f"--n-layer={args.n_layer}: {key} cuts the blocks into {stages} stages (one block at least each)")
        if (args.global_batch // dp) % microbatches:
            p.error(f"--global-batch={args.global_batch}: {key}'s {args.global_batch // dp} sequences per rank are not "
                    f"divisible by its {microbatches} micro-batches")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = {"layouts": args.layout_list, "global_batch": args.global_batch,
           **{k: getattr(args, k) for k in ("steps", "warmup", "window", "rounds", "n_layer", "n_embd", "n_head",
                                            "seq_len", "vocab_size")}}
    meta = run_metadata()
    start = time.perf_counter()
    print(f"launching {WORLD} processes: {len(cfg['layouts'])} layouts x {args.rounds} rounds ...", flush=True)
    # KINETO_LOG_LEVEL=6: no "USDT ... profiler_start/stop" lines from every rank's profiler window
    per_rank = launch(WORLD, worker, cfg, timeout=args.timeout, env={"KINETO_LOG_LEVEL": "6"})
    launch_s = time.perf_counter() - start
    ref = reference(cfg)
    res = combine(cfg, per_rank)
    total_s = time.perf_counter() - start
    n_params = ref["state_bytes"]["param_numel"]
    print(f"\nGPT {cfg['n_layer']} layers x {cfg['n_embd']} wide, {cfg['n_head']} heads, {n_params:,} parameters "
          f"(fp32), seq {cfg['seq_len']}, vocab {cfg['vocab_size']}, global batch {cfg['global_batch']} sequences, "
          f"AdamW; world {WORLD}, CPU, gloo, 1 thread per rank, {meta['cpu_count']} cores")
    print("\nMemory per rank (the largest rank): model state = params + grads + AdamW state from local shards after "
          "a step (under pp: this rank's stages only); saved act = peak bytes autograd holds saved for backward at "
          "once in one training step (saved_tensors_hooks; under pp over the micro-batches in flight). "
          "Not counted: transient buffers (FSDP all-gathered blocks, comm buffers, pipeline stage outputs, "
          "temporary grads). "
          "/full = fraction of one unparallelized process holding the whole batch.")
    print(memory_table(ref, res))
    print(f"\nTime per step: median of the slowest rank, {args.rounds} rounds x {args.steps} steps "
          f"({args.warmup} warm-up steps per fit left out). Communication per step by kind: CommOverlapMonitor over "
          f"a profiled window of {args.window} steps, max over ranks (read from the logger), mean over rounds; "
          "FSDP RS includes HSDP's all-reduce across replicas; Lightning = its own per-step collectives (loss "
          "sync_dist all-reduce + barrier, SIGTERM broadcast; under pp also the loss broadcast from the last stage), "
          "where rank skew shows up as waiting; PP = pipeline stage send/recv; comm = all kinds "
          "together, exposed = not overlapped by compute; prof. step = step time in that (profiled) window.")
    print(time_table(res))
    print(f"\nNote: {NOISE_NOTE} Here 4 ranks share {meta['cpu_count']} cores: a step time is the total work + "
          "communication of all ranks, not parallel scaling, and gloo comm times include waiting for peers that "
          "are descheduled (upper bounds of the transfer cost).")
    meta.update(load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None, device="cpu",
                backend="gloo", threads_per_rank=1, world_size=WORLD, total_wall_s=total_s, launch_wall_s=launch_s,
                memory_measure="model state (local shards) + bytes saved for backward (saved_tensors_hooks); "
                               "not the resident-set peak")
    out = write_json(args.out, {"benchmark": "layouts", "args": vars(args),
                                "model": {**{k: v for k, v in cfg.items() if k != "layouts"}, "param_numel": n_params},
                                "metadata": meta, "reference_one_process": ref, "results": res})
    print(f"Total {total_s:.0f} s; results written to {out}")


if __name__ == "__main__":
    main()

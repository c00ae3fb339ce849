"""Pipeline parallelism through the Trainer: step time against a hand-written ``torch.distributed.pipelining``
loop, and the measured bubble of every schedule next to theory.

One launch per pipeline size p (tests/launch.py: fresh processes, one gloo group, world = pp). In it, for every
schedule and micro-batch count m (micro-batches of a fixed size ``--mb-size``, so the global batch is
``mb_size * m`` sequences), the same GPT (example_projects/gpt, ``--n-layer`` x ``--n-embd``, 4 heads, vocab 64)
trains two ways:

- ``ours`` (the product): ``GPTModule`` under ``Trainer(accelerator="cpu", devices=p,
  strategy=PipelineParallelStrategy(pp=p, pp_schedule=..., pp_microbatches=m))``; its ``training_step`` is
  the plain ``self.loss(self(x), y)`` + ``self.log(..., sync_dist=True)``, AdamW + LR schedule from
  ``configure_optimizers``;
- ``hand-written``: what the torch docs show: ``pipeline(model, mb_args, split_spec)``, ``pipe.build_stage(i,
  device)`` (``PipelineStage`` around ``pipe.get_stage_module(i)`` for multi-stage schedules), the schedule class,
  ``schedule.step(...)``; per step the same work as the Lightning step: zero_grad, schedule step, the loss
  broadcast from the last stage and all-reduced (what ``self.log(..., sync_dist=True)`` costs), AdamW step
  (the same groups and hyper-parameters, built by ``GPTModule.configure_optimizers``), LR scheduler step.

The two run step by step in lockstep (``benchmarks.common.Lockstep``: one thread per variant, only the one whose
turn it is runs), so neighbouring steps of both see the same machine load; odd rounds (and every other layout)
start with the other variant. Step time: ``perf_counter`` at ``on_train_batch_start`` / ``on_train_batch_end``
(ours, ``benchmarks.common.step_timer``) and around the same work (hand-written), the slowest rank per step,
the first ``--warmup`` steps of every fit left out (the first step of a fit traces the model, ~1 s). Reported:
the median and ours/hand-written as ratio of medians and as the median of paired step ratios (step k of both,
taken moments apart). What the ratio holds besides Lightning's per-step overhead: the hand-written stages run the
traced graph (each block a ``torch.fx`` ``InterpreterModule``, op by op in Python), ours the model's own eager
modules with only the glue traced; on CPU at this size the traced blocks take about twice the compute time.

Then ``--record`` more steps of each run under ``ScheduleRecorder`` (ours: ``trainer.strategy.pipeline.record_next``
set in a callback, the recording read from ``pipeline.last_recording``): idle fraction per rank (1 - compute time
/ step time, the step from the first rank's start to the last rank's end; idle = bubble + transfers) next to the
theory, and a timeline PNG of ours per layout. Recorded steps are not timed.

Theory (fraction of the step a rank is idle, equal F/B times): GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B with
v stages per rank ((p-1)/v)/(m+(p-1)/v); zero-bubble schedules ~0 when F = I = W in time (they are not here:
on CPU a weight-gradient costs about as much as an input-gradient, and transfers are not free).

Usage: python benchmarks/bench_pipeline.py [--pps 2,4] [--microbatches 1,2,4] (multiples of p)
       [--schedules gpipe,1f1b,...] [--steps 4 --warmup 2 --record 2 --rounds 1]
       [--n-layer 8 --n-embd 64 --seq 32 --mb-size 2] [--out benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
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

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
VARIANTS = ("ours", "hand-written")
VOCAB, N_HEAD, SEED = 64, 4, 0


# ---------------------------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------------------------
def module_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=N_HEAD,
                n_embd=cfg["n_embd"], max_steps=total_steps(cfg))


def total_steps(cfg: dict[str, Any]) -> int:
    return cfg["warmup"] + cfg["steps"] + cfg["record"]


def token_batches(cfg: dict[str, Any], m: int) -> Any:
    """Random tokens: ``total_steps`` global batches of ``mb_size * m`` sequences (the same on every rank)."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (cfg["mb_size"] * m * total_steps(cfg), cfg["seq"] + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def run_ours(cfg: dict[str, Any], p: int, schedule: str, m: int, yield_turn: Callable[[], None]) -> dict[str, Any]:
    """Trainer.fit of GPTModule under PipelineParallelStrategy: step times, then ``record`` recorded steps."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from example_projects.gpt.lit import GPTModule
    from lightning_par import PipelineParallelStrategy
    from lightning_par.techniques.pipeline.schedule_recorder import gather_timelines

    n_timed, n_total = cfg["warmup"] + cfg["steps"], total_steps(cfg)

    class RecordAndYield(Callback):
        """After the timer (callbacks run in list order): the recording of the last steps, else hand the turn on."""

        def __init__(self) -> None:
            self.idle: list[list[float]] = []
            self.timelines: Any = None
            self.stages_per_rank = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step >= n_timed:
                trainer.strategy.pipeline.record_next = True

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            pipeline = trainer.strategy.pipeline
            self.stages_per_rank = pipeline.stages_per_rank
            rec, pipeline.last_recording = pipeline.last_recording, None
            if rec is not None:
                self.timelines = gather_timelines(rec, group=pipeline.group)  # a collective over pp: every rank
                self.idle.append(idle_per_rank(self.timelines))
            if trainer.global_step < n_total:
                yield_turn()

    timer, rec = step_timer(), RecordAndYield()
    trainer = pl.Trainer(
        accelerator="cpu", devices=p, strategy=PipelineParallelStrategy(pp=p, pp_schedule=schedule,
                                                                        pp_microbatches=m),
        max_steps=n_total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer, rec],
    )
    torch.manual_seed(SEED)
    model = GPTModule(**module_kwargs(cfg))
    trainer.fit(model, DataLoader(token_batches(cfg, m), batch_size=cfg["mb_size"] * m))
    return {"times": timer.times[:n_timed], "idle": rec.idle, "timelines": rec.timelines,
            "stages_per_rank": rec.stages_per_rank}


def run_hand_written(cfg: dict[str, Any], p: int, schedule: str, m: int, pipe: Any,
                     yield_turn: Callable[[], None]) -> dict[str, Any]:
    """The torch-docs loop over ``pipe`` (traced once per stage count), the same work per step as the Trainer's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from example_projects.gpt.lit import GPTModule
    from lightning_par.techniques.pipeline.pipeline import SCHEDULES as SPECS
    from lightning_par.techniques.pipeline.pipeline import last_stage_rank, stage_ids
    from lightning_par.techniques.pipeline.schedule_recorder import ScheduleRecorder, gather_timelines

    rank = dist.get_rank()
    spec = SPECS[schedule]
    spr = spec.stages_per_rank or 2
    n_stages = p * spr
    ids = stage_ids(rank, p, spr, spec.style)
    # pipe.build_stage (torch's traced-stage class) fails in the p2p warm-up of multi-stage schedules here
    # (torch 2.13, gloo); the manual PipelineStage around the same traced module is the documented other way
    stages = [pipe.build_stage(i, torch.device("cpu")) if spr == 1 else
              PipelineStage(pipe.get_stage_module(i), i, n_stages, torch.device("cpu")) for i in ids]
    module = GPTModule(**module_kwargs(cfg))  # only for its configure_optimizers: the same AdamW and schedule
    params = [q for s in stages for q in s.submod.parameters()]
    opt_cfg = GPTModule.configure_optimizers(_ParamsAndHparams(params, module.hparams))
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    loss_fn = module.loss  # the LightningModule's own loss: F.cross_entropy over the flattened tokens
    sched = spec.cls(stages[0] if spr == 1 else stages, m, loss_fn=loss_fn)
    first, last, src = 0 in ids, n_stages - 1 in ids, last_stage_rank(p, spec.style)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        loss = torch.stack([v.detach() for v in losses]).mean() if last else torch.zeros(())
        dist.broadcast(loss, src)  # every rank logs the loss
        dist.all_reduce(loss)  # what self.log(..., sync_dist=True) costs in the Lightning step
        optimizer.step()
        scheduler.step()

    n_timed, n_total = cfg["warmup"] + cfg["steps"], total_steps(cfg)
    data = token_batches(cfg, m).tensors
    bs = cfg["mb_size"] * m
    times, idle, timelines = [], [], None
    for k in range(n_total):
        x, y = data[0][k * bs:(k + 1) * bs], data[1][k * bs:(k + 1) * bs]
        if k < n_timed:
            start = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - start)
        else:
            with ScheduleRecorder(stages) as rec:
                step(x, y)
            timelines = gather_timelines(rec)
            idle.append(idle_per_rank(timelines))
        if k < n_total - 1:
            yield_turn()
    return {"times": times, "idle": idle, "timelines": timelines, "stages_per_rank": spr}


def idle_per_rank(timelines: list[list[Any]]) -> list[float]:
    """Each pp rank's idle fraction over the pipeline's step: from the first rank's start to the last rank's end
    (as PipelineTimelineMonitor measures it), so a rank that enters the step late is not counted busy."""
    from lightning_par.techniques.pipeline.schedule_recorder import idle_fraction

    start = min((e.t0 for tl in timelines for e in tl), default=0.0)
    end = max((e.t1 for tl in timelines for e in tl), default=0.0)
    return [idle_fraction(tl, start, end) for tl in timelines]


class _ParamsAndHparams:
    """What ``GPTModule.configure_optimizers`` reads from ``self``: ``parameters()`` and ``hparams``."""

    def __init__(self, params: list[Any], hparams: Any) -> None:
        self._params, self.hparams = params, hparams

    def parameters(self) -> list[Any]:
        return list(self._params)


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every rank: every (schedule, m) layout, ``rounds`` times, ours and hand-written in lockstep."""
    quiet_worker()
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import SplitPoint, pipeline

    from example_projects.gpt.model import GPT, GPTConfig
    from lightning_par.techniques.pipeline.pipeline import SCHEDULES as SPECS
    from lightning_par.techniques.pipeline.pipeline import init_weights, plan_split

    dist.init_process_group("gloo")  # Lightning's strategies find it initialized and reuse it
    rank, p = dist.get_rank(), dist.get_world_size()
    gcfg = GPTConfig(vocab_size=VOCAB, block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=N_HEAD,
                     n_embd=cfg["n_embd"])
    traces: dict[int, Any] = {}  # hand-written: one trace per stage count (micro-batches have one shape)
    runs = []
    try:
        for i, (schedule, m) in enumerate(cfg["layouts"][p]):
            n_stages = p * (SPECS[schedule].stages_per_rank or 2)
            if n_stages not in traces:
                torch.manual_seed(SEED)
                real = GPT(gcfg)
                init_weights(real, SEED)
                points = plan_split(real, n_stages)
                x0 = torch.zeros(cfg["mb_size"], cfg["seq"], dtype=torch.long)
                traces[n_stages] = pipeline(real, (x0,), split_spec={f: SplitPoint.BEGINNING for f in points})
            for rnd in range(cfg["rounds"]):
                order = list(VARIANTS) if (rnd + i) % 2 == 0 else list(VARIANTS[::-1])
                gc.collect()
                dist.barrier()  # start each layout together (outside the timed steps)
                outcome = Lockstep(order).run({
                    "ours": lambda turn, s=schedule, mm=m: run_ours(cfg, p, s, mm, turn),
                    "hand-written": lambda turn, s=schedule, mm=m, n=n_stages: run_hand_written(
                        cfg, p, s, mm, traces[n], turn),
                })
                for name in order:
                    res = outcome[name]
                    runs.append({"schedule": schedule, "m": m, "round": rnd, "variant": name, "order": order,
                                 "stages_per_rank": res["stages_per_rank"], "step_times_s": res["times"],
                                 "idle": res["idle"], "timelines": res["timelines"] if rank == 0 else None})
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "runs": runs}


# ---------------------------------------------------------------------------------------------------------------
# the parent: launch, combine ranks, report
# ---------------------------------------------------------------------------------------------------------------
def valid_layouts(cfg: dict[str, Any], p: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(schedule, m) pairs this p can run, and why the others cannot (checked before launching)."""
    from lightning_par.techniques.pipeline.pipeline import validate_pipeline

    ok, skipped = [], []
    for schedule in cfg["schedules"]:
        for m in (k * p for k in cfg["microbatches"]):
            try:
                validate_pipeline(schedule, p, m, cfg["n_layer"])
            except ValueError as e:
                skipped.append(f"{schedule} p={p} m={m}: {e}")
            else:
                ok.append((schedule, m))
    return ok, skipped


def combine(cfg: dict[str, Any], p: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layout and variant: slowest-rank step times (warm-up dropped) pooled over rounds, paired ratios,
    idle fraction per rank (mean over recorded steps and rounds)."""
    warmup = cfg["warmup"]
    out = []
    for schedule, m in cfg["layouts"][p]:
        entry: dict[str, Any] = {"schedule": schedule, "p": p, "m": m}
        per_round: dict[str, list[list[float]]] = {}
        for name in VARIANTS:
            runs = [[r for r in rank["runs"] if (r["schedule"], r["m"], r["variant"]) == (schedule, m, name)]
                    for rank in per_rank]  # [rank][round]
            rounds = [slowest_rank_per_step([rank_runs[i]["step_times_s"] for rank_runs in runs])
                      for i in range(len(runs[0]))]
            per_round[name] = rounds
            entry["stages_per_rank"] = runs[0][0]["stages_per_rank"]
            entry[name] = {
                "time": summarize([t for rnd in rounds for t in rnd[warmup:]]),
                "slowest_rank_step_times_s_per_round": rounds,
                # rank 0's gathers (every rank gets the same): per recorded step and round, one value per pp rank
                "idle_per_rank": [statistics.mean(col) for col in zip(*(v for r in runs[0] for v in r["idle"]))],
                "timelines": runs[0][-1]["timelines"],  # rank 0's gather of the last recorded step
            }
        paired = [a / b for o, h in zip(per_round["ours"], per_round["hand-written"])
                  for a, b in zip(o[warmup:], h[warmup:])]
        entry["ratio_of_medians"] = entry["ours"]["time"]["median_s"] / entry["hand-written"]["time"]["median_s"]
        entry["ratio_paired_median"] = statistics.median(paired)
        entry["ratio_paired_per_step"] = paired
        out.append(entry)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pps", default="2,4", help="pipeline sizes (one launch of p processes each)")
    ap.add_argument("--microbatches", default="1,2,4", help="micro-batch counts as multiples of p")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=4, help="timed steps per fit")
    ap.add_argument("--warmup", type=int, default=2, help="steps per fit left out (the first one traces)")
    ap.add_argument("--record", type=int, default=2, help="recorded (untimed) steps per fit for the idle fraction")
    ap.add_argument("--rounds", type=int, default=1, help="fits per layout and variant (odd rounds start with the "
                                                          "other variant)")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one launch may take before it is killed")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    args = ap.parse_args(argv)
    args.pp_list = [int(v) for v in args.pps.split(",") if v.strip()]
    args.mb_list = [int(v) for v in args.microbatches.split(",") if v.strip()]
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in args.schedule_list if s not in SCHEDULES]
    if unknown:
        ap.error(f"--schedules: unknown {unknown}; choose from {', '.join(SCHEDULES)}")
    if not args.pp_list or any(v < 2 for v in args.pp_list) or not args.mb_list or any(k < 1 for k in args.mb_list):
        ap.error("--pps must be sizes >= 2 and --microbatches multiples >= 1")
    if args.steps < 1 or args.warmup < 1 or args.record < 1 or args.rounds < 1:
        ap.error("--steps, --warmup (the first step traces), --record and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import matplotlib.pyplot as plt

    from lightning_par.techniques.pipeline.schedule_recorder import draw_timeline, theory_idle

    cfg: dict[str, Any] = {"microbatches": args.mb_list, "schedules": args.schedule_list, "steps": args.steps,
                           "warmup": args.warmup, "record": args.record, "rounds": args.rounds,
                           "n_layer": args.n_layer, "n_embd": args.n_embd, "seq": args.seq, "mb_size": args.mb_size,
                           "layouts": {}}
    skipped: list[str] = []
    for p in args.pp_list:
        cfg["layouts"][p], why = valid_layouts(cfg, p)
        skipped += why
    meta = run_metadata()
    png_dir = Path(args.out).with_suffix("")
    png_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results, launch_s = [], {}
    for p in args.pp_list:
        if not cfg["layouts"][p]:
            continue
        print(f"p={p}: launching {p} processes, {len(cfg['layouts'][p])} layouts ...", flush=True)
        t0 = time.perf_counter()
        per_rank = launch(p, worker, cfg, timeout=args.timeout)
        launch_s[p] = time.perf_counter() - t0
        print(f"p={p}: {launch_s[p]:.0f} s", flush=True)
        results += combine(cfg, p, per_rank)
    total_s = time.perf_counter() - start

    time_rows, idle_rows = [], []
    for r in results:
        s, p, m = r["schedule"], r["p"], r["m"]
        ours, hand = r["ours"]["time"], r["hand-written"]["time"]
        time_rows.append([s, p, m, f"{ours['median_s'] * 1e3:.1f}",
                          f"{ours['p25_s'] * 1e3:.1f}-{ours['p75_s'] * 1e3:.1f}", f"{hand['median_s'] * 1e3:.1f}",
                          f"{hand['p25_s'] * 1e3:.1f}-{hand['p75_s'] * 1e3:.1f}", f"{r['ratio_of_medians']:.2f}x",
                          f"{r['ratio_paired_median']:.2f}x", ours["n"]])
        theory = theory_idle(s, p, m, r["stages_per_rank"])
        r["idle_theory"] = theory
        png = png_dir / f"{s}_p{p}_m{m}.png"
        fig = draw_timeline(r["ours"]["timelines"], f"{s} p={p} m={m} (Trainer + PipelineParallelStrategy)", m)
        fig.savefig(png)
        plt.close(fig)
        r["timeline_png"] = str(png)
        idle_o, idle_h = r["ours"]["idle_per_rank"], r["hand-written"]["idle_per_rank"]
        idle_rows.append([s, p, m, r["stages_per_rank"], " ".join(f"{v:.2f}" for v in idle_o),
                          f"{statistics.mean(idle_o):.2f}", f"{statistics.mean(idle_h):.2f}", f"{theory:.2f}"])
        for name in VARIANTS:  # the timelines are in the PNGs; keep the JSON readable
            r[name].pop("timelines")

    n_params = _param_count(cfg)
    print(f"\nGPT {cfg['n_layer']} layers x {cfg['n_embd']} wide, {N_HEAD} heads, vocab {VOCAB}, seq {cfg['seq']}, "
          f"{n_params:,} parameters (fp32), micro-batches of {cfg['mb_size']} sequences (global batch "
          f"{cfg['mb_size']} x m), AdamW; world = pp, CPU, gloo, 1 thread per rank, {meta['cpu_count']} cores")
    print(f"\nStep time: slowest rank per step, median over {args.rounds} round(s) x {args.steps} steps per variant "
          f"({args.warmup} warm-up steps per fit left out), ours and hand-written in lockstep. ours = Trainer + "
          "PipelineParallelStrategy; ratio = ours / hand-written (of medians; paired = median of step-k ratios). "
          "The hand-written stages run torch's traced blocks (fx InterpreterModules), ours the eager modules.")
    print(format_table(["schedule", "p", "m", "ours ms", "ours p25-p75", "hand ms", "hand p25-p75", "ratio",
                        "paired", "steps"], time_rows))
    print(f"\nIdle fraction per rank (1 - compute / step time, bubble + transfers) of ours, mean over {args.record} "
          "recorded step(s) per fit, over the pipeline's step (first rank's start to last rank's end); hand = the "
          "hand-written loop's mean over ranks; theory = textbook bubble")
    print(format_table(["schedule", "p", "m", "v", "ours idle per rank", "ours mean", "hand mean", "theory"],
                       idle_rows))
    for why in skipped:
        print(f"skipped {why}")
    print(f"\nNote: {NOISE_NOTE} With p > cores the ranks time-share cores: a step is the total work of all ranks.")
    meta.update(load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None, device="cpu",
                backend="gloo", threads_per_rank=1, total_wall_s=total_s, launch_wall_s=launch_s)
    cfg_json = {**cfg, "layouts": {str(k): v for k, v in cfg["layouts"].items()}}
    path = write_json(args.out, {"benchmark": "pipeline", "args": vars(args), "config": cfg_json,
                                 "model": {"param_numel": n_params}, "metadata": meta, "skipped": skipped,
                                 "results": results})
    print(f"Total {total_s:.0f} s; wrote {path} and timelines in {png_dir}/")


def _param_count(cfg: dict[str, Any]) -> int:
    import torch

    from example_projects.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=N_HEAD,
                              n_embd=cfg["n_embd"]))
    return sum(q.numel() for q in model.parameters())


if __name__ == "__main__":
    main()

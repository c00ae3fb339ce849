"""Pipeline parallelism: the measured bubble of every schedule next to theory, and step time against a
hand-written ``torch.distributed.pipelining`` loop.

One launch per pipeline size p (tests/launch.py: fresh processes, one gloo group = the pp group). In it, for every
schedule and micro-batch count m (micro-batches of a fixed size, so one trace per stage count serves all m):

- ``lightning_par``: ``PipelineRunner`` (meta-device model, local stages materialized, the loss broadcast from
  the last stage to every rank) + SGD;
- ``hand-written``: what the torch docs show: ``pipeline(real_model, mb_args, split_spec)``,
  ``pipe.build_stage(i, device)``, the schedule class, ``schedule.step(...)`` + SGD (no loss broadcast);

the two alternate step by step (neighbouring steps see the same machine load). Step time per step is the slowest
rank's; medians over ``--steps`` after ``--warmup``. Then ``--record`` steps of ours run under
``ScheduleRecorder``: idle fraction per rank (1 - compute time / step time; idle = bubble + transfers) next to
the theory, and a timeline PNG per layout.

Theory (fraction of the step a rank is idle, equal F/B times): GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B with
v stages per rank ((p-1)/v)/(m+(p-1)/v); zero-bubble schedules ~0 when F = I = W in time (they are not here:
on CPU a weight-gradient costs about as much as an input-gradient, and transfers are not free).

Usage: python benchmarks/bench_pipeline.py [--pps 2,4] [--microbatches 1,2,4] (multiples of p)
       [--steps 4 --warmup 1 --record 2] [--out benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

from common import format_table, launch, quiet_worker, run_metadata, summarize, write_json

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]


def _ours_step(opt: Any, runner: Any, x: Any, y: Any) -> None:
    opt.zero_grad()
    runner.step(x, target=y)
    opt.step()


def _theirs_step(opt: Any, sched: Any, x: Any, y: Any) -> None:
    opt.zero_grad()
    sched.step(*((x,) if x is not None else ()), target=y, losses=[] if y is not None else None)
    opt.step()


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    quiet_worker()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

    from example_projects.gpt.model import GPT, GPTConfig
    from lightning_par.parallel.pipeline import SCHEDULES as SPECS
    from lightning_par.parallel.pipeline import PipelineRunner, init_weights, plan_split, stage_ids, trace_pipeline
    from lightning_par.parallel.pipeline_timeline import ScheduleRecorder, gather_timelines, idle_fraction

    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    gcfg = GPTConfig(vocab_size=64, block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=4, n_embd=cfg["n_embd"])
    with torch.device("meta"):
        meta = GPT(gcfg)
    mb, seq = cfg["mb_size"], cfg["seq"]

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    ours_traces: dict[int, Any] = {}
    theirs_traces: dict[int, Any] = {}
    results = []
    for schedule in cfg["schedules"]:
        for m in [k * p for k in cfg["microbatches"]]:
            spec = SPECS[schedule]
            spr = spec.stages_per_rank or 2
            n_stages = p * spr
            points = plan_split(meta, n_stages)
            if n_stages not in ours_traces:
                x0 = torch.zeros(mb, seq, dtype=torch.long)
                ours_traces[n_stages] = trace_pipeline(meta, (x0,), points)
                real = GPT(gcfg)
                init_weights(real, 0)
                theirs_traces[n_stages] = pipeline(real, (x0,), split_spec={f: SplitPoint.BEGINNING for f in points})
            runner = PipelineRunner(meta, (torch.zeros(mb * m, seq, dtype=torch.long),), schedule=schedule,
                                    pp_rank=rank, pp=p, n_microbatches=m, loss_fn=loss_fn,
                                    pipe=ours_traces[n_stages])
            ours_opt = torch.optim.SGD(runner.parameters(), lr=0.01)
            # the hand-written loop, as in torch's docs
            pipe = theirs_traces[n_stages]
            # pipe.build_stage (torch's traced-stage class) fails in the p2p warm-up of multi-stage schedules here
            # (torch 2.13, gloo); the manual PipelineStage around the same traced module is the documented other way
            stages = [pipe.build_stage(i, torch.device("cpu")) if spr == 1 else
                      PipelineStage(pipe.get_stage_module(i), i, n_stages, torch.device("cpu"))
                      for i in stage_ids(rank, p, spr, spec.style)]
            sched = spec.cls(stages[0] if spr == 1 else stages, m, loss_fn=loss_fn)
            their_opt = torch.optim.SGD([q for s in stages for q in s.submod.parameters()], lr=0.01)
            first, last = 0 in runner.parts.stage_ids, runner.has_last_stage
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(0, 64, (mb * m, seq), generator=torch.Generator().manual_seed(0))
            y = torch.randint(0, 64, (mb * m, seq), generator=g.manual_seed(1))

            ours = partial(_ours_step, ours_opt, runner, x, y)
            theirs = partial(_theirs_step, their_opt, sched, x if first else None, y if last else None)
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            for k in range(cfg["warmup"] + cfg["steps"]):
                for name, fn in (("ours", ours), ("theirs", theirs)) if k % 2 == 0 else (("theirs", theirs),
                                                                                           ("ours", ours)):
                    t0 = time.perf_counter()
                    fn()
                    if k >= cfg["warmup"]:
                        times[name].append(time.perf_counter() - t0)
            idles, timelines = [], None
            for _ in range(cfg["record"]):
                with ScheduleRecorder(runner.parts.stages) as rec:
                    ours()
                idles.append(idle_fraction(rec.events, *rec.window))
                timelines = gather_timelines(rec)
            results.append({"schedule": schedule, "p": p, "m": m, "stages_per_rank": spr, "times": times,
                            "idle": statistics.mean(idles), "timelines": timelines if rank == 0 else None})
    dist.destroy_process_group()
    return {"rank": rank, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pps", default="2,4")
    ap.add_argument("--microbatches", default="1,2,4", help="micro-batch counts as multiples of p")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--record", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/pipeline.json")
    args = ap.parse_args()

    import matplotlib.pyplot as plt

    from lightning_par.parallel.pipeline_timeline import draw_timeline, theory_idle

    cfg = {"microbatches": [int(v) for v in args.microbatches.split(",")], "schedules": args.schedules.split(","),
           "steps": args.steps, "warmup": args.warmup, "record": args.record, "n_layer": args.n_layer,
           "n_embd": args.n_embd, "seq": args.seq, "mb_size": args.mb_size}
    png_dir = Path(args.out).with_suffix("")
    png_dir.mkdir(parents=True, exist_ok=True)
    rows, records = [], []
    for p in (int(v) for v in args.pps.split(",")):
        t0 = time.time()
        per_rank = launch(p, worker, cfg, timeout=600)
        print(f"p={p}: launch {time.time() - t0:.0f}s", flush=True)
        for i, res0 in enumerate(per_rank[0]["results"]):
            entries = [r["results"][i] for r in per_rank]
            ours = summarize([max(s) for s in zip(*(e["times"]["ours"] for e in entries))])
            theirs = summarize([max(s) for s in zip(*(e["times"]["theirs"] for e in entries))])
            idle = [round(e["idle"], 3) for e in entries]
            theory = theory_idle(res0["schedule"], p, res0["m"], res0["stages_per_rank"])
            png = png_dir / f"{res0['schedule']}_p{p}_m{res0['m']}.png"
            fig = draw_timeline(res0["timelines"], f"{res0['schedule']} p={p} m={res0['m']}", res0["m"])
            fig.savefig(png)
            plt.close(fig)
            rows.append([res0["schedule"], p, res0["m"], " ".join(f"{v:.2f}" for v in idle),
                         f"{statistics.mean(idle):.2f}", f"{theory:.2f}", f"{ours['median_s'] * 1e3:.1f}",
                         f"{theirs['median_s'] * 1e3:.1f}", f"{ours['median_s'] / theirs['median_s']:.2f}x"])
            records.append({"schedule": res0["schedule"], "p": p, "m": res0["m"], "idle_per_rank": idle,
                            "idle_theory": theory, "ours": ours, "hand_written": theirs,
                            "ratio": ours["median_s"] / theirs["median_s"], "timeline_png": str(png)})
    print(format_table(["schedule", "p", "m", "idle per rank", "idle mean", "theory", "ours ms",
                        "hand ms", "ratio"], rows))
    path = write_json(args.out, {"config": cfg, "meta": run_metadata(), "results": records})
    print(f"wrote {path} and timelines in {png_dir}/")


if __name__ == "__main__":
    main()

"""What the pipeline tests run in each process: a tiny GPT split into stages, trained with plain SGD.

Several layouts per launch (a launch costs seconds): the model is traced once per stage count and reused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from example_projects.gpt.model import GPT, GPTConfig
from lightning_par.parallel.pipeline import PipelineRunner, init_weights, plan_split, trace_pipeline
from lightning_par.parallel.pipeline_timeline import ScheduleRecorder, idle_fraction

SEED = 7
BATCH, SEQ, VOCAB, LR = 8, 16, 32, 0.5


def gpt_config(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=32)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def reference(n_layer: int, steps: int) -> dict[str, Any]:
    """The same GPT on one process, whole batch at once: the losses and final weights to match."""
    torch.manual_seed(SEED)
    model = GPT(gpt_config(n_layer))
    init_weights(model, SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def train_layouts(n_layer: int, layouts: list[tuple[str, int]], steps: int) -> dict[str, Any]:
    """Train each ``(schedule, n_microbatches)`` layout over the whole world as the pp group; per layout return
    the losses seen on this rank, its local parameters by original FQN and their bytes."""
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        meta = GPT(gpt_config(n_layer))
    traces: dict[tuple[int, int], Any] = {}
    results: dict[str, Any] = {}
    for schedule, m in layouts:
        spr = 1 if schedule in ("gpipe", "1f1b") else 2
        key = (pp * spr, m)
        if key not in traces:
            x0 = torch.zeros(BATCH // m, SEQ, dtype=torch.long)
            traces[key] = trace_pipeline(meta, (x0,), plan_split(meta, pp * spr))
        runner = PipelineRunner(meta, (torch.zeros(BATCH, SEQ, dtype=torch.long),), schedule=schedule, pp_rank=rank,
                                pp=pp, n_microbatches=m, loss_fn=lm_loss, seed=SEED, pipe=traces[key])
        opt = torch.optim.SGD(runner.parameters(), lr=LR)
        losses = []
        for x, y in batches(steps):
            opt.zero_grad()
            losses.append(runner.step(x, target=y).item())
            opt.step()
        params = {k: v.detach().clone() for k, v in runner.parts.named_parameters().items()}
        results[f"{schedule}/m{m}"] = {
            "losses": losses, "params": params, "stage_ids": runner.parts.stage_ids,
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "fqns": runner.parts.fqns,
        }
    dist.destroy_process_group()
    return results


def record_timeline(n_layer: int, schedule: str, m: int) -> dict[str, Any]:
    """One warm-up step, then one recorded step: the events and idle fraction of this rank."""
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        meta = GPT(gpt_config(n_layer))
    runner = PipelineRunner(meta, (torch.zeros(BATCH, SEQ, dtype=torch.long),), schedule=schedule, pp_rank=rank,
                            pp=pp, n_microbatches=m, loss_fn=lm_loss, seed=SEED)
    (x, y), = batches(1)
    runner.step(x, target=y)
    with ScheduleRecorder(runner.parts.stages) as rec:
        runner.step(x, target=y)
    out = {"events": rec.timeline(), "window": rec.window, "idle": idle_fraction(rec.events, *rec.window),
           "stage_ids": runner.parts.stage_ids}
    # a bad layout fails on every rank before any communication (no hang): the launch would time out otherwise
    try:
        PipelineRunner(meta, (torch.zeros(6, SEQ, dtype=torch.long),), schedule=schedule, pp_rank=rank, pp=pp,
                       n_microbatches=4, loss_fn=lm_loss)
    except ValueError as e:
        out["error"] = str(e)
    dist.destroy_process_group()
    return out

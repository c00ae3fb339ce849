"""What the pipeline tests run in each process: a tiny GPT split into stages, trained with plain SGD.

Several layouts per launch (a launch costs seconds): the model is traced once per stage count and reused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from example_projects.gpt.model import GPT, GPTConfig
from lightning_par.parallel.pipeline import PipelineRunner, init_weights, plan_split, trace_pipeline
from lightning_par.parallel.pipeline_timeline import ScheduleRecorder, gather_timelines, idle_fraction

SEED = 7
#: every layout uses micro-batches of MB rows (global batch MB * n_microbatches), so that one trace per stage count
#: serves all layouts of a launch (the trace is specialized to the micro-batch shape; tracing is most of a launch)
MB, SEQ, VOCAB, LR = 2, 16, 32, 0.5


def gpt_config(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=32)


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def reference(n_layer: int, steps: int, batch: int) -> dict[str, Any]:
    """The same GPT on one process, whole batch at once: the losses and final weights to match."""
    torch.manual_seed(SEED)
    model = GPT(gpt_config(n_layer))
    init_weights(model, SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches(steps, batch):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def train_layouts(n_layer: int, layouts: list[tuple[str, int]], steps: int, save_dir: str | None = None,
                  load_dir: str | None = None) -> dict[str, Any]:
    """Train each ``(schedule, n_microbatches)`` layout over the whole world as the pp group; per layout return
    the losses seen on this rank, its local parameters by original FQN and their bytes.

    ``save_dir``: save the first layout's final stages with torch.distributed.checkpoint (original FQNs).
    ``load_dir``: load such a checkpoint (saved under another pp) into fresh one-stage-per-rank stages.
    """
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        meta = GPT(gpt_config(n_layer))
    traces: dict[int, Any] = {}
    results: dict[str, Any] = {}
    for schedule, m in layouts:
        num_stages = pp * (1 if schedule in ("gpipe", "1f1b") else 2)
        if num_stages not in traces:
            x0 = torch.zeros(MB, SEQ, dtype=torch.long)
            traces[num_stages] = trace_pipeline(meta, (x0,), plan_split(meta, num_stages))
        runner = PipelineRunner(meta, (torch.zeros(MB * m, SEQ, dtype=torch.long),), schedule=schedule,
                                pp_rank=rank, pp=pp, n_microbatches=m, loss_fn=lm_loss, seed=SEED,
                                pipe=traces[num_stages])
        opt = torch.optim.SGD(runner.parameters(), lr=LR)
        losses = []
        for i, (x, y) in enumerate(batches(steps, MB * m)):
            opt.zero_grad()
            if i < steps - 1:
                losses.append(runner.step(x, target=y).item())
            else:  # the last step is recorded: the timeline test reads it (recording changes no number)
                with ScheduleRecorder(runner.parts.stages) as rec:
                    losses.append(runner.step(x, target=y).item())
            opt.step()
        params = {k: v.detach().clone() for k, v in runner.parts.named_parameters().items()}
        results[f"{schedule}/m{m}"] = {
            "losses": losses, "params": params, "stage_ids": runner.parts.stage_ids,
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "fqns": runner.parts.fqns,
            "timeline": {"events": rec.timeline(), "window": rec.window,
                         "idle": idle_fraction(rec.events, *rec.window), "all": gather_timelines(rec)},
        }
        if len(results) == 1:  # the unsplit model as this rank's parameter holder: same objects, original names
            holder = GPT(gpt_config(n_layer)).to("meta")
            runner.parts.bind_to(holder)
            results["bind_to"] = {n: p is runner.parts.named_parameters()[n] for n, p in holder.named_parameters()}
        if save_dir is not None and len(results) == 2:
            dcp.save(runner.parts.state_dict(), checkpoint_id=save_dir)
    if load_dir is not None:
        runner = PipelineRunner(meta, (torch.zeros(MB * pp, SEQ, dtype=torch.long),), schedule="gpipe",
                                pp_rank=rank, pp=pp, n_microbatches=pp, loss_fn=lm_loss, pipe=traces[pp])
        state = runner.parts.state_dict()  # views of the parameters: loaded in place
        dcp.load(state, checkpoint_id=load_dir)
        results["loaded"] = {k: v.detach().clone() for k, v in state.items()}
    # a bad layout fails on every rank before any communication (else this launch would hang until its timeout)
    try:
        PipelineRunner(meta, (torch.zeros(6, SEQ, dtype=torch.long),), schedule="gpipe", pp_rank=rank, pp=pp,
                       n_microbatches=4, loss_fn=lm_loss)
    except ValueError as e:
        results["error"] = str(e)
    dist.destroy_process_group()
    return results

"""What the pipeline core tests run in each process: a tiny GPT split into stages by ``LivePipeline`` (no
Lightning), trained with plain SGD. Several layouts per launch (a launch costs seconds)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from example_projects.gpt.model import GPT, GPTConfig
from lightning_par.techniques.pipeline.pipeline import init_weights
from lightning_par.techniques.pipeline.pipeline_live import LivePipeline, materialize_local
from lightning_par.techniques.pipeline.schedule_recorder import gather_timelines, idle_fraction

SEED = 7
#: every layout uses micro-batches of MB rows (global batch MB * n_microbatches)
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


def pipelined_gpt(n_layer: int, schedule: str, m: int) -> tuple[GPT, LivePipeline]:
    """A meta GPT cut into stages over the world; this rank's stages materialized with the reference's init."""
    with torch.device("meta"):
        model = GPT(gpt_config(n_layer))
    live = LivePipeline(model, schedule=schedule, pp_rank=dist.get_rank(), pp=dist.get_world_size(),
                        n_microbatches=m, group=dist.group.WORLD, device=torch.device("cpu"))
    materialize_local(model, live.plan, live.stage_ids, torch.device("cpu"), seed=SEED)
    live.loss_fn = lm_loss
    return model, live


def train_layouts(n_layer: int, layouts: list[tuple[str, int]], steps: int, save_dir: str | None = None,
                  load_dir: str | None = None) -> dict[str, Any]:
    """Train each ``(schedule, n_microbatches)`` layout over the whole world as the pp group; per layout return
    the losses seen on this rank, its local parameters by original FQN and their bytes.

    ``save_dir``: save the first layout's final stages with torch.distributed.checkpoint (original FQNs).
    ``load_dir``: load such a checkpoint (saved under another pp) into fresh one-stage-per-rank stages.
    """
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    for schedule, m in layouts:
        model, live = pipelined_gpt(n_layer, schedule, m)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for i, (x, y) in enumerate(batches(steps, MB * m)):
            opt.zero_grad()
            live.record_next = i == steps - 1  # the timeline test reads the last step (recording changes no number)
            losses.append(live.train_step((x,), y).item())
            opt.step()
        rec = live.last_recording
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        results[f"{schedule}/m{m}"] = {
            "losses": losses, "params": params, "stage_ids": live.stage_ids,
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "fqns": [sorted(t) for t in live.plan.tensors],
            "timeline": {"events": rec.timeline(), "window": rec.window,
                         "idle": idle_fraction(rec.events, *rec.window), "all": gather_timelines(rec)},
        }
        if save_dir is not None and len(results) == 1:
            dcp.save(model.state_dict(), checkpoint_id=save_dir)
    if load_dir is not None:
        model, _ = pipelined_gpt(n_layer, "gpipe", dist.get_world_size())
        state = model.state_dict()  # this rank's stages only: loaded in place
        dcp.load(state, checkpoint_id=load_dir)
        results["loaded"] = {k: v.detach().clone() for k, v in state.items()}
    # a bad batch fails on every rank before any communication (else this launch would hang until its timeout)
    try:
        _, live = pipelined_gpt(n_layer, "gpipe", 4)
        live.train_step((torch.zeros(6, SEQ, dtype=torch.long),), torch.zeros(6, SEQ, dtype=torch.long))
    except ValueError as e:
        results["error"] = str(e)
    dist.destroy_process_group()
    return results

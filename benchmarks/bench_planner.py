"""The planner's predictions against measurements, side by side, in one run: world 4 on CPU, two models.

Models: the GPT of example_projects/gpt (``GPTModule``, 4 layers x 128 wide, 4 heads, vocab 128) and a Hugging Face
Llama built from a tiny config (tests/hf_models.py's ``HFCausalLM``, the same sizes, 4 key/value heads so tp = 4
divides them), both at sequence 64 with a global batch of 8 sequences (bench_layouts' sizes), fp32, AdamW.

One launch of 4 processes (tests/launch.py). Per model, every rank:

1. measures the hardware as ``AutoParallelStrategy`` does, all ranks at once: ``planner.probe.probe_hardware`` at
   the model's matmul shapes (the ranks share the 2 cores, so each measures what it gets while the others run) and
   the gloo all-reduce over the 4 ranks;
2. plans (rank 0 plans, the layouts to measure are broadcast): the whole ranking (``plan_layouts``), its first
   layout, and again under a memory budget below one full replica's model state (``--budget-fraction`` of it);
3. trains every layout of ``WANTED`` (FSDP2, HSDP, tp, dp x tp, cp, dp x cp, pp 1F1B and interleaved, pp x dp,
   pp x tp, with and without activation checkpointing, FSDP2 with 2 micro-batches of gradient accumulation; the
   planner's own flags, e.g. sequence parallelism), plus the
   planner's two picks when they are not among them. All layouts train at once, one step each in turn
   (``benchmarks.common.Lockstep``: one Trainer per layout in its own thread, only the one whose turn it is runs), so
   that neighbouring steps of every layout see the same load of the shared machine; ``--rounds`` times, odd rounds
   in reverse order. Per fit: ``--warmup`` steps, ``--steps`` timed steps (``benchmarks.common.step_timer``, the
   slowest rank per step, the median over rounds), one probe step (``planner.measure.probe_callback``: the peak bytes
   autograd holds saved, then the model state from local shards).

The parent then predicts each measured layout with the probed hardware (``planner.predict.predict``) and prints,
per model: predicted against measured model state, saved activations and step time with their ratios; the Spearman
rank correlation of predicted against measured step time; whether the layout the planner ranks first measures
within 1.15x of the fastest measured; and the budget run (every measured layout the planner calls fitting must
measure model state + saved activations <= budget; is its pick the fastest measured of those?). Then the published
cases of tests/test_planner_published.py, planned from the device table. Everything goes to a JSON file
(benchmarks/results/planner.json), the raw measurements beside it (``.raw.pkl``): ``--replay`` predicts them again
after a change to the time model, without launching.

Usage: python benchmarks/bench_planner.py [--models gpt,llama] [--layouts fsdp,tp4,...] [--steps 6] [--warmup 3]
       [--rounds 2] [--global-batch 8] [--budget-fraction 0.5] [--no-published] [--replay RAW]
       [--out benchmarks/results/planner.json]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_fsdp import module_kwargs  # noqa: E402
from benchmarks.bench_layouts import dp_size, token_data  # noqa: E402
from benchmarks.common import (  # noqa: E402
    NOISE_NOTE,
    Lockstep,
    format_table,
    launch,
    peak_memory,
    quiet_worker,
    reset_peak_memory,
    run_metadata,
    slowest_rank_per_step,
    step_timer,
    summarize,
    write_json,
)

SEED = 0
PICK_TOLERANCE = 1.15  # the goal: the planner's first layout measures within this factor of the fastest

#: the layouts measured for every model: (key, Layout fields). The planner's own flags (sequence and loss
#: parallelism under tp) are taken from its enumeration where it lists the layout.
WANTED: list[tuple[str, dict[str, Any]]] = [
    ("fsdp", dict(dp_shard=4)),
    ("fsdp_ac", dict(dp_shard=4, activation_checkpointing=True)),
    ("fsdp_sac", dict(dp_shard=4, activation_checkpointing="selective")),
    ("fsdp_accumulate2", dict(dp_shard=4, accumulate_grad_batches=2)),  # each rank's batch in 2 micro-batches
    # the same reducing once per step, units gathered once (ZeRO-1-like: accumulate_unsharded)
    ("fsdp_accumulate2_zero1", dict(dp_shard=4, accumulate_grad_batches=2, reshard_after_forward=False,
                                    accumulate_unsharded=True)),
    ("hsdp", dict(dp_replicate=2, dp_shard=2)),
    ("tp4", dict(tp=4)),
    ("tp4_sp", dict(tp=4, sequence_parallel=True, loss_parallel=True)),
    # the gathered layer inputs saved as chunks, gathered again in backward
    ("tp4_sp_regather", dict(tp=4, sequence_parallel=True, loss_parallel=True, regather_sequence=True)),
    ("dp2_tp2", dict(dp_shard=2, tp=2)),
    ("dp2_tp2_ac", dict(dp_shard=2, tp=2, activation_checkpointing=True)),
    ("dp2_tp2_sac", dict(dp_shard=2, tp=2, activation_checkpointing="selective")),
    ("cp4", dict(cp=4)),
    ("dp2_cp2", dict(dp_shard=2, cp=2)),
    ("pp4_1f1b", dict(pp=4, pp_schedule="1f1b", pp_microbatches=4)),
    ("pp2_interleaved", dict(pp=2, dp_shard=2, pp_schedule="interleaved_1f1b", pp_microbatches=4)),
    ("pp2_dp2", dict(pp=2, dp_shard=2, pp_schedule="1f1b", pp_microbatches=2)),
    ("pp2_dp2_once", dict(pp=2, dp_shard=2, pp_schedule="1f1b", pp_microbatches=2, accumulate_unsharded=True)),
    ("pp2_tp2", dict(pp=2, tp=2, pp_schedule="1f1b", pp_microbatches=4)),
]
#: the layouts one device can run (the GPU half, ``--device cuda --world 1``): memory against time
WANTED_ONE: list[tuple[str, dict[str, Any]]] = [
    ("single", {}),
    ("single_ac", dict(activation_checkpointing=True)),
    ("single_sac", dict(activation_checkpointing="selective")),
    ("single_accumulate2", dict(accumulate_grad_batches=2)),
]


def wanted(world: int) -> list[tuple[str, dict[str, Any]]]:
    return WANTED_ONE if world == 1 else WANTED


# ---------------------------------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------------------------------
def build_module(cfg: dict[str, Any], model: str, max_steps: int) -> Any:
    """A fresh LightningModule of ``model`` at the configured sizes (seeded by the caller)."""
    if model == "gpt":
        from example_projects.gpt.lit import GPTModule

        return GPTModule(**module_kwargs({**cfg, "steps": max_steps, "warmup": 0}))
    from hf_models import HFCausalLM  # tests/ is on sys.path (benchmarks.common)

    return HFCausalLM("llama", hidden_size=cfg["n_embd"], intermediate_size=cfg["llama_intermediate"],
                      num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
                      num_key_value_heads=cfg["n_head"], vocab_size=cfg["vocab_size"],
                      max_position_embeddings=cfg["seq_len"])


def profile(cfg: dict[str, Any], model: str) -> Any:
    """The planner's trace of ``model`` at the global batch, built on the meta device."""
    import torch

    from lightning_par.costs.profile import profile_model

    with torch.device("meta"):
        module = build_module(cfg, model, 1)
        if hasattr(module, "configure_model"):
            module.configure_model()
    ids = torch.zeros(cfg["global_batch"], cfg["seq_len"], dtype=torch.long)
    return profile_model(module, (ids, ids))


def plans(cfg: dict[str, Any], prof: Any, hardware: Any) -> tuple[Any, Any]:
    """(the whole ranking, the ranking under the memory budget; at world 1, where no layout shards the model
    state, the whole ranking again)."""
    from lightning_par.planner.search import plan_layouts

    full = plan_layouts(prof, None, cfg["world"], hardware, precision=cfg["precision"])
    if cfg["world"] == 1:
        return full, full
    budget = cfg["budget_fraction"] * full_replica_state(prof)
    return full, plan_layouts(prof, None, cfg["world"], hardware, precision=cfg["precision"], memory_budget=budget)


def full_replica_state(prof: Any) -> float:
    """Model state of one whole, unsharded replica: parameters, gradients and optimizer state."""
    trainable = sum(p.numel for p in prof.params if p.trainable)
    return prof.param_bytes() + prof.param_bytes(trainable_only=True) + trainable * prof.optimizer_bytes_per_element


def layouts_to_measure(full: Any, budgeted: Any, keys: list[str], world: int) -> dict[str, Any]:
    """``wanted(world)`` as the planner enumerates them (its flags), then its two picks unless already there."""
    from lightning_par.planner.predict import Layout

    out: dict[str, Any] = {}
    for key, fields in wanted(world):
        if key not in keys:
            continue
        listed = [p.layout for p in full.predictions
                  if all(getattr(p.layout, k) == v for k, v in fields.items()) and not p.layout.cpu_offload
                  and all(getattr(p.layout, k) == 1 for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
                          if k not in fields)
                  and (p.layout.activation_checkpointing == fields.get("activation_checkpointing", False))
                  and p.layout.pp_stages_per_rank == fields.get("pp_stages_per_rank")
                  and p.layout.accumulate_grad_batches == fields.get("accumulate_grad_batches", 1)
                  and p.layout.reshard_after_forward == fields.get("reshard_after_forward", True)
                  and p.layout.accumulate_unsharded == fields.get("accumulate_unsharded", False)
                  and p.layout.regather_sequence == fields.get("regather_sequence", False)]
        out[key] = listed[0] if listed else Layout(**fields)
    for key, layout in (("pick", full.best.layout), ("budget_pick", budgeted.best.layout)):
        if layout not in out.values():
            out[key] = layout
    return out


# ---------------------------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------------------------
def run_one(cfg: dict[str, Any], model: str, layout: Any, yield_turn: Callable[[], None]) -> dict[str, Any]:
    """One Trainer.fit of ``layout`` on this rank, handing the turn on after every step (``Lockstep``): step times,
    then the probe step's bytes."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_par import NDParallelStrategy
    from lightning_par.planner.measure import probe_callback

    probe_step = cfg["warmup"] + cfg["steps"]
    total_steps = probe_step + 1
    # checkpointing keeps what autograd's hooks do not see (the generator's state, selective checkpointing's cache):
    # there the activations are all that the forward left alive until backward
    live = bool(layout.activation_checkpointing or layout.regather_sequence) and layout.pp == 1
    cuda = cfg["device"] == "cuda"
    timer, probe = step_timer(cuda=cuda), probe_callback(probe_step, live=live)
    device_peak = device_peak_callback()

    class HandOn(Callback):
        """Last in the list: after the timer and the probe, the next layout's step runs."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step < total_steps:
                yield_turn()

    kwargs = layout.strategy_kwargs()
    trainer = pl.Trainer(
        accelerator=cfg["device"], devices=cfg["world"], strategy=NDParallelStrategy(**kwargs), max_steps=total_steps,
        precision=cfg["precision"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[timer, probe, *([device_peak] if cuda else []), HandOn()], **layout.trainer_kwargs(),
    )
    torch.manual_seed(SEED)
    module = build_module(cfg, model, total_steps)
    micro = layout.accumulate_grad_batches  # the loader's batch is one micro-batch; a step is that many batches
    loader = DataLoader(token_data(cfg, total_steps), batch_size=cfg["global_batch"] // dp_size(kwargs) // micro)
    trainer.fit(module, loader)
    steps = [sum(timer.times[i:i + micro]) for i in range(0, len(timer.times) - micro + 1, micro)]
    # regather_sequence's own saved-tensor hooks sit inside the probe's, which then sees nothing, and the live scan
    # needs pp == 1: a pipelined layout with it has no activation measurement
    unmeasurable = layout.regather_sequence and not live
    activations = None if unmeasurable else probe.live_bytes if live else probe.activation_bytes
    return {"step_times_s": steps, "activation_bytes": activations,
            "state_bytes": probe.state, **(device_memory(device_peak) if cuda else {})}


def device_peak_callback() -> Any:
    """A callback keeping the most device memory in use (``cudaMemGetInfo``: the caching allocator's reserve, the
    CUDA context, cuBLAS and NCCL workspaces, anything else on the GPU) at the end of any batch. Read during the
    fit: its end empties the allocator's cache."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class _DevicePeak(Callback):
        used, total = 0, 0

        def on_train_batch_end(self, *args: Any) -> None:
            free, self.total = torch.cuda.mem_get_info()
            self.used = max(self.used, self.total - free)

    return _DevicePeak()


def device_memory(peak: Any) -> dict[str, int]:
    """What the CUDA caching allocator held at its peak since the last reset (the bytes tensors used: allocated;
    the bytes it took from the driver: reserved, allocated + its cached free blocks) and the device's peak in use
    (``peak``: a :func:`device_peak_callback`): the planner's memory reserve is the gap between allocated and in use."""
    return {**peak_memory(True), "device_used_bytes": peak.used, "device_total_bytes": peak.total}


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every rank, per model: probe the hardware, plan (rank 0, broadcast), train each layout ``rounds`` times."""
    quiet_worker()
    import torch
    import torch.distributed as dist

    from lightning_par.planner.probe import probe_dtype as _dtype  # as AutoParallelStrategy takes them
    from lightning_par.planner.probe import probe_hardware, tp_degrees
    from lightning_par.planner.probe import probe_shapes as _matmul_shapes

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = cfg["world"]
    out: dict[str, Any] = {"rank": dist.get_rank(), "models": {}}
    try:
        for model in cfg["models"]:
            prof = profile(cfg, model)
            t0 = time.perf_counter()
            shapes = _matmul_shapes(prof)
            # on one GPU the split matmuls are measured as an 8-GPU node's tensor parallelism would split them
            hardware = probe_hardware(torch.device(cfg["device"]), _dtype(cfg["precision"]), shapes, world,
                                      tp_sizes=tp_degrees(shapes, 8 if cuda else world))
            probe_s = time.perf_counter() - t0
            box = [None]
            if dist.get_rank() == 0:
                box = [layouts_to_measure(*plans(cfg, prof, hardware), cfg["layouts"], world)]
            dist.broadcast_object_list(box, src=0)
            layouts = box[0]
            runs: dict[str, list[dict[str, Any]]] = {key: [] for key in layouts}
            for rnd in range(cfg["rounds"]):
                order = list(layouts) if rnd % 2 == 0 else list(layouts)[::-1]
                # a GPU runs one layout at a time (its memory peaks are then each layout's own; nothing shares it)
                for group in ([[key] for key in order] if cuda else [order]):
                    gc.collect()
                    reset_peak_memory(cuda)
                    dist.barrier()  # start the round together
                    outcome = Lockstep(group).run({key: partial(run_one, cfg, model, layouts[key]) for key in group})
                    for key in group:
                        runs[key].append(outcome[key])
            out["models"][model] = {"hardware": hardware, "probe_s": probe_s, "layouts": layouts, "runs": runs}
    finally:
        dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the parent: predict, compare, report
# ---------------------------------------------------------------------------------------------------------------
def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank): Pearson's correlation of the ranks."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def compare_model(cfg: dict[str, Any], model: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Measured (slowest rank per step, largest rank for bytes) against predicted, per layout; the goals."""

    first = per_rank[0]["models"][model]
    hardware, layouts = first["hardware"], first["layouts"]
    prof = profile(cfg, model)
    full, budgeted = plans(cfg, prof, hardware)
    budget = budgeted.best.budget
    rows = {key: compare_layout(cfg, prof, hardware, budget, layout,
                                [rank["models"][model]["runs"][key] for rank in per_rank])
            for key, layout in layouts.items()}
    for key, layout in layouts.items():
        rows[key]["plan_rank"] = next((i for i, p in enumerate(full.predictions, 1) if p.layout == layout), None)
    t = {k: r["measured"]["time"]["median_s"] for k, r in rows.items()}
    fastest = min(t, key=t.get)
    pick = next(k for k in rows if layouts[k] == full.best.layout)
    return {
        "model": model, "world": cfg["world"],
        "profile": {"name": prof.name, "params": sum(p.numel for p in prof.params), "tokens": prof.tokens},
        "hardware": vars(hardware), "probe_s": first["probe_s"], "layouts": rows,
        "spearman_step_time": spearman([rows[k]["predicted"]["step_s"] for k in rows], [t[k] for k in rows]),
        "pick": {"key": pick, "layout": str(full.best.layout), "fastest": fastest,
                 "ratio_to_fastest": t[pick] / t[fastest]},
        "budget": None if cfg["world"] == 1 else budget_summary(prof, rows, layouts, budgeted, t),
        "plan_top": [{"layout": str(p.layout), "step_s": p.step_s, "fits": p.fits} for p in full.predictions[:10]],
    }


def budget_summary(prof: Any, rows: dict[str, Any], layouts: dict[str, Any], budgeted: Any,
                   t: dict[str, float]) -> dict[str, Any]:
    """The budget run: which measured layouts the planner calls fitting, which of them measured over it, its pick."""
    budget = budgeted.best.budget
    fitting = [k for k in rows if rows[k]["fits_budget_predicted"]]
    budget_pick = next(k for k in rows if layouts[k] == budgeted.best.layout)
    fastest_fitting = min(fitting, key=t.get) if fitting else None
    return {"bytes": budget, "full_replica_state_bytes": full_replica_state(prof), "fitting_predicted": fitting,
            "fitting_measured_over_budget": [k for k in fitting if (rows[k]["measured"]["peak_bytes"] or 0) > budget],
            "fitting_not_counted": [k for k in fitting if rows[k]["measured"]["peak_bytes"] is None],
            "pick": budget_pick, "pick_layout": str(budgeted.best.layout), "fastest_fitting": fastest_fitting,
            "ratio_to_fastest_fitting": t[budget_pick] / t[fastest_fitting] if fastest_fitting else None}


def compare_layout(cfg: dict[str, Any], prof: Any, hardware: Any, budget: float, layout: Any,
                   runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One layout: ``runs[rank][round]`` against its prediction (and whether it fits the budget)."""
    from lightning_par.planner.predict import predict

    lo, hi = cfg["warmup"], cfg["warmup"] + cfg["steps"]
    slowest = [slowest_rank_per_step([r[i]["step_times_s"] for r in runs]) for i in range(len(runs[0]))]
    states = [r[-1]["state_bytes"]["total"] for r in runs]
    acts = [r[-1]["activation_bytes"] for r in runs]
    counted = None not in acts
    batch = cfg["global_batch"] // layout.dp
    p = predict(layout, prof, hardware, batch, cfg["seq_len"], cfg["precision"])
    timing = summarize([t for rnd in slowest for t in rnd[lo:hi]])
    return {
        "device_memory": device_memory_row(p, runs) if "peak_allocated_bytes" in runs[0][-1] else None,
        "layout": str(layout), "strategy_kwargs": layout.strategy_kwargs(),
        "measured": {"state_bytes": max(states), "activation_bytes": max(acts) if counted else None,
                     "peak_bytes": max(s + a for s, a in zip(states, acts)) if counted else None, "time": timing,
                     "state_bytes_per_rank": states, "activation_bytes_per_rank": acts,
                     "slowest_rank_step_times_s_per_round": slowest},
        "predicted": p.as_dict(),
        "ratio": {"state": p.model_state / max(states),
                  "activations": p.activations / max(acts) if counted else None,
                  "step": p.step_s / timing["median_s"]},
        "fits_budget_predicted": predict(layout, prof, hardware, batch, cfg["seq_len"], cfg["precision"],
                                         memory_budget=budget).fits,
    }


def device_memory_row(p: Any, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A GPU layout's memory (its last round on rank 0; world 1): what the planner predicts against what tensors
    took at their peak, and what the device held beyond that: the caching allocator's cached free blocks
    (reserved - allocated) and what lies outside the allocator (the CUDA context, cuBLAS and NCCL workspaces)."""
    m = runs[0][-1]
    allocated, reserved, used = m["peak_allocated_bytes"], m["peak_reserved_bytes"], m["device_used_bytes"]
    return {"predicted_bytes": p.memory, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
            "device_used_bytes": used, "device_total_bytes": m["device_total_bytes"],
            "predicted_over_allocated": p.memory / allocated,
            "cached_free_over_allocated": (reserved - allocated) / allocated,
            "outside_allocator_bytes": used - reserved,
            "reserve_needed_share_of_device": (used - allocated) / m["device_total_bytes"]}


#: published dense models' matmuls for ``--gemm-curve``: (hidden, MLP width, heads, key/value heads, gated MLP).
#: Llama 3: "The Llama 3 Herd of Models" (arXiv:2407.21783) table 3; GPT-3 175B: arXiv:2005.14165 table 2.1.
CURVE_MODELS: dict[str, tuple[int, int, int, int, bool]] = {
    "Llama 3 8B": (4096, 14336, 32, 8, True),
    "Llama 3 70B": (8192, 28672, 64, 8, True),
    "GPT-3 175B": (12288, 49152, 96, 96, False),
    "Llama 3 405B": (16384, 53248, 128, 8, True),
}
CURVE_TOKENS = (2048, 8192)  # a micro-batch's tokens per rank: m (context parallelism and micro-batches cut it)
CURVE_TP = (1, 2, 4, 8)


def block_matmuls(hidden: int, mlp: int, heads: int, kv_heads: int, gated: bool, tokens: int) -> list[tuple[int, ...]]:
    """One transformer block's forward matmuls as Megatron fuses them: qkv, the attention output, the MLP's input
    (gate and up together when gated) and output projections, ``(m, k, n)``."""
    head_dim = hidden // heads
    return [(tokens, hidden, hidden + 2 * kv_heads * head_dim), (tokens, hidden, hidden),
            (tokens, hidden, (2 if gated else 1) * mlp), (tokens, mlp, hidden)]


def gemm_curve(precision: str, device: str = "cuda") -> dict[str, Any]:
    """The achieved matmul rate of published models' blocks on this device, whole and split as tensor parallelism
    splits them (``split_for_tp``), at two token counts: what the device table's shape efficiency is read from.
    Each (model, tokens, tp) is timed by ``probe_matmul`` with a budget that keeps every shape whole on an H100
    (a 405B MLP matmul at 8,192 tokens is 2.9e13 FLOP, 40 ms)."""
    import torch

    from lightning_par.devices import lookup_peak_flops, precision_kind
    from lightning_par.planner.probe import _device_name, probe_matmul, split_for_tp
    from lightning_par.planner.probe import probe_dtype as _dtype

    name = _device_name(torch.device(device))
    peak = lookup_peak_flops(name, precision_kind(precision) or "bf16")
    rows = []
    for model, dims in CURVE_MODELS.items():
        for tokens in CURVE_TOKENS:
            for tp in CURVE_TP:
                shapes = split_for_tp(block_matmuls(*dims, tokens), tp)
                # a budget over 20 times the largest matmul, so that probe_matmul cuts no shape's m (its rule)
                seconds = 0.6 if tokens <= 2048 else 1.5
                rate = probe_matmul(torch.device(device), _dtype(precision), shapes, seconds=seconds)
                rows.append({"model": model, "tokens": tokens, "tp": tp, "shapes": shapes, "flops": rate,
                             "of_peak": rate / peak if peak else None})
                if device == "cuda":
                    torch.cuda.empty_cache()
    return {"device": name, "precision": precision, "peak_flops": peak, "rows": rows}


def curve_report(curve: dict[str, Any]) -> str:
    headers = ["model", "tokens (m)", *(f"tp{t} TFLOP/s (of peak)" for t in CURVE_TP)]
    rows = []
    for model in CURVE_MODELS:
        for tokens in CURVE_TOKENS:
            got = {r["tp"]: r for r in curve["rows"] if r["model"] == model and r["tokens"] == tokens}
            rows.append([model, tokens, *(f"{got[t]['flops'] / 1e12:.0f} ({got[t]['of_peak'] or 0:.2f})"
                                          for t in CURVE_TP)])
    title = (f"Matmul rate of published blocks on {curve['device']} ({curve['precision']}, peak "
             f"{(curve['peak_flops'] or 0) / 1e12:.0f} TFLOP/s), whole and split for tp:")
    return title + "\n" + format_table(headers, rows)


def where(cfg: dict[str, Any], hw: dict[str, Any]) -> str:
    return "CPU, gloo" if cfg["device"] == "cpu" else f"{hw['device']}, NCCL"


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def report(res: dict[str, Any]) -> str:
    rows = []
    for key, r in sorted(res["layouts"].items(), key=lambda kv: kv[1]["measured"]["time"]["median_s"]):
        m, p, q = r["measured"], r["predicted"], r["ratio"]
        mark = " <- pick" if key == res["pick"]["key"] else ""
        rows.append([r["layout"] + mark, mib(p["model_state"]), mib(m["state_bytes"]), ratio(q["state"]),
                     mib(p["activations"]), mib(m["activation_bytes"]), ratio(q["activations"]),
                     f"{p['step_s'] * 1e3:.1f}", f"{m['time']['median_s'] * 1e3:.1f}",
                     f"{m['time']['p25_s'] * 1e3:.0f}-{m['time']['p75_s'] * 1e3:.0f}", f"{q['step']:.2f}",
                     r["plan_rank"] or "-", "yes" if r["fits_budget_predicted"] else "no", mib(m["peak_bytes"])])
    headers = ["layout (fastest measured first)", "state MiB pred", "meas", "ratio", "act MiB pred", "meas", "ratio",
               "step ms pred", "meas", "p25-p75", "ratio", "plan #", "fits budget", "meas peak MiB"]
    pick = res["pick"]
    within = pick["ratio_to_fastest"] <= PICK_TOLERANCE
    lines = [
        format_table(headers, rows),
        *([memory_report(res)] if any(r["device_memory"] for r in res["layouts"].values()) else []),
        f"Spearman(predicted, measured step time) over {len(rows)} layouts: {res['spearman_step_time']:.3f}",
        f"planner's first: {pick['layout']}, measured {pick['ratio_to_fastest']:.3f}x the fastest "
        f"({res['layouts'][pick['fastest']]['layout']}): {'within' if within else 'NOT within'} {PICK_TOLERANCE}x",
    ]
    b = res["budget"]
    if b is None:  # one device: no layout shards the model state, so no budget run
        return "\n".join(lines)
    over = b["fitting_measured_over_budget"]
    fastest_fitting = res["layouts"][b["fastest_fitting"]]["layout"] if b["fastest_fitting"] else None
    return "\n".join([
        *lines,
        f"budget {mib(b['bytes'])} MiB ({b['bytes'] / b['full_replica_state_bytes']:.2f} of a full replica's model "
        f"state, {mib(b['full_replica_state_bytes'])} MiB): {len(b['fitting_predicted'])} measured layouts called "
        f"fitting, {len(over)} of them measured over it{' (' + ', '.join(over) + ')' if over else ''}"
        f"{', not counted: ' + ', '.join(b['fitting_not_counted']) if b['fitting_not_counted'] else ''}; pick "
        f"{b['pick_layout']}, measured "
        + (f"{b['ratio_to_fastest_fitting']:.3f}x the fastest fitting ({fastest_fitting})" if fastest_fitting else "-"),
    ])


def memory_report(res: dict[str, Any]) -> str:
    """The device's memory per layout (GPU): predicted, allocated, reserved, in use, and the planner's reserve."""
    rows = []
    for r in res["layouts"].values():
        d = r["device_memory"]
        rows.append([r["layout"], mib(d["predicted_bytes"]), mib(d["peak_allocated_bytes"]),
                     f"{d['predicted_over_allocated']:.3f}", mib(d["peak_reserved_bytes"]),
                     f"{d['cached_free_over_allocated']:.3f}", mib(d["outside_allocator_bytes"]),
                     mib(d["device_used_bytes"]), f"{d['reserve_needed_share_of_device']:.4f}"])
    headers = ["layout", "predicted MiB", "peak allocated", "ratio", "peak reserved", "cached/allocated",
               "outside allocator", "device used", "(used - allocated) / device"]
    title = ("Device memory (CUDA caching allocator, peaks over the fit; 'device used': cudaMemGetInfo's most at a "
             "batch end):")
    return title + "\n" + format_table(headers, rows)


def plan_published(cases: list[Any], title: str = "published case") -> tuple[str, list[dict[str, Any]]]:
    """Published runs (tests/test_planner_published.py's ``PublishedCase``), planned from the device table: the
    table of predicted against published tokens/s per GPU and the published layout's rank, and the records."""
    from test_planner_published import plan_case  # tests/ is on sys.path (benchmarks.common)

    rows, records = [], []
    for case in cases:
        result = plan_case(case)
        records.append(result)
        rows.append([case.name, f"{result['published_tokens_per_s']:,.0f}", f"{result['predicted_tokens_per_s']:,.0f}",
                     f"{result['ratio']:.2f}", result["published_rank"], result["best"]])
    headers = [title, "published tok/s/GPU", "predicted", "ratio", "rank of its layout", "planner's first"]
    return format_table(headers, rows), records


def published_report() -> tuple[str, list[dict[str, Any]]]:
    """The published cases of tests/test_planner_published.py, planned from the device table."""
    from test_planner_published import CASES

    table, records = plan_published(CASES)
    sources = "\n".join(f"  {c.name}: {c.source}; {c.config}" for c in CASES)
    return table + "\nSources:\n" + sources, records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,llama", help="comma-separated, of gpt, llama")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (gloo, world 4) or cuda (NCCL; one GPU: --world 1)")
    p.add_argument("--world", type=int, default=4, help="processes: 4, or 1 (one device; the GPU half)")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    p.add_argument("--layouts", default=None,
                   help=f"comma-separated, of {', '.join(k for k, _ in WANTED)} at world 4, of "
                        f"{', '.join(k for k, _ in WANTED_ONE)} at world 1 (default all; the planner's picks are "
                        f"added)")
    p.add_argument("--gemm-curve", action="store_true",
                   help="also time published models' matmuls, whole and split for tp 2, 4, 8 (the device table's "
                        "shape efficiency; meant for --device cuda)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per layout and round")
    p.add_argument("--warmup", type=int, default=3, help="steps per fit left out of the timing")
    p.add_argument("--rounds", type=int, default=2, help="repetitions of all layouts (odd rounds reversed)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks together")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--llama-intermediate", type=int, default=384, help="the Llama's MLP width")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=128, help="divisible by tp (vocab-parallel embedding/head)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="the memory budget as a fraction of one full replica's model state (below 1)")
    p.add_argument("--no-published", action="store_true", help="skip the published cases")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds the launch may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner.json"))
    p.add_argument("--replay", metavar="RAW", help="predict again against the measurements of an earlier run (its "
                   "--out with .raw.pkl), without launching: for changes to the planner's time model")
    args = p.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.model_list or set(args.model_list) - {"gpt", "llama"}:
        p.error(f"--models={args.models!r}: choose from gpt, llama")
    if args.world not in (1, 4):
        p.error(f"--world={args.world}: the layouts are written for world 4 (CPU) or 1 (one device)")
    if args.device == "cuda" and args.world != 1:
        p.error(f"--device cuda --world {args.world}: one GPU is what this half is for; pass --world 1")
    known = [k for k, _ in wanted(args.world)]
    args.layout_list = known if args.layouts is None else [k.strip() for k in args.layouts.split(",") if k.strip()]
    unknown = set(args.layout_list) - set(known)
    if unknown:
        p.error(f"--layouts={args.layouts!r}: unknown at world {args.world}: {sorted(unknown)}; choose from {known}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    if not 0 < args.budget_fraction < 1:
        p.error(f"--budget-fraction={args.budget_fraction}: the budget must be below a full replica's model state")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    cfg = {"models": args.model_list, "layouts": args.layout_list, **{k: getattr(args, k) for k in (
        "device", "world", "precision", "steps", "warmup", "rounds", "global_batch", "n_layer", "n_embd", "n_head",
        "llama_intermediate", "seq_len", "vocab_size", "budget_fraction")}}
    meta = run_metadata()
    start = time.perf_counter()
    raw = Path(args.out).with_suffix(".raw.pkl")
    if args.replay:
        cfg, per_rank = pickle.loads(Path(args.replay).read_bytes())
        for key, default in (("device", "cpu"), ("world", 4), ("precision", "32-true")):  # older measurements
            cfg.setdefault(key, default)
        print(f"replaying the measurements of {args.replay}")
    else:
        print(f"launching {cfg['world']} process(es): {len(cfg['models'])} models x {len(cfg['layouts'])}+ layouts x "
              f"{args.rounds} rounds ...", flush=True)
        per_rank = launch(cfg["world"], worker, cfg, timeout=args.timeout)
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_bytes(pickle.dumps((cfg, per_rank)))
    launch_s = time.perf_counter() - start
    results = {}
    for model in cfg["models"]:
        res = compare_model(cfg, model, per_rank)
        results[model] = res
        hw = res["hardware"]
        print(f"\n{res['profile']['name']}: {cfg['n_layer']} layers x {cfg['n_embd']} wide, "
              f"{res['profile']['params']:,} parameters ({cfg['precision']}, AdamW), global batch "
              f"{cfg['global_batch']} x {cfg['seq_len']} tokens; world {cfg['world']}, {where(cfg, hw)}. Probed in "
              f"{res['probe_s']:.1f} s: "
              f"{hw['matmul_flops'] / 1e9:.2f} GFLOP/s per rank, all-reduce {hw['intra_bandwidth'] / 1e9:.3f} GB/s, "
              f"{hw['intra_latency'] * 1e6:.0f} us/hop; split for tp: "
              + (", ".join(f"tp{t} {f / hw['matmul_flops']:.2f}" for t, f in hw["matmul_by_tp"]) or "-"))
        print(report(res))
    published: list[dict[str, Any]] = []
    if not args.no_published:
        text, published = published_report()
        print("\nPublished results, planned from the device table (tests/test_planner_published.py):")
        print(text)
    curve = None
    if args.gemm_curve:
        curve = gemm_curve(cfg["precision"])
        print("\n" + curve_report(curve))
    total_s = time.perf_counter() - start
    if cfg["device"] == "cpu":
        print(f"\nNote: {NOISE_NOTE} {cfg['world']} rank(s) share {meta['cpu_count']} cores here.")
    meta.update(load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None, device=cfg["device"],
                backend="gloo" if cfg["device"] == "cpu" else "nccl", world_size=cfg["world"], total_wall_s=total_s,
                launch_wall_s=launch_s, **({"threads_per_rank": 1} if cfg["device"] == "cpu" else {}))
    out = write_json(args.out, {"benchmark": "planner", "args": vars(args), "metadata": meta, "results": results,
                                "published": published, "gemm_curve": curve})
    print(f"Total {total_s:.0f} s; results written to {out}" + ("" if args.replay else f" (measurements: {raw})"))


if __name__ == "__main__":
    main()

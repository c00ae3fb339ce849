"""Full fine-tuning against LoRA, under each layout: what a rank holds, how long a step takes, what a checkpoint weighs.

One model, a Hugging Face Llama built from a config (``HFCausalLMModule`` of example_projects/hf_lm; default 4 layers
x 512 wide, 8 query / 4 key-value heads, MLP 1376, vocabulary 2048: 13.7 M parameters), trained two ways:

- ``full``: every parameter trains (AdamW over all of them);
- ``lora``: PEFT LoRA (r 16, alpha 32) on every attention and MLP projection, as the fine-tuning example builds it
  (``example_projects.finetune.lit.add_lora``); the base frozen, AdamW over the adapters only.

Layouts (``NDParallelStrategy``): ``dp_shard=2`` (FSDP2), ``tp=2`` (the model's own plan, sequence parallel),
``pp=2`` (1F1B, 2 micro-batches) on 2 processes, and ``dp_shard=2 x tp=2`` on 4. The global batch is the same
everywhere (default 8 sequences of 64 random tokens): each data-parallel rank reads ``global / dp`` of it. The
weights start from the model's own initialization on the meta device (no ``pretrained=``): the values change neither
the bytes nor the time.

Per layout, the two variants run in one launch, step by step interleaved (``benchmarks.common.Lockstep``: full,
lora, full, lora, ...; odd rounds start with lora), so neighbouring steps see the same machine load. Per variant
and round one ``Trainer.fit`` of ``warmup + steps + 1`` steps:

1. ``--warmup`` steps, not timed (first steps pay one-time set-up: allocations, the pipeline schedule);
2. ``--steps`` timed steps (``benchmarks.common.step_timer``: ``on_train_batch_start`` to ``on_train_batch_end``,
   no barrier), the slowest rank per step; reported: medians, and the median of the paired ratios lora(k)/full(k)
   of steps run moments apart (the estimate least moved by other jobs' load);
3. one probe step (``lightning_par.planner.measure``, as its ``probe_callback`` does: see :func:`probe`): the peak
   bytes of the tensors autograd saves for backward (parameters excluded), then after its optimizer step the model
   state this rank holds: parameters, gradients and AdamW state, each ``DTensor.to_local()`` (``state_bytes``).

After the last round's fit, rank 0 measures the checkpoint directories ``trainer.save_checkpoint`` writes (DCP,
every rank its shards; bytes of all files): full fine-tuning's (weights + AdamW state), and for LoRA the adapter-only
one (``save_trainable_only=True``: the adapters + their AdamW state) and the whole-model one (the frozen base too).

Usage: python benchmarks/bench_finetune.py [--layouts fsdp2,tp2,pp2,fsdp2_x_tp2] [--steps 5] [--warmup 2]
       [--rounds 1] [--global-batch 8] [--seq-len 64] [--hidden-size 512 --intermediate-size 1376 --layers 4
       --heads 8 --kv-heads 4 --vocab-size 2048] [--lora-r 16] [--out benchmarks/results/finetune.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
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

SEED = 0
VARIANTS = ("full", "lora")
#: key -> (label, world size, NDParallelStrategy options)
LAYOUTS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "fsdp2": ("dp_shard=2 (FSDP2)", 2, dict(dp_shard=2)),
    "tp2": ("tp=2 (+SP)", 2, dict(tp=2, dp_shard=1, sequence_parallel=True)),
    "pp2": ("pp=2 (1F1B, 2 mb)", 2, dict(pp=2, dp_shard=1, pp_schedule="1f1b", pp_microbatches=2)),
    "fsdp2_x_tp2": ("dp_shard=2 x tp=2 (+SP)", 4, dict(dp_shard=2, tp=2, sequence_parallel=True)),
}


def dp_size(spec: dict[str, Any]) -> int:
    return spec.get("dp_replicate", 1) * spec.get("dp_shard", 1)


# ---------------------------------------------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------------------------------------------
def module_kwargs(cfg: dict[str, Any], total_steps: int) -> dict[str, Any]:
    return dict(model_type="llama", vocab_size=cfg["vocab_size"], vocab_multiple=64, max_seq_len=cfg["seq_len"],
                num_hidden_layers=cfg["layers"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["heads"],
                num_key_value_heads=cfg["kv_heads"], meta_init=True, warmup_steps=1, max_steps=total_steps)


def module_class(variant: str, cfg: dict[str, Any]) -> type:
    """``full``: the hf_lm module as it is; ``lora``: its model wrapped as the fine-tuning example does."""
    from example_projects.finetune.lit import DEFAULT_TARGETS, add_lora
    from example_projects.hf_lm.lit import HFCausalLMModule

    if variant == "full":
        return HFCausalLMModule

    class LoRAModule(HFCausalLMModule):
        def build_model(self) -> Any:
            return add_lora(super().build_model(), cfg["lora_r"], 2 * cfg["lora_r"], 0.0, DEFAULT_TARGETS)

    return LoRAModule


def token_data(cfg: dict[str, Any], steps: int) -> Any:
    """Random tokens, ``global_batch * steps`` sequences: each data-parallel rank reads ``steps`` batches."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg["vocab_size"], (cfg["global_batch"] * steps, cfg["seq_len"] + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def checkpoint_bytes(trainer: Any, path: Path, trainable_only: bool) -> int | None:
    """Collective: write a checkpoint (adapter-only or whole), return its size on disk on rank 0, delete it."""
    strategy = trainer.strategy
    kept, strategy.save_trainable_only = strategy.save_trainable_only, trainable_only  # read at each save
    try:
        trainer.save_checkpoint(path)
    finally:
        strategy.save_trainable_only = kept
    if not trainer.is_global_zero:  # rank 0 publishes the directory last: complete once its save returns
        return None
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path)
    return size


def run_variant(cfg: dict[str, Any], key: str, variant: str, ckpt_dir: str | None,
                yield_turn: Callable[[], None]) -> dict[str, Any]:
    """One Trainer.fit of ``variant`` under layout ``key`` on this rank."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_par import NDParallelStrategy
    from lightning_par.planner.measure import probe_callback

    _, world, spec = LAYOUTS[key]
    probe_step = cfg["warmup"] + cfg["steps"]
    total_steps = probe_step + 1

    class YieldTurn(Callback):
        """After the timer and the probe (callbacks run in list order): hand the turn on, except after the last
        step, which the checkpoints follow."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step < trainer.max_steps:
                yield_turn()

    timer, measure = step_timer(), probe_callback(probe_step)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=NDParallelStrategy(**spec), max_steps=total_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer, measure, YieldTurn()],
    )
    torch.manual_seed(SEED)
    module = module_class(variant, cfg)(**module_kwargs(cfg, total_steps))
    loader = DataLoader(token_data(cfg, total_steps), batch_size=cfg["global_batch"] // dp_size(spec))
    trainer.fit(module, loader)  # Lightning adds the DistributedSampler over the data-parallel ranks
    disk: dict[str, int | None] = {}
    if ckpt_dir is not None:
        base = Path(ckpt_dir) / f"{key}_{variant}"
        disk["whole"] = checkpoint_bytes(trainer, base.with_name(base.name + "_whole"), trainable_only=False)
        if variant == "lora":
            disk["trainable_only"] = checkpoint_bytes(trainer, base.with_name(base.name + "_adapters"),
                                                      trainable_only=True)
    return {"step_times_s": timer.times, "activation_bytes": measure.activation_bytes, "state_bytes": measure.state,
            "disk_bytes": disk}


def worker(cfg: dict[str, Any], keys: list[str], ckpt_dir: str) -> dict[str, Any]:
    """Every rank: per layout, ``rounds`` of the two variants in lockstep; per-rank results to the parent."""
    quiet_worker()
    import torch.distributed as dist

    dist.init_process_group("gloo")  # Lightning's strategies find it initialized and reuse it
    rank = dist.get_rank()
    runs = []
    try:
        for key in keys:
            for rnd in range(cfg["rounds"]):
                order = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS[::-1])
                ckpt = ckpt_dir if rnd == cfg["rounds"] - 1 else None  # checkpoints after the last round
                gc.collect()
                dist.barrier()  # start each round together (outside the timed steps)
                loops = {v: (lambda turn, v=v, key=key, ckpt=ckpt: run_variant(cfg, key, v, ckpt, turn))
                         for v in VARIANTS}
                outcome = Lockstep(order).run(loops)
                runs += [{"layout": key, "variant": v, "round": rnd, **outcome[v]} for v in VARIANTS]
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "runs": runs}


# ---------------------------------------------------------------------------------------------------------------
# the parent: launch, combine ranks, report
# ---------------------------------------------------------------------------------------------------------------
def count_parameters(cfg: dict[str, Any]) -> dict[str, int]:
    """All parameters and the trainable ones of each variant (built on the meta device, in this process)."""
    import torch

    counts = {}
    for variant in VARIANTS:
        module = module_class(variant, cfg)(**module_kwargs(cfg, 1))
        with torch.device("meta"):
            model = module.build_model()
        counts[variant] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return counts


def combine(cfg: dict[str, Any], key: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: slowest-rank step times pooled over rounds, bytes of the largest rank; LoRA / full ratios."""
    lo = cfg["warmup"]
    out: dict[str, Any] = {"label": LAYOUTS[key][0], "world": LAYOUTS[key][1], "strategy_kwargs": LAYOUTS[key][2],
                           "variants": {}}
    rounds: dict[str, list[list[float]]] = {}
    for v in VARIANTS:
        runs = [[r for r in rank["runs"] if r["layout"] == key and r["variant"] == v] for rank in per_rank]
        rounds[v] = [slowest_rank_per_step([rank_runs[i]["step_times_s"] for rank_runs in runs])[lo:lo + cfg["steps"]]
                     for i in range(cfg["rounds"])]
        last = [rank_runs[-1] for rank_runs in runs]
        states, acts = [r["state_bytes"] for r in last], [r["activation_bytes"] for r in last]
        big = max(range(len(states)), key=lambda i: states[i]["total"])
        out["variants"][v] = {
            "time": summarize([t for rnd in rounds[v] for t in rnd]),
            "slowest_rank_step_times_s_per_round": rounds[v],
            "state_bytes_per_rank": states,
            "activation_bytes_per_rank": acts,
            "largest_rank": big,
            "disk_bytes": last[0]["disk_bytes"],  # measured on rank 0
        }
    full, lora = out["variants"]["full"], out["variants"]["lora"]
    paired = [b / a for ra, rb in zip(rounds["full"], rounds["lora"]) for a, b in zip(ra, rb)]
    fb, lb = full["state_bytes_per_rank"][full["largest_rank"]], lora["state_bytes_per_rank"][lora["largest_rank"]]
    out["lora_over_full"] = {
        **{k: lb[k] / fb[k] for k in ("params", "grads", "optim", "total")},
        "saved_activations": max(lora["activation_bytes_per_rank"]) / max(full["activation_bytes_per_rank"]),
        "step_time_of_medians": lora["time"]["median_s"] / full["time"]["median_s"],
        "step_time_paired_median": statistics.median(paired),
        "checkpoint_trainable_only_over_full_finetuning": (
            lora["disk_bytes"]["trainable_only"] / full["disk_bytes"]["whole"]),
        "checkpoint_trainable_only_over_whole_lora": (
            lora["disk_bytes"]["trainable_only"] / lora["disk_bytes"]["whole"]),
    }
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def memory_table(results: dict[str, Any]) -> str:
    rows = []
    for res in results.values():
        for v in VARIANTS:
            r = res["variants"][v]
            s, act = r["state_bytes_per_rank"][r["largest_rank"]], max(r["activation_bytes_per_rank"])
            rows.append([res["label"], res["world"], v, mib(s["params"]), mib(s["grads"]), mib(s["optim"]),
                         mib(s["total"]), mib(act), f"{r['time']['median_s'] * 1e3:.0f}"])
        q = res["lora_over_full"]
        rows.append(["", "", "lora / full", f"{q['params']:.3f}", f"{q['grads']:.4f}", f"{q['optim']:.4f}",
                     f"{q['total']:.3f}", f"{q['saved_activations']:.3f}",
                     f"{q['step_time_of_medians']:.2f} (paired {q['step_time_paired_median']:.2f})"])
    headers = ["layout", "world", "variant", "params MiB", "grads MiB", "AdamW MiB", "state MiB", "saved act MiB",
               "step ms"]
    return format_table(headers, rows)


def disk_table(results: dict[str, Any]) -> str:
    rows = []
    for res in results.values():
        full, lora = res["variants"]["full"]["disk_bytes"], res["variants"]["lora"]["disk_bytes"]
        q = res["lora_over_full"]
        rows.append([res["label"], mib(full["whole"]), mib(lora["whole"]), mib(lora["trainable_only"]),
                     f"{q['checkpoint_trainable_only_over_full_finetuning']:.4f}",
                     f"{q['checkpoint_trainable_only_over_whole_lora']:.4f}"])
    headers = ["layout", "full FT ckpt MiB", "LoRA whole ckpt MiB", "LoRA adapter-only MiB", "adapters / full FT",
               "adapters / LoRA whole"]
    return format_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="steps per fit left out of the timing")
    p.add_argument("--rounds", type=int, default=1, help="repetitions (odd rounds start with lora)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, all ranks together")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1376)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--lora-r", type=int, default=16, help="adapter rank (alpha = 2 r)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one launch may take before it is killed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "finetune.json"))
    args = p.parse_args(argv)
    args.layout_list = [k.strip() for k in args.layouts.split(",") if k.strip()]
    unknown = [k for k in args.layout_list if k not in LAYOUTS]
    if unknown or not args.layout_list:
        p.error(f"--layouts={args.layouts!r}: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.lora_r < 1:
        p.error("--steps, --rounds and --lora-r must be >= 1, --warmup >= 0")
    for key in args.layout_list:
        spec = LAYOUTS[key][2]
        tp, dp, pp = spec.get("tp", 1), dp_size(spec), spec.get("pp", 1)
        if args.global_batch % (dp * spec.get("pp_microbatches", 1)):
            p.error(f"--global-batch={args.global_batch} must be divisible by {key}'s data-parallel size {dp} times "
                    f"its micro-batches {spec.get('pp_microbatches', 1)}")
        for name in ("heads", "kv_heads", "intermediate_size", "seq_len"):
            if getattr(args, name) % tp:
                p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be divisible by {key}'s tp={tp}")
        if args.layers < pp:
            p.error(f"--layers={args.layers}: {key} needs at least one layer per pipeline stage ({pp})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "global_batch", "seq_len", "hidden_size",
                                         "intermediate_size", "layers", "heads", "kv_heads", "vocab_size", "lora_r")}
    meta = run_metadata()
    start = time.perf_counter()
    results: dict[str, Any] = {}
    launch_s: dict[int, float] = {}
    by_world: dict[int, list[str]] = {}
    for key in args.layout_list:
        by_world.setdefault(LAYOUTS[key][1], []).append(key)
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as ckpt_dir:
        for world, keys in by_world.items():
            print(f"world {world}: launching {world} processes for {', '.join(keys)} ...", flush=True)
            t0 = time.perf_counter()
            per_rank = launch(world, worker, cfg, keys, ckpt_dir, timeout=args.timeout)
            launch_s[world] = time.perf_counter() - t0
            for key in keys:
                results[key] = combine(cfg, key, per_rank)
    total_s = time.perf_counter() - start
    counts = count_parameters(cfg)
    n_params, n_lora = counts["full"], counts["lora"]
    print(f"\nLlama {args.layers} layers x {args.hidden_size} wide (MLP {args.intermediate_size}, {args.heads}/"
          f"{args.kv_heads} heads, vocab {-(-args.vocab_size // 64) * 64}): {n_params:,} parameters, fp32; LoRA r "
          f"{args.lora_r} on q/k/v/o/gate/up/down: {n_lora:,} trainable ({n_lora / n_params:.2%}). Global batch "
          f"{args.global_batch} x {args.seq_len} tokens, AdamW; CPU, gloo, 1 thread per rank, {meta['cpu_count']} "
          f"cores")
    print("\nPer rank (the rank holding the most state), after the probe step's optimizer step: parameters, "
          "gradients, AdamW state (local shards); saved activations: peak bytes autograd keeps for backward (max over "
          f"ranks); step time: median of the slowest rank, {args.rounds} round(s) x {args.steps} steps, full and "
          "lora interleaved step by step")
    print(memory_table(results))
    print("\nCheckpoints on disk (trainer.save_checkpoint: DCP directory, all ranks' files; the optimizer state "
          "included)")
    print(disk_table(results))
    print(f"\nNote: {NOISE_NOTE} World 4 time-shares {meta['cpu_count']} cores.")
    meta.update(load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None, device="cpu",
                backend="gloo", threads_per_rank=1, total_wall_s=total_s, launch_wall_s=launch_s)
    out = write_json(args.out, {"benchmark": "finetune", "args": vars(args),
                                "model": {**cfg, "param_numel": n_params, "lora_trainable_numel": n_lora},
                                "metadata": meta, "results": results})
    print(f"Total {total_s:.0f} s; results written to {out}")


if __name__ == "__main__":
    main()

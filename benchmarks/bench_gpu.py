"""Training throughput on the GPU(s) present, side by side: a hand-written loop (eager and compiled per block),
FSDP2Strategy (eager and compile=True), Lightning's ModelParallelStrategy with fully_shard in configure_model, and
FSDP2Strategy(compile=True) with the three monitors (CUPTI detached after the profiling window, and left attached).

The model is the GPT example's (default 24 x 1024, 16 heads, vocabulary 32,000, sequence 2,048, batch 8 per GPU,
bf16-mixed, AdamW: 370 M parameters, the size shared/GPU_FACTS.md measured). Each variant runs in its own process on
one GPU (NCCL, world size 1; a fresh CUDA context, compile cache and CUPTI state), on the same random token batches.
Timed: ``--steps`` steps after ``--warmup`` (compilation, allocator warm-up and, with the monitors, their profiling
window are in the warm-up), from a device synchronization before the first timed step to one after the last.

Reported per variant: ms per step, tokens/s, achieved TFLOP/s and MFU (FLOPs per step counted once with
``lightning_par.callbacks.flops.count_training_flops``; the peak from ``lightning_par.devices`` for the GPU's name
and the precision), peak allocated and reserved memory, and the ratio to the hand-written loop (compiled variants to
the compiled loop). Writes JSON (``--out``).

Without CUDA it refuses ("needs CUDA"), unless ``--smoke``: the same code on the CPU (gloo) with a tiny model and
nothing compiled, to check the harness, not to measure anything.

``--profile-steps N``: N more steps after the timed ones under ``torch.profiler`` (``record_shapes=False``); each
variant's JSON gets the top host-side ops, the host syncs counted (``*Synchronize``, blocking ``cudaMemcpy``) and the
device's idle share between its kernels, and its Chrome trace is written beside ``--out``.

Usage: ``python benchmarks/bench_gpu.py [--variants hand,fsdp2,...] [--steps 20] [--warmup 10] [--out ...]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_table, launch, quiet_worker, run_metadata, write_json  # noqa: E402

VARIANTS = {  # name: (kind, compiled, with the three monitors, CUPTI teardown)
    "hand": ("hand", False, False, True),
    "hand_compiled": ("hand", True, False, True),
    "fsdp2": ("fsdp2", False, False, True),
    "fsdp2_compiled": ("fsdp2", True, False, True),
    "model_parallel": ("model_parallel", False, False, True),
    "fsdp2_compiled_monitors": ("fsdp2", True, True, True),
    "fsdp2_compiled_monitors_cupti_attached": ("fsdp2", True, True, False),
    # float8 (tensorwise): the hand loop converts with torchao's call, the strategy with its float8 option
    "hand_compiled_float8": ("hand", True, False, True),
    "fsdp2_compiled_float8": ("fsdp2", True, False, True),
}
SMOKE = dict(n_layer=2, n_embd=64, n_head=2, vocab=128, seq=64, batch=2, steps=3, warmup=6,
             precision="32-true")


# ---- what each variant's process runs ------------------------------------------------------------------------------
def _model_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                n_embd=cfg["n_embd"], lr=3e-4, warmup_steps=10, max_steps=_total_steps(cfg))


def _total_steps(cfg: dict[str, Any]) -> int:
    return cfg["warmup"] + cfg["steps"] + cfg.get("profile_steps", 0)


def _loader(cfg: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n = _total_steps(cfg) * cfg["batch"]
    ids = torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=cfg["batch"], drop_last=True)


class _Window:
    """Wall time from a synchronization before batch ``start`` to one after batch ``start + count - 1``."""

    def __init__(self, start: int, count: int, cuda: bool, profile_steps: int = 0, trace: str = "") -> None:
        self.start, self.count, self.cuda = start, count, cuda
        self.t0 = self.t1 = 0.0
        self.profile_steps, self.trace, self.profiler, self.profile = profile_steps, trace, None, {}

    def _sync_time(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def before(self, i: int) -> None:
        if i == self.start:
            self.t0 = self._sync_time()
        if self.profile_steps and i == self.start + self.count:  # after the timed steps: they stay unprofiled
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities, record_shapes=False)
            self.profiler.__enter__()

    def after(self, i: int) -> None:
        if i == self.start + self.count - 1:
            self.t1 = self._sync_time()
        if self.profiler is not None and i == self.start + self.count + self.profile_steps - 1:
            self._sync_time()
            self.profiler.__exit__(None, None, None)
            self.profile = _profile_summary(self.profiler, self.profile_steps)
            if self.trace:
                self.profiler.export_chrome_trace(self.trace)
                self.profile["trace"] = self.trace
            self.profiler = None

    @property
    def step_s(self) -> float:
        return (self.t1 - self.t0) / self.count


def _profile_summary(prof: Any, steps: int) -> dict[str, Any]:
    """Per step: the top host-side ops by self CPU time, the host syncs, and the device's idle share between the
    first and the last kernel (time no kernel or copy ran)."""
    averages = prof.key_averages()
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    syncs = {e.key: e.count / steps for e in averages
             if "Synchronize" in e.key or e.key == "cudaMemcpy"}  # CUDA runtime calls that wait for the device
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA")
    busy, end = 0.0, None
    for a, b in spans:  # union of the device intervals
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {"top_host_ops_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in top},
            "host_syncs_per_step": syncs,
            "device_idle_share": (1 - busy / window) if window else None,
            "device_idle_ms_per_step": (window - busy) / 1e3 / steps if window else None}


def _hand(cfg: dict[str, Any], compiled: bool, window: _Window, device: str,
          float8: str | None = None) -> dict[str, Any]:
    import contextlib

    import torch

    from example_projects.gpt.lit import GPTModule

    torch.manual_seed(0)
    module = GPTModule(**_model_kwargs(cfg))
    module.configure_model()
    module.to(device)
    if float8:
        from lightning_par.techniques.float8.float8_layers import convert_to_float8

        convert_to_float8(module, float8, [f"model.blocks.{i}" for i in range(len(module.model.blocks))])
    if compiled:
        for block in module.model.blocks:
            block.compile()
    opt_cfg = module.configure_optimizers()
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if cfg["precision"] == "bf16-mixed"
                else contextlib.nullcontext())
    for i, (x, y) in enumerate(_loader(cfg)):
        window.before(i)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            loss = module.loss(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        window.after(i)
    return {"final_loss": float(loss)}


def _hand_sharded_module(cfg: dict[str, Any], compiled: bool) -> Any:
    """GPTModule parallelized by hand in ``configure_model``, Lightning's way for its ModelParallelStrategy."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from example_projects.gpt.lit import GPTModule

    class ShardedByHand(GPTModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if cfg["precision"] == "bf16-mixed" else MixedPrecisionPolicy())
            for block in self.model.blocks:
                if compiled:
                    block.compile()
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(self.model, mesh=mesh, mp_policy=mp)

    return ShardedByHand(**_model_kwargs(cfg))


def _lightning(cfg: dict[str, Any], kind: str, compiled: bool, monitors: bool, teardown: bool, window: _Window,
               device: str, float8: str | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from example_projects.gpt.lit import GPTModule
    from lightning_par.callbacks import CommOverlapMonitor, DeviceUtilizationMonitor, MemoryMonitor

    # the MemoryMonitor resets the process's peak statistics after each of its logs, so the peaks are read here,
    # before it runs (callbacks run in list order), and the run's peak is the largest of them
    peaks = {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0}

    def read_peaks() -> None:
        if device == "cuda":  # host-side counters: no device synchronization
            peaks["peak_allocated_bytes"] = max(peaks["peak_allocated_bytes"], torch.cuda.max_memory_allocated())
            peaks["peak_reserved_bytes"] = max(peaks["peak_reserved_bytes"], torch.cuda.max_memory_reserved())

    class Timing(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            read_peaks()  # setup's (materialization, sharding), before the monitor resets them

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            window.before(batch_idx)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            window.after(batch_idx)
            read_peaks()

    callbacks: list[Any] = [Timing()]
    if monitors:  # the profiling window (batches 1-4) inside the warm-up: the timed steps come after it, as most
        # steps of a run do; utilization and memory log every 10 steps
        callbacks += [DeviceUtilizationMonitor(), MemoryMonitor(),
                      CommOverlapMonitor(start_step=1, every_n_steps=1000, teardown_cupti=teardown)]
    if kind == "fsdp2":
        from lightning_par import FSDP2Strategy

        strategy: Any = FSDP2Strategy(compile=compiled, float8=float8)
        module = GPTModule(**_model_kwargs(cfg))
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy()
        module = _hand_sharded_module(cfg, compiled)
    trainer = pl.Trainer(accelerator=device, devices=1, strategy=strategy, precision=cfg["precision"],
                         max_steps=_total_steps(cfg), logger=False, callbacks=callbacks,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=10)
    trainer.fit(module, _loader(cfg))
    return {"final_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))), **peaks}


def _count_flops(cfg: dict[str, Any], device: str) -> float:
    """FLOPs of one training step (3 x forward, counted on the eager model with one real batch)."""
    import contextlib

    import torch

    from example_projects.gpt.lit import GPTModule
    from lightning_par.callbacks.flops import count_training_flops

    module = GPTModule(**_model_kwargs(cfg))
    module.configure_model()
    module.to(device)
    x, y = next(iter(_loader(cfg)))
    x, y = x.to(device), y.to(device)
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if cfg["precision"] == "bf16-mixed"
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            loss = module.loss(module(x), y)
        loss.backward()

    return float(count_training_flops(step))


def run_variant(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One variant on this process's device; its timing, memory and (for ``count``) the step's FLOPs."""
    import torch

    quiet_worker()
    kind, compiled, monitors, teardown = VARIANTS[name]
    compiled = compiled and not cfg["smoke"]  # compiling on a CPU takes minutes and measures nothing
    device = "cuda" if torch.cuda.is_available() and not cfg["smoke"] else "cpu"
    out: dict[str, Any] = {}
    if cfg.get("count"):
        out["flops_per_step"] = _count_flops(cfg, device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trace = str(Path(cfg["out"]).with_name(f"{Path(cfg['out']).stem}_{name}_trace.json")) if cfg.get("out") else ""
    window = _Window(cfg["warmup"], cfg["steps"], device == "cuda", cfg.get("profile_steps", 0), trace)
    float8 = "tensorwise" if name.endswith("_float8") else None
    if kind == "hand":
        out.update(_hand(cfg, compiled, window, device, float8))
    else:
        out.update(_lightning(cfg, kind, compiled, monitors, teardown, window, device, float8))
    out["step_s"] = window.step_s
    if window.profile:
        out["profile"] = window.profile
    if device == "cuda":  # the peak since the reset above, or since the MemoryMonitor's last reset (see _lightning)
        out["peak_allocated_bytes"] = max(out.get("peak_allocated_bytes", 0), torch.cuda.max_memory_allocated())
        out["peak_reserved_bytes"] = max(out.get("peak_reserved_bytes", 0), torch.cuda.max_memory_reserved())
        out["device_name"] = torch.cuda.get_device_name()
    out["device"] = device
    return out


# ---- the parent: run, tabulate, write ------------------------------------------------------------------------------
def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"])
    p.add_argument("--profile-steps", type=int, default=0,
                   help="steps after the timed ones under torch.profiler: summary in the JSON, trace beside --out")
    p.add_argument("--smoke", action="store_true", help="no GPU: a tiny CPU run of the harness (not a measurement)")
    p.add_argument("--out", default="benchmarks/results/gpu.json")
    args = p.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    for name in ("n_layer", "n_embd", "n_head", "vocab", "seq", "batch", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile_steps < 0:
        p.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.warmup < 6:
        p.error("--warmup must be >= 6: compilation and the monitors' profiling window (batches 1-4) happen there")
    return args


def main() -> None:
    import torch

    args = _parse()
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench_gpu.py needs CUDA: no GPU is visible to torch here. Run it on a GPU machine, or pass --smoke "
                 "for a tiny CPU run that only checks the harness.")
    names = args.variants.split(",")
    cfg = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab=args.vocab, seq=args.seq,
               batch=args.batch, steps=args.steps, warmup=args.warmup, precision=args.precision, smoke=args.smoke,
               profile_steps=args.profile_steps, out=args.out)
    if args.smoke:
        cfg.update(SMOKE)
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        results[name] = launch(1, run_variant, name, {**cfg, "count": i == 0}, timeout=1200)[0]
        print(f"{name}: {results[name]['step_s'] * 1e3:.1f} ms/step", flush=True)
    flops = results[names[0]]["flops_per_step"]
    device_name = results[names[0]].get("device_name", "cpu")
    from lightning_par.callbacks.flops import lookup_peak_flops, precision_kind

    kind = precision_kind(cfg["precision"])
    peak = lookup_peak_flops(device_name, kind) if device_name != "cpu" and kind else None
    tokens = cfg["batch"] * cfg["seq"]
    formula = (6 * _matmul_params(cfg) + 12 * cfg["n_layer"] * cfg["n_embd"] * cfg["seq"]) * tokens
    rows, table = [], []
    for name in names:
        r = results[name]
        base = "hand_compiled" if VARIANTS[name][1] and "hand_compiled" in results else "hand"
        if name.endswith("_float8") and "hand_compiled_float8" in results:
            base = "hand_compiled_float8"
        achieved = flops / r["step_s"]
        row = {"variant": name, "ms_per_step": r["step_s"] * 1e3, "tokens_per_s": tokens / r["step_s"],
               "tflops_per_s": achieved / 1e12, "mfu": achieved / peak if peak else None,
               "peak_allocated_gib": r.get("peak_allocated_bytes", 0) / 2**30,
               "peak_reserved_gib": r.get("peak_reserved_bytes", 0) / 2**30,
               "ratio_to": base if base in results else None,
               "time_ratio": r["step_s"] / results[base]["step_s"] if base in results else None}
        rows.append(row)
        table.append([name, f"{row['ms_per_step']:.1f}", f"{row['tokens_per_s'] / 1e3:.1f}k",
                      f"{row['tflops_per_s']:.1f}", "-" if row["mfu"] is None else f"{row['mfu']:.3f}",
                      f"{row['peak_allocated_gib']:.1f}",
                      "-" if row["time_ratio"] is None else f"{row['time_ratio']:.3f} ({base})"])
    wall = time.perf_counter() - t0
    print(f"\n{device_name}, torch {torch.__version__}, GPT {cfg['n_layer']} x {cfg['n_embd']} ({cfg['n_head']} heads, "
          f"vocabulary {cfg['vocab']}), sequence {cfg['seq']}, batch {cfg['batch']}, {cfg['precision']}; "
          f"{cfg['steps']} timed steps after {cfg['warmup']}; {flops:.4g} FLOP per step counted "
          f"({formula:.4g} by 6N + 12 L d s per token); peak {peak / 1e12 if peak else 0:g} TFLOP/s:")
    print(format_table(["variant", "ms/step", "tokens/s", "TFLOP/s", "MFU", "peak GiB", "time vs"], table))
    if args.smoke:
        print("(--smoke: a CPU check of the harness; these numbers measure nothing)")
    result = {"benchmark": "gpu", "args": vars(args), "config": cfg, "device": device_name, "peak_flops": peak,
              "flops_per_step": flops, "formula_flops_per_step": formula, "variants": rows, "raw": results,
              "meta": run_metadata(), "wall_s": wall}
    print(f"wrote {write_json(args.out, result)}")


def _matmul_params(cfg: dict[str, Any]) -> int:
    """Parameters in matmuls: 12 d^2 per block (attention 4 d^2, MLP 8 d^2) and the head (d x vocabulary)."""
    return 12 * cfg["n_layer"] * cfg["n_embd"] ** 2 + cfg["n_embd"] * cfg["vocab"]


if __name__ == "__main__":
    main()

"""What the monitoring callbacks cost: step time with each one on vs off, and the cost of a profiling window.

One process, CPU, a small MLP, CSVLogger in every configuration (so logging cost is the callbacks' own). The
configurations run interleaved, ``--repeats`` times each, so machine noise spreads evenly. A timing callback
records every batch start; step time = time between consecutive batch starts (everything the loop does).

- "outside windows": the overlap monitor's first window is set after the run ends, so its per-batch check is what
  is measured; utilization and memory log every ``--log-every`` steps, and their logging is included (mean) or not
  (median). Goal: ratio <= 1.01. On a shared 2-core machine end-to-end ratios carry a few percent of noise, so
  the callbacks' own hook time is also measured directly (each per-batch hook wrapped in a timer):
  ratio(hooks) = (mean step off + hook time per step) / mean step off, which is what the callbacks add.
- "window": a run with one profiling window (1 warm-up + ``--window`` measured batches); its cost = the window's
  batches minus as many normal batches, and the in-process analysis time (part of it).

Usage: ``python benchmarks/bench_callbacks.py [--steps 120] [--repeats 5] [--out benchmarks/results/callbacks.json]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from benchmarks.common import format_table, quiet_worker, run_metadata, write_json  # noqa: E402
from lightning_par.callbacks import CommOverlapMonitor, DeviceUtilizationMonitor, MemoryMonitor  # noqa: E402

SKIP = 10  # first batches of each run left out (allocator and thread-pool warm-up)


class MLP(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class BatchClock(L.Callback):
    """Records each batch start; step i's time = start(i+1) - start(i)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.starts.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def time_hooks(callbacks: list[Any]) -> dict[int, float]:
    """Wrap each callback's per-batch hooks with a timer (an instance attribute, which Lightning calls instead of
    the method); returns {batch index: seconds spent in the callbacks' hooks}."""
    spent: dict[int, float] = {}
    for cb in callbacks:
        for hook in ("on_train_batch_start", "on_train_batch_end"):
            inner = getattr(cb, hook)

            def timed(*a: Any, _inner: Any = inner, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    idx = a[-1]  # batch_idx is the hooks' last positional argument
                    spent[idx] = spent.get(idx, 0.0) + time.perf_counter() - t

            setattr(cb, hook, timed)
    return spent


def make_callbacks(name: str, args: argparse.Namespace, window_at: int | None) -> list[Any]:
    never = args.steps + 10  # the first window would start after the run: only the per-batch check runs
    overlap = dict(every_n_steps=args.steps + 100, window_steps=args.window, warmup_steps=1)
    return {
        "off": [],
        "utilization": [DeviceUtilizationMonitor(log_every_n_steps=args.log_every)],
        "memory": [MemoryMonitor(log_every_n_steps=args.log_every)],
        "overlap (no window)": [CommOverlapMonitor(start_step=never, **overlap)],
        "all three": [
            DeviceUtilizationMonitor(log_every_n_steps=args.log_every),
            MemoryMonitor(log_every_n_steps=args.log_every),
            CommOverlapMonitor(start_step=never, **overlap),
        ],
        "overlap (one window)": [CommOverlapMonitor(start_step=window_at or 0, **overlap)],
    }[name]


def run_once(name: str, args: argparse.Namespace, data: TensorDataset, window_at: int | None = None) -> dict:
    clock = BatchClock()
    callbacks = make_callbacks(name, args, window_at)
    hook_s = time_hooks(callbacks)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=args.steps,
            logger=CSVLogger(root, name="bench"),
            callbacks=[clock, *callbacks],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        torch.manual_seed(0)
        trainer.fit(MLP(args.width), DataLoader(data, batch_size=args.batch_size))
    steady = [hook_s.get(i, 0.0) for i in range(SKIP, args.steps)]  # one-time set-up costs left out, as for times
    out = {"times": clock.step_times(), "hook_s_per_step": sum(steady) / len(steady)}
    for cb in callbacks:
        if isinstance(cb, CommOverlapMonitor):
            out["analysis_s"] = cb.last_analysis_s
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per configuration (interleaved)")
    p.add_argument("--width", type=int, default=768, help="MLP width (sets the step time)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--log-every", type=int, default=10, help="utilization/memory logging interval (steps)")
    p.add_argument("--window", type=int, default=3, help="measured batches per profiling window")
    p.add_argument("--out", default="benchmarks/results/callbacks.json", help="where the JSON goes")
    args = p.parse_args()
    for name in ("steps", "repeats", "width", "batch_size", "log_every", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < SKIP + 2 * (args.window + 1) + 5:
        p.error(f"--steps must be at least {SKIP + 2 * (args.window + 1) + 5} (warm-up, window and normal steps)")

    quiet_worker()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(args.steps * args.batch_size, args.width, generator=g),
        torch.randn(args.steps * args.batch_size, 1, generator=g),
    )
    configs = ["off", "utilization", "memory", "overlap (no window)", "all three"]
    times: dict[str, list[float]] = {c: [] for c in configs}
    hooks: dict[str, list[float]] = {c: [] for c in configs}
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        for c in configs:
            r = run_once(c, args, data)
            times[c] += r["times"][SKIP:]
            hooks[c].append(r["hook_s_per_step"])

    window_at = args.steps // 2
    window_runs = [run_once("overlap (one window)", args, data, window_at) for _ in range(args.repeats)]
    wall = time.perf_counter() - t0

    base_med, base_mean = statistics.median(times["off"]), statistics.fmean(times["off"])
    rows = []
    for c in configs:
        med, mean = statistics.median(times[c]), statistics.fmean(times[c])
        hook = statistics.median(hooks[c])
        rows.append(
            {
                "config": c,
                "median_step_ms": med * 1e3,
                "mean_step_ms": mean * 1e3,
                "ratio_median": med / base_med,
                "ratio_mean": mean / base_mean,
                "hook_us_per_step": hook * 1e6,
                "ratio_hooks": (base_mean + hook) / base_mean,
                "steps_measured": len(times[c]),
            }
        )
    # window: batches window_at .. window_at + 1 + window - 1 (warm-up + measured); the analysis runs in the last
    n_win = 1 + args.window
    extra, analysis = [], []
    for r in window_runs:
        t = r["times"]
        win = t[window_at : window_at + n_win]
        normal = statistics.median(t[SKIP:window_at] + t[window_at + n_win :])
        extra.append(sum(win) - n_win * normal)
        analysis.append(r.get("analysis_s", float("nan")))
    window = {
        "window_batches": n_win,
        "extra_s_per_window": statistics.median(extra),
        "analysis_s": statistics.median(analysis),
        "normal_step_ms": base_med * 1e3,
        "extra_in_normal_steps": statistics.median(extra) / base_med,
    }

    print(f"\ncallback overhead, CPU, MLP width {args.width}, batch {args.batch_size}, ", end="")
    print(f"{args.steps} steps x {args.repeats} runs (first {SKIP} steps of each left out):")
    headers = ["config", "median ms", "mean ms", "ratio(median)", "ratio(mean)", "hooks us/step", "ratio(hooks)"]
    table = [
        [
            r["config"],
            f"{r['median_step_ms']:.3f}",
            f"{r['mean_step_ms']:.3f}",
            f"{r['ratio_median']:.4f}",
            f"{r['ratio_mean']:.4f}",
            f"{r['hook_us_per_step']:.1f}",
            f"{r['ratio_hooks']:.4f}",
        ]
        for r in rows
    ]
    print(format_table(headers, table))
    print(
        f"\nprofiling window ({n_win} batches: 1 warm-up + {args.window} measured): "
        f"+{window['extra_s_per_window'] * 1e3:.1f} ms per window "
        f"(= {window['extra_in_normal_steps']:.1f} normal steps), of which analysis {window['analysis_s'] * 1e3:.1f} ms"
    )
    print(f"wall time {wall:.1f} s")

    result = {
        "benchmark": "callbacks",
        "args": vars(args),
        "overhead": rows,
        "window": window,
        "goal": "ratio <= 1.01 outside profiling windows",
        "meta": run_metadata(),
        "wall_s": wall,
    }
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()

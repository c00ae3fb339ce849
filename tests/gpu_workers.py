"""What tests/test_gpu.py runs in its launched processes (``launch`` pickles these by name), and the hand-written loop
every strategy is compared with.

Each run takes ``device``: ``"cuda"`` in the GPU tests; ``"cpu"`` in tests/test_gpu_helpers.py, which checks on any
machine that the hand-written loop does what Lightning does (same batches, optimizer, schedule, precision), so that a
difference on a GPU points at the GPU path, not at the harness.

The hand-written loop starts from the weights the strategy run had when training started and trains on the batches
it saw, in the same order: parity then checks the training math (forward, backward, optimizer, precision), not
initialization or sampling, whose random numbers differ between CPU and CUDA generators.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset
from workers import GLOBAL_BATCH, SEED, TINY_GPT, token_dataset

from example_projects.gpt.lit import GPTModule
from lightning_par import FSDP2Strategy, NDParallelStrategy, full_state_dict
from lightning_par.costs.profile import default_dtype

STEPS = 10
STRATEGIES = {"FSDP2Strategy": FSDP2Strategy, "NDParallelStrategy": NDParallelStrategy}

#: Weights' dtype after training, by precision (mixed keeps fp32 master weights).
WEIGHT_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.float32, "bf16-true": torch.bfloat16}


def _cpu(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in weights.items()}


class Recorder(Callback):
    """The weights when training starts, every batch (on the CPU), every step's loss, and the dtype the model's
    logits came out in (what the precision really ran the matmuls in)."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.losses: list[float] = []
        self.logits_dtypes: set[str] = set()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.initial = _cpu(full_state_dict(pl_module))
        pl_module.model.head.register_forward_hook(lambda mod, args, out: self.logits_dtypes.add(str(out.dtype)))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append(tuple(t.detach().cpu().clone() for t in batch))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach().float()))


def strategy_fit(strategy: Any, precision: str = "32-true", device: str = "cuda", max_steps: int = STEPS,
                 callbacks: tuple[Callback, ...] = (), ckpt_dir: str | None = None, ckpt_every: int | None = None,
                 resume_from: str | None = None, num_samples: int = 96) -> dict[str, Any]:
    """The tiny GPT trained by Lightning under ``strategy`` on one device (world size 1: NCCL on CUDA)."""
    pl.seed_everything(SEED, verbose=False)
    record = Recorder()
    all_callbacks: list[Callback] = [record, *callbacks]
    if ckpt_every:
        all_callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=ckpt_every, save_top_k=-1,
                                             filename="{step}"))
    trainer = pl.Trainer(
        accelerator=device, devices=1, strategy=strategy, precision=precision, max_steps=max_steps, logger=False,
        enable_checkpointing=bool(ckpt_every), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=all_callbacks,
        default_root_dir=ckpt_dir or os.getcwd(),
    )
    with trainer.init_module():
        model = GPTModule(**TINY_GPT)
    trainer.fit(model, DataLoader(token_dataset(num_samples), batch_size=GLOBAL_BATCH, shuffle=True),
                ckpt_path=resume_from)
    return {"losses": record.losses, "batches": record.batches, "initial": record.initial,
            "weights": _cpu(full_state_dict(model)), "global_step": trainer.global_step,
            "devices": sorted({str(p.device) for p in model.parameters()}), "logits_dtypes": record.logits_dtypes}


def precision_context(precision: str, device: str) -> contextlib.AbstractContextManager:
    """What Lightning's plugin wraps ``training_step`` in: autocast for bf16-mixed, bf16 as the default dtype for
    bf16-true (Lightning's HalfPrecision), nothing for 32-true."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    if precision == "bf16-true":
        return default_dtype(torch.bfloat16)
    if precision == "32-true":
        return contextlib.nullcontext()
    raise ValueError(f"precision={precision!r}: the hand-written loop knows 32-true, bf16-mixed and bf16-true.")


def hand_loop(initial: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str,
              device: str = "cuda", compile_blocks: bool = False) -> dict[str, Any]:
    """The same training written by hand: the GPT from ``initial``, the module's own optimizer and LR schedule, one
    optimizer step per batch, the loss as ``training_step`` computes it."""
    module = GPTModule(**TINY_GPT)
    module.configure_model()
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    module.load_state_dict(initial)
    module.to(device)
    if compile_blocks:
        for block in module.model.blocks:
            block.compile()
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with precision_context(precision, device):
            loss = module.loss(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "weights": _cpu(module.state_dict())}


def run_parity(cases: dict[str, tuple[str, dict[str, Any], str]], device: str = "cuda") -> dict[str, Any]:
    """For each case ``name -> (strategy class name, its kwargs, precision)``: the strategy run and the hand-written
    loop (compiled per block where the strategy compiles), plus a 32-true hand loop from the same start (to show
    that a bf16 run really ran in bf16).

    On CUDA both run with deterministic algorithms (``CUBLAS_WORKSPACE_CONFIG`` must be in the environment before
    CUDA starts; the test's launch sets it): the same kernels on the same inputs then give the same bits, as on the
    CPU, and what is left to differ is the GPU path of the strategy."""
    if torch.device(device).type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    out = {}
    for name, (cls, kwargs, precision) in cases.items():
        run = strategy_fit(STRATEGIES[cls](**kwargs), precision, device=device)
        hand = hand_loop(run["initial"], run["batches"], precision, device, compile_blocks=kwargs.get("compile", False))
        fp32 = hand_loop(_fp32(run["initial"]), run["batches"], "32-true", device) if precision != "32-true" else None
        out[name] = {"run": {k: v for k, v in run.items() if k != "batches"}, "hand": hand, "hand_fp32": fp32}
    return out


def _fp32(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---- checkpoints ------------------------------------------------------------------------------------------------
CKPT_SAMPLES = 40  # 5 steps per epoch: checkpoints every 3 steps fall mid-epoch


def run_checkpointed(ckpt_dir: str, device: str = "cuda") -> dict[str, Any]:
    run = strategy_fit(FSDP2Strategy(), device=device, ckpt_dir=ckpt_dir, ckpt_every=3, num_samples=CKPT_SAMPLES)
    return {k: v for k, v in run.items() if k != "batches"}


def run_resumed(path: str, device: str = "cuda") -> dict[str, Any]:
    """In a new process (new NCCL group): resume from ``path`` and train to step 10."""
    run = strategy_fit(FSDP2Strategy(), device=device, resume_from=path, num_samples=CKPT_SAMPLES)
    return {k: v for k, v in run.items() if k != "batches"}


# ---- the monitors on a GPU ----------------------------------------------------------------------------------------
class _Square(nn.Module):
    """One width x width layer (a block list of one, as lightning_par's strategies expect a model to have)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / math.sqrt(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


class Matmuls(pl.LightningModule):
    """A GPU-bound step (the one layer applied ``depth`` times to width x width rows: ~0.1 TFLOP per matmul at 4096),
    or an idle one (a tiny op, then the host sleeps): NVML's busy percentage must tell them apart. ``ballast_step``:
    that batch also allocates ``BALLAST`` bytes for a moment, so the allocator's peak of that interval is known (the
    step's own tensors: ~0.6 GiB at width 4096)."""

    BALLAST = 2 << 30

    def __init__(self, busy: bool, width: int = 4096, depth: int = 6, ballast_step: int | None = None) -> None:
        super().__init__()
        self.busy, self.depth, self.ballast_step = busy, depth, ballast_step
        self.blocks = nn.ModuleList([_Square(width)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        layer = self.blocks[0]
        x = batch[0].repeat(layer.weight.size(0) // batch[0].size(0), 1)
        if batch_idx == self.ballast_step:
            ballast = torch.empty(self.BALLAST, dtype=torch.uint8, device=self.device)
            ballast.fill_(1)
            del ballast
        if not self.busy:
            time.sleep(0.02)
            return (layer.weight[:1, :1] * x[:1, :1]).sum()
        for _ in range(self.depth):
            x = layer(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class _Rows(Dataset):
    def __init__(self, n: int, width: int) -> None:
        self.x = torch.randn(n, width, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (self.x[i],)


class DeviceProbe(Callback):
    """At the monitors' logging steps, right after them: what CUDA itself says (free/total memory, allocated)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.readings: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            free, total = torch.cuda.mem_get_info()
            self.readings[step] = {"used": float(total - free), "allocated": float(torch.cuda.memory_allocated())}


def forbid_syncs(callbacks: list[Callback], every: int) -> None:
    """Run each callback's per-batch hooks under ``torch.cuda.set_sync_debug_mode("error")``, except at logging
    steps: a device synchronization there raises, naming the hook."""
    for cb in callbacks:
        for hook in ("on_train_batch_start", "on_train_batch_end"):
            inner = getattr(cb, hook)

            def guarded(trainer: Any, *args: Any, _inner: Any = inner, _hook: str = hook, _cb: Any = cb) -> Any:
                logging = trainer.global_step % every == 0 and _hook == "on_train_batch_end"
                torch.cuda.set_sync_debug_mode("default" if logging else "error")
                try:
                    return _inner(trainer, *args)
                except RuntimeError as err:
                    raise RuntimeError(f"{type(_cb).__name__}.{_hook} at step {trainer.global_step}: {err}") from err
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            setattr(cb, hook, guarded)


def run_monitors(log_dir: str, busy: bool, steps: int = 60, every: int = 10, ballast_step: int | None = 23,
                 check_syncs: bool = False) -> dict[str, Any]:
    """The three monitors on one GPU under FSDP2Strategy (NCCL, world 1), logged to CSV; returns the logged metrics
    ({name: {step: value}}) and the probe's readings."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_par.callbacks import CommOverlapMonitor, DeviceUtilizationMonitor, MemoryMonitor

    monitors = [DeviceUtilizationMonitor(log_every_n_steps=every, nvml_interval_s=0.02),
                MemoryMonitor(log_every_n_steps=every),
                CommOverlapMonitor(start_step=steps + 10, every_n_steps=1000)]  # no window: only its per-batch check
    if check_syncs:
        forbid_syncs(monitors, every)
    probe = DeviceProbe(every)
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=FSDP2Strategy(), max_steps=steps,
                         logger=CSVLogger(log_dir, name="csv", version=0), callbacks=[*monitors, probe],
                         log_every_n_steps=every, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    width = 4096
    trainer.fit(Matmuls(busy, width, ballast_step=ballast_step),
                DataLoader(_Rows(steps * 8, width), batch_size=8, drop_last=True))
    return {"metrics": read_csv(str(Path(log_dir) / "csv" / "version_0" / "metrics.csv")), "probe": probe.readings,
            "nvml_sees_this_process": _nvml_sees_this_process()}


def _nvml_sees_this_process() -> bool:
    """Whether NVML lists this process on its GPU (not in some containers): then MemoryMonitor's "outside the
    allocator" comes from NVML, independently of ``mem_get_info``; else it falls back to ``mem_get_info`` itself."""
    try:
        import pynvml

        from lightning_par.callbacks.nvml import nvml_handle

        pynvml.nvmlInit()
        handle = nvml_handle(pynvml, torch.cuda.current_device())
        return any(p.pid == os.getpid() for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception:  # noqa: BLE001 - no NVML at all: the fallback was used
        return False


def read_csv(path: str) -> dict[str, dict[int, float]]:
    import csv

    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v != "":
                    out.setdefault(k, {})[int(row["step"])] = float(v)
    return out


# ---- a CUDA trace at NCCL world size 1 ----------------------------------------------------------------------------
COMM_ELEMENTS = 1 << 24  # 64 MiB of fp32: the all-reduce is long enough to measure


class ComputeThenAllReduce(pl.LightningModule):
    """Matmuls, then an all-reduce (AVG) of a large buffer each step: compute and communication in one trace."""

    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Square(width)])
        self.buffer: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0].repeat(self.blocks[0].weight.size(0) // batch[0].size(0), 1)
        for _ in range(4):
            x = self.blocks[0](x)
        if self.buffer is None:
            self.buffer = torch.ones(COMM_ELEMENTS, device=self.device)
        dist.all_reduce(self.buffer, op=dist.ReduceOp.AVG)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def gpu_work_of_all_reduce(op: Any) -> list[tuple[str, str]]:
    """(name, activity) of the GPU events launched from inside one NCCL all_reduce with ``op`` at world size 1,
    matched by correlation id to the launches made inside it."""
    from lightning_par.callbacks.trace import events_from_profiler

    buf = torch.ones(COMM_ELEMENTS, device="cuda")
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("probe::all_reduce"):
            dist.all_reduce(buf, op=op)
        torch.cuda.synchronize()
    events = events_from_profiler(prof)
    probe = next(e for e in events if e.name == "probe::all_reduce")
    launched = {e.correlation for e in events if not e.on_gpu and e.activity in ("cuda_runtime", "cuda_driver")
                and e.track == probe.track and probe.start <= e.start <= probe.end and e.correlation}
    return sorted({(e.name, e.activity) for e in events if e.on_gpu and e.correlation in launched})


def run_trace(export_dir: str) -> dict[str, Any]:
    """A profiling window over compute + all_reduce steps under FSDP2Strategy (NCCL, world 1)."""
    from lightning_par.callbacks import CommOverlapMonitor

    monitor = CommOverlapMonitor(start_step=3, every_n_steps=100, window_steps=3, warmup_steps=1,
                                 export_trace_dir=export_dir)
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=FSDP2Strategy(), max_steps=8, logger=False,
                         callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(ComputeThenAllReduce(), DataLoader(_Rows(64, 2048), batch_size=8))
    return {"values": monitor.last_values, "exported": monitor.exported,
            "avg_launches": gpu_work_of_all_reduce(dist.ReduceOp.AVG),
            "sum_launches": gpu_work_of_all_reduce(dist.ReduceOp.SUM)}


# ---- what the monitors cost a launch-bound step, and whether a profiling window slows the steps after it --------
class StepClock(Callback):
    """Wall time between consecutive batch starts: everything the loop does, monitors included."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


LAUNCH_BOUND_GPT = dict(TINY_GPT, n_layer=12, n_embd=256, n_head=4, block_size=64)
CLOCK_STEPS, WINDOW_AT = 200, 50  # the window: batches 50-53 (1 warm-up + 3 measured)


def run_step_clock(monitors: bool, teardown_cupti: bool = True, device: str = "cuda") -> dict[str, Any]:
    """A launch-bound GPT (12 small blocks, ~600 kernels a step) for ``CLOCK_STEPS`` steps, with the three monitors
    (one profiling window at ``WINDOW_AT``) or none; each batch's wall time."""
    from lightning_par.callbacks import CommOverlapMonitor, DeviceUtilizationMonitor, MemoryMonitor

    clock = StepClock()
    callbacks: list[Callback] = [clock]
    if monitors:
        callbacks += [DeviceUtilizationMonitor(log_every_n_steps=20), MemoryMonitor(log_every_n_steps=20),
                      CommOverlapMonitor(start_step=WINDOW_AT, every_n_steps=1000, teardown_cupti=teardown_cupti)]
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(accelerator=device, devices=1, strategy=FSDP2Strategy(), max_steps=CLOCK_STEPS,
                         logger=False, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=20)
    model = GPTModule(**{**LAUNCH_BOUND_GPT, "max_steps": CLOCK_STEPS})
    data = token_dataset(CLOCK_STEPS * GLOBAL_BATCH, seq_len=64)
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True))
    return {"times": clock.times(), "teardown_env": os.environ.get("TEARDOWN_CUPTI")}


def median_ms(times: list[float], lo: int, hi: int) -> float:
    return 1e3 * statistics.median(times[lo:hi])


# ---- context parallelism: the fused per-block CUDA kernels against the math path ----------------------------------
def emulated_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cp: int,
                          causal: bool, load_balance: bool, window: int | None = None) -> tuple[torch.Tensor, ...]:
    """Context-parallel attention of ``cp`` ranks emulated in one process, block by block exactly as
    ``techniques/context/context.py`` computes it (its block plan and sliding-window masks ``_plan``,
    ``_block_forward``, ``_merge``, ``_block_backward``), with the K/V exchange replaced by indexing. Returns the full
    (out, dq, dk, dv), joined from the shards."""
    from lightning_par.techniques.context.context_sharding import join_shards

    parts = emulated_cp_blocks(cp_shards(q, k, v, dout, cp, load_balance), cp, causal, load_balance, window)
    return tuple(join_shards(p, 2, load_balance) for p in parts)


def cp_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cp: int,
              load_balance: bool) -> list[list[torch.Tensor]]:
    """Each rank's shard of q, k, v and dout, as a run's inputs arrive (``context_sharding.shard_sequence``)."""
    from lightning_par.techniques.context.context_sharding import shard_sequence

    return [[shard_sequence(t, 2, r, cp, load_balance) for r in range(cp)] for t in (q, k, v, dout)]


def emulated_cp_blocks(shards: list[list[torch.Tensor]], cp: int, causal: bool, load_balance: bool,
                       window: int | None = None) -> tuple[list[torch.Tensor], ...]:
    """The blocks of every rank on its shards (``cp_shards``): per rank (out, dq, dk, dv), the work of the whole cp
    group without its communication."""
    from lightning_par.techniques.context import context as ctx

    qs, ks, vs, dos = shards
    scale = 1.0 / math.sqrt(qs[0].size(-1))
    n = qs[0].size(2)
    device = qs[0].device
    setups = [ctx._Setup(None, rank, cp, causal, load_balance, scale, "ring", None, window) for rank in range(cp)]
    plans = {(rank, src): ctx._plan(setups[rank], src, n, device) for rank in range(cp) for src in range(cp)}
    outs, lses = [], []
    for rank in range(cp):
        acc = ctx._acc(qs[rank])
        out = qs[rank].new_zeros((*qs[rank].shape[:3], vs[rank].size(-1)), dtype=acc)
        lse = qs[rank].new_full(qs[rank].shape[:3], float("-inf"), dtype=acc)
        for src in range(cp):
            blk, visible = plans[rank, src]
            if blk is None:
                continue
            o, m = ctx._block_forward(qs[rank][:, :, blk.q], ks[src][:, :, blk.kv], vs[src][:, :, blk.kv], scale,
                                      blk.causal, visible)
            ctx._merge(out, lse, blk.q, o, m)
        outs.append(out.to(qs[rank].dtype))  # what the autograd Function saves and returns
        lses.append(lse)
    dqs = [torch.zeros_like(x, dtype=ctx._acc(x)) for x in qs]
    dks = [torch.zeros_like(x, dtype=ctx._acc(x)) for x in ks]
    dvs = [torch.zeros_like(x, dtype=ctx._acc(x)) for x in vs]
    for rank in range(cp):
        for src in range(cp):
            blk, visible = plans[rank, src]
            if blk is None:
                continue
            r, c = blk.q, blk.kv
            gq, gk, gv = ctx._block_backward(dos[rank][:, :, r], qs[rank][:, :, r], ks[src][:, :, c], vs[src][:, :, c],
                                             outs[rank][:, :, r], lses[rank][:, :, r], scale, blk.causal, visible)
            dqs[rank][:, :, r] += gq
            dks[src][:, :, c] += gk
            dvs[src][:, :, c] += gv
    return outs, dqs, dks, dvs


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool,
                        window: int | None = None, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Plain attention in fp64 (the math formula, GQA by repeating K/V heads; a causal sliding window of ``window``
    keys; ``sinks``: a logit per head joining each softmax's denominator): (out, dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.size(1) // k.size(1)
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ kk.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        rows, cols = s.shape[-2:]
        distance = torch.arange(rows, device=s.device)[:, None] - torch.arange(cols, device=s.device)[None, :]
        hidden = (distance < 0) if window is None else (distance < 0) | (distance >= window)
        s = s.masked_fill(hidden, float("-inf"))
    if sinks is None:
        out = torch.softmax(s, dim=-1) @ vv
    else:
        sink = sinks.detach().double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        out = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1] @ vv
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


CP_CASES = [  # (cp, causal, load_balance, q heads, kv heads, global sequence length[, sliding window])
    (1, True, False, 8, 8, 512),
    (2, True, True, 8, 8, 1024),
    (4, True, True, 8, 2, 1024),
    (8, True, True, 8, 2, 2048),
    (2, False, False, 8, 8, 512),
    (4, True, False, 4, 4, 512),
    (2, True, True, 8, 8, 1024, 200),  # windows: blocks partly masked run the math path, the others the kernels
    (4, True, True, 8, 2, 1024, 100),
]


def case_name(dtype: torch.dtype, case: tuple) -> str:
    cp, causal, lb, h, hkv, seq, *window = case
    return (f"{str(dtype)[6:]}/cp{cp}/{'causal' if causal else 'full'}/{'lb' if lb else 'plain'}/h{h}kv{hkv}/s{seq}"
            + (f"/w{window[0]}" if window else ""))


class _OpsRun(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the attention kernels that ran (by op name), to tell the fused path from the math path."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name:
            self.names.add(name)
        return func(*args, **(kwargs or {}))


def cp_kernel_errors(fused: bool, device: str, dtypes: tuple[torch.dtype, ...], cases: list[tuple] = CP_CASES,
                     kernels_ran: dict[str, list[str]] | None = None) -> dict[str, float]:
    """Largest error of (out, dq, dk, dv) against fp64 attention, relative to the reference's largest magnitude, for
    every case (default ``CP_CASES``) and dtype; ``fused`` sets ``CUDA_KERNELS`` to "auto" (else "math").
    ``kernels_ran``, if given, receives the attention ops each case ran."""
    from lightning_par.techniques.context import context as ctx

    before, ctx.CUDA_KERNELS = ctx.CUDA_KERNELS, "auto" if fused else "math"
    errors = {}
    try:
        for dtype in dtypes:
            for case in cases:
                cp, causal, lb, h, hkv, seq, *window = case
                window = window[0] if window else None
                g = torch.Generator(device=device).manual_seed(0)
                q = torch.randn(2, h, seq, 64, device=device, generator=g).to(dtype)
                k, v = (torch.randn(2, hkv, seq, 64, device=device, generator=g).to(dtype) for _ in range(2))
                dout = torch.randn(2, h, seq, 64, device=device, generator=g).to(dtype)
                with _OpsRun() as ops:
                    got = emulated_cp_attention(q, k, v, dout, cp, causal, lb, window)
                want = reference_attention(q, k, v, dout, causal, window)
                err = max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
                errors[case_name(dtype, case)] = err
                if kernels_ran is not None:
                    kernels_ran[case_name(dtype, case)] = sorted(ops.names)
    finally:
        ctx.CUDA_KERNELS = before
    return errors


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def cp_kernel_seconds(fused: bool, dtype: torch.dtype = torch.bfloat16, seq: int = 4096, repeats: int = 10,
                      cp: int = 2, batch: int = 4, heads: int = 16, head_dim: int = 128) -> float:
    """Median seconds of one emulated causal, load-balanced forward + backward over ``cp`` blocks on the GPU (the
    fused kernels or the math path), all blocks in one process: the work of all ranks together, on inputs already
    sharded (a run's arrive so) and left in shards (the engine never joins them)."""
    from lightning_par.techniques.context import context as ctx

    before, ctx.CUDA_KERNELS = ctx.CUDA_KERNELS, "auto" if fused else "math"
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", generator=g).to(dtype)
                         for _ in range(4))
        shards = cp_shards(q, k, v, dout, cp, True)  # cut before the clock: a run's inputs arrive sharded
        return _median_seconds(lambda: emulated_cp_blocks(shards, cp, True, True), repeats)
    finally:
        ctx.CUDA_KERNELS = before


def sdpa_seconds(dtype: torch.dtype = torch.bfloat16, seq: int = 4096, repeats: int = 10, batch: int = 4,
                 heads: int = 16, head_dim: int = 128) -> float:
    """Median seconds of one causal ``F.scaled_dot_product_attention`` forward + backward over the whole sequence."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", generator=g).to(dtype)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
        q.grad = k.grad = v.grad = None

    return _median_seconds(step, repeats)


def run_cp_kernels() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_par.techniques.context import context as ctx

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    ran: dict[str, list[str]] = {}
    out: dict[str, Any] = {"math": cp_kernel_errors(False, "cuda", dtypes), "kernels_ran": ran, "by_kernel": {},
                           "by_kernel_ran": {}, "by_kernel_failed": {}}
    try:  # a kernel that fails is a result for the tests to name, not the end of the others' checks
        out["fused"] = cp_kernel_errors(True, "cuda", dtypes, CP_CASES, ran)
        out["seconds"] = {"math": cp_kernel_seconds(False), "fused": cp_kernel_seconds(True), "sdpa": sdpa_seconds()}
    except Exception as e:  # noqa: BLE001
        out["fused_failed"] = f"{type(e).__name__}: {e}"[:2000]
    # each fused kernel in turn, as torch.nn.attention.sdpa_kernel leaves it the only choice: every one must be exact
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        ran_here: dict[str, list[str]] = {}
        try:
            with sdpa_kernel([backend, SDPBackend.MATH]):
                out["by_kernel"][name] = cp_kernel_errors(True, "cuda", dtypes, CP_CASES, ran_here)
        except Exception as e:  # noqa: BLE001 - recorded; the test names the kernel and the error
            out["by_kernel_failed"][name] = f"{type(e).__name__}: {e}"[:2000]
        out["by_kernel_ran"][name] = ran_here
    before, ctx.SCORE_TILE_BYTES = ctx.SCORE_TILE_BYTES, 2**16  # the math path in row tiles of 64 KiB of scores
    try:
        out["tiled"] = cp_kernel_errors(False, "cuda", dtypes)
    finally:
        ctx.SCORE_TILE_BYTES = before
    return out


def run_dispatch_syncs() -> dict[str, Any]:
    """The per-rank dispatch of transformers' experts on CUDA tensors (NCCL, one rank, ep 1): the synchronizing
    CUDA operations torch reports (``torch.cuda.set_sync_debug_mode``) in its forward and backward, which should
    be the counts' one ``tolist()``, and the output against the weighted sum (each expert doubles its rows)."""
    import warnings

    from lightning_par.techniques.experts.experts import _TokenDispatch

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(64, 16, device="cuda", generator=g, requires_grad=True)
        weights, index = torch.rand(64, 8, device="cuda", generator=g).softmax(-1).topk(2, dim=1)
        weights = weights.detach().requires_grad_()
        dispatch = _TokenDispatch(dist.group.WORLD, 1)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                sent = dispatch.send_tokens(x, index, weights, 8)
                y = dispatch.combine_tokens(sent.expert_rows * 2.0, sent, x)
                y.sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        expected = 2.0 * x.detach() * weights.detach().sum(dim=1, keepdim=True)
        return {"syncs": syncs, "error": float((y.detach() - expected).abs().max())}
    finally:
        dist.destroy_process_group()


def run_cp_attention_world1(fused: bool) -> dict[str, float]:
    """The public ``context_parallel_attention`` (autograd Function, one process = cp 1) against torch's SDPA and the
    fp64 formula, bf16: plain causal (the kernels' forward and backward), a sliding window (masked blocks: the math
    path) and attention sinks (the kernels' forward, the math backward that takes lse's own gradient)."""
    import torch.nn.functional as F

    from lightning_par.techniques.context import context as ctx

    before, ctx.CUDA_KERNELS = ctx.CUDA_KERNELS, "auto" if fused else "math"
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        base = [torch.randn(2, 8, 256, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
        dout = torch.randn(2, 8, 256, 64, device="cuda", generator=g).to(torch.bfloat16)
        sinks = torch.randn(8, device="cuda", generator=g)
        cases = {
            "ours": (lambda q, k, v: ctx.context_parallel_attention(q, k, v, is_causal=True), {}),
            "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), {}),
            "ours_window": (lambda q, k, v: ctx.context_parallel_attention(q, k, v, is_causal=True, window=50),
                            {"window": 50}),
            "ours_sinks": (lambda q, k, v: ctx.context_parallel_attention(q, k, v, is_causal=True, sinks=sinks),
                           {"sinks": sinks}),
        }
        errors = {}
        for name, (attn, options) in cases.items():
            q, k, v = (t.clone().requires_grad_() for t in base)
            out = attn(q, k, v)
            out.backward(dout)
            want = reference_attention(*base, dout, causal=True, **options)
            errors[name] = max(float((a.double() - w).abs().max() / w.abs().max())
                               for a, w in zip((out.detach(), q.grad, k.grad, v.grad), want))
        return errors
    finally:
        ctx.CUDA_KERNELS = before

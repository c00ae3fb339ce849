"""Context-parallel attention: memory, time and bytes per rank against sequence length, cp = 1, 2, 4.

For each (cp, sequence length, algorithm) one rank-group runs causal, load-balanced attention fwd+bwd and reports:

- ``saved``: bytes of the tensors autograd keeps for backward (q, k, v, out, lse), counted with
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward: the per-rank activation memory of the layer.
  It should be 1/cp of cp = 1. (Transient buffers are not in it: the ring holds 2 K/V blocks at a time, the
  all-gather cp of them.) cp = 1 also shows torch's own SDPA for reference.
- ``fwd+bwd``: median wall time of a forward+backward, slowest rank. On a 2-core machine cp = 4 runs 4 ranks on
  2 cores, so its times are not a scaling measurement; per-rank compute still drops as 1/cp.
- ``comm``: bytes this rank sent (CommCounter of lightning_par.techniques.context.context) against the formula
  ring: (cp-1)*KV fwd + (cp-1)*KV + cp*dKV bwd; allgather: (cp-1)*KV fwd + (cp-1)*KV + (cp-1)*dKV bwd,
  with KV the local K+V bytes and dKV the local K+V gradient bytes in fp32.

Usage: python benchmarks/bench_context.py [--seq-lens 512 1024 2048] [--cps 1 2 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package and the shared launcher (tests/launch.py)

from launch import launch  # noqa: E402

from lightning_par.techniques.context.context import CommCounter, context_parallel_attention  # noqa: E402

ALGORITHMS = ("ring", "allgather")


def expected_bytes(algorithm: str, cp: int, kv_bytes: int, dkv_bytes: int) -> int:
    if cp == 1:
        return 0
    if algorithm == "ring":
        return 2 * (cp - 1) * kv_bytes + cp * dkv_bytes
    return 2 * (cp - 1) * kv_bytes + (cp - 1) * dkv_bytes


def saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Run ``fn`` (a forward) and return (bytes of distinct tensors saved for backward, its output)."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def measure(attn, shape: tuple[int, int, int, int], iters: int, sync) -> dict:
    """Saved bytes, comm bytes and median fwd+bwd time of ``attn(q, k, v, counter)`` on local shards."""
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape)
    counter = CommCounter()
    saved, out = saved_bytes(lambda: attn(q, k, v, counter))
    out.backward(dout)
    comm = counter.total()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        attn(q, k, v, None).backward(dout)
        times.append(time.perf_counter() - t0)
    kv = (k.numel() + v.numel()) * k.element_size()
    return {
        "saved_bytes": saved,
        "comm_bytes": comm,
        "kv_bytes": kv,
        "dkv_bytes": (k.numel() + v.numel()) * max(k.element_size(), 4),
        "time_s": statistics.median(times),
    }


def _attn(algorithm: str, group):
    def run(q, k, v, counter):
        return context_parallel_attention(
            q, k, v, group=group, is_causal=True, algorithm=algorithm, load_balance=True, comm_counter=counter
        )

    return run


def worker(cfg: dict) -> list[dict]:
    """One cp group = the whole world; every sequence length and algorithm; the slowest rank's time wins."""
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    rows = []
    try:
        for seq in cfg["seq_lens"]:
            shape = (cfg["batch"], cfg["heads"], seq // cp, cfg["head_dim"])
            for alg in ALGORITHMS:
                measure(_attn(alg, None), shape, 1, dist.barrier)  # warm-up
                r = measure(_attn(alg, None), shape, cfg["iters"], dist.barrier)
                t = torch.tensor([r["time_s"]])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append({"cp": cp, "seq_len": seq, "algorithm": alg, **r, "time_s": t.item()})
    finally:
        dist.destroy_process_group()
    return rows


def single_process(cfg: dict) -> list[dict]:
    """cp = 1 without a process group (our code, no communication), plus torch's SDPA as the reference."""
    torch.set_num_threads(1)  # the same compute per rank as the launched ranks get
    rows = []
    sdpa = lambda q, k, v, counter: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for seq in cfg["seq_lens"]:
        shape = (cfg["batch"], cfg["heads"], seq, cfg["head_dim"])
        for name, attn in (("ours", _attn("ring", None)), ("torch_sdpa", sdpa)):
            measure(attn, shape, 1, lambda: None)
            rows.append(
                {"cp": 1, "seq_len": seq, "algorithm": name, **measure(attn, shape, cfg["iters"], lambda: None)}
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "context.json")
    args = p.parse_args()
    cfg = {
        "seq_lens": args.seq_lens,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "iters": args.iters,
    }
    bad = [s for s in args.seq_lens for cp in args.cps if s % (2 * cp)]
    if bad:
        raise SystemExit(f"--seq-lens must be multiples of 2*cp for every cp in {args.cps}; bad: {sorted(set(bad))}")

    start = time.perf_counter()
    rows = []
    for cp in args.cps:
        rows += single_process(cfg) if cp == 1 else launch(cp, worker, cfg)[0]
    base = {r["seq_len"]: r for r in rows if r["cp"] == 1 and r["algorithm"] == "ours"}
    for r in rows:
        r["expected_comm_bytes"] = expected_bytes(r["algorithm"], r["cp"], r["kv_bytes"], r["dkv_bytes"])
        if r["algorithm"] == "torch_sdpa":
            r["expected_comm_bytes"] = 0
        r["saved_vs_cp1"] = r["saved_bytes"] / base[r["seq_len"]]["saved_bytes"] if r["seq_len"] in base else None

    mib = 2**20
    head = (
        f"{'cp':>3} {'seq':>6} {'algorithm':>10} {'saved MiB/rank':>15} {'vs cp1':>7} {'fwd+bwd ms':>11} "
        f"{'comm MiB/rank':>14} {'formula MiB':>12} {'match':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["cp"], r["algorithm"])):
        ratio = f"{r['saved_vs_cp1']:.3f}" if r["saved_vs_cp1"] is not None else "-"
        match = "yes" if r["comm_bytes"] == r["expected_comm_bytes"] else "NO"
        print(
            f"{r['cp']:>3} {r['seq_len']:>6} {r['algorithm']:>10} {r['saved_bytes'] / mib:>15.3f} {ratio:>7} "
            f"{r['time_s'] * 1e3:>11.1f} {r['comm_bytes'] / mib:>14.3f} {r['expected_comm_bytes'] / mib:>12.3f} "
            f"{match:>6}"
        )
    elapsed = time.perf_counter() - start
    print(
        f"\ncausal, load-balanced; batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, fp32, gloo; "
        f"{os.cpu_count()} CPU cores, 1 thread per rank; {elapsed:.0f} s"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "backend": "gloo",
        "threads_per_rank": 1,
    }
    payload = {
        "benchmark": "context_parallel_attention",
        "config": cfg,
        "environment": env,
        "memory_metric": "bytes of tensors saved for backward (saved_tensors_hooks), per rank",
        "elapsed_s": elapsed,
        "rows": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Context-parallel attention's block decomposition on one GPU against one fused SDPA call over the whole sequence.

Context parallelism splits a sequence over ``cp`` ranks and computes attention as blocks (each rank's queries
against each rank's keys), merged by their log-sum-exp. On one GPU the blocks of ALL ranks run in one process
(``tests/gpu_workers.py``'s ``emulated_cp_blocks``: the engine's own block plan, kernels and merge, the K/V
exchange replaced by indexing), so the time is the work of the whole cp group without its communication: the
cost of cutting the attention into blocks. The inputs are cut into shards before the clock starts and the results
stay in shards, as in a run (the 2026-11-27 and first 2026-11-28 runs timed the cutting and joining too: about 4 ms
of the 67 at cp 2). The goal is at most 1.15x one fused SDPA call (causal, forward +
backward), and the same result.

Rows, per kernel (``--kernels``: ``auto`` is what SDPA picks, cuDNN on an H100 or H200 with torch 2.11; ``cudnn`` and
``flash`` force one, for the unsplit call and the blocks alike): ``sdpa[k]`` (``F.scaled_dot_product_attention``,
causal), ``cp{N}[k]`` (the blocks of cp N), and ``cp2_math`` (the fp32 matmul path the engine ran before, at a
shorter sequence where it fits a step).

Usage: python benchmarks/bench_cp_kernels.py [--seq 32768] [--heads 32] [--head-dim 128] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package and the GPU test helpers

import gpu_workers as G  # noqa: E402

from benchmarks.common import run_metadata  # noqa: E402
from lightning_par._compat import sdpa_kernel_choice  # noqa: E402
from lightning_par.techniques.context import context as ctx  # noqa: E402

_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def _only(kernel: str) -> contextlib.AbstractContextManager:
    """``torch.nn.attention.sdpa_kernel`` leaving ``kernel`` the only fused choice ("auto": no restriction)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel == "auto":
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, _BACKENDS[kernel])])


def _inputs(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]


def agreement(batch: int, heads: int, seq: int, head_dim: int, cp: int) -> float:
    """Largest error of (out, dq, dk, dv) of the decomposition against SDPA's, relative to SDPA's largest value
    (both bf16: a few 2**-8 roundings apart)."""
    q, k, v, dout = _inputs(batch, heads, seq, head_dim)
    got = G.emulated_cp_attention(q, k, v, dout, cp, True, True)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    out.backward(dout)
    want = (out.detach(), qq.grad, kk.grad, vv.grad)
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want))


def _profile(batch: int, heads: int, seq: int, head_dim: int, cp: int, top: int = 15) -> dict[str, float]:
    """GPU milliseconds per kernel name over one emulated forward + backward of ``cp`` blocks, the largest ``top``:
    where the time beyond the attention kernels goes."""
    from torch.profiler import ProfilerActivity, profile

    shards = G.cp_shards(*_inputs(batch, heads, seq, head_dim), cp, True)
    G.emulated_cp_blocks(shards, cp, True, True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        G.emulated_cp_blocks(shards, cp, True, True)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:120]] = times.get(e.name[:120], 0.0) + e.time_range.elapsed_us() / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:top]) | {"(all)": sum(times.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--kernels", nargs="+", default=["auto", "cudnn", "flash"],
                   help="fused kernels, each for SDPA and the blocks alike (auto: the one SDPA picks)")
    p.add_argument("--math-seq", type=int, default=8192, help="sequence of the fp32 math-path row (0: skip)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="the first cp row's GPU time by kernel (torch.profiler)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cp_kernels.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cp_kernels.py needs a CUDA GPU")
    shape = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    start = time.perf_counter()
    rows = []

    def record(name: str, seq: int, seconds: float, base: float | None, **extra) -> None:
        row = {"row": name, "seq": seq, "ms": seconds * 1e3, "vs_sdpa": seconds / base if base else None, **extra}
        rows.append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "cp_kernels", "config": vars(args) | {"out": str(args.out)},
                                        "environment": run_metadata(), "rows": rows}, indent=2))
        ratio = f"{row['vs_sdpa']:.3f}" if row["vs_sdpa"] else "-"
        print(f"{name:>16} {seq:>7} {row['ms']:>10.2f} {ratio:>8} {extra}", flush=True)

    print(f"{'row':>16} {'seq':>7} {'ms':>10} {'vs sdpa':>8}")
    q = torch.empty(args.batch, args.heads, args.seq, args.head_dim, device="cuda", dtype=torch.bfloat16)
    print(f"SDPA's own choice for the whole sequence: {sdpa_kernel_choice(q, q, q, True)}")
    del q
    for kernel in args.kernels:
        # the same kernel for the unsplit call and the blocks: "auto" is what SDPA picks, the others are forced
        try:
            with _only(kernel):
                sdpa = G.sdpa_seconds(torch.bfloat16, args.seq, args.repeats, **shape)
                record(f"sdpa[{kernel}]", args.seq, sdpa, sdpa)
                for cp in args.cps:
                    seconds = G.cp_kernel_seconds(True, torch.bfloat16, args.seq, args.repeats, cp, **shape)
                    extra = {"error_vs_sdpa": agreement(seq=args.seq, cp=cp, **shape)}
                    if args.profile and kernel == "auto" and cp == args.cps[0]:
                        extra["cuda_time_by_kernel_ms"] = _profile(seq=args.seq, cp=cp, **shape)
                    record(f"cp{cp}[{kernel}]", args.seq, seconds, sdpa, **extra)
                    torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - one kernel's failure is a result, the others still run
            record(f"failed[{kernel}]", args.seq, float("nan"), None, error=f"{type(e).__name__}: {e}"[:1000])
            torch.cuda.empty_cache()
    if args.math_seq:
        base = G.sdpa_seconds(torch.bfloat16, args.math_seq, args.repeats, **shape)
        record("sdpa", args.math_seq, base, base)
        record("cp2_math", args.math_seq, G.cp_kernel_seconds(False, torch.bfloat16, args.math_seq, 2, 2, **shape),
               base)
    print(f"causal, load-balanced, bf16, batch {args.batch}, {args.heads} heads of {args.head_dim}; "
          f"{torch.cuda.get_device_name()}; kernels {ctx.CUDA_KERNELS!r}; {time.perf_counter() - start:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

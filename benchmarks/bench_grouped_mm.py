"""How fast mixture-of-experts experts run against how many rows each expert gets: the measurement behind the
planner's ``GroupedMatmulCurve`` (``lightning_par/devices.py``).

A layer's experts are one grouped matmul per projection (``torch.nn.functional.grouped_mm``: SwiGLU, ``x @ w_gate``
and ``x @ w_up`` then ``h @ w_down``, each expert its own slice of rows). Expert parallelism changes how many rows
each expert gets: with ``ep`` ranks, each holding ``E / ep`` experts, a rank's experts get the rows of the whole ep
group, ``tokens x top_k x ep / E`` each; without it every rank runs all ``E`` experts on its own tokens only,
``tokens x top_k / E`` rows each. Few rows make skinny matmuls that reach a small share of the device's matmul rate,
which a planner pricing FLOPs at one rate misses: it then sees no compute gain in expert parallelism at all.

For each published model's expert shape (hidden ``K``, expert width ``N``) and rows per expert ``r``, this times the
experts' forward and backward (the three grouped matmuls, SiLU and product, and their gradients for the input and
the weights) with ``G`` local experts of ``r`` rows each, against the same SwiGLU MLP as dense matmuls over
:data:`DENSE_ROWS` rows (what a dense layer of that shape sees in a micro-batch). Printed and written: TFLOP/s of
both and their ratio, the figure the planner applies to expert FLOPs.

``--hf``: the same measurement on transformers' ``Qwen3MoeExperts`` (Qwen3-30B-A3B's sizes, its ``grouped_mm``
implementation) with the rows a rank's 16 experts receive at ep 8, grouped by expert as the dispatch hands them
over, one row per choice with weight 1, the experts drawn from a random router's softmax (uneven loads, as
training has): its own forward, and ``lightning_par.techniques.experts.experts.grouped_experts``, which the engine runs
under ep (the same math without the forward's sorting and copies), against the curve at the mean rows per
expert.

    python benchmarks/bench_grouped_mm.py --device cuda --hf --out grouped_mm.json  # the GPU figures (~60 s)
    python benchmarks/bench_grouped_mm.py --quick --hf                              # the code path on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

#: label, hidden K, expert width N, experts E (the Hugging Face configs)
SHAPES = (("Qwen3-30B-A3B", 2048, 768, 128), ("gpt-oss-20b", 2880, 2880, 32),
          ("DeepSeek-V3", 7168, 2048, 256), ("Mixtral-8x7B", 4096, 14336, 8))
ROWS_PER_EXPERT = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: rows of the dense reference: a micro-batch of 4 sequences of 4,096 tokens
DENSE_ROWS = 16384
#: at most this many rows in one grouped call (the activations' memory)
MAX_ROWS = 131072


def swiglu_flops(rows: int, k: int, n: int) -> float:
    """Forward and backward of ``down(silu(x @ gate) * (x @ up))``: 3 matmuls of ``2 x rows x K x N`` FLOPs, x3."""
    return 3 * 3 * 2 * rows * k * n


def _timed(fn: Any, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _swiglu_step(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 grad: torch.Tensor, offsets: torch.Tensor | None) -> Any:
    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return a @ w if offsets is None else F.grouped_mm(a, w, offs=offsets)

    def step() -> None:
        h = F.silu(mm(x, w_gate)) * mm(x, w_up)
        mm(h, w_down).backward(grad)  # a real gradient tensor: an expanded one has strides grouped_mm refuses
        for t in (x, w_gate, w_up, w_down):
            t.grad = None

    return step


def measure(label: str, k: int, n: int, experts: int, local: int, rows: int, device: str, dtype: torch.dtype,
            warmup: int, repeats: int, dense_rate: float) -> dict[str, Any]:
    total = local * rows
    gen = torch.Generator(device=device).manual_seed(0)

    def param(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=dtype, generator=gen) * shape[-2] ** -0.5).requires_grad_()

    x = torch.randn(total, k, device=device, dtype=dtype, generator=gen).requires_grad_()
    w_gate, w_up, w_down = param(local, k, n), param(local, k, n), param(local, n, k)
    grad = torch.randn(total, k, device=device, dtype=dtype, generator=gen)
    offsets = torch.arange(1, local + 1, device=device, dtype=torch.int32) * rows
    seconds = _timed(_swiglu_step(x, w_gate, w_up, w_down, grad, offsets), device, warmup, repeats)
    rate = swiglu_flops(total, k, n) / seconds
    return {"model": label, "hidden": k, "expert_width": n, "experts": experts, "local_experts": local,
            "rows_per_expert": rows, "rows": total, "seconds": seconds, "tflops_per_s": rate / 1e12,
            "dense_tflops_per_s": dense_rate / 1e12, "ratio": rate / dense_rate}


def dense_rate(k: int, n: int, device: str, dtype: torch.dtype, warmup: int, repeats: int, rows: int) -> float:
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen).requires_grad_()
    ws = [(torch.randn(*s, device=device, dtype=dtype, generator=gen) * s[0] ** -0.5).requires_grad_()
          for s in ((k, n), (k, n), (n, k))]
    grad = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
    return swiglu_flops(rows, k, n) / _timed(_swiglu_step(x, *ws, grad, None), device, warmup, repeats)


def measure_hf(rows: int, local: int, hidden: int, width: int, device: str, dtype: torch.dtype, warmup: int,
               repeats: int, dense: float) -> dict[str, Any]:
    """transformers' Qwen3-MoE experts called as the engine calls them under ep (:mod:`lightning_par.techniques.experts.
    experts`): ``rows`` routed rows, each with its local expert (of ``local``) and weight 1."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from lightning_par.devices import H100_GROUPED_MM
    from lightning_par.techniques.experts.experts import grouped_experts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=local)
    config._experts_implementation = "grouped_mm"
    experts = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=hidden ** -0.5)
    gen = torch.Generator(device=device).manual_seed(2)
    logits = torch.randn(local, device=device, generator=gen)  # an uneven router: some experts get more rows
    # grouped by expert, as the dispatch hands them over
    index = torch.multinomial(logits.softmax(0), rows, replacement=True, generator=gen).sort().values.unsqueeze(1)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    ones = torch.ones(rows, 1, device=device, dtype=dtype)
    grad = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen)

    def step(forward: Any) -> Any:
        def run() -> None:
            forward().backward(grad)
            x.grad = None
            for w in experts.parameters():
                w.grad = None
        return run

    transformers_s = _timed(step(lambda: experts(x, index, ones)), device, warmup, repeats)
    engine_s = _timed(step(lambda: grouped_experts(experts, x, index[:, 0])), device, warmup, repeats)
    flops = swiglu_flops(rows, hidden, width)
    return {"model": "Qwen3-30B-A3B (transformers' experts)", "hidden": hidden,
            "expert_width": width, "local_experts": local, "rows": rows, "rows_per_expert": rows / local,
            "seconds": transformers_s, "tflops_per_s": flops / transformers_s / 1e12,
            "dense_tflops_per_s": dense / 1e12,
            "ratio": flops / transformers_s / dense, "engine_seconds": engine_s,
            "engine_ratio": flops / engine_s / dense, "curve": H100_GROUPED_MM.rate(rows / local, local, width)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="small shapes, few rows (the code path, on the CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hf", action="store_true",
                        help="also time transformers' Qwen3-MoE experts as the engine calls them (see above)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes, rows_list, dense_rows = SHAPES, ROWS_PER_EXPERT, DENSE_ROWS
    if args.quick:
        shapes, rows_list, dense_rows = (("tiny", 64, 32, 8),), (16, 64), 256
    results = []
    for label, k, n, experts in shapes:
        reference = dense_rate(k, n, args.device, dtype, args.warmup, args.repeats, dense_rows)
        # the experts of one rank at ep 8 (the published runs' layout), and all of them (no expert parallelism)
        # (all of DeepSeek-V3's 256 would not fit with their gradients)
        for local in sorted({max(1, experts // 8), experts if experts <= 128 else experts // 8}):
            for rows in rows_list:
                if local * rows > MAX_ROWS:
                    continue
                row = measure(label, k, n, experts, local, rows, args.device, dtype, args.warmup, args.repeats,
                              reference)
                results.append(row)
                print(f"{label:14s} K={k:5d} N={n:5d} G={local:3d} rows/expert={rows:5d}: "
                      f"{row['tflops_per_s']:7.1f} TFLOP/s, dense {row['dense_tflops_per_s']:7.1f}, "
                      f"ratio {row['ratio']:.3f}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    hf_rows = []
    if args.hf:
        hidden, width, local = (2048, 768, 16) if not args.quick else (64, 32, 4)
        reference = dense_rate(hidden, width, args.device, dtype, args.warmup, args.repeats, dense_rows)
        for rows_per_expert in (rows_list if not args.quick else (16, 64)):
            row = measure_hf(rows_per_expert * local, local, hidden, width, args.device, dtype, args.warmup,
                             args.repeats, reference)
            hf_rows.append(row)
            print(f"transformers' experts G={local} rows/expert={rows_per_expert:5d}: {row['tflops_per_s']:7.1f} "
                  f"TFLOP/s, ratio {row['ratio']:.3f}; the engine's grouped_experts {row['engine_ratio']:.3f}; "
                  f"curve {row['curve']:.3f}", flush=True)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."), "dense_rows": dense_rows}
    if args.hf:
        import transformers

        meta["transformers"] = transformers.__version__
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"metadata": meta, "rows": results, "transformers_experts": hf_rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Context-parallel attention: bytes per rank, saved activations and time of ring, all-gather, Ulysses and the hybrid.

For each (world = cp, sequence length, key/value heads, variant) the ranks run causal, load-balanced attention
forward + backward on their shards and report:

- ``comm``: bytes this rank sent, forward + backward (the ``CommCounter`` of
  ``lightning_par.techniques.context.context``, by ``"<phase>/<op>"``), against the formula (``expected``):

  * ``ring``: ``2 (cp-1) KV + cp dKV`` (K/V around the ring forward, again backward with dK/dV travelling along);
  * ``allgather``: ``2 (cp-1) KV + (cp-1) dKV`` (all-gather forward, again backward, reduce-scatter of dK/dV);
  * ``ulysses`` (all-to-all over the ``u = cp`` ranks): each all-to-all sends ``(u-1)/u`` of its tensor: q, k', v'
    and the output forward, their gradients backward, so ``2 (u-1)/u (Q + r KV + O)``, with ``k' = k`` repeated
    ``r = kv_repeats(H, Hkv, u)`` times (grouped-query attention with fewer key/value heads than ``u`` ranks);
  * the hybrid ``ulysses{u}x{ring|allgather}``: the all-to-all inside groups of ``u`` consecutive ranks, then the
    ring (all-gather) over the ``cp/u`` groups, of the gathered ``k', v'``: the Ulysses bytes at ``u`` plus the
    ring's (all-gather's) at ``cp/u`` with ``KV' = r KV``;

  with ``Q``, ``O``, ``KV`` this rank's local q, output and k+v bytes (``S/cp`` tokens) and ``dKV`` the K/V gradient
  bytes in fp32 (the ring and the reduce-scatter carry fp32 accumulators).
  Per rank the ring moves ``O(S d)`` whatever cp (every key passes every rank), Ulysses ``O(S d / cp)``.
- ``saved``: bytes of the tensors autograd keeps for backward (q, k, v, out, lse after any all-to-all), counted with
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward: the per-rank activation memory of the layer.
  Transient buffers are not in it (the ring holds 2 K/V blocks at a time, the all-gather cp of them).
- ``fwd+bwd``: median wall time of a forward + backward (the variants' passes taking turns), the slowest rank's;
  ``tokens/s`` = the whole sequence's tokens (batch x seq) over it. On a 2-core machine world 4 runs 4 ranks on
  2 cores: its times are not a scaling measurement.
- world 1 (one process, no process group): our engine at cp = 1 and torch's SDPA, the reference for ``saved``.

Ulysses splits the heads: it needs ``u`` to divide the query heads (rows it cannot run are listed as skipped).

CPU (default): gloo, fp32, 1 thread per rank. With CUDA (or ``--device cuda``): NCCL, one GPU per rank, bf16,
worlds up to the number of GPUs, fused kernels; defaults sized for tokens/s at 32k and more.

Usage: python benchmarks/bench_context.py [--world 1 2 4] [--seq 2048] [--heads 8] [--kv-heads 8 2]
       [--head-dim 64] [--hybrid 2] [--iters 3] [--device cpu|cuda] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package and the shared launcher (tests/launch.py)

from benchmarks.common import format_table, launch, run_metadata, write_json  # noqa: E402
from lightning_par.techniques.context.context import CommCounter, context_parallel_attention  # noqa: E402
from lightning_par.techniques.context.ulysses import kv_repeats  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------------------------
# The variants and their formulas


def variants(cp: int, hybrid: list[int]) -> list[tuple[str, str, int]]:
    """(name, algorithm over the ring group, Ulysses size) of every variant at ``cp``."""
    out = [("ring", "ring", 1), ("allgather", "allgather", 1), ("ulysses", "ulysses", cp)]
    for u in hybrid:
        if 1 < u < cp and cp % u == 0:
            out += [(f"ulysses{u}x{alg}", alg, u) for alg in ("ring", "allgather")]
    return out


def _ring_bytes(algorithm: str, size: int, kv: int, dkv: int) -> int:
    if size == 1:
        return 0
    if algorithm == "ring":
        return 2 * (size - 1) * kv + size * dkv
    return 2 * (size - 1) * kv + (size - 1) * dkv


def expected_bytes(algorithm: str, cp: int, ulysses: int, heads: int, kv_heads: int, q_bytes: int, k_bytes: int,
                   elem: int) -> dict[str, int]:
    """Bytes one rank sends, forward + backward, by part: ``all_to_all`` (Ulysses) and ``ring`` (the K/V exchange
    over the ring group, ring or all-gather). ``q_bytes``/``k_bytes``: this rank's local q and k (v as k, the
    output as q); ``elem``: their element size (the ring's dK/dV travel in fp32 at least)."""
    if cp == 1:
        return {"all_to_all": 0, "ring": 0}
    u = ulysses
    r = kv_repeats(heads, kv_heads, u) if u > 1 else 1
    a2a = 0
    if u > 1:  # each tensor: (u-1)/u of it, floored as the counter does; q, k', v', out forward, gradients backward
        a2a = 2 * sum(b * (u - 1) // u for b in (q_bytes, r * k_bytes, r * k_bytes, q_bytes))
    kv = 2 * r * k_bytes
    dkv = kv * max(elem, 4) // elem
    ring = _ring_bytes("allgather" if algorithm == "allgather" else "ring", cp // u, kv, dkv)
    return {"all_to_all": a2a, "ring": ring}


# ----------------------------------------------------------------------------------------------------------------
# Measuring one variant on this rank


def saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Run ``fn`` (a forward) and return (bytes of distinct tensors saved for backward, its output)."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def measure(attns: dict, cfg: dict, local_seq: int, kv_heads: int, sync) -> dict[str, dict]:
    """Saved bytes, bytes sent and median fwd+bwd time of each ``attns[name](q, k, v, counter)`` on random local
    shards. The timed passes take turns (one of every variant a round), so that a burst of load from other jobs on
    the shared machine falls on all variants alike, not on one."""
    device, dtype = torch.device(cfg["device_str"]), DTYPES[cfg["dtype"]]
    b, h, d = cfg["batch"], cfg["heads"], cfg["head_dim"]

    def make(heads: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(b, heads, local_seq, d, device=device, dtype=dtype, requires_grad=grad)

    q, k, v = make(h), make(kv_heads), make(kv_heads)
    dout = make(h, False)
    results = {}
    for name, attn in attns.items():  # the counted pass: bytes sent and saved (a warm-up too)
        counter = CommCounter()
        sync()
        saved, out = saved_bytes(lambda attn=attn, counter=counter: attn(q, k, v, counter))
        out.backward(dout)
        del out
        results[name] = {
            "saved_bytes": saved,
            "comm_bytes": counter.total(),
            "comm_forward_bytes": counter.total("forward"),
            "comm_backward_bytes": counter.total("backward"),
            "comm_by_op": dict(counter.bytes),
            "q_bytes": q.numel() * q.element_size(),
            "k_bytes": k.numel() * k.element_size(),
            "elem_bytes": q.element_size(),
            "times_s": [],
        }
    for i in range(cfg["warmup"] + cfg["iters"]):
        for name, attn in attns.items():
            sync()
            t0 = time.perf_counter()
            attn(q, k, v, None).backward(dout)
            sync()
            if i >= cfg["warmup"]:
                results[name]["times_s"].append(time.perf_counter() - t0)
    for r in results.values():
        r["time_s"] = statistics.median(r["times_s"])
    return results


def _attn(algorithm: str, group, ulysses_group=None):
    def run(q, k, v, counter):
        return context_parallel_attention(
            q, k, v, group=group, is_causal=True, algorithm=algorithm, load_balance=True, comm_counter=counter,
            ulysses_group=ulysses_group,
        )

    return run


def _hybrid_groups(cp: int, u: int, rank: int) -> tuple:
    """(ring group, Ulysses group) of ``rank``: all-to-all over ``u`` consecutive ranks, the ring over the ranks with
    the same member index. Every rank creates every group, in the same order (``dist.new_group``'s rule)."""
    pieces = [dist.new_group(list(range(g * u, (g + 1) * u))) for g in range(cp // u)]
    rings = [dist.new_group(list(range(m, cp, u))) for m in range(u)]
    return rings[rank % u], pieces[rank // u]


def worker(cfg: dict) -> list[dict]:
    """One cp group = the whole world; every sequence length, key/value head count and variant; the slowest rank's
    time wins."""
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        cfg = {**cfg, "device_str": f"cuda:{torch.cuda.current_device()}"}
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    rows = []
    try:
        hybrid = {u: _hybrid_groups(cp, u, rank) for u in cfg["hybrid"] if 1 < u < cp and cp % u == 0}
        for seq in cfg["seq"]:
            for kv_heads in cfg["kv_heads"]:
                attns, meta = {}, {}
                for name, alg, u in variants(cp, cfg["hybrid"]):
                    meta[name] = {"world": cp, "cp": cp, "seq_len": seq, "kv_heads": kv_heads, "variant": name,
                                  "algorithm": alg, "ulysses": u, "ring_size": cp // u}
                    if u > 1 and cfg["heads"] % u:
                        rows.append({**meta[name], "skipped": f"{cfg['heads']} query heads do not split over {u} "
                                                              "ranks"})
                        continue
                    attns[name] = _attn(alg, None) if u == 1 or alg == "ulysses" else _attn(alg, *hybrid[u])
                for name, r in measure(attns, cfg, seq // cp, kv_heads, sync).items():
                    t = torch.tensor([r["time_s"]], device=cfg["device_str"])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    hi = torch.tensor([r["comm_bytes"], r["saved_bytes"]], dtype=torch.float64,
                                      device=cfg["device_str"])
                    lo = hi.clone()
                    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
                    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
                    rows.append({**meta[name], **r, "time_s": t.item(), "comm_bytes_max_rank": int(hi[0]),
                                 "comm_bytes_min_rank": int(lo[0]), "saved_bytes_max_rank": int(hi[1])})
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return rows


def single_process(cfg: dict) -> list[dict]:
    """cp = 1 without a process group (our engine, no communication), plus torch's SDPA as the reference."""
    if cfg["device"] == "cuda":
        cfg = {**cfg, "device_str": "cuda:0"}
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(1)  # the same compute per rank as the launched ranks get
        sync = lambda: None  # noqa: E731
    rows = []
    for seq in cfg["seq"]:
        for kv_heads in cfg["kv_heads"]:
            gqa = kv_heads != cfg["heads"]

            def sdpa(q, k, v, counter, gqa=gqa):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

            attns = {"cp1_ours": _attn("ring", None), "torch_sdpa": sdpa}
            for name, r in measure(attns, cfg, seq, kv_heads, sync).items():
                rows.append({"world": 1, "cp": 1, "seq_len": seq, "kv_heads": kv_heads, "variant": name,
                             "algorithm": name, "ulysses": 1, "ring_size": 1, **r,
                             "comm_bytes_max_rank": 0, "comm_bytes_min_rank": 0,
                             "saved_bytes_max_rank": r["saved_bytes"]})
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The table


def annotate(rows: list[dict], cfg: dict) -> None:
    """Expected bytes, ratios to the ring at the same (cp, seq, kv heads) and to cp = 1, tokens/s."""
    ring = {(r["cp"], r["seq_len"], r["kv_heads"]): r for r in rows if r["variant"] == "ring" and "skipped" not in r}
    base = {(r["seq_len"], r["kv_heads"]): r for r in rows if r["variant"] == "cp1_ours"}
    for r in rows:
        if "skipped" in r:
            continue
        if r["cp"] == 1:
            parts = {"all_to_all": 0, "ring": 0}
        else:
            parts = expected_bytes(r["algorithm"], r["cp"], r["ulysses"], cfg["heads"], r["kv_heads"],
                                   r["q_bytes"], r["k_bytes"], r["elem_bytes"])
        r["expected_by_part"] = parts
        r["expected_comm_bytes"] = sum(parts.values())
        r["comm_matches_formula"] = r["comm_bytes"] == r["expected_comm_bytes"]
        r["kv_repeats"] = kv_repeats(cfg["heads"], r["kv_heads"], r["ulysses"]) if r["ulysses"] > 1 else 1
        r["tokens_per_s"] = cfg["batch"] * r["seq_len"] / r["time_s"]
        key = (r["cp"], r["seq_len"], r["kv_heads"])
        ref = ring.get(key)
        r["comm_vs_ring"] = r["comm_bytes"] / ref["comm_bytes"] if ref and ref["comm_bytes"] else None
        r["time_vs_ring"] = r["time_s"] / ref["time_s"] if ref else None
        b = base.get((r["seq_len"], r["kv_heads"]))
        r["saved_vs_cp1"] = r["saved_bytes"] / b["saved_bytes"] if b else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    mib = 2**20
    order = {"cp1_ours": 0, "torch_sdpa": 1, "ring": 2, "allgather": 3, "ulysses": 4}
    body = []
    for r in sorted(rows, key=lambda r: (r["seq_len"], -r["kv_heads"], r["cp"], order.get(r["variant"], 5),
                                         r["ulysses"], r["algorithm"] != "ring")):
        if "skipped" in r:
            body.append([r["cp"], r["seq_len"], r["kv_heads"], r["variant"]] + ["-"] * 3 + ["skipped"] + ["-"] * 6)
            continue
        body.append([
            r["cp"], r["seq_len"], r["kv_heads"], r["variant"], r["kv_repeats"],
            f"{r['comm_bytes'] / mib:.2f}", f"{r['expected_comm_bytes'] / mib:.2f}",
            "yes" if r["comm_matches_formula"] else "NO", _fmt(r["comm_vs_ring"], ".2f"),
            f"{r['saved_bytes'] / mib:.2f}", _fmt(r["saved_vs_cp1"], ".3f"),
            f"{r['time_s'] * 1e3:.0f}", _fmt(r["time_vs_ring"], ".2f"), f"{r['tokens_per_s']:,.0f}",
        ])
    heads = ["cp", "seq", "kv heads", "variant", "kv rep", "sent MiB/rank", "formula MiB", "match", "sent/ring",
             "saved MiB/rank", "saved/cp1", "fwd+bwd ms", "time/ring", "tokens/s"]
    skipped = sorted({f"cp{r['cp']} {r['variant']}: {r['skipped']}" for r in rows if "skipped" in r})
    return format_table(heads, body) + "".join(f"\nskipped {s}" for s in skipped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, nargs="+", help="cp sizes (world 1: one process, our engine and SDPA); "
                   "default 1 2 4 on the CPU, 1 and the powers of 2 up to the GPUs on CUDA")
    p.add_argument("--seq", type=int, nargs="+", help="global sequence lengths; default 2048 (CPU), 32768 65536")
    p.add_argument("--heads", type=int, help="query heads; default 8 (CPU), 32 (CUDA)")
    p.add_argument("--kv-heads", type=int, nargs="+", help="key/value head counts (GQA); default: heads and 2 "
                   "(CPU), heads and 8 (CUDA)")
    p.add_argument("--head-dim", type=int, help="default 64 (CPU), 128 (CUDA)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hybrid", type=int, nargs="+", default=[2], help="Ulysses sizes of the hybrid rows")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default fp32 (CPU), bf16 (CUDA)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, help="untimed passes after the counted one (itself a warm-up); default 0 "
                   "(CPU), 1 (CUDA)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    gpus = torch.cuda.device_count() if cuda else 0
    worlds = args.world or ([1] + [w for w in (2, 4, 8, 16) if w <= gpus] if cuda else [1, 2, 4])
    heads = args.heads or (32 if cuda else 8)
    cfg = {
        "device": args.device,
        "device_str": "cpu",
        "dtype": args.dtype or ("bf16" if cuda else "fp32"),
        "seq": args.seq or ([32768, 65536] if cuda else [2048]),
        "batch": args.batch,
        "heads": heads,
        "kv_heads": args.kv_heads or sorted({heads, 8 if cuda else 2}, reverse=True),
        "head_dim": args.head_dim or (128 if cuda else 64),
        "hybrid": args.hybrid,
        "iters": args.iters,
        "warmup": args.warmup if args.warmup is not None else int(cuda),
    }
    if cuda and max(worlds) > gpus:
        raise SystemExit(f"--world {max(worlds)} needs that many GPUs (NCCL, one per rank); {gpus} here")
    bad = [s for s in cfg["seq"] for w in worlds if s % (2 * w)]
    if bad:
        raise SystemExit(f"--seq must be multiples of 2*world for every world in {worlds}; bad: {sorted(set(bad))}")
    bad = [h for h in cfg["kv_heads"] if heads % h]
    if bad:
        raise SystemExit(f"--kv-heads {bad} must divide --heads {heads}")
    date = time.strftime("%Y-%m-%d", time.gmtime())
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"context_{'gpu' if cuda else 'cpu'}_world{'-'.join(map(str, worlds))}_{date}.json")

    start = time.perf_counter()
    rows: list[dict] = []
    for w in worlds:
        t0 = time.perf_counter()
        rows += single_process(cfg) if w == 1 else launch(w, worker, cfg, timeout=3600)[0]
        print(f"world {w}: {time.perf_counter() - t0:.0f} s", flush=True)
    annotate(rows, cfg)
    elapsed = time.perf_counter() - start
    print()
    print(table(rows))
    machine = (torch.cuda.get_device_name() + f", NCCL, {gpus} GPUs" if cuda
               else f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank")
    print(f"\ncausal, load-balanced; batch {cfg['batch']}, {heads} heads of {cfg['head_dim']}, {cfg['dtype']}; "
          f"{machine}; torch {torch.__version__}; {elapsed:.0f} s")
    mismatched = [r for r in rows if "skipped" not in r and not r["comm_matches_formula"]]
    if mismatched:
        print(f"{len(mismatched)} rows sent other bytes than the formula: " + ", ".join(
            f"cp{r['cp']} {r['variant']} kv{r['kv_heads']} ({r['comm_bytes']} vs {r['expected_comm_bytes']})"
            for r in mismatched))
    payload = {
        "benchmark": "context_parallel_attention",
        "date": date,
        "config": {k: v for k, v in cfg.items() if k != "device_str"} | {"worlds": worlds},
        "environment": run_metadata() | {"backend": "nccl" if cuda else "gloo", "machine": machine,
                                         "device_name": torch.cuda.get_device_name() if cuda else None,
                                         "threads_per_rank": None if cuda else 1},
        "memory_metric": "bytes of tensors saved for backward (saved_tensors_hooks), per rank (this rank: rank 0; "
                         "saved_bytes_max_rank: the largest)",
        "comm_metric": "bytes this rank sent, forward + backward (CommCounter: collectives at what a bandwidth-optimal "
                       "implementation sends per rank); comm_bytes: rank 0's, *_max_rank / *_min_rank over ranks",
        "time_metric": "median forward + backward wall time, the slowest rank's; tokens_per_s = batch * seq / it",
        "elapsed_s": elapsed,
        "rows": rows,
    }
    print(f"wrote {write_json(out, payload)}")


if __name__ == "__main__":
    main()

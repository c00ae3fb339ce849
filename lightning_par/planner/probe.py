"""Measure the hardware on the spot, in a few seconds: matmul throughput at the model's shapes and all-reduce
bandwidth and latency over each group the layouts would communicate in. The result is a
:class:`~lightning_par.devices.Hardware`, the same on every rank, so that every rank plans the same.

Under ``torch.distributed`` every rank measures at the same time, so ranks that share a CPU or a GPU measure what
each of them gets (4 processes on 2 cores: about half of what one process alone gets), which is what a layout of
that many ranks will get too. Each probe keeps within its ``seconds`` budget: matmul shapes too large for it are
cut along ``m`` (the token dimension; the inner dimensions, which set the efficiency, stay), and the collective
probe sizes its repetitions from a first timing every member agrees on.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_par.devices import (
    BANDWIDTH_SHARE,
    DEVICES,
    H100_GROUPED_MM,
    MATMUL_STEP_SHARE,
    Hardware,
    cp_attention_rate,
    find_device,
)
from lightning_par.techniques.context import context

Shape = tuple[int, int, int]


def probe_shapes(profile: Any) -> list[Shape]:
    """The model's own matmul sizes for the throughput probe: its residual width by 4x that, at the traced tokens."""
    width = max(1, profile.hidden_bytes // profile.hidden_itemsize)
    tokens = max(1, min(profile.tokens, 4096))
    return [(tokens, width, 4 * width), (tokens, 4 * width, width)]


def precision_family(precision: str) -> str:
    """"bf16", "fp16" or "fp32": the matmuls a Trainer precision flag runs."""
    return "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"


def probe_dtype(precision: str) -> torch.dtype:
    """The dtype the throughput probe runs its matmuls in for a Trainer precision flag."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_family(precision), torch.float32)

#: all-reduce message sizes in bytes (small: latency, the two larger: bandwidth), per device type. Accelerator links
#: need large messages before bandwidth dominates (NVLink: 256 MiB take about 1 ms against tens of us of latency).
CPU_SIZES = (1 << 10, 1 << 20, 1 << 22)
ACCELERATOR_SIZES = (1 << 12, 1 << 24, 1 << 28)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _check_seconds(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"seconds={seconds!r} must be a positive number (the probe's time budget).")
    return float(seconds)


def _check_shapes(shapes: Sequence[Shape]) -> list[Shape]:
    ok = isinstance(shapes, Sequence) and len(shapes) > 0 and all(
        isinstance(s, Sequence) and len(s) == 3 and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                        for d in s) for s in shapes)
    if not ok:
        raise ValueError(f"shapes={shapes!r} must be a non-empty list of (m, k, n) positive ints: the matmuls "
                         "(m x k) @ (k x n) of the model, e.g. [(batch * seq, d_model, 4 * d_model)].")
    return [tuple(s) for s in shapes]


def _fit_to_budget(shapes: list[Shape], device: torch.device, dtype: torch.dtype, seconds: float) -> list[Shape]:
    """Cut ``m`` of the shapes whose one matmul would take more than a fifth of the budget over their number (a
    warm-up and a few timed rounds must fit). The speed is estimated on square matmuls grown from 256 until one
    takes a two-hundredth of the budget (or reaches 4096, where accelerators run near their best): small ones
    underestimate it, so the cut errs on the short side."""
    size = 256
    while True:
        a = torch.ones(size, size, device=device, dtype=dtype)
        torch.matmul(a, a)
        _sync(device)
        start = time.perf_counter()
        torch.matmul(a, a)
        _sync(device)
        took = max(time.perf_counter() - start, 1e-9)
        if took >= seconds / 200 or size >= 4096:
            break
        size *= 2
    estimate = 2 * size**3 / took
    per_shape = seconds / (5 * len(shapes))
    return [(max(1, min(m, int(per_shape * estimate / (2 * k * n)))), k, n) for m, k, n in shapes]


def probe_matmul(device: torch.device, dtype: torch.dtype, shapes: Sequence[Shape], seconds: float = 1.0) -> float:
    """Achieved FLOP/s of ``torch.matmul`` at the model's shapes, ``(m x k) @ (k x n)`` each, run in turn for about
    ``seconds`` (warm-up included in the budget, excluded from the figure; accelerator work synchronized)."""
    return probe_matmul_sets(device, dtype, [shapes], seconds)[0]


def probe_matmul_sets(device: torch.device, dtype: torch.dtype, sets: Sequence[Sequence[Shape]],
                      seconds: float = 1.0) -> list[float]:
    """``probe_matmul`` of each set of shapes, the sets' rounds interleaved within the one budget, so that each set
    meets the same machine (a shared CPU's share of it drifts from second to second)."""
    seconds = _check_seconds(seconds)
    device = torch.device(device)
    begin = time.perf_counter()
    checked = [_check_shapes(shapes) for shapes in sets]
    if not checked:
        raise ValueError("sets=[] leaves nothing to measure: pass one list of (m, k, n) shapes or more.")
    every = _fit_to_budget([s for shapes in checked for s in shapes], device, dtype, seconds)
    fitted, offset = [], 0
    for shapes in checked:
        fitted.append(every[offset:offset + len(shapes)])
        offset += len(shapes)
    # constant operands: a matmul's speed does not depend on the values, and 1/sqrt(k) keeps fp16 sums finite
    operands = [[(torch.full((m, k), k**-0.5, device=device, dtype=dtype),
                  torch.full((k, n), k**-0.5, device=device, dtype=dtype)) for m, k, n in shapes] for shapes in fitted]
    outputs = [[torch.matmul(a, b) for a, b in pairs] for pairs in operands]  # warm-up: allocations, kernel choice
    _sync(device)
    flops_per_round = [sum(2 * m * k * n for m, k, n in shapes) for shapes in fitted]
    deadline = begin + seconds
    spent = [0.0] * len(fitted)
    rounds = 0
    while True:
        for i, (pairs, outs) in enumerate(zip(operands, outputs)):
            start = time.perf_counter()
            for (a, b), out in zip(pairs, outs):
                torch.matmul(a, b, out=out)
            _sync(device)
            spent[i] += time.perf_counter() - start
        rounds += 1
        if time.perf_counter() >= deadline:
            return [rounds * f / max(t, 1e-9) for f, t in zip(flops_per_round, spent)]


def split_for_tp(shapes: Sequence[Shape], tp: int) -> list[Shape]:
    """The model's matmuls as tensor parallelism of degree ``tp`` leaves them on a rank: each one's larger inner
    dimension divided by ``tp`` (a column-parallel layer splits its outputs, ``n``; a row-parallel one its inputs,
    ``k``; the model's up- and down-projections are both the larger side)."""
    return [(m, k, max(1, n // tp)) if n >= k else (m, max(1, k // tp), n) for m, k, n in shapes]


# ---------------------------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------------------------
def fit_ring(n: int, sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s per hop) of the ring model ``t = latency * 2(n-1) + bytes * 2(n-1)/n /
    bandwidth`` from all-reduce times at two or more sizes: a straight line ``t = a + b * bytes`` fitted to relative
    errors (so the small message sets ``a`` and the large ones ``b``). Noise that makes ``b`` or ``a`` non-positive
    falls back to the largest message as all bandwidth, or the smallest as all latency."""
    if n < 2:
        return math.inf, 0.0
    t = [max(float(x), 1e-9) for x in times]
    w = [1 / x**2 for x in t]
    sw = sum(w)
    sx = sum(wi * si for wi, si in zip(w, sizes))
    sy = sum(wi * ti for wi, ti in zip(w, t))
    sxx = sum(wi * si * si for wi, si in zip(w, sizes))
    sxy = sum(wi * si * ti for wi, si, ti in zip(w, sizes, t))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    if not slope > 0:
        slope = t[-1] / sizes[-1]
    fixed = (sy - slope * sx) / sw
    if not fixed > 0:
        fixed = t[0]
    hops = 2 * (n - 1)
    return hops / n / slope, fixed / hops


def _member(group: dist.ProcessGroup | None) -> bool:
    return dist.get_rank(group) >= 0


def _time_all_reduce(
    group: dist.ProcessGroup | None, device: torch.device, sizes: Sequence[int], budget: float
) -> list[float]:
    """Median seconds of one all-reduce per size over this group. The repetitions come from a first timing that
    the members agree on (their maximum), so that every member runs the same number of collectives."""
    buffers = [torch.zeros(max(1, size // 4), dtype=torch.float32, device=device) for size in sizes]
    dist.all_reduce(buffers[0], group=group)  # connection set-up, not timed
    first = []
    for buf in buffers:
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        _sync(device)
        first.append(time.perf_counter() - start)
    agreed = torch.tensor(first, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    medians = []
    for buf, once in zip(buffers, agreed.tolist()):
        reps = int(min(50, max(3, budget / len(sizes) / max(once, 1e-9))))
        samples = []
        for _ in range(reps):
            _sync(device)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    return medians


def probe_collectives(
    groups: dict[str, dist.ProcessGroup | None],
    device: torch.device,
    seconds: float = 2.0,
    sizes: Sequence[int] | None = None,
) -> dict[str, tuple[float, float]]:
    """Collective over the default group: ``{name: (bandwidth bytes/s, latency s per hop)}`` of each named group,
    fitted to the ring model (:func:`fit_ring`) from all-reduce times at three message sizes.

    Every rank passes the same names (a name may stand for a different group on each rank, e.g. "intra" for the
    ranks of its own node; groups of one name run at the same time, as they would in training; a rank outside a
    name's group contributes nothing). The median time per size is taken per rank, then the maximum over all ranks
    (one all-reduce), so the result is the slowest group's and identical on every rank. A group of one rank
    communicates nothing: ``(inf, 0.0)``."""
    seconds = _check_seconds(seconds)
    if not dist.is_initialized():
        raise ValueError("probe_collectives needs an initialized process group (torch.distributed.init_process_group"
                         "); with one process there is nothing to measure.")
    if not isinstance(groups, dict) or not groups or not all(isinstance(k, str) for k in groups):
        raise ValueError(f"groups={groups!r} must be a non-empty dict of name -> ProcessGroup (None: the world).")
    device = torch.device(device)
    sizes = tuple(sizes or (CPU_SIZES if device.type == "cpu" else ACCELERATOR_SIZES))
    if len(sizes) < 2 or any(not isinstance(s, int) or s < 4 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"sizes={sizes!r} must be two or more increasing message sizes in bytes (>= 4).")
    names = sorted(groups)
    rows = []
    for name in names:  # the same order on every rank
        group = groups[name]
        n = dist.get_world_size(group) if _member(group) else 0
        times = [0.0] * len(sizes)
        if n > 1:
            times = _time_all_reduce(group, device, sizes, seconds / len(names))
        rows.append([float(n), *times])
    worst = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {name: fit_ring(int(row[0]), sizes, row[1:]) for name, row in zip(names, worst.tolist())}


# ---------------------------------------------------------------------------------------------------------------
# everything the planner needs
# ---------------------------------------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


#: the device table's peak kind of a probed dtype
_PEAK_KIND = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None  # host memory is shared and rarely the limit: the planner does not check fit


def _node_groups(gpus_per_node: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's node, this rank's peers of the same local rank on the other nodes); collective: every rank
    builds every group, in the same order. One node: (the world, None)."""
    world = dist.get_world_size()
    if world <= gpus_per_node:
        return None, None
    intra, _ = dist.new_subgroups(group_size=gpus_per_node)
    peers = [list(range(local, world, gpus_per_node)) for local in range(gpus_per_node)]
    inter, _ = dist.new_subgroups_by_enumeration(peers)
    return intra, inter


def group_shapes(ranks_per_node: int) -> list[tuple[int, int]]:
    """The shapes ``(size, stride)`` a mesh dimension's groups can take within a node of ``ranks_per_node`` ranks,
    the whole node excepted: ``size`` ranks ``stride`` apart, inside a block of ``size * stride`` that divides the
    node (the mesh is row-major, so every dimension's groups have this form)."""
    return [(size, stride) for size in range(2, ranks_per_node + 1) for stride in range(1, ranks_per_node // size + 1)
            if ranks_per_node % (size * stride) == 0 and (size, stride) != (ranks_per_node, 1)]


def _shape_groups(shapes: Sequence[tuple[int, int]]) -> dict[str, dist.ProcessGroup | None]:
    """One named group per shape: this rank's group of that shape (every node's ranks split alike: a shape's blocks
    divide a node). Collective: every rank builds every group, in the same order."""
    world = dist.get_world_size()
    groups = {}
    for size, stride in shapes:
        block = size * stride
        members = [[start + offset + i * stride for i in range(size)]
                   for start in range(0, world, block) for offset in range(stride)]
        mine, _ = dist.new_subgroups_by_enumeration(members)
        groups[f"{size}x{stride}"] = mine
    return groups


def probe_hardware(
    device: torch.device,
    dtype: torch.dtype,
    shapes: Sequence[Shape],
    gpus_per_node: int | None = None,
    matmul_seconds: float = 1.0,
    comm_seconds: float = 2.0,
    sizes: Sequence[int] | None = None,
    tp_sizes: Sequence[int] = (),
) -> Hardware:
    """The :class:`Hardware` of this machine, measured: the matmul probe on every rank at once (the mean of the
    ranks' figures) and, under ``torch.distributed`` with more than one rank, the collective probe over the ranks
    of a node, over every other shape of group a mesh dimension can take within a node (:func:`group_shapes`; all
    groups of a shape at once, as in training: ``Hardware.group_links``) and, with several nodes, over the ranks of
    one local rank across nodes. Collective when distributed:
    call it on every rank. ``gpus_per_node``: the ranks per node (default ``LOCAL_WORLD_SIZE``, else all ranks on
    one node; under ``torch.distributed`` the result says at most the world size). With one node the inter-node
    figures repeat the intra-node ones; with one process both are ``inf`` bandwidth and 0 latency: nothing was
    measured, so a plan for more devices from one process needs the links from elsewhere (``known_hardware``).
    ``tp_sizes``: also measure the matmuls as tensor parallelism of each of these degrees splits them
    (``split_for_tp``; ``Hardware.matmul_by_tp``), interleaved with the whole ones in the same budget."""
    device = torch.device(device)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if distributed else 1
    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be a positive int (the ranks on each node).")
    if world > gpus_per_node and world % gpus_per_node:
        raise ValueError(f"gpus_per_node={gpus_per_node} does not divide the world size {world}: every node must "
                         "hold the same number of ranks.")
    degrees = _check_tp_sizes(tp_sizes)  # before any collective
    if distributed:
        dist.barrier()  # all ranks multiply at the same time
    share = step_share(device)
    sets = [shapes, *(split_for_tp(shapes, tp) for tp in degrees)]
    rates = [r * share for r in probe_matmul_sets(device, dtype, sets, matmul_seconds)]
    name = _device_name(device)
    memory = _memory_bytes(device)
    # the probe times dense matmuls: experts' skinny grouped ones on a GPU as measured on an H100 relative to those
    grouped = H100_GROUPED_MM if device.type == "cuda" else None
    # the context-parallel blocks on a GPU: fused kernels (priced as such: None), unless the engine is told to run
    # its fp32 math path, at the table's fp32 / dtype peak ratio of this GPU (of an H100 where the table lacks it)
    cp_rate = bandwidth = None
    if device.type == "cuda":
        spec = find_device(_device_name(device)) or DEVICES["H100-SXM"]
        # the non-matmul ops' bytes: at the table's share of this GPU's memory bandwidth (the device table's rule)
        bandwidth = spec.memory_bandwidth * BANDWIDTH_SHARE
        if context.CUDA_KERNELS == "math":
            cp_rate = cp_attention_rate(spec, _PEAK_KIND.get(dtype, "fp32"))
    what = f"measured on this machine: matmul {_name(dtype)} at {len(shapes)} shape{'s' if len(shapes) > 1 else ''}"
    if degrees:
        what += f" (and split for tp {', '.join(map(str, degrees))})"
    if share != 1.0:
        what += f", x {share:.4g} (a step's share of its matmuls' rate: step_share)"
    if not distributed:
        return Hardware(name, rates[0], memory, gpus_per_node, math.inf, 0.0, math.inf, 0.0,
                        f"{what}, 1 rank; no communication", matmul_by_tp=tuple(zip(degrees, rates[1:])),
                        grouped_mm=grouped, cp_attention_rate=cp_rate, memory_bandwidth=bandwidth)
    # the mean over ranks: what each gets on average. On a shared CPU the ranks' shares of one second differ by up
    # to 7x (4 processes on 2 busy cores, measured), so the minimum would be one rank's unlucky second.
    mean = torch.tensor([r / world for r in rates], dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    rates = mean.tolist()
    intra, inter = _node_groups(gpus_per_node)
    groups = {"intra": intra} if inter is None else {"intra": intra, "inter": inter}
    per_node = min(gpus_per_node, world)
    shapes = group_shapes(per_node)
    groups.update(_shape_groups(shapes))
    measured = probe_collectives(groups, device, comm_seconds, sizes)
    intra_bw, intra_lat = measured["intra"]
    inter_bw, inter_lat = measured.get("inter", measured["intra"])
    group_links = tuple((n, s, *measured[f"{n}x{s}"]) for n, s in shapes)
    nodes = "one node: inter-node = intra-node" if inter is None else f"{world // gpus_per_node} nodes"
    source = (f"{what}, mean of {world} ranks running at once; all_reduce ring fit over the node and over every "
              f"shape of group within it, {dist.get_backend()} ({nodes})")
    return Hardware(name, rates[0], memory, per_node, intra_bw, intra_lat, inter_bw, inter_lat, source,
                    group_links=group_links, matmul_by_tp=tuple(zip(degrees, rates[1:])),
                    grouped_mm=grouped, cp_attention_rate=cp_rate, memory_bandwidth=bandwidth)


def step_share(device: torch.device) -> float:
    """The share of the probed matmul rate at which a training step's matmuls run. On an accelerator the probe
    times large matmuls alone, at shapes and with the device to themselves: the device table's rule,
    ``devices.MATMUL_STEP_SHARE``, with the step's other ops priced at the memory bandwidth
    (``devices.BANDWIDTH_SHARE``), so that a probed device and the same device from the table predict alike. Under
    the earlier rule (one share, 0.5625, for all the step's work), measured on an H200
    (2026-11-26, ``bench_planner.py --device cuda``, 325 M-parameter GPT and Llama, bf16-mixed): their steps ran
    at 0.41 and 0.29 of the probed rate, which the raw rate had predicted at 0.45 and 0.32 of the measured time.
    On the CPU the raw rate (1): the CPU benchmark's predictions are calibrated on it (world 4)."""
    return 1.0 if torch.device(device).type == "cpu" else MATMUL_STEP_SHARE


def _check_tp_sizes(tp_sizes: Sequence[int]) -> tuple[int, ...]:
    ok = isinstance(tp_sizes, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1
                                                for t in tp_sizes)
    if not ok:
        raise ValueError(f"tp_sizes={tp_sizes!r} must be a list of positive ints (tensor-parallel degrees to "
                         "measure the split matmuls at), e.g. [2, 4].")
    return tuple(sorted({t for t in tp_sizes if t > 1}))


def tp_degrees(shapes: Sequence[Shape], ranks_per_node: int) -> list[int]:
    """The tensor-parallel degrees worth probing: every one that divides a node's ranks (tensor parallelism stays
    within a node) and the larger inner dimension of each of the model's matmuls."""
    return [tp for tp in range(2, ranks_per_node + 1)
            if ranks_per_node % tp == 0 and all(max(k, n) % tp == 0 for _, k, n in shapes)]

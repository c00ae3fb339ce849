"""Tests of the monitoring callbacks: interval math, trace classification, cross-rank summaries, and real runs
whose TensorBoard event files, offline W&B run and CSV files are read back.

Two world-2 runs are shared by several tests (module-scoped fixtures): DDP + TensorBoard with all three monitors,
and FSDP2 + W&B (offline) with all three. Rank 1 loads its data slowly and holds a 128 MiB ballast, so the
cross-rank summaries have a known answer.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import callbacks_workers as W
import pytest
import torch
from launch import launch

from lightning_par.callbacks import CommOverlapMonitor, DeviceUtilizationMonitor, MemoryMonitor
from lightning_par.callbacks import intervals as iv
from lightning_par.callbacks.cross_rank import summarize, summarize_across_ranks
from lightning_par.callbacks.nvml import NvmlSampler
from lightning_par.callbacks.overlap import window_metrics
from lightning_par.callbacks.trace import MONITOR_MARK, TraceEvent, classify
from lightning_par.callbacks.utilization import default_num_tokens, lookup_peak_flops

STEPS = 10  # optimizer steps per run; utilization and memory log every 2, overlap windows end at steps 5 and 9
LOG_STEPS = [2, 4, 6, 8, 10]
WINDOW_END_STEPS = [5, 9]


def overlap_monitor(**kw: Any) -> CommOverlapMonitor:
    return CommOverlapMonitor(every_n_steps=4, window_steps=2, warmup_steps=1, start_step=2, **kw)


# ---------------------------------------------------------------------------------------------------------------
# interval math (HTA definitions) on known answers
# ---------------------------------------------------------------------------------------------------------------
def test_merge_handles_nested_overlapping_touching_and_unsorted():
    assert iv.merge([(5, 8), (0, 10), (2, 3), (10, 12), (20, 21), (15, 15)]) == [(0, 12), (20, 21)]
    assert iv.total([(0, 10), (2, 3), (5, 15)]) == 15


def test_intersect_and_subtract():
    a = [(0, 10), (20, 30)]
    b = [(5, 25)]
    assert iv.intersect(a, b) == [(5, 10), (20, 25)]
    assert iv.subtract(a, b) == [(0, 5), (25, 30)]
    assert iv.subtract(b, a) == [(10, 20)]
    assert iv.subtract([(0, 10)], [(2, 3), (4, 5), (9, 20)]) == [(0, 2), (3, 4), (5, 9)]


@pytest.mark.parametrize(
    "compute, comm, ratio, exposed",
    [
        ([(0, 100)], [(10, 50)], 1.0, 0),  # full overlap: comm hidden under compute
        ([(0, 30)], [(10, 50)], 0.5, 20),  # partial
        ([(0, 10)], [(20, 50)], 0.0, 30),  # none
        ([(0, 10), (5, 30)], [(10, 50), (20, 40)], 0.5, 20),  # nested/overlapping on both sides count once
    ],
)
def test_overlap_ratio_and_exposed(compute, comm, ratio, exposed):
    assert iv.overlap_ratio(compute, comm) == pytest.approx(ratio)
    assert iv.exposed(compute, comm) == pytest.approx(exposed)


def test_overlap_undefined_without_comm_and_idle_fraction():
    assert math.isnan(iv.overlap_ratio([(0, 10)], []))
    assert iv.idle_fraction([(0, 10), (20, 30), (25, 35)], (0, 50)) == pytest.approx(1 - 25 / 50)
    assert iv.idle_fraction([(-10, 100)], (0, 50)) == 0.0


def test_negative_interval_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"\(5, 1\).*end is before its start"):
        iv.merge([(0, 1), (5, 1)])
    with pytest.raises(ValueError, match="comm"):
        iv.overlap_ratio([(0, 1)], [(3, 2)])


# ---------------------------------------------------------------------------------------------------------------
# trace classification on synthetic event lists
# ---------------------------------------------------------------------------------------------------------------
def ev(name: str, start: int, end: int, track: Any = 1, activity: str = "cpu_op", **kw: Any) -> TraceEvent:
    return TraceEvent(name, activity, track, start, end, **kw)


def gloo_trace() -> list[TraceEvent]:
    """A CPU/gloo window in the shape CPU_FACTS.md describes; thread 1 is the main thread, 2 and 3 gloo threads."""
    return [
        ev("lightning_par::step", 0, 300, activity="user_annotation"),
        ev("Optimizer.step#SGD.step", 0, 295, activity="user_annotation"),  # an annotation, not compute
        ev("aten::linear", 0, 100),
        ev("aten::addmm", 10, 20),  # nested: counts once
        ev("FSDP::all_gather (0)", 100, 130, activity="user_annotation"),
        ev("c10d::_allgather_base_", 102, 105),  # enqueue only: neither compute nor communication
        ev("gloo:all_gather", 110, 160, track=2, activity="user_annotation"),
        ev("aten::copy_", 150, 155, track=2),  # inside gloo's own work: communication, not compute
        ev("aten::mm", 140, 200),
        ev("FSDP::post_backward_reduce (0)", 200, 210, activity="user_annotation"),
        ev("c10d::_reduce_scatter_base_", 201, 203),  # gloo runs it as an all-reduce
        ev("gloo:all_reduce", 205, 260, track=3, activity="user_annotation"),
        ev("aten::add_", 240, 250),
        ev("aten::pipeline_stage", 265, 290),  # wraps a send on the same thread: the send is not compute
        ev("gloo:send", 270, 280, activity="user_annotation"),
    ]


def test_classify_cpu_gloo_trace_known_answers():
    t = classify(gloo_trace())
    assert t.comm == [(110, 160), (205, 260), (270, 280)]
    assert t.compute == [(0, 100), (140, 200), (240, 250), (265, 270), (280, 290)]
    assert {k: iv.total(v) for k, v in t.comm_by_kind.items()} == {
        "fsdp_all_gather": 50,
        "fsdp_reduce_scatter": 55,
        "pp_send_recv": 10,
    }
    assert t.steps == [(0, 300)]
    m = window_metrics(t)
    assert m["comm/overlap_ratio"] == pytest.approx(30 / 115)  # [140,160] + [240,250] hidden
    assert m["comm/exposed_s_per_step"] == pytest.approx(85e-9)
    assert m["comm/time_s_per_step"] == pytest.approx(115e-9)
    assert m["comm/compute_s_per_step"] == pytest.approx(185e-9)
    assert m["comm/idle_frac"] == pytest.approx(30 / 300)  # gaps 100-110, 200-205, 260-265, 290-300
    assert m["comm/time_s/fsdp_all_gather"] == pytest.approx(50e-9)
    assert m["comm/time_s/ddp_all_reduce"] == 0.0


def test_classify_kinds_by_issue_context_and_order():
    events = [
        ev("lightning_par::step", 0, 1000, activity="user_annotation"),
        # DDP: the reducer enqueues its bucket all-reduce from an AccumulateGrad node
        ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 0, 20),
        ev("c10d::allreduce_", 5, 10),
        # a plain all-reduce enqueued just after, outside any context
        ev("c10d::allreduce_", 30, 35),
        # the monitors' own summary: left out entirely
        ev(MONITOR_MARK, 40, 60, activity="user_annotation"),
        ev("c10d::allgather_", 41, 43),
        # a DTensor functional collective wrapping a c10d op: one enqueue (the outer one), kind tp
        ev("_c10d_functional::all_gather_into_tensor", 70, 80),
        ev("c10d::_allgather_base_", 71, 79),
        ev("_c10d_functional::wait_tensor", 80, 200),  # a wait is not an enqueue and not compute
        # user annotation matched by a custom rule
        ev("my_cp_ring", 300, 310, activity="user_annotation"),
        ev("c10d::broadcast_", 301, 302),
        # gloo executes them in order on two threads
        ev("gloo:all_reduce", 50, 100, track=2, activity="user_annotation"),
        ev("gloo:all_reduce", 100, 130, track=2, activity="user_annotation"),
        ev("gloo:all_gather", 60, 70, track=3, activity="user_annotation"),
        ev("gloo:all_gather", 150, 190, track=3, activity="user_annotation"),
        ev("gloo:broadcast", 320, 330, track=3, activity="user_annotation"),
    ]
    t = classify(events, rules=[("my_cp_ring", "cp")])
    kinds = {k: iv.total(v) for k, v in t.comm_by_kind.items()}
    assert kinds == {"ddp_all_reduce": 50, "all_reduce": 30, "tp": 40, "cp": 10}
    assert t.comm == [(50, 130), (150, 190), (320, 330)]  # the monitor's all_gather (60-70) is not there
    assert t.compute == [(0, 5), (10, 20)]  # AccumulateGrad minus its enqueue; the wait is not compute


def test_classify_cuda_trace_streams_and_correlation():
    k = {"activity": "kernel", "on_gpu": True}
    events = [
        ev("lightning_par::step", 0, 195, activity="user_annotation"),
        ev("aten::whatever", 0, 200),  # CPU ops only launch work in a GPU trace: not compute
        ev("FSDP::all_gather (0)", 30, 45, activity="user_annotation"),
        ev("cudaLaunchKernel", 40, 41, activity="cuda_runtime", correlation=5),
        ev("FSDP::post_backward_reduce (0)", 150, 158, activity="user_annotation"),
        ev("cudaLaunchKernel", 155, 156, activity="cuda_runtime", correlation=6),
        ev("ampere_sgemm", 0, 100, track=(0, 7), **k),
        ev("vectorized_elementwise", 100, 150, track=(0, 7), **k),
        ev("ncclDevKernel_AllGather_RING_LL", 50, 120, track=(0, 20), correlation=5, **k),
        ev("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 160, 200, track=(0, 20), correlation=6, **k),
        ev("Memcpy DtoD", 150, 160, track=(0, 7), activity="gpu_memcpy", on_gpu=True),
        ev("other_gpu_kernel", 0, 300, track=(1, 7), **k),  # another device: ignored
    ]
    t = classify(events, device_index=0)
    assert t.compute == [(0, 150)]
    assert t.comm == [(50, 120), (160, 200)]
    assert {k: iv.total(v) for k, v in t.comm_by_kind.items()} == {"fsdp_all_gather": 70, "fsdp_reduce_scatter": 40}
    m = window_metrics(t, gpu_tail=True)  # the window runs to the last kernel's end (200), past the host's 195
    assert m["comm/overlap_ratio"] == pytest.approx(70 / 110)
    assert m["comm/exposed_s_per_step"] == pytest.approx(40e-9)
    assert m["comm/idle_frac"] == pytest.approx(0.0)
    assert m["comm/step_time_s"] == pytest.approx(200e-9)


def test_classify_rejects_bad_rules_and_window_needs_steps():
    with pytest.raises(ValueError, match="'nope'"):
        classify([], rules=[("X::", "nope")])
    with pytest.raises(ValueError, match="no measured steps"):
        window_metrics(classify([ev("aten::mm", 0, 1)]))


# ---------------------------------------------------------------------------------------------------------------
# cross-rank summaries
# ---------------------------------------------------------------------------------------------------------------
def test_summarize_min_max_argmax_nan_and_ties():
    per_rank = [[1.0, math.nan, 5.0], [3.0, math.nan, 5.0], [2.0, math.nan, 4.0]]
    s = summarize(["a", "b", "c"], per_rank)
    assert s == {"a/min": 1.0, "a/max": 3.0, "a/max_rank": 1.0, "c/min": 4.0, "c/max": 5.0, "c/max_rank": 0.0}


def test_summarize_across_ranks_without_distributed_is_local():
    assert summarize_across_ranks({"x": 2.5}, ["x", "y"]) == {"x/min": 2.5, "x/max": 2.5, "x/max_rank": 0.0}
    with pytest.raises(ValueError, match=r"\['z'\]"):
        summarize_across_ranks({"z": 1.0}, ["x"])


def test_summarize_across_two_unequal_ranks():
    names = ["big_on_1", "big_on_0", "only_rank_1"]
    values = [{"big_on_1": 1.0, "big_on_0": 7.0}, {"big_on_1": 9.0, "big_on_0": -2.0, "only_rank_1": 4.0}]
    r0, r1 = launch(2, W.summarize_worker, values, names)
    assert r0 == r1  # every rank gets the same summary
    assert r0 == {
        "big_on_1/min": 1.0,
        "big_on_1/max": 9.0,
        "big_on_1/max_rank": 1.0,
        "big_on_0/min": -2.0,
        "big_on_0/max": 7.0,
        "big_on_0/max_rank": 0.0,
        "only_rank_1/min": 4.0,
        "only_rank_1/max": 4.0,
        "only_rank_1/max_rank": 1.0,
    }


# ---------------------------------------------------------------------------------------------------------------
# log readers
# ---------------------------------------------------------------------------------------------------------------
def tb_scalars(log_dir: str) -> tuple[dict[str, dict[int, float]], list[str]]:
    """All scalars of a TensorBoard run ({tag: {step: value}}) and its image tags, via tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    return scalars, acc.Tags()["images"]


def wandb_records(run_file: str) -> list[Any]:
    """The protobuf records of an offline ``.wandb`` file (a LevelDB-style log: 32 KiB blocks, 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", ident
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += block - pos % block
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # FULL, FIRST
            pending = chunk
        else:  # MIDDLE, LAST
            pending += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def wandb_history(run_file: str) -> dict[str, dict[int, Any]]:
    """{metric: {trainer/global_step: value}} from an offline run's history records."""
    out: dict[str, dict[int, Any]] = {}
    for rec in wandb_records(run_file):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        step = row.get("trainer/global_step")
        for k, v in row.items():
            if not k.startswith(("_", "trainer/")):
                out.setdefault(k, {})[step] = v
    return out


def summary_triples(metrics: dict[str, dict[int, Any]], name: str) -> dict[int, tuple[float, float, int]]:
    mins, maxs, ranks = (metrics[f"{name}/{s}"] for s in ("min", "max", "max_rank"))
    assert set(mins) == set(maxs) == set(ranks), name
    return {step: (mins[step], maxs[step], int(ranks[step])) for step in mins}


def assert_utilization(metrics: dict[str, dict[int, Any]], with_tokens: bool) -> None:
    for name in ("perf/step_time_s", "perf/data_wait_frac", "perf/samples_per_s", "perf/cpu_percent"):
        assert sorted(metrics[f"{name}/max"]) == LOG_STEPS, name
    steps = summary_triples(metrics, "perf/step_time_s")
    for lo, hi, rank in steps.values():
        assert 0 < lo <= hi < 10 and rank in (0, 1)
    for lo, hi, _ in summary_triples(metrics, "perf/data_wait_frac").values():
        assert 0 <= lo <= hi <= 1
    for lo, hi, _ in summary_triples(metrics, "perf/cpu_percent").values():
        assert 0 <= lo <= hi <= 100 * (os.cpu_count() or 1) + 50
    # per rank, samples/s = 8 samples / step time: the fastest rank has the highest throughput
    for step, (lo, _, _) in steps.items():
        assert metrics["perf/samples_per_s/max"][step] == pytest.approx(8 / lo, rel=1e-5)
    # rank 1 loads data slowly: its data-wait fraction is the largest in (nearly) every interval
    wait_ranks = [r for _, _, r in summary_triples(metrics, "perf/data_wait_frac").values()]
    assert wait_ranks.count(1) >= len(wait_ranks) - 1, wait_ranks
    if with_tokens:  # (x, y) batches of int token ids: tokens = x.numel() = 8 samples x SEQ
        for step, v in metrics["perf/tokens_per_s/max"].items():
            assert v == pytest.approx(W.SEQ * metrics["perf/samples_per_s/max"][step], rel=1e-5)
    else:
        assert not any(k.startswith("perf/tokens_per_s") for k in metrics)
    assert not any(k.startswith("gpu/") for k in metrics)


def assert_memory_cpu(metrics: dict[str, dict[int, Any]]) -> None:
    rss = summary_triples(metrics, "mem/rss_bytes")
    peak = summary_triples(metrics, "mem/rss_peak_bytes")
    assert sorted(rss) == sorted(peak) == LOG_STEPS
    for step, (lo, hi, rank) in rss.items():
        assert 50e6 < lo <= hi < 20e9
        assert hi - lo > 0.5 * W.BALLAST_BYTES and rank == 1  # the ballast rank
        assert peak[step][1] >= hi * 0.999 and peak[step][2] == 1


def assert_overlap(metrics: dict[str, dict[int, Any]], kinds: list[str]) -> None:
    for name in ("comm/overlap_ratio", "comm/idle_frac"):
        t = summary_triples(metrics, name)
        assert sorted(t) == WINDOW_END_STEPS, name
        assert all(0 <= lo <= hi <= 1 for lo, hi, _ in t.values()), (name, t)
    exposed = summary_triples(metrics, "comm/exposed_s_per_step")
    total = summary_triples(metrics, "comm/time_s_per_step")
    for step in WINDOW_END_STEPS:
        assert 0 <= exposed[step][0] and exposed[step][1] <= total[step][1] * (1 + 1e-9)
        assert 0 < total[step][0] <= total[step][1] < 5
    for kind in kinds:
        t = summary_triples(metrics, f"comm/time_s/{kind}")
        assert sorted(t) == WINDOW_END_STEPS, kind
        assert all(0 < lo <= hi < 5 for lo, hi, _ in t.values()), (kind, t)
    for step in WINDOW_END_STEPS:  # the kinds add up to no more than the kinds' sum (overlapping kinds merge)
        kind_sum = sum(metrics[k][step] for k in metrics if k.startswith("comm/time_s/") and k.endswith("/max"))
        assert total[step][0] <= kind_sum * (1 + 1e-9)
    assert not any(k.startswith("comm/time_s/all_gather") for k in metrics)  # the monitors' own gathers


# ---------------------------------------------------------------------------------------------------------------
# world-2 run 1: DDP + TensorBoard
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_tensorboard_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ddp_tb"))
    callbacks = [
        DeviceUtilizationMonitor(log_every_n_steps=2),
        MemoryMonitor(log_every_n_steps=2),
        overlap_monitor(log_timeline=True, export_trace_dir=os.path.join(root, "traces")),
    ]
    results = launch(2, W.train_run, root, "tensorboard", "ddp", callbacks, STEPS)
    scalars, images = tb_scalars(os.path.join(root, "tb", "version_0"))
    return SimpleNamespace(root=root, results=results, metrics=scalars, images=images)


def test_tensorboard_utilization(ddp_tensorboard_run):
    assert_utilization(ddp_tensorboard_run.metrics, with_tokens=False)


def test_tensorboard_memory_ballast_rank_is_max(ddp_tensorboard_run):
    assert_memory_cpu(ddp_tensorboard_run.metrics)


def test_tensorboard_overlap_ddp(ddp_tensorboard_run):
    m = ddp_tensorboard_run.metrics
    assert_overlap(m, kinds=["ddp_all_reduce"])
    # rank 0 waits inside every gradient all-reduce for slow rank 1: its communication time is the largest
    assert [r for _, _, r in summary_triples(m, "comm/time_s/ddp_all_reduce").values()] == [0, 0]
    assert [r for _, _, r in summary_triples(m, "comm/exposed_s_per_step").values()] == [0, 0]
    assert "comm/timeline" in ddp_tensorboard_run.images


def test_tensorboard_run_local_values_match_the_logged_summary(ddp_tensorboard_run):
    r0, r1 = ddp_tensorboard_run.results
    assert r0["strategy"] == "DDPStrategy"
    key = "CommOverlapMonitor.last_values"
    for name in ("comm/overlap_ratio", "comm/time_s/ddp_all_reduce", "comm/idle_frac"):
        lo, hi = sorted([r0[key][name], r1[key][name]])
        assert ddp_tensorboard_run.metrics[f"{name}/min"][9] == pytest.approx(lo, rel=1e-6)
        assert ddp_tensorboard_run.metrics[f"{name}/max"][9] == pytest.approx(hi, rel=1e-6)
    assert (
        r0["CommOverlapMonitor.last_figure_targets"] == ["tensorboard"]
        and r1["CommOverlapMonitor.last_figure_targets"] == []
    )


def test_exported_traces_hold_gloo_collectives(ddp_tensorboard_run):
    files = sorted(glob.glob(os.path.join(ddp_tensorboard_run.root, "traces", "*.json")))
    assert [os.path.basename(f) for f in files] == [
        "rank0_step5.json",
        "rank0_step9.json",
        "rank1_step5.json",
        "rank1_step9.json",
    ]
    names = {e.get("name") for e in json.loads(Path(files[0]).read_text())["traceEvents"]}
    assert "gloo:all_reduce" in names and "lightning_par::step" in names


# ---------------------------------------------------------------------------------------------------------------
# world-2 run 2: FSDP2 + W&B offline, token batches and MFU
# ---------------------------------------------------------------------------------------------------------------
PEAK = 1e11


@pytest.fixture(scope="module")
def fsdp_wandb_run(tmp_path_factory):
    # a dependency of lightning_par; an environment set up without it (a lent GPU machine's) skips these tests
    pytest.importorskip("wandb", reason="W&B is not installed here: pip install -e . installs it")
    root = str(tmp_path_factory.mktemp("fsdp_wandb"))
    flops_per_batch = 6 * W.n_params(True) * 8 * W.SEQ
    callbacks = [
        DeviceUtilizationMonitor(log_every_n_steps=2, flops_per_batch=flops_per_batch, peak_flops_per_device=PEAK),
        MemoryMonitor(log_every_n_steps=2),
        overlap_monitor(log_timeline=True),
    ]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": root, "WANDB_SILENT": "true", "WANDB_DISABLE_CODE": "true"}
    results = launch(2, W.train_run, root, "wandb", "fsdp2", callbacks, STEPS, True, env=env)
    runs = sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*")))
    run_files = glob.glob(os.path.join(runs[0], "*.wandb")) if runs else []
    metrics = wandb_history(run_files[0]) if run_files else {}
    return SimpleNamespace(root=root, results=results, runs=runs, metrics=metrics, flops=flops_per_batch)


def test_wandb_one_run_only(fsdp_wandb_run):
    assert len(fsdp_wandb_run.runs) == 1  # rank 1 made no run of its own
    assert fsdp_wandb_run.results[0]["strategy"] in ("FSDP2Strategy", "ModelParallelStrategy")


def test_wandb_utilization_tokens_and_mfu(fsdp_wandb_run):
    m = fsdp_wandb_run.metrics
    assert_utilization(m, with_tokens=True)
    for step, (lo, hi, _) in summary_triples(m, "perf/mfu").items():
        assert 0 < lo <= hi < 1
        # per rank, achieved FLOP/s = flops per batch / step time: the fastest rank has the top MFU
        fastest = m["perf/step_time_s/min"][step]
        assert hi == pytest.approx(fsdp_wandb_run.flops / fastest / PEAK, rel=1e-5)
        assert m["perf/tflops_per_s/max"][step] == pytest.approx(hi * PEAK / 1e12, rel=1e-6)


def test_wandb_memory(fsdp_wandb_run):
    assert_memory_cpu(fsdp_wandb_run.metrics)


def test_wandb_overlap_fsdp2_kinds_and_timeline(fsdp_wandb_run):
    m = fsdp_wandb_run.metrics
    assert_overlap(m, kinds=["fsdp_all_gather", "fsdp_reduce_scatter"])
    assert not any(k.startswith("comm/time_s/ddp_all_reduce") for k in m)
    images = glob.glob(os.path.join(fsdp_wandb_run.runs[0], "files", "media", "images", "comm", "timeline_*.png"))
    assert len(images) == len(WINDOW_END_STEPS)
    assert all(os.path.getsize(p) > 5000 for p in images)


# ---------------------------------------------------------------------------------------------------------------
# single-process runs: fake NVML (no GPU here), CSVLogger, snapshots
# ---------------------------------------------------------------------------------------------------------------
class FakeNvml:
    """TEST DOUBLE for the ``pynvml`` module: NVML cannot run on a machine without a GPU.

    Fixed readings: 40 % busy, 25 % memory bandwidth, 250 W, SM 1500 / memory 2600 MHz, power-cap throttling,
    GPM SM active 61 %, occupancy 33 %, tensor active 12 %, DRAM bandwidth 44 %; the energy counter grows 5 J
    per read. ``unsupported`` names functions that raise like NVML's NotSupported.
    """

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_GPM_METRICS_GET_VERSION = 1
    GPM = {2: 61.0, 3: 33.0, 5: 12.0, 10: 44.0}

    def __init__(self, unsupported: tuple[str, ...] = ()) -> None:
        self.unsupported = set(unsupported)
        self.energy_mj = 0
        self.inits = 0

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "unsupported"):

            def not_supported(*_: Any) -> Any:
                raise RuntimeError(f"fake NVML: {name} not supported")

            return not_supported
        return object.__getattribute__(self, name)

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"fake-gpu-{i}"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        return SimpleNamespace(gpu=40, memory=25)

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 250_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        self.energy_mj += 5000
        return self.energy_mj

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 1500 if kind == self.NVML_CLOCK_SM else 2600

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:
        return 0x4  # SW power cap

    def nvmlGpmQueryDeviceSupport(self, h: str) -> Any:
        return SimpleNamespace(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self) -> dict:
        return {}

    def nvmlGpmSampleGet(self, h: str, sample: dict) -> dict:
        return sample

    def nvmlGpmSampleFree(self, sample: dict) -> None:
        pass

    def c_nvmlGpmMetricsGet_t(self) -> Any:
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, value=0.0) for _ in range(8)])

    def nvmlGpmMetricsGet(self, req: Any) -> Any:
        for m in req.metrics[: req.numMetrics]:
            m.value = self.GPM[m.metricId]
        return req


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real-NVML test covers this path")
def test_nvml_sampler_means_energy_and_unsupported_metrics():
    fake = FakeNvml(unsupported=("nvmlDeviceGetPowerUsage",))
    s = NvmlSampler(0, interval_s=10.0, nvml=fake)
    assert s.handle == "fake-gpu-0"
    s.sample()
    s.sample()
    out = s.read()
    assert out["busy_pct"] == 40 and out["mem_bw_pct"] == 25 and out["sm_clock_mhz"] == 1500
    assert out["sm_active_pct"] == 61 and out["tensor_active_pct"] == 12 and out["sm_occupancy_pct"] == 33
    assert out["throttle/power_frac"] == 1 and out["throttle/thermal_frac"] == 0 and out["throttle/any_frac"] == 1
    assert out["energy_j"] == 5.0
    assert "power_w" not in out  # unsupported: dropped, not zero
    assert s.read()["busy_pct"] == 40  # an empty interval gets a sample of its own


def cpu_trainer(root: str, callbacks: list, max_steps: int = 6, logger: Any = None) -> Any:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=logger if logger is not None else CSVLogger(root, name="csv", version=0),
        callbacks=callbacks,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def read_csv_metrics(path: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v != "":
                    out.setdefault(k, {})[int(row["step"])] = float(v)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real-NVML test covers this path")
def test_fake_nvml_gpu_metrics_through_csv_logger(tmp_path):
    from torch.utils.data import DataLoader

    fake = FakeNvml()
    monitor = DeviceUtilizationMonitor(log_every_n_steps=2, nvml=fake, nvml_interval_s=0.005)
    trainer = cpu_trainer(str(tmp_path), [monitor])
    data = W.SlowOnRankDataset(slow_rank=None)
    trainer.fit(W._lightning_module(False, False), DataLoader(data, batch_size=8))
    m = read_csv_metrics(str(tmp_path / "csv" / "version_0" / "metrics.csv"))
    expected = {
        "gpu/busy_pct": 40,
        "gpu/mem_bw_pct": 25,
        "gpu/sm_active_pct": 61,
        "gpu/sm_occupancy_pct": 33,
        "gpu/tensor_active_pct": 12,
        "gpu/dram_bw_pct": 44,
        "gpu/power_w": 250,
        "gpu/sm_clock_mhz": 1500,
        "gpu/mem_clock_mhz": 2600,
        "gpu/throttle/power_frac": 1,
        "gpu/throttle/thermal_frac": 0,
    }
    for name, value in expected.items():
        assert m[f"{name}/max"] == {2: value, 4: value, 6: value}, name
        assert m[f"{name}/min"] == m[f"{name}/max"] and set(m[f"{name}/max_rank"].values()) == {0.0}
    # 5 J per read; the first interval measured 1 step (the epoch's first batch has no data wait), later ones 2
    assert m["gpu/energy_j_per_step/max"] == {2: 5.0, 4: 2.5, 6: 2.5}
    assert sorted(m["perf/step_time_s/max"]) == [2, 4, 6]
    assert monitor._sampler is not None and monitor._sampler._thread is None  # the thread stopped at the end


def test_memory_snapshot_at_step_and_on_oom(tmp_path):
    from torch.utils.data import DataLoader

    data = W.SlowOnRankDataset(slow_rank=None)
    mon = MemoryMonitor(log_every_n_steps=2, snapshot_at_step=3, snapshot_dir=str(tmp_path / "snaps"))
    cpu_trainer(str(tmp_path), [mon]).fit(W._lightning_module(False, False), DataLoader(data, batch_size=8))
    report = json.loads((tmp_path / "snaps" / "rank0_step3.json").read_text())
    assert report["global_step"] == 3 and report["rss_bytes"] > 50e6
    assert report["rss_peak_bytes"] >= report["rss_bytes"] * 0.99
    m = read_csv_metrics(str(tmp_path / "csv" / "version_0" / "metrics.csv"))
    assert sorted(m["mem/rss_bytes/max"]) == [2, 4, 6]

    mon = MemoryMonitor(snapshot_on_oom=True, snapshot_dir=str(tmp_path / "oom"))
    model = W._lightning_module(False, False, oom_at_step=2)
    with pytest.raises(torch.OutOfMemoryError):
        cpu_trainer(str(tmp_path / "run2"), [mon]).fit(model, DataLoader(data, batch_size=8))
    assert json.loads((tmp_path / "oom" / "rank0_oom.json").read_text())["global_step"] == 2


# ---------------------------------------------------------------------------------------------------------------
# small pure helpers and bad input
# ---------------------------------------------------------------------------------------------------------------
def test_token_count_and_peak_lookup():
    assert default_num_tokens({"input_ids": torch.zeros(2, 3, dtype=torch.long), "num_tokens": 5}) == 5
    assert default_num_tokens((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16))) == 64
    assert default_num_tokens((torch.zeros(4, 16), torch.zeros(4))) is None  # float inputs: no token count
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert lookup_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert lookup_peak_flops("NVIDIA A10") == 125e12
    assert lookup_peak_flops("Some CPU") is None


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DeviceUtilizationMonitor(log_every_n_steps=0), r"`log_every_n_steps`.*got 0"),
        (lambda: DeviceUtilizationMonitor(peak_flops_per_device=-1), r"`peak_flops_per_device`.*-1"),
        (lambda: DeviceUtilizationMonitor(flops_per_batch="many"), r"`flops_per_batch`.*'many'"),
        (lambda: DeviceUtilizationMonitor(nvml_interval_s=0), r"`nvml_interval_s`"),
        (lambda: CommOverlapMonitor(window_steps=0), r"`window_steps`.*got 0"),
        (lambda: CommOverlapMonitor(every_n_steps=3, window_steps=3), r"must not exceed `every_n_steps`"),
        (lambda: CommOverlapMonitor(rules=[("X::", "bogus")]), r"'bogus'"),
        (lambda: MemoryMonitor(snapshot_at_step=-1), r"`snapshot_at_step`.*-1"),
    ],
)
def test_bad_options_are_value_errors_naming_parameter_and_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------------------------------------------------
# real GPU (runs only where CUDA is present)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_gpu_nvml_memory_and_kernel_trace(tmp_path):
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    data = W.SlowOnRankDataset(slow_rank=None, tokens=True)
    callbacks = [
        DeviceUtilizationMonitor(log_every_n_steps=2, nvml_interval_s=0.01),
        MemoryMonitor(log_every_n_steps=2),
        CommOverlapMonitor(every_n_steps=4, window_steps=2, warmup_steps=1, start_step=2),
    ]
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=STEPS,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        callbacks=callbacks,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(W._lightning_module(True, False), DataLoader(data, batch_size=8))
    m = read_csv_metrics(str(tmp_path / "csv" / "version_0" / "metrics.csv"))
    assert sorted(m["gpu/busy_pct/max"]) == LOG_STEPS
    assert all(0 <= v <= 100 for v in m["gpu/busy_pct/max"].values())
    assert all(v > 10 for v in m["gpu/power_w/max"].values())
    assert all(v > 100 for v in m["gpu/sm_clock_mhz/max"].values())
    assert all(v > 0 for v in m["mem/allocated_peak_bytes/max"].values())
    assert all(m["mem/reserved_peak_bytes/max"][s] >= m["mem/allocated_peak_bytes/max"][s] for s in LOG_STEPS)
    assert all(0 <= v <= 1 for v in m["mem/fragmentation/max"].values())
    assert all(v > 0 for v in m["mem/outside_allocator_bytes/max"].values())  # at least the CUDA context
    assert sorted(m["comm/compute_s_per_step/max"]) == WINDOW_END_STEPS  # kernels were seen as compute
    assert all(v > 0 for v in m["comm/compute_s_per_step/max"].values())
    assert all(0 <= v <= 1 for v in m["comm/idle_frac/max"].values())
    if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name():
        assert "gpu/sm_active_pct/max" in m  # Hopper has GPM


def test_overlap_single_process_and_skipped_when_another_profiler_runs(tmp_path):
    from torch.utils.data import DataLoader

    data = W.SlowOnRankDataset(slow_rank=None)
    mon = overlap_monitor(log_timeline=True)
    cpu_trainer(str(tmp_path / "a"), [mon], max_steps=STEPS).fit(W._lightning_module(False, False), DataLoader(data))
    log_dir = tmp_path / "a" / "csv" / "version_0"
    assert sorted(p.name for p in log_dir.glob("*.png")) == ["comm_timeline_step5.png", "comm_timeline_step9.png"]
    m = read_csv_metrics(str(log_dir / "metrics.csv"))
    assert sorted(m["comm/compute_s_per_step/max"]) == WINDOW_END_STEPS  # one process: compute, no communication
    assert all(0 <= v <= 1 for v in m["comm/idle_frac/max"].values())
    assert not any(k.startswith(("comm/overlap_ratio", "comm/time_s/")) for k in m)  # undefined / zero: not logged

    mon = overlap_monitor()
    trainer = cpu_trainer(str(tmp_path / "b"), [mon], max_steps=STEPS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        trainer.fit(W._lightning_module(False, False), DataLoader(data))
    assert mon.last_values == {} and mon.last_summary == {}  # windows skipped, training went on

"""The hardware tables (lightning_par.devices) and the on-the-spot probe (lightning_par.planner.probe)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from launch import launch

import lightning_par.callbacks.flops as flops
from lightning_par.devices import (
    BANDWIDTH_SHARE,
    DEFAULT_EFFICIENCY,
    DEVICES,
    LINKS,
    MATMUL_EFFICIENCY,
    MATMUL_STEP_SHARE,
    PEAK_FLOPS,
    STEP_SHARE,
    GiB,
    Hardware,
    known_hardware,
    lookup_device,
    lookup_link,
    lookup_peak_flops,
)
from lightning_par.dims import ParallelDims
from lightning_par.planner.predict import _link
from lightning_par.planner.probe import (
    _shape_groups,
    fit_ring,
    group_shapes,
    probe_collectives,
    probe_hardware,
    probe_matmul,
    probe_matmul_sets,
    split_for_tp,
    tp_degrees,
)

PRE_AMPERE = {"T4", "V100S", "V100-PCIe-32GB", "V100-PCIe-16GB", "V100-SXM2-32GB", "V100-SXM2-16GB"}


# ---------------------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_device_has_dense_peaks_memory_and_a_known_link(name):
    spec = DEVICES[name]
    assert spec.name == name and spec.source
    assert spec.peak_flops["fp16"] > 1e13
    assert ("bf16" in spec.peak_flops) == (name not in PRE_AMPERE)  # Turing and Volta have no bf16 tensor cores
    assert all(kind in ("bf16", "fp16", "tf32", "fp32") for kind in spec.peak_flops)
    if "tf32" in spec.peak_flops:  # dense figures: tf32 tensor cores run at half the bf16 rate on every chip here
        assert spec.peak_flops["tf32"] == pytest.approx(spec.peak_flops["bf16"] / 2, rel=0.02)
    assert 16 * GiB <= spec.memory_bytes <= 192 * GiB and spec.memory_bytes % (GiB // 4) == 0
    assert 3e11 <= spec.memory_bandwidth <= 8e12
    assert spec.intra_link in LINKS


@pytest.mark.parametrize(
    "torch_name, key",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H800", "H800"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB-PCIe"),
        ("NVIDIA A800-SXM4-80GB", "A800"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB"),
        ("Tesla V100-PCIE-32GB", "V100-PCIe-32GB"),
        ("Tesla V100S-PCIE-32GB", "V100S"),
        ("h100-sxm", "H100-SXM"),  # a key, any case
        ("a100-40gb", "A100-40GB"),
    ],
)
def test_lookup_by_torch_name_or_key(torch_name, key):
    assert lookup_device(torch_name) is DEVICES[key]


def test_datasheet_figures_of_the_main_devices():
    h100, a100 = lookup_device("H100-SXM"), lookup_device("A100-40GB")
    assert h100.peak_flops["bf16"] == 989e12 and h100.memory_bytes == 80 * GiB and h100.memory_bandwidth == 3.35e12
    assert a100.peak_flops["bf16"] == 312e12 and a100.memory_bytes == 40 * GiB and a100.memory_bandwidth == 1.555e12
    assert lookup_device("H200").memory_bytes == 141 * GiB and lookup_device("B200").peak_flops["bf16"] == 2.25e15
    assert lookup_link("nvlink4").bandwidth == 450e9 and lookup_link("nvlink3").bandwidth == 300e9
    assert lookup_link("ib-ndr400").bandwidth == 50e9 and lookup_link("ib-hdr200").bandwidth == 25e9
    assert lookup_link("pcie5").bandwidth == 64e9


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"device='TPU v5'.*known:.*'H100-SXM'.*Hardware\(device="):
        lookup_device("TPU v5")
    with pytest.raises(TypeError, match="device=3"):
        lookup_device(3)
    with pytest.raises(ValueError, match=r"link='nvlink9'.*known:.*'ib-ndr400'.*'nvlink4'"):
        lookup_link("nvlink9")


def test_the_peak_table_of_the_flops_callbacks_is_this_one():
    assert flops.PEAK_FLOPS is PEAK_FLOPS and flops.lookup_peak_flops is lookup_peak_flops
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494e12 and lookup_peak_flops("Some CPU") is None


def test_known_hardware_is_peak_times_efficiency_and_the_table_links():
    hw = known_hardware("NVIDIA H100 80GB HBM3")
    assert hw.device == "H100-SXM" and hw.gpus_per_node == 8 and hw.memory_bytes == 80 * GiB
    assert hw.matmul_flops == pytest.approx(989e12 * 0.8 * MATMUL_STEP_SHARE)
    assert (hw.intra_bandwidth, hw.intra_latency) == (450e9, 3.4e-6)  # NVLink 4
    assert (hw.inter_bandwidth, hw.inter_latency) == (50e9, 14e-6)  # NDR 400 Gb/s per GPU
    assert hw.source == (f"table: H100-SXM bf16 x {0.8 * MATMUL_STEP_SHARE:.3g} ({MATMUL_STEP_SHARE:g} of its "
                         f"matmuls' 0.8), other ops at {BANDWIDTH_SHARE:g} of 3.35 TB/s, nvlink4, ib-ndr400")

    a100 = known_hardware("A100-80GB", precision="tf32", gpus_per_node=4, inter_link="ib-hdr200", efficiency=0.5)
    assert a100.matmul_flops == pytest.approx(78e12) and a100.gpus_per_node == 4
    assert (a100.intra_bandwidth, a100.inter_bandwidth) == (300e9, 25e9)

    shared = known_hardware("L40S", inter_link="eth-100", nics_per_node=2)  # 2 NICs for 8 GPUs
    assert shared.intra_bandwidth == 32e9 and shared.inter_bandwidth == pytest.approx(12.5e9 / 4)
    bridged = known_hardware("H100-PCIe", intra_link="nvlink4")
    assert bridged.intra_bandwidth == 450e9 and "nvlink4" in bridged.source


def test_a_step_from_the_table_prices_matmuls_at_each_devices_own_rate_and_the_rest_at_its_memory_bandwidth():
    """One large matmul reaches a different fraction of the peak on each device (the MAMF table: 0.869 on an A100
    SXM, 0.80 on an H100, 0.776 on a B200); a step's matmuls are priced at one share of it
    (``MATMUL_STEP_SHARE``), its other ops' bytes at one share of the device's memory bandwidth
    (``BANDWIDTH_SHARE``), both fitted on the published set's fitting half."""
    h100, a100 = known_hardware("H100-SXM"), known_hardware("NVIDIA A100-SXM4-80GB")
    assert 0.5 <= MATMUL_STEP_SHARE <= 1 and 0 < BANDWIDTH_SHARE <= 1
    assert a100.matmul_flops == pytest.approx(312e12 * 0.869 * MATMUL_STEP_SHARE)
    assert known_hardware("A100-40GB-PCIe").matmul_flops == pytest.approx(312e12 * 0.811 * MATMUL_STEP_SHARE)
    assert known_hardware("B200").matmul_flops == pytest.approx(2.25e15 * 0.776 * MATMUL_STEP_SHARE)
    assert h100.memory_bandwidth == pytest.approx(3.35e12 * BANDWIDTH_SHARE)
    assert a100.memory_bandwidth == pytest.approx(2.039e12 * BANDWIDTH_SHARE)
    assert h100.matmul_share == a100.matmul_share == 1.0  # the non-matmul work is priced by its bytes instead
    for name, spec in DEVICES.items():  # every row says where its figure comes from
        assert 0.5 < spec.matmul_efficiency <= 1 and "one large matmul" in spec.source, name
        assert ("MAMF row" in spec.source) == (spec.matmul_efficiency != MATMUL_EFFICIENCY or name in (
            "H100-SXM", "H800", "H200")), name
    # an efficiency given by hand is the whole step's, whatever the device's matmuls reach (the earlier rule: no
    # memory term); its share follows from both
    custom = known_hardware("A100-80GB", efficiency=0.5)
    assert custom.matmul_flops == pytest.approx(156e12) and custom.matmul_share == pytest.approx(0.5 / 0.869)
    assert custom.memory_bandwidth is None and "other ops" not in custom.source
    assert STEP_SHARE == pytest.approx(DEFAULT_EFFICIENCY / MATMUL_EFFICIENCY) == pytest.approx(0.5625)
    # both shares by hand: the matmuls' fraction of peak and the memory bandwidth's share
    both = known_hardware("A100-80GB", efficiency=0.6, memory_efficiency=0.5)
    assert both.matmul_flops == pytest.approx(312e12 * 0.6) and both.memory_bandwidth == pytest.approx(2.039e12 / 2)
    with pytest.raises(ValueError, match="memory_efficiency=1.5 must be in"):
        known_hardware("A100-80GB", memory_efficiency=1.5)


def test_known_hardware_bad_input():
    with pytest.raises(ValueError, match=r"precision='bf16': T4 has dense peaks for \['fp16', 'fp32'\]"):
        known_hardware("T4")
    with pytest.raises(ValueError, match=r"efficiency=1.5 must be in \(0, 1\]"):
        known_hardware("H100-SXM", efficiency=1.5)
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        known_hardware("H100-SXM", gpus_per_node=0)
    with pytest.raises(ValueError, match="nics_per_node=0"):
        known_hardware("H100-SXM", nics_per_node=0)
    with pytest.raises(ValueError, match="link='ib-foo'"):
        known_hardware("H100-SXM", inter_link="ib-foo")


def test_hardware_by_hand_is_checked_and_summarized():
    hw = Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand")
    assert hw.summary() == ("mine: 100 TFLOP/s, memory unknown, 4 per node; intra-node 100 GB/s, 2 us/hop; "
                            "inter-node 10 GB/s, 10 us/hop (by hand)")
    with pytest.raises(ValueError, match=r"intra_bandwidth=-1.0 must be a positive number"):
        Hardware("mine", 1e14, None, 4, -1.0, 2e-6, 1e10, 1e-5, "by hand")
    with pytest.raises(ValueError, match=r"memory_bytes=1.5 must be a positive int"):
        Hardware("mine", 1e14, 1.5, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand")
    with pytest.raises(ValueError, match=r"inter_latency=inf must be a finite number"):
        Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, math.inf, "by hand")


def test_matmul_rates_measured_per_tensor_parallel_degree_serve_those_layouts():
    hw = Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand", matmul_by_tp=((2, 9e13), (4, 7e13)))
    assert (hw.matmul_rate(1), hw.matmul_rate(2), hw.matmul_rate(4), hw.matmul_rate(8)) == (1e14, 9e13, 7e13, 1e14)
    assert hw.summary().startswith("mine: 100 TFLOP/s, 90 at tp 2, 70 at tp 4, memory unknown, 4 per node; ")
    with pytest.raises(ValueError, match=r"matmul_by_tp entry \(0, 1.0\) must be \(tp, FLOP/s\)"):
        Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand", matmul_by_tp=((0, 1.0),))
    with pytest.raises(ValueError, match=r"matmul_by_tp FLOP/s=-1.0 must be a positive number"):
        Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand", matmul_by_tp=((2, -1.0),))


def test_measured_group_links_serve_the_mesh_dimensions_of_their_shape():
    hw = Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand", group_links=((2, 2, 5e10, 4e-6),))
    assert "groups of 2 ranks 2 apart 50 GB/s, 4 us/hop" in hw.summary()
    assert hw.link(2, 2, within_node=True) == (5e10, 4e-6)
    assert hw.link(2, 1, within_node=True) == (1e11, 2e-6)  # not measured: the node's link
    assert hw.link(2, 2, within_node=False) == (1e10, 1e-5)
    # dp_shard 2 x tp 2 on one node of 4: FSDP's groups are 2 apart, TP's adjacent
    dims = ParallelDims(dp_shard=2, tp=2).resolve(4)
    assert (dims.group_stride("dp_shard"), dims.group_stride("tp"), dims.group_stride("dp_shard_cp")) == (2, 1, 2)
    assert _link("dp_shard", dims, hw) == (2, 5e10, 4e-6, 5e10, 2, 1e11, 2e-6)
    assert _link("tp", dims, hw) == (2, 1e11, 2e-6, 1e11, 2, 1e11, 2e-6)
    across = _link("dp_shard", dims, replace(hw, gpus_per_node=2))  # across two nodes
    assert across == (2, 1e10, 1e-5, 1e10, 1, 1e11, 2e-6)
    # ranks sharing CPU cores: the node's all-reduce prices every group (see predict._link)
    cpu = _link("dp_shard", dims, replace(hw, device="cpu (x86_64, 1 threads)"))
    assert cpu == (2, 1e11, 2e-6, 1e11, 2, 1e11, 2e-6)
    assert ParallelDims(pp=2, dp_replicate=2, cp=2).resolve(8).group_stride("dp_cp") == 1
    assert ParallelDims(pp=2, dp_replicate=2, cp=2).resolve(8).group_stride("pp") == 4
    for bad in [(2,), (0, 1, 1e9, 0.0), (2, 1, -1.0, 0.0)]:
        with pytest.raises(ValueError, match="group_links"):
            Hardware("mine", 1e14, None, 4, 1e11, 2e-6, 1e10, 1e-5, "by hand", group_links=(bad,))


def test_group_shapes_are_every_mesh_dimension_group_within_a_node():
    assert group_shapes(1) == [] and group_shapes(2) == []
    assert group_shapes(4) == [(2, 1), (2, 2)]
    assert group_shapes(8) == [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]


# ---------------------------------------------------------------------------------------------------------------
# probe, one process
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_fit_recovers_bandwidth_and_latency(n):
    bandwidth, latency = 3e9, 2e-5
    sizes = [1 << 10, 1 << 20, 1 << 22]
    times = [latency * 2 * (n - 1) + s * 2 * (n - 1) / n / bandwidth for s in sizes]
    assert fit_ring(n, sizes, times) == pytest.approx((bandwidth, latency), rel=1e-9)
    assert fit_ring(1, sizes, times) == (math.inf, 0.0)
    noisy = fit_ring(n, sizes, [times[0], times[2], times[2]])  # a flat top: no slope between the large sizes
    assert noisy[0] > 0 and noisy[1] > 0


def _hand_timed_flops(m: int, k: int, n: int, seconds: float) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.matmul(a, b)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        reps += 1
    return reps * 2 * m * k * n / (time.perf_counter() - start)


def test_probe_matmul_measures_what_a_hand_timed_matmul_gets():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        by_hand = _hand_timed_flops(256, 512, 384, 0.3)
        start = time.perf_counter()
        probed = probe_matmul(torch.device("cpu"), torch.float32, [(256, 512, 384)], seconds=0.3)
        took = time.perf_counter() - start
        again = _hand_timed_flops(256, 512, 384, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert 0.5 < probed / max(by_hand, again) and probed / min(by_hand, again) < 2
    assert took < 0.6  # the budget, warm-up included (one round of slack)


def test_split_matmuls_are_probed_beside_the_whole_ones():
    """Tensor parallelism divides each matmul's larger inner dimension (a column-parallel layer's outputs, a
    row-parallel one's inputs); the probe times the sets of shapes interleaved in one budget, each set its own
    figure: a skinny matmul runs far below a wide one on any device, and each figure is what a hand-timed loop of
    that shape gets."""
    shapes = [(512, 128, 512), (512, 512, 128)]  # the probe's (tokens, width, 4 x width) and back
    assert split_for_tp(shapes, 4) == [(512, 128, 128), (512, 128, 128)]
    assert tp_degrees(shapes, 8) == [2, 4, 8] and tp_degrees([(512, 96, 384)], 8) == [2, 4, 8]
    assert tp_degrees([(512, 20, 100)], 8) == [2, 4] and tp_degrees(shapes, 1) == []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wide, skinny = (256, 512, 384), (256, 512, 3)
        start = time.perf_counter()
        rates = probe_matmul_sets(torch.device("cpu"), torch.float32, [[wide], [skinny]], seconds=0.4)
        took = time.perf_counter() - start
        by_hand = [_hand_timed_flops(*shape, 0.2) for shape in (wide, skinny)]
    finally:
        torch.set_num_threads(threads)
    assert rates[1] < 0.5 * rates[0]
    for probed, timed in zip(rates, by_hand):
        assert 0.5 < probed / timed < 2, (rates, by_hand)
    assert took < 0.8
    hw = probe_hardware(torch.device("cpu"), torch.float32, shapes, matmul_seconds=0.2, tp_sizes=[4, 2, 1])
    assert [tp for tp, _ in hw.matmul_by_tp] == [2, 4] and all(f > 1e7 for _, f in hw.matmul_by_tp)
    assert "split for tp 2, 4" in hw.source
    with pytest.raises(ValueError, match=r"tp_sizes=\[0\] must be a list of positive ints"):
        probe_hardware(torch.device("cpu"), torch.float32, shapes, tp_sizes=[0])


def test_probe_matmul_cuts_shapes_too_large_for_the_budget():
    start = time.perf_counter()
    probed = probe_matmul(torch.device("cpu"), torch.float32, [(1 << 22, 256, 256)], seconds=0.2)  # 550 GFLOP
    assert time.perf_counter() - start < 1.0 and probed > 1e8


def test_probe_bad_input():
    with pytest.raises(ValueError, match=r"shapes=\[\] must be a non-empty list of \(m, k, n\)"):
        probe_matmul(torch.device("cpu"), torch.float32, [])
    with pytest.raises(ValueError, match=r"shapes=\[\(0, 4, 4\)\]"):
        probe_matmul(torch.device("cpu"), torch.float32, [(0, 4, 4)])
    with pytest.raises(ValueError, match="seconds=0 must be a positive number"):
        probe_matmul(torch.device("cpu"), torch.float32, [(4, 4, 4)], seconds=0)
    with pytest.raises(ValueError, match="needs an initialized process group"):
        probe_collectives({"world": None}, torch.device("cpu"))


def test_probe_hardware_one_process_sends_nothing():
    hw = probe_hardware(torch.device("cpu"), torch.float32, [(64, 64, 64)], matmul_seconds=0.1)
    assert hw.matmul_flops > 1e7 and hw.memory_bytes is None and hw.gpus_per_node == 1
    assert math.isinf(hw.intra_bandwidth) and hw.intra_latency == 0.0 and "1 rank" in hw.source
    assert hw.matmul_share == 1.0 and "step_share" not in hw.source  # the CPU: the raw rate


def test_a_probed_accelerator_predicts_at_the_device_tables_step_share(monkeypatch):
    """A probe times matmuls alone; a step's matmuls take the table's share of that rate and its other ops' bytes
    the table's share of the memory bandwidth (on an H200 the raw rate predicted 325 M-parameter steps at
    0.32-0.45 of their measured time): probed and tabled agree."""
    from lightning_par.devices import known_hardware
    from lightning_par.planner import probe

    assert probe.step_share(torch.device("cuda")) == MATMUL_STEP_SHARE
    h100 = known_hardware("H100-SXM", "bf16")
    assert h100.matmul_flops == pytest.approx(989e12 * 0.8 * probe.step_share(torch.device("cuda")))
    assert probe.step_share(torch.device("cpu")) == 1.0
    # the probe applies it to every rate it measured: the whole matmuls' and the tp splits' (here on the CPU, with
    # the measurement and the share stood in for, so that the arithmetic is what is checked)
    monkeypatch.setattr(probe, "probe_matmul_sets", lambda *a, **k: [100e9, 80e9])
    monkeypatch.setattr(probe, "step_share", lambda device: 0.5)
    hw = probe.probe_hardware(torch.device("cpu"), torch.float32, [(64, 64, 64)], tp_sizes=[2])
    assert (hw.matmul_flops, hw.matmul_by_tp, hw.matmul_share) == (50e9, ((2, 40e9),), 1.0)
    assert "step_share" in hw.source and hw.memory_bandwidth is None  # the CPU: its rate covers the other ops


# ---------------------------------------------------------------------------------------------------------------
# probe, 2 and 4 processes (gloo on loopback)
# ---------------------------------------------------------------------------------------------------------------
SHAPES = [(256, 512, 384)]


def _probe_worker(gpus_per_node: int) -> dict:
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")

    def alone() -> float | None:  # rank 0 alone; the others wait in the barrier (blocked on a socket, not spinning)
        dist.barrier()
        flops = probe_matmul(cpu, torch.float32, SHAPES, seconds=0.4) if dist.get_rank() == 0 else None
        dist.barrier()
        return flops

    before = alone()
    start = time.perf_counter()
    hw = probe_hardware(cpu, torch.float32, SHAPES, gpus_per_node=gpus_per_node, matmul_seconds=0.4,
                        comm_seconds=0.6, tp_sizes=[2])
    took = time.perf_counter() - start
    after = alone()  # the machine is shared with other work: one process alone, before and after
    world = probe_collectives({"world": None}, cpu, seconds=0.3)
    out = {"alone": None if before is None else max(before, after), "hw": hw, "took": took, "world": world}
    if dist.get_world_size() == 4:  # the same 4 ranks as one node: groups of 2 measured, adjacent and 2 apart
        out["one_node"] = probe_hardware(cpu, torch.float32, SHAPES, gpus_per_node=4, matmul_seconds=0.1,
                                         comm_seconds=0.6)
        out["members"] = {name: dist.get_process_group_ranks(group)
                          for name, group in _shape_groups(group_shapes(4)).items()}
    return out


def _check_link(bandwidth: float, latency: float) -> None:
    assert 1e7 < bandwidth < 1e11 and 1e-6 < latency < 1e-1


@pytest.mark.parametrize("world_size, gpus_per_node", [(2, 2), (4, 2)])
def test_probe_on_gloo_is_the_same_on_every_rank(world_size, gpus_per_node):
    results = launch(world_size, _probe_worker, gpus_per_node, timeout=120)
    hw = results[0]["hw"]
    assert all(r["hw"] == hw for r in results) and all(r["world"] == results[0]["world"] for r in results)
    assert hw.gpus_per_node == gpus_per_node and hw.memory_bytes is None
    assert [tp for tp, _ in hw.matmul_by_tp] == [2] and hw.matmul_by_tp[0][1] > 1e7  # the mean of the ranks too
    _check_link(hw.intra_bandwidth, hw.intra_latency)
    _check_link(hw.inter_bandwidth, hw.inter_latency)
    _check_link(*results[0]["world"]["world"])
    if world_size == 2:
        assert (hw.inter_bandwidth, hw.inter_latency) == (hw.intra_bandwidth, hw.intra_latency)  # one node
        assert "one node" in hw.source
    else:
        assert "2 nodes" in hw.source
        # 4 single-threaded processes on fewer cores (2 on the development machine) share them: each gets about half
        # of what one process alone gets; with a core each (a GPU machine's 16) they do not
        if len(os.sched_getaffinity(0)) < world_size:
            assert hw.matmul_flops < 0.8 * results[0]["alone"], (hw.matmul_flops, results[0]["alone"])
        else:
            assert hw.matmul_flops > 0.5 * results[0]["alone"], (hw.matmul_flops, results[0]["alone"])
        assert hw.group_links == ()  # 2 ranks per node: the node is the only group shape within it
        one_node = results[0]["one_node"]
        assert all(r["one_node"] == one_node for r in results) and "one node" in one_node.source
        assert [(n, stride) for n, stride, _, _ in one_node.group_links] == [(2, 1), (2, 2)]
        for _, _, bandwidth, latency in one_node.group_links:
            _check_link(bandwidth, latency)
        assert [r["members"] for r in results] == [
            {"2x1": [0, 1], "2x2": [0, 2]}, {"2x1": [0, 1], "2x2": [1, 3]},
            {"2x1": [2, 3], "2x2": [0, 2]}, {"2x1": [2, 3], "2x2": [1, 3]}]
    assert max(r["took"] for r in results) < 6.0  # 0.4 s matmul + 0.6 s collectives + group set-up, on busy cores


def test_a_group_across_nodes_rings_over_as_many_nics_as_it_has_ranks_in_a_node():
    """NCCL spreads a ring's channels over the NICs of the group's ranks in a node: FSDP over 64 GPUs of 8 nodes
    moves its cross-node bytes through 8 NICs per node (8 x 50 GB/s, capped by NVLink's 450), a data-parallel group
    one rank per node (TP 8 inside) through one; all-to-alls and pipeline sends go through a rank's own NIC, an
    all-to-all's bytes for the other ranks of its node over NVLink meanwhile."""
    hw = known_hardware("H100-SXM", gpus_per_node=8, inter_link="ib-ndr400")
    fsdp = ParallelDims(dp_shard=64).resolve(64)
    assert fsdp.members_per_node("dp_shard", 8) == 8
    assert _link("dp_shard", fsdp, hw) == (64, 400e9, hw.inter_latency, 50e9, 8, 450e9, hw.intra_latency)
    over_tp = ParallelDims(dp_shard=8, tp=8).resolve(64)
    assert over_tp.members_per_node("dp_shard", 8) == 1
    assert _link("dp_shard", over_tp, hw)[1] == 50e9
    half = ParallelDims(dp_shard=32, tp=2).resolve(64)  # 4 ranks of each FSDP group per node
    assert _link("dp_shard", half, hw)[1] == 200e9
    assert ParallelDims(dp_shard=8).resolve(8).members_per_node("dp_shard", 8) == 8  # within one node: all
    # capped by the node-internal link, which joins the ranks that share the NICs
    slow_node = Hardware("mine", 1e14, None, 8, 100e9, 3e-6, 50e9, 1e-5, "by hand")
    assert slow_node.link(64, 1, within_node=False, members_per_node=8) == (100e9, 1e-5)
    # the time model: a ring collective at the group's bandwidth, an all-to-all at the rank's own NIC
    from lightning_par.costs.sheet import Transfer
    from lightning_par.planner.predict import _transfer_time
    gather = Transfer("fsdp_all_gather", "dp_shard", "all_gather", 64e9, 1, True)
    to_all = Transfer("ep_all_to_all", "dp_shard", "all_to_all", 64e9, 1, False)
    link = _link("dp_shard", fsdp, hw)
    assert _transfer_time(gather, *link) == pytest.approx(63 / 64 * 64e9 / 400e9 + 63 * hw.inter_latency)
    # 56 of its 64 shares leave the node through the NIC; 7 cross NVLink meanwhile, one stays
    assert _transfer_time(to_all, *link) == pytest.approx(56 / 64 * 64e9 / 50e9 + 63 * hw.inter_latency)
    assert _transfer_time(to_all, *link[:4]) == pytest.approx(63 / 64 * 64e9 / 50e9 + 63 * hw.inter_latency)
    # expert parallelism over two nodes: half of each all-to-all stays in the node
    ep16 = ParallelDims(dp_shard=16, ep=16).resolve(16)
    experts = Transfer("all_to_all", "ep", "all_to_all", 64e9, 1, False)
    assert _link("ep", ep16, hw)[4:] == (8, 450e9, hw.intra_latency)
    assert _transfer_time(experts, *_link("ep", ep16, hw)) == pytest.approx(8 / 16 * 64e9 / 50e9
                                                                           + 15 * hw.inter_latency)
    # within one node: every byte over NVLink
    ep8 = ParallelDims(dp_shard=8, ep=8).resolve(8)
    assert _transfer_time(experts, *_link("ep", ep8, hw)) == pytest.approx(7 / 8 * 64e9 / 450e9
                                                                          + 7 * hw.intra_latency)

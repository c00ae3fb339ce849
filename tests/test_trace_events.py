"""Reading torch.profiler events on every torch the project claims, checked on real traces.

``events_from_profiler`` reads kineto's event list directly (private API). ``_KinetoEvent.activity_type()``
exists from torch 2.12 on; before, the activity type is rebuilt from methods every version has. These tests
profile a real 2-process gloo job (FSDP2 plus plain collectives) and check the classification against what the
job did, compare the two ways of reading the activity type on the same events (where torch has both), and fail
loudly if the private API changes. Checked on torch 2.11.0 (fallback) and 2.13.0 (``activity_type()``).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from launch import launch

from lightning_par.callbacks import intervals as iv
from lightning_par.callbacks.trace import (
    MONITOR_MARK,
    activity_without_activity_type,
    classify,
    events_from_profiler,
    kineto_activity,
    kineto_events,
    to_trace_event,
)

TORCH_MINOR = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
HAS_ACTIVITY_TYPE = hasattr(torch._C._autograd._KinetoEvent, "activity_type")
#: the activity types ``classify`` reads; the fallback must agree with ``activity_type()`` on these exactly
READ_ACTIVITIES = {
    "cpu_op",
    "user_annotation",
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "cuda_runtime",
    "cuda_driver",
    "python_function",  # skipped: reading a Python call as an op would add its time to compute
}
STEPS = 2
WIDTH = 64
BIG = 256 * 1024  # floats in the plain collectives, large enough to take measurable time


def activity_pairs(events: list[Any]) -> collections.Counter:
    """(``activity_type()`` or None where torch lacks it, the fallback's answer) for every kineto event."""
    return collections.Counter(
        (e.activity_type() if HAS_ACTIVITY_TYPE else None, activity_without_activity_type(e)) for e in events
    )


def disagreements(pairs: collections.Counter) -> dict:
    """Pairs where the fallback reads a type the analysis uses differently from ``activity_type()``."""
    return {
        (truth, guess): n
        for (truth, guess), n in pairs.items()
        if truth != guess and (truth in READ_ACTIVITIES or guess in READ_ACTIVITIES)
    }


# ---------------------------------------------------------------------------------------------------------------
# a real 2-process gloo job
# ---------------------------------------------------------------------------------------------------------------
def profile_gloo_job() -> dict[str, Any]:
    """Each profiled step: FSDP2 forward/backward/SGD, an all-reduce inside ``TP::manual``, a bare all-reduce,
    a broadcast inside the monitors' own range (to be left out), a send/recv pair, and a matmul."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(2)])
    mesh = init_device_mesh("cpu", (2,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, WIDTH)
    big = torch.ones(BIG)
    a = torch.randn(128, 128)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.profiler.record_function("TP::manual"):
            dist.all_reduce(big)
        dist.all_reduce(big)
        with torch.profiler.record_function(MONITOR_MARK):
            dist.broadcast(big, src=0)
        if rank == 0:
            dist.send(big, dst=1)
        else:
            dist.recv(big, src=0)
        torch.mm(a, a)

    step()  # warm-up outside the profile
    cpu = torch.profiler.ProfilerActivity.CPU
    # with_stack and profile_memory add Python-call and memory events, which the reading must skip on every torch
    with torch.profiler.profile(activities=[cpu], with_stack=True, profile_memory=True) as prof:
        for _ in range(STEPS):
            with torch.profiler.record_function("lightning_par::step"):
                step()
    raw = kineto_events(prof)
    events = events_from_profiler(prof)
    fallback = [ev for e in raw if (ev := to_trace_event(e, activity_without_activity_type(e))) is not None]
    return {
        "pairs": activity_pairs(raw),
        "events": events,
        "trace": classify(events),
        "fallback_events": fallback,
        "fallback_trace": classify(fallback),
    }


@pytest.fixture(scope="module")
def gloo_job() -> list[dict[str, Any]]:
    return launch(2, profile_gloo_job, timeout=240)


def spans(events: list, name: str) -> list[iv.Interval]:
    return iv.merge([(e.start, e.end) for e in events if e.name == name])


def covered(inner: list[iv.Interval], outer: list[iv.Interval]) -> bool:
    return iv.total(iv.intersect(inner, outer)) == iv.total(inner)


@pytest.mark.parametrize("rank", [0, 1])
def test_gloo_job_activities_are_read_alike_on_every_torch(gloo_job, rank):
    r = gloo_job[rank]
    activities = {e.activity for e in r["events"]}
    assert {"cpu_op", "user_annotation"} <= activities, activities
    assert "python_function" not in activities  # Python calls are not ops: skipped on every torch
    assert not any(e.on_gpu for e in r["events"])
    assert all(e.start <= e.end for e in r["events"])
    # the fallback reads the same events as the same activities, and the analysis gives the same answer
    # (below torch 2.12 both are the fallback: then the other tests here are what checks it)
    assert r["fallback_events"] == r["events"]
    assert r["fallback_trace"] == r["trace"]
    if HAS_ACTIVITY_TYPE:
        assert disagreements(r["pairs"]) == {}
        truths = {truth for truth, _ in r["pairs"]}  # the comparison saw each kind it is about
        assert {"cpu_op", "user_annotation", "python_function", "cpu_instant_event"} <= truths, truths
    steps = [e for e in r["events"] if e.name == "lightning_par::step"]
    assert len(steps) == STEPS and all(e.activity == "user_annotation" for e in steps)


@pytest.mark.parametrize("rank", [0, 1])
def test_gloo_job_communication_is_classified_by_kind(gloo_job, rank):
    r = gloo_job[rank]
    events, t = r["events"], r["trace"]
    all_gather = spans(events, "gloo:all_gather")
    all_reduce = spans(events, "gloo:all_reduce")
    broadcast = spans(events, "gloo:broadcast")
    p2p = spans(events, "gloo:send" if rank == 0 else "gloo:recv")
    assert all_gather and all_reduce and broadcast and p2p, sorted({e.name for e in events if "gloo" in e.name})
    kinds = t.comm_by_kind
    # every kind the job issued, and no other: the broadcast ran inside the monitors' range and is left out
    assert set(kinds) == {"fsdp_all_gather", "fsdp_reduce_scatter", "tp", "all_reduce", "pp_send_recv"}
    assert all(kinds.values())
    # FSDP's all-gathers are all the job's all-gathers; its reduce-scatters run as gloo all-reduces, as do the
    # TP-annotated and the bare all-reduce: the three kinds cover exactly the gloo:all_reduce events
    assert kinds["fsdp_all_gather"] == all_gather
    assert iv.merge(kinds["fsdp_reduce_scatter"] + kinds["tp"] + kinds["all_reduce"]) == all_reduce
    assert kinds["pp_send_recv"] == p2p
    assert iv.total(iv.intersect(broadcast, t.comm)) == 0
    assert t.comm == iv.merge(all_gather + all_reduce + p2p)
    # communication lies inside the window of measured steps
    assert t.steps == sorted((e.start, e.end) for e in events if e.name == "lightning_par::step")
    window = [(t.steps[0][0], t.steps[-1][1])]
    assert covered(t.comm, window)
    # each step issued the TP-annotated all-reduce, then the bare one: matched to their enqueues in that order
    assert len(kinds["tp"]) == len(kinds["all_reduce"]) == STEPS
    for step, tp, bare in zip(t.steps, kinds["tp"], kinds["all_reduce"]):
        assert step[0] <= tp[0] and tp[1] <= bare[0] and bare[1] <= step[1], (step, tp, bare)


@pytest.mark.parametrize("rank", [0, 1])
def test_gloo_job_compute_is_the_main_threads_ops(gloo_job, rank):
    r = gloo_job[rank]
    events, t = r["events"], r["trace"]
    gloo_threads = {e.track for e in events if e.name in ("gloo:all_gather", "gloo:all_reduce", "gloo:broadcast")}
    main = {e.track for e in events if e.name == "lightning_par::step"}
    assert len(main) == 1 and not main & gloo_threads
    main_ops = iv.merge([(e.start, e.end) for e in events if e.track in main and e.activity == "cpu_op"])
    assert t.compute and covered(t.compute, main_ops)  # no compute from the gloo threads or from annotations
    matmuls = spans([e for e in events if e.track in main], "aten::mm")
    assert len(matmuls) >= STEPS and covered(matmuls, t.compute)  # the step's matmuls are compute
    # the main thread computes nothing while it waits in a synchronous collective: neither annotations
    # (``TP::manual``) nor Python calls (recorded here, with_stack=True) may be read as ops
    waits = t.comm_by_kind["tp"] + t.comm_by_kind["all_reduce"] + t.comm_by_kind["pp_send_recv"]
    assert iv.total(iv.intersect(t.compute, iv.merge(waits))) == 0


# ---------------------------------------------------------------------------------------------------------------
# the private API the fast path reads
# ---------------------------------------------------------------------------------------------------------------
def profile_small(device: str) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    a = torch.randn(64, 64, device=device)
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("lightning_par::step"):
            b = torch.mm(a, a)
            b.cpu()  # a device-to-host copy on CUDA
            if device == "cuda":
                torch.cuda.synchronize()
    return prof


def test_private_kineto_api_the_fast_path_reads():
    """Fails loudly when torch changes what ``kineto_events``/``kineto_activity`` rely on (checked on 2.11.0,
    2.13.0): ``prof.profiler.kineto_results.events()``, the ``_KinetoEvent`` methods below, and
    ``activity_type()``, which torch 2.12 added (pytorch PR #178086)."""
    events = kineto_events(profile_small("cpu"))
    assert events, "prof.profiler.kineto_results.events() returned no events"
    used = ["name", "device_type", "device_index", "device_resource_id", "start_thread_id", "start_ns"]
    used += ["duration_ns", "correlation_id", "is_user_annotation"]
    missing = [m for m in used if not callable(getattr(events[0], m, None))]
    assert not missing, f"torch {torch.__version__}: _KinetoEvent lost {missing}; update callbacks/trace.py"
    assert HAS_ACTIVITY_TYPE == (TORCH_MINOR >= (2, 12)), (
        f"torch {torch.__version__}: _KinetoEvent.activity_type() is {'present' if HAS_ACTIVITY_TYPE else 'absent'}"
        f"; it appeared in 2.12. Check kineto_activity in callbacks/trace.py."
    )
    by_name = {e.name(): e for e in events}
    assert kineto_activity(by_name["lightning_par::step"]) == "user_annotation"
    assert kineto_activity(by_name["aten::mm"]) == "cpu_op"
    assert by_name["aten::mm"].correlation_id() > 0  # the fallback tells ops from Python calls by it
    if HAS_ACTIVITY_TYPE:
        assert all(isinstance(e.activity_type(), str) for e in events)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_ACTIVITY_TYPE, reason="needs activity_type() (torch >= 2.12) to compare with")
def test_fallback_agrees_with_activity_type_on_a_cuda_trace():
    pairs = activity_pairs(kineto_events(profile_small("cuda")))
    assert disagreements(pairs) == {}, pairs
    truths = {truth for truth, _ in pairs}
    assert {"kernel", "gpu_memcpy", "cuda_runtime", "user_annotation"} <= truths, truths


def test_events_from_profiler_needs_a_stopped_profile():
    with pytest.raises(ValueError, match="`prof`.*kineto results"):
        events_from_profiler(torch.profiler.profile())

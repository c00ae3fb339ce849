"""Pipeline parallelism without Lightning: splitting, every schedule's parity with one process, local-only
materialization, checkpoints across pp sizes, the timeline recorder, and every bad input."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from example_projects.gpt.model import GPT
from lightning_par.techniques.pipeline.pipeline import (
    build_schedule,
    plan_split,
    stage_ids,
    validate_pipeline,
)
from lightning_par.techniques.pipeline.pipeline_live import LivePipeline, plan_stages
from lightning_par.techniques.pipeline.schedule_recorder import COMPUTE, draw_timeline, figure_to_array, theory_idle
from tests.launch import launch
from tests.pipeline_workers import MB, gpt_config, reference, train_layouts

warnings.filterwarnings("ignore", category=FutureWarning)

N_LAYER, STEPS, TOL = 8, 5, 1e-5
SCHEDULES_ALL = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
# every schedule at m=4 (m=8 for zbv at pp=4, which holds 8 stages), plus m=1: layer-split model parallelism
LAYOUTS = {2: [(s, 4) for s in SCHEDULES_ALL] + [("gpipe", 1), ("interleaved_1f1b", 1)],
           4: [(s, 4) for s in SCHEDULES_ALL[:-1]] + [("zbv", 8), ("gpipe", 1), ("interleaved_zb", 2)]}


@functools.lru_cache
def ref(batch: int) -> dict:
    return reference(N_LAYER, STEPS, batch)


def nbytes(model: nn.Module, names: list[str]) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() * params[n].element_size() for n in names)


def check_layouts(results: list[dict], pp: int) -> None:
    full = GPT(gpt_config(N_LAYER))
    full_bytes = nbytes(full, [n for n, _ in full.named_parameters()])
    for schedule, m in LAYOUTS[pp]:
        name = f"{schedule}/m{m}"
        expected = ref(MB * m)
        for rank, res in enumerate(results):
            losses = res[name]["losses"]  # every rank reports the last stage's loss
            assert len(losses) == STEPS
            diffs = [abs(a - b) for a, b in zip(losses, expected["losses"])]
            assert max(diffs) <= TOL, (name, rank, diffs)
        merged: dict[str, torch.Tensor] = {}
        for res in results:
            local = res[name]["params"]
            assert not merged.keys() & local.keys(), f"{name}: a parameter lives on two ranks"
            merged.update(local)
            # materialization: a rank holds exactly its stages' parameters, nothing of the others
            stage_fqns = [f for s in res[name]["stage_ids"] for f in res[name]["fqns"][s]]
            assert sorted(local) == sorted(stage_fqns)
            assert res[name]["param_bytes"] == nbytes(full, stage_fqns) < full_bytes
        assert merged.keys() == expected["params"].keys(), name  # 1:1 with the original FQNs
        worst = max((merged[k] - v).abs().max().item() for k, v in expected["params"].items())
        assert worst <= TOL, (name, worst)
        placement = [res[name]["stage_ids"] for res in results]
        spr = 1 if schedule in ("gpipe", "1f1b") else 2
        assert placement == [stage_ids(r, pp, spr, "v" if schedule == "zbv" else "loop") for r in range(pp)]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pp_ckpt") / "pp2")


@pytest.fixture(scope="module")
def pp2_results(ckpt_dir: str) -> list[dict]:
    return launch(2, train_layouts, N_LAYER, LAYOUTS[2], STEPS, ckpt_dir)


def test_parity_pp2_every_schedule(pp2_results: list[dict]) -> None:
    check_layouts(pp2_results, 2)


def test_checkpoint_pp2_loads_under_pp1_and_pp4(pp2_results: list[dict], ckpt_dir: str) -> None:
    """Saved by two ranks under the original FQNs; loads into the unsplit model and into four stages."""
    first = f"{LAYOUTS[2][0][0]}/m{LAYOUTS[2][0][1]}"
    saved = {k: v for res in pp2_results for k, v in res[first]["params"].items()}
    single = GPT(gpt_config(N_LAYER))
    state = single.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)  # no process group: one process reads every shard
    assert all(torch.equal(state[k], v) for k, v in saved.items()) and state.keys() == saved.keys()
    results = launch(4, train_layouts, N_LAYER, LAYOUTS[4], STEPS, None, ckpt_dir)
    check_layouts(results, 4)  # pp=4 parity, same launch
    loaded = {k: v for res in results for k, v in res["loaded"].items()}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_timeline_events_and_idle(pp2_results: list[dict]) -> None:
    """The recorded last step of each pp=2 layout: every (stage, micro-batch) once per kind, ordered, idle in
    [0, 1] and equal to the gaps between compute; the picture renders."""
    kinds = {"gpipe": {"forward", "backward"}, "1f1b": {"forward", "backward"},
             "interleaved_1f1b": {"forward", "backward"},
             "interleaved_zb": {"forward", "backward_input", "backward_weight"},
             "zbv": {"forward", "backward_input", "backward_weight"}}
    for schedule, m in LAYOUTS[2]:
        name = f"{schedule}/m{m}"
        for res in pp2_results:
            out = res[name]["timeline"]
            start, end = out["window"]
            events = out["events"]
            assert 0.0 <= out["idle"] <= 1.0
            assert [e.t0 for e in events] == sorted(e.t0 for e in events)
            assert all(start <= e.t0 <= e.t1 <= end for e in events)
            compute = [e for e in events if e.kind in COMPUTE]
            assert all(a.t1 <= b.t0 for a, b in zip(compute, compute[1:])), "compute events overlap"
            # zero-bubble schedules may fuse I and W into a full backward where nothing waits for W
            assert {"forward"} < {e.kind for e in compute} <= kinds[schedule] | {"backward"}, name
            got = sorted((e.stage, e.microbatch) for e in compute if e.kind == "forward")
            assert got == sorted((s, mb) for s in res[name]["stage_ids"] for mb in range(m)), name
            got = sorted((e.stage, e.microbatch) for e in compute if e.kind in ("backward", "backward_input"))
            assert got == sorted((s, mb) for s in res[name]["stage_ids"] for mb in range(m)), name
            busy = sum(e.t1 - e.t0 for e in compute)
            idle = sum(e.t1 - e.t0 for e in events if e.kind == "idle")
            assert abs(busy + idle - (end - start)) < 1e-6
            assert abs(out["idle"] - idle / (end - start)) < 1e-6
            forward_at = {(e.stage, e.microbatch): e.t0 for e in compute if e.kind == "forward"}
            assert all(forward_at[(e.stage, e.microbatch)] < e.t0 for e in compute if e.kind != "forward")
        timelines = pp2_results[0][name]["timeline"]["all"]
        assert len(timelines) == 2 and min(e.t0 for tl in timelines for e in tl) == 0.0
    image = figure_to_array(draw_timeline(timelines, name, m))
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.std() > 0
    # the bad layout raised on both ranks before any communication
    assert all("batch size 6 is not divisible by n_microbatches=4" in r["error"] for r in pp2_results)


def test_theory_idle() -> None:
    assert theory_idle("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert theory_idle("1f1b", 2, 8) == pytest.approx(1 / 9)
    assert theory_idle("interleaved_1f1b", 4, 4, 2) < theory_idle("1f1b", 4, 4)


# ---- bad input: all raised before any communication (no process group here) --------------------------------------


def meta_gpt(n_layer: int = 4) -> nn.Module:
    with torch.device("meta"):
        return GPT(gpt_config(n_layer))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(schedule="pipedream", pp=2, n_microbatches=4, num_blocks=4), r"schedule='pipedream'.*'1f1b'.*'zbv'"),
        (dict(schedule="gpipe", pp=8, n_microbatches=8, num_blocks=4), r"pp=8 needs 8 stages.*only 4 blocks"),
        (dict(schedule="interleaved_1f1b", pp=2, n_microbatches=4, num_blocks=3),
         r"2 stages per rank.*needs 4 stages.*only 3 blocks.*'gpipe', '1f1b'"),
        (dict(schedule="interleaved_zb", pp=4, n_microbatches=8, num_blocks=6), r"needs 8 stages.*only 6 blocks"),
        (dict(schedule="zbv", pp=2, n_microbatches=4, num_blocks=3), r"needs 4 stages.*only 3 blocks"),
        (dict(schedule="zbv", pp=2, n_microbatches=4, num_blocks=8, stages_per_rank=3),
         r"stages_per_rank=3.*exactly 2"),
        (dict(schedule="1f1b", pp=4, n_microbatches=2, num_blocks=4), r"n_microbatches=2.*'1f1b'.*>= 4.*'gpipe'"),
        (dict(schedule="interleaved_1f1b", pp=4, n_microbatches=9, num_blocks=8),
         r"n_microbatches=9.*rounds.*multiple of 4"),
        (dict(schedule="gpipe", pp=2, n_microbatches=4, num_blocks=4, batch_size=6),
         r"batch size 6 is not divisible by n_microbatches=4"),
        (dict(schedule="gpipe", pp=0, n_microbatches=4, num_blocks=4), r"pp=0 must be a positive int"),
        (dict(schedule="gpipe", pp=2, n_microbatches=0, num_blocks=4), r"n_microbatches=0 must be a positive int"),
    ],
)
def test_validate_pipeline_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_pipeline(**kwargs)


def test_validate_accepts_what_torch_runs() -> None:
    assert validate_pipeline("interleaved_1f1b", 4, 10, 8) == 2  # torch 2.13: 2 rounds of 5
    assert validate_pipeline("zbv", 2, 1, 4) == 2  # ZBV runs fewer micro-batches than stages
    assert validate_pipeline("gpipe", 2, 1, 2) == 1  # layer-split model parallelism


def test_split_plan_even_uneven_and_user_points() -> None:
    model = meta_gpt(7)
    assert plan_split(model, 3) == ["blocks.3", "blocks.5"]  # 3 + 2 + 2: the first stages take the remainder
    assert plan_split(model, 2, ["blocks.1"]) == ["blocks.1"]  # uneven: 1 + 6
    with pytest.raises(ValueError, match=r"gives 2 stages.*needs 3"):
        plan_split(model, 3, ["blocks.2"])
    with pytest.raises(ValueError, match=r"\['head'\] are not blocks of 'blocks'"):
        plan_split(model, 2, ["head"])
    with pytest.raises(ValueError, match=r"not blocks.*other than the first"):
        plan_split(model, 2, ["blocks.0"])
    with pytest.raises(ValueError, match=r"distinct and in model order"):
        plan_split(model, 3, ["blocks.4", "blocks.2"])
    with pytest.raises(ValueError, match=r"num_stages=8 is more than the 7 blocks"):
        plan_split(model, 8)
    assert stage_ids(1, 4, 2, "v") == [1, 6] and stage_ids(1, 4, 2) == [1, 5]


def test_block_list_not_found_says_what_to_pass() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"pass `block_list="):
        plan_split(model, 2)
    with pytest.raises(ValueError, match=r"block_list='layers' names no submodule"):
        LivePipeline(meta_gpt(), schedule="gpipe", pp_rank=0, pp=2, n_microbatches=2, group=None,
                     device=torch.device("cpu"), block_list="layers")


def test_bad_layout_is_refused_before_any_communication() -> None:
    with pytest.raises(ValueError, match=r"choose one of"):
        LivePipeline(meta_gpt(), schedule="gpipe2", pp_rank=0, pp=2, n_microbatches=4, group=None,
                     device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"choose one of"):
        build_schedule("bfs", [], 4, None)


def test_partition_puts_glue_on_the_first_and_last_stage() -> None:
    """Registration order decides: embeddings before the block list go to stage 0, norm and head to the last."""
    plan = plan_stages(meta_gpt(4), 2)
    assert plan.owners == [["tok_emb", "pos_emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "head"]]
    assert "head.weight" in plan.tensors[1] and "tok_emb.weight" in plan.tensors[0]

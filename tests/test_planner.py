"""The planner: every layout it names is one the engine accepts; its memory predictions against the real sharded
tensors and saved activations of those layouts (world 4); AutoParallelStrategy training the layout it chose in
parity with the same layout by hand; the CLI; the picture; and what is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hf_models import HFCausalLM
from launch import launch
from planner_workers import auto_then_by_hand, measure
from torch import nn
from workers import GLOBAL_BATCH, TINY_GPT

from example_projects.gpt.lit import GPTModule
from lightning_par import AutoParallelStrategy, NDParallelStrategy, plan_layouts
from lightning_par.costs.profile import profile_model
from lightning_par.costs.sheet import CostSheet
from lightning_par.devices import Hardware, known_hardware
from lightning_par.planner import search
from lightning_par.planner.predict import Layout, Prediction, account, check_profile_precision, predict
from lightning_par.planner.probe import probe_shapes
from lightning_par.planner.search import SPEED_RESOLUTION, _dimensions, zero2_twins
from lightning_par.strategies.auto import _recipe_options
from lightning_par.techniques import build_recipe

ROOT = Path(__file__).resolve().parents[1]
CPU = Hardware("cpu", 2e10, None, 4, 2e9, 2e-5, 2e9, 2e-5, "a fixed stand-in for tests")
LAYOUTS = {  # world 4, the tiny GPT with 4 blocks: one of each technique and their mixes
    "dp_shard4": dict(dp_shard=4),
    "hsdp_2x2": dict(dp_replicate=2, dp_shard=2),
    "tp4_sp_lp": dict(dp_shard=1, tp=4, sequence_parallel=True, loss_parallel=True),
    "tp4_sp_lp_regather": dict(dp_shard=1, tp=4, sequence_parallel=True, loss_parallel=True, regather_sequence=True),
    "dp2_x_tp2_sp_regather": dict(dp_shard=2, tp=2, sequence_parallel=True, regather_sequence=True),
    "dp2_x_tp2": dict(dp_shard=2, tp=2),
    "cp4": dict(dp_shard=1, cp=4),
    "dp2_x_cp2": dict(dp_shard=2, cp=2),
    "pp4_1f1b": dict(dp_shard=1, pp=4, pp_schedule="1f1b", pp_microbatches=4),
    "pp2_x_dp2": dict(dp_shard=2, pp=2, pp_schedule="1f1b", pp_microbatches=2),
    "pp2_x_tp2_interleaved": dict(dp_shard=1, pp=2, tp=2, pp_schedule="interleaved_1f1b", pp_microbatches=4),
    "dp4_ac": dict(dp_shard=4, activation_checkpointing=True),
    "dp2_x_tp2_ac": dict(dp_shard=2, tp=2, activation_checkpointing=True),
    "dp4_sac": dict(dp_shard=4, activation_checkpointing="selective"),
    "dp2_x_tp2_sp_sac": dict(dp_shard=2, tp=2, sequence_parallel=True, activation_checkpointing="selective"),
    # the example's mixture of experts: 4 experts split over ep2, FSDP-sharded over the other 2 (efsdp)
    "dp4_ep2_moe": dict(dp_shard=4, ep=2, model=dict(n_experts=4, moe_top_k=2)),
}
MOE = dict(n_experts=4, moe_top_k=2)


def gpt(n_layer: int = 4, **model: object) -> GPTModule:
    module = GPTModule(**{**TINY_GPT, "n_layer": n_layer, **model})
    module.configure_model()
    return module


def batch(n: int = GLOBAL_BATCH, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(n, seq, dtype=torch.long)
    return ids, ids


# ---- enumeration and validity (one process) ---------------------------------------------------------------------
@pytest.mark.parametrize("world", [4, 8])
def test_every_named_layout_is_one_the_engine_accepts(world):
    plan = plan_layouts(gpt(), batch(), world, CPU)
    assert len(plan.predictions) >= 10
    names = {str(p.layout) for p in plan.predictions}
    assert len(names) == len(plan.predictions), "a layout listed twice"
    for p in plan.predictions:
        layout = p.layout
        assert layout.world_size == world
        strategy = NDParallelStrategy(**layout.strategy_kwargs())
        dims = layout.dims().resolve(world)
        # what a user builds from the layout is what auto_parallel trains (selective checkpointing stays selective)
        chosen = build_recipe(**_recipe_options(layout))
        assert [t.describe(dims) for t in strategy.techniques] == [t.describe(dims) for t in chosen], str(layout)
        for technique in strategy.techniques:
            technique.check(dims)
        assert GLOBAL_BATCH % layout.dp == 0 and 16 % (2 * layout.cp) == 0
    # every dimension appears; the tiny GPT's 4 heads allow tp <= 4
    for dim in ("dp_shard", "tp", "cp", "pp"):
        assert any(getattr(p.layout, dim) > 1 for p in plan.predictions), dim


def test_strategy_kwargs_carry_every_option_as_the_layout_has_it():
    """The one translation of a layout into strategy options (auto_parallel uses it too): selective checkpointing
    stays selective, not full."""
    layout = Layout(pp=2, tp=2, pp_schedule="interleaved_1f1b", pp_microbatches=4, pp_stages_per_rank=4,
                    activation_checkpointing="selective", sequence_parallel=True, loss_parallel=True)
    assert layout.strategy_kwargs() == dict(
        dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=4,
        pp_stages_per_rank=4, activation_checkpointing="selective", sequence_parallel=True, loss_parallel=True)
    assert NDParallelStrategy(**layout.strategy_kwargs()).activation_checkpointing.mode == "selective"


def test_experts_are_profiled_and_priced_under_expert_parallelism():
    """The profile finds the experts (the ep sizes that fit divide their count) and the rows routed to them; under
    ep2 FSDP gathers each rank's half of the experts over efsdp, the dispatch adds its all-to-alls, and the state
    per rank stays as FSDP alone would leave it."""
    profile = profile_model(gpt(**MOE), batch())
    assert profile.num_experts == 4
    expert_bytes = sum(p.numel * p.itemsize for p in profile.params if p.expert and p.section == "model.blocks.0")
    experts = gpt(**MOE).model.blocks[0].mlp.experts
    assert expert_bytes == sum(w.numel() * 4 for w in experts.parameters()) > 0  # fp32
    tokens = GLOBAL_BATCH * 16
    assert all(profile.sections[b].routed_bytes == tokens * 2 * TINY_GPT["n_embd"] * 4 for b in profile.blocks)
    plain, split = (account(Layout(dp_shard=4, ep=ep), profile, GLOBAL_BATCH // 4, 16, "32-true") for ep in (1, 2))
    assert not any(t.kind == "all_to_all" for t in plain.transfers)
    # per block its own messages (each pays the link's latency): the rows out and back in forward and backward,
    # and the counts (E int64) before them
    a2a, counts = [t for t in split.transfers if t.kind == "all_to_all"]
    assert (a2a.dim, a2a.nbytes, a2a.count) == ("ep", tokens / 4 * 2 * TINY_GPT["n_embd"] * 4, 4 * 4)
    assert (counts.dim, counts.nbytes, counts.count) == ("ep", 4 * 8, 4)
    gathers = {t.dim: t for t in split.transfers if t.kind == "fsdp_all_gather"}
    assert gathers["efsdp"].nbytes == expert_bytes / 2 and gathers["efsdp"].count == 2 * 4  # fwd + bwd, 4 blocks
    # the blocks' units (4 blocks x 2 gathers) lose their experts; the root's (2 gathers) stays
    whole = {t.count: t.nbytes for t in plain.transfers if t.kind == "fsdp_all_gather"}
    assert {t.count: t.nbytes for t in split.transfers if t.kind == "fsdp_all_gather" and t.dim == "dp_shard_cp"} == {
        8: whole[8] - expert_bytes, 2: whole[2]}
    one, two = (predict(Layout(dp_shard=4, ep=ep), profile, CPU, GLOBAL_BATCH // 4, 16) for ep in (1, 2))
    assert one.model_state == two.model_state and two.buffers < one.buffers
    # recomputation: full checkpointing runs the dispatch again; selective keeps its two outputs per block
    AC = {"none": False, "full": True, "selective": "selective"}
    def sent(mode: str) -> tuple[float, float]:  # the rows' messages, the counts' messages (recomputed included)
        transfers = [t for t in account(Layout(dp_shard=4, ep=2, activation_checkpointing=AC[mode]), profile,
                                        GLOBAL_BATCH // 4, 16, "32-true").transfers if t.kind == "all_to_all"]
        return (sum(t.count for t in transfers if t.nbytes == a2a.nbytes),
                sum(t.count for t in transfers if t.nbytes == counts.nbytes))
    assert {mode: sent(mode) for mode in AC} == {"none": (16, 4), "full": (24, 8), "selective": (16, 8)}
    kept = [predict(Layout(dp_shard=4, ep=ep, activation_checkpointing="selective"), profile, CPU, GLOBAL_BATCH // 4,
                    16).activations for ep in (1, 2)]
    assert kept[1] - kept[0] == pytest.approx(4 * 2 * tokens / 4 * 2 * TINY_GPT["n_embd"] * 4)  # 4 blocks
    plan = plan_layouts(gpt(**MOE), batch(), 4, CPU)
    assert {p.layout.ep for p in plan.predictions} == {1, 2, 4}
    assert all(p.layout.dp_shard * p.layout.cp % p.layout.ep == 0 for p in plan.predictions)
    assert {p.layout.ep for p in plan_layouts(profile, batch(), 4, CPU, restrict={"ep": [1]}).predictions} == {1}
    assert Layout(dp_shard=4, ep=2).strategy_kwargs()["ep"] == 2 and "ep2" in str(Layout(dp_shard=4, ep=2))
    assert {p.layout.ep for p in plan_layouts(gpt(), batch(), 4, CPU).predictions} == {1}  # dense: no ep


def test_restrict_and_the_reasons_for_what_was_left_out():
    plan = plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [1], "tp": [1]})
    assert {(p.layout.pp, p.layout.tp) for p in plan.predictions} == {(1, 1)}
    assert plan.skipped["restricted"] > 0
    with pytest.raises(ValueError, match=r"restrict=.*\['dp'\] are not layout dimensions"):
        plan_layouts(gpt(), batch(), 4, CPU, restrict={"dp": [2]})
    for bare in (2, "2", ["2"]):
        with pytest.raises(TypeError, match=r"'tp' takes the sizes to allow, a list of ints such as \{'tp': \[2\]\}"):
            plan_layouts(gpt(), batch(), 4, CPU, restrict={"tp": bare})
    with pytest.raises(TypeError, match=r"schedules='1f1b' must be a sequence of schedule names, e.g. \('1f1b',\)"):
        plan_layouts(gpt(), batch(), 4, CPU, schedules="1f1b")
    # a misspelt schedule is named, not taken for pipelines that do not fit
    with pytest.raises(ValueError, match=r"schedules=\('1fb1',\): \['1fb1'\] are not pipeline schedules; choose "
                                         r"from \['1f1b', 'gpipe'"):
        plan_layouts(gpt(), batch(), 4, CPU, schedules=("1fb1",))


def test_replicas_smaller_than_a_node_only_where_restrict_forbids_sharding_them():
    """dp_replicate 4 on one node moves what dp_shard 4 moves, plus whole gradients: left out, unless ``restrict``
    keeps dp_shard at 1 (plain data parallelism, as Megatron-LM ran its published layouts)."""
    only_dp = {"pp": [1], "tp": [1], "cp": [1]}
    free = plan_layouts(gpt(), batch(), 4, CPU, restrict=only_dp)
    assert {(p.layout.dp_replicate, p.layout.dp_shard) for p in free.predictions} == {(1, 4)}
    assert free.skipped["replicas smaller than a node (use dp_shard)"] > 0
    plain = plan_layouts(gpt(), batch(), 4, CPU, restrict={**only_dp, "dp_shard": [1]})
    assert {(p.layout.dp_replicate, p.layout.dp_shard) for p in plain.predictions} == {(4, 1)}
    whole = predict(Layout(), plain.profile, CPU, GLOBAL_BATCH, 16)  # one process: the full replica
    assert plain.best.model_state == whole.model_state  # nothing sharded
    assert NDParallelStrategy(**plain.best.layout.strategy_kwargs()).dims.dp_replicate == 4


def test_pipelines_weigh_micro_batches_down_to_one_sample():
    """Besides one to eight micro-batches per stage, micro-batches of 4, 2 and 1 samples (Megatron's choice at
    scale: the bubble shrinks with their count)."""
    plan = plan_layouts(gpt(), batch(24), 2, CPU, restrict={"pp": [2]}, schedules=("1f1b",))
    assert {p.layout.pp_microbatches for p in plan.predictions} == {2, 4, 8, 6, 12, 24}


def test_equal_speeds_rank_the_layout_with_fewer_dimensions_first():
    """Within 1 % the time model cannot tell layouts apart: the one with fewer parallel dimensions (fewer costs left
    out of the model) first, then the one that communicates less."""
    plan = plan_layouts(gpt(), batch(), 4, CPU)
    fast = max(p.tokens_per_s for p in plan.fitting)
    near = [p for p in plan.fitting if p.tokens_per_s >= fast * (1 - SPEED_RESOLUTION)]
    key = [(_dimensions(p.layout), sum(p.comm_total_s.values())) for p in plan.fitting[:len(near)]]
    assert plan.fitting[:len(near)] == near and key == sorted(key)


def test_sequence_parallelism_is_weighed_on_and_off_and_can_be_fixed():
    """With tp > 1 both are candidates (a published run without SP can be planned as it ran); the option fixes it."""
    tp_only = {"pp": [1], "cp": [1], "tp": [2]}
    both = plan_layouts(gpt(), batch(), 2, CPU, restrict=tp_only)
    assert {p.layout.sequence_parallel for p in both.predictions} == {True, False}
    off = plan_layouts(gpt(), batch(), 2, CPU, restrict=tp_only, sequence_parallel=(False,))
    assert {(p.layout.sequence_parallel, p.layout.loss_parallel) for p in off.predictions} == {(False, False)}
    assert len(both.predictions) == 2 * len(off.predictions)


def test_regathered_sequence_is_priced_as_chunks_and_backward_all_gathers():
    """``regather_sequence``: outside activation checkpointing each gathered layer input (a block's attention and
    MLP inputs, the vocabulary-parallel head's) is saved as 1/tp of itself, and backward gathers it again (2 per
    block, 1 for the head, each of the whole residual stream); under full checkpointing only the head's input is
    affected; under autocast alone nothing is (its matmuls save autocast's own copy)."""
    profile = profile_model(gpt(), batch())  # 4 blocks
    base = Layout(tp=4, sequence_parallel=True, loss_parallel=True)

    def both(layout: Layout, precision: str = "32-true") -> tuple:
        a, b = (predict(x, profile, CPU, GLOBAL_BATCH, 16, precision) for x in (layout, replace(
            layout, regather_sequence=True)))
        extra = [t for t in account(replace(layout, regather_sequence=True), profile, GLOBAL_BATCH, 16,
                                    precision).transfers if t not in account(layout, profile, GLOBAL_BATCH, 16,
                                                                             precision).transfers]
        return a, b, sorted((t.kind, t.collective, t.count, t.nbytes) for t in extra)

    residual = GLOBAL_BATCH * 16 * profile.hidden_bytes
    a, b, extra = both(base)
    whole = sum(s.saved.layer_input for s in profile.sections.values())
    head = profile.sections["last"].saved.layer_input
    assert whole == 9 * head == 9 * residual  # 4 blocks x (attention, MLP) and the head, the residual stream each
    assert a.activations - b.activations == pytest.approx(whole * (1 - 1 / 4))
    assert extra == [("tp", "all_gather", 1, residual), ("tp", "all_gather", 8, residual)]
    assert b.comm_s["tp"] > a.comm_s["tp"]
    a, b, extra = both(replace(base, activation_checkpointing=True))
    assert a.activations - b.activations == pytest.approx(head * (1 - 1 / 4))
    assert extra == [("tp", "all_gather", 1, residual)]
    a, b, extra = both(base, "bf16-mixed")  # tp alone: autocast without FSDP
    assert (a.activations, a.step_s, extra) == (b.activations, b.step_s, [])
    assert str(replace(base, regather_sequence=True)) == "tp4 (SP, regather, LP)"
    assert replace(base, regather_sequence=True).strategy_kwargs()["regather_sequence"] is True


def test_regather_twins_are_weighed_for_sequence_parallel_layouts_that_do_not_fit():
    """Planned where they can matter: the twin of a layout that does not fit (none of one that does, which would
    only add all-gathers); always or never when the option fixes it."""
    only_tp = {"pp": [1], "cp": [1], "tp": [2], "dp_replicate": [1]}
    profile = profile_model(gpt(), batch())
    sp = Layout(dp_shard=2, tp=2, sequence_parallel=True)
    needs = [predict(x, profile, CPU, GLOBAL_BATCH // 2, 16).memory for x in (sp, replace(sp, regather_sequence=True))]
    assert needs[1] < needs[0]
    plan = plan_layouts(profile, batch(), 4, CPU, restrict=only_tp, memory_budget=sum(needs) / 2,
                        activation_checkpointing=(False,), gradient_accumulation=False)
    twins = [p for p in plan.predictions if p.layout.regather_sequence]
    assert twins and all(p.layout.sequence_parallel for p in twins)
    assert plan.best.layout.regather_sequence and plan.best.fits
    _, original = plan.find(**{**vars(plan.best.layout), "regather_sequence": False})
    assert not original.fits
    # what a user builds from the layout, and what auto_parallel trains, re-gathers
    assert NDParallelStrategy(**plan.best.layout.strategy_kwargs()).tensor_parallel.regather_sequence
    assert build_recipe(**_recipe_options(plan.best.layout)).tensor_parallel.regather_sequence
    roomy = plan_layouts(profile, batch(), 4, CPU, restrict=only_tp)
    assert not any(p.layout.regather_sequence for p in roomy.predictions)
    forced = plan_layouts(profile, batch(), 4, CPU, restrict=only_tp, regather_sequence=(True,))
    assert {p.layout.regather_sequence for p in forced.predictions} == {True, False}  # on wherever SP is
    assert all(p.layout.regather_sequence == p.layout.sequence_parallel for p in forced.predictions)


def test_zero2_like_twins_are_weighed_where_they_can_matter():
    """The ZeRO-2-like twin of an FSDP layout moves less and holds more; it is planned for the FSDP layouts that
    could come near the fastest, and never when the option fixes resharding on."""
    plan = plan_layouts(gpt(), batch(), 4, CPU)
    twins = [p for p in plan.predictions if not p.layout.reshard_after_forward]
    assert twins and all(p.layout.dp_shard * p.layout.cp > 1 for p in twins)
    for twin in twins:
        _, original = plan.find(**{**vars(twin.layout), "reshard_after_forward": True})
        assert sum(twin.comm_total_s.values()) < sum(original.comm_total_s.values())
        # reducing once per step keeps every unit gathered anyway: then the twin only moves less
        assert twin.buffers > original.buffers or (twin.layout.accumulate_unsharded
                                                   and twin.buffers == original.buffers)
    zero3_only = plan_layouts(gpt(), batch(), 4, CPU, reshard_after_forward=(True,))
    assert all(p.layout.reshard_after_forward for p in zero3_only.predictions)


def test_a_layout_held_back_by_its_per_micro_batch_reductions_gets_its_zero1_twin(monkeypatch):
    """``zero2_twins`` weighs a layout whose own FSDP traffic keeps it from the fastest: one that would come near
    without its gathers gets the ZeRO-2-like twin; one with several micro-batches that comes near only without its
    per-micro-batch reductions too gets the ZeRO-1-like twin directly (gathered once, reduced once; its ZeRO-2-like
    stepping stone alone would not come near), unless reducing once is not weighed or the twin could not fit. The
    exposed time is the rank's busy time, which a pipeline's bubble stretches by step / busy."""
    plan = plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [2], "dp_shard": [2]}, reshard_after_forward=(True,),
                        accumulate_unsharded=(False,))
    base = next(p for p in plan.predictions if p.fits and p.layout.pp_microbatches > 1)
    # the fastest: plain replicas (no FSDP twin of its own)
    fastest = replace(base, layout=replace(base.layout, dp_shard=1, dp_replicate=2), step_s=1.0,
                      tokens_per_s=1000.0, comm_s={}, bubble_s=0.0)

    def slowed(bubble_s: float = 0.0, budget: float | None = None, **exposed: float) -> Prediction:
        return replace(base, step_s=2.0, tokens_per_s=500.0, comm_s=exposed, bubble_s=bubble_s, budget=budget)

    zero1 = replace(base.layout, reshard_after_forward=False, accumulate_unsharded=True)
    held_by_both = slowed(fsdp_all_gather=0.5, fsdp_reduce_scatter=0.5)
    assert zero2_twins([fastest, held_by_both]) == [zero1]
    assert zero2_twins([fastest, held_by_both], reduce_once=False) == []
    assert zero2_twins([fastest, slowed(fsdp_all_gather=1.0)]) == [replace(base.layout, reshard_after_forward=False)]
    assert zero2_twins([fastest, slowed(fsdp_all_gather=0.2, fsdp_reduce_scatter=0.2)]) == []
    # half the step is bubble: 0.5 s of exposed traffic is 1 s of step
    assert zero2_twins([fastest, slowed(bubble_s=1.0, fsdp_all_gather=0.25, fsdp_reduce_scatter=0.25)]) == [zero1]
    # over budget even without its FSDP buffers: the twin (same state and activations) could not fit
    over = held_by_both.memory - held_by_both.buffers - 1.0
    assert zero2_twins([fastest, slowed(budget=over, fsdp_all_gather=0.5, fsdp_reduce_scatter=0.5)]) == []
    # plan_layouts tells zero2_twins whether reducing once is weighed (the real function, its argument recorded)
    asked = []

    def recording(predictions: list[Prediction], reduce_once: bool = True) -> list[Layout]:
        asked.append(reduce_once)
        return zero2_twins(predictions, reduce_once)

    monkeypatch.setattr(search, "zero2_twins", recording)
    for options in ((False,), (True,), (False, True)):
        plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [2], "dp_shard": [2]}, accumulate_unsharded=options)
    assert asked == [False, True, True]


def test_reducing_once_per_step_is_weighed_for_fsdp_with_micro_batches():
    """FSDP over a pipeline's micro-batches: by default every micro-batch gathers and reduce-scatters each unit; the
    ``accumulate_unsharded`` twin reduces once per step and gathers once more than the micro-batches (once in all
    without resharding after forward), for every unit gathered and its unsharded gradients in memory. Priced
    against the engine's counts (tests/test_pipeline_strategy.py, tests/test_fsdp.py), weighed where it can
    matter, and fixed by the option."""
    plan = plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [2], "dp_shard": [2]})
    once = [p for p in plan.predictions if p.layout.accumulate_unsharded]
    assert once and all(p.layout.pp_microbatches > 1 for p in once)
    for twin in once:
        # (a ZeRO-1-like twin that zero2_twins made directly has no ZeRO-2-like sibling in the plan)
        sibling = replace(twin.layout, accumulate_unsharded=False)
        default = next((p for p in plan.predictions if p.layout == sibling), None) or predict(
            sibling, plan.profile, plan.hardware, plan.batch // sibling.dp, plan.seq_len, plan.precision)
        m = twin.layout.pp_microbatches

        def count(prediction, kind):
            return {t.collective: t.count for t in _sheet(prediction).transfers if t.kind == kind}

        assert count(default, "fsdp_reduce_scatter")["reduce_scatter"] == m * count(twin, "fsdp_reduce_scatter")[
            "reduce_scatter"]
        gathers = m + 1 if twin.layout.reshard_after_forward else 1
        per_microbatch = 2 if twin.layout.reshard_after_forward else 1
        assert count(default, "fsdp_all_gather")["all_gather"] * gathers == count(twin, "fsdp_all_gather")[
            "all_gather"] * m * per_microbatch
        assert twin.buffers > default.buffers
        assert sum(twin.comm_total_s.values()) < sum(default.comm_total_s.values())
    fixed = plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [2], "dp_shard": [2]},
                         accumulate_unsharded=(True,))
    assert all(p.layout.accumulate_unsharded for p in fixed.predictions if p.layout.pp_microbatches > 1)
    assert {"accumulate_unsharded": True}.items() <= once[0].layout.strategy_kwargs().items()
    # the twin holds the same state and activations and more FSDP buffers: a layout over budget even without its
    # buffers gets no twin (it could not fit; planning 8,192 GPUs skips some 12,000 of them), the others keep theirs
    defaults = [p for p in plan.predictions if p.layout.pp_microbatches > 1 and not p.layout.accumulate_unsharded]
    budget = sorted(p.memory - p.buffers for p in defaults)[len(defaults) // 2]
    tight = plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [2], "dp_shard": [2]}, memory_budget=budget)
    twins = {p.layout for p in tight.predictions if p.layout.accumulate_unsharded}
    skipped = [p for p in defaults if p.memory - p.buffers > budget]
    assert skipped and twins
    for p in skipped:
        twin = replace(p.layout, accumulate_unsharded=True)
        assert twin not in twins
        assert not predict(twin, tight.profile, CPU, GLOBAL_BATCH // twin.dp, tight.seq_len,
                           memory_budget=budget).fits


def _sheet(prediction):
    profile = _gpt_profile()
    return account(prediction.layout, profile, GLOBAL_BATCH // prediction.layout.dp, profile.seq_len, "32-true")


@cache
def _gpt_profile():
    """The tiny GPT's profile, traced once: ``_sheet`` is asked for some hundred layouts' sheets."""
    return profile_model(gpt(), batch())


def test_gradient_accumulation_is_weighed_where_the_batch_does_not_fit():
    """A layout without a pipeline whose batch does not fit is weighed with its batch in micro-batches, the fewest
    that fit: activations of one micro-batch, FSDP's collectives once per micro-batch, the same compute; the Trainer
    gets the count. ``gradient_accumulation=False`` (what auto_parallel plans with) weighs none."""
    profile = profile_model(gpt(), batch())
    one = predict(Layout(dp_shard=4), profile, CPU, GLOBAL_BATCH // 4, 16)
    two = predict(Layout(dp_shard=4, accumulate_grad_batches=2), profile, CPU, GLOBAL_BATCH // 4, 16)
    assert two.activations == pytest.approx(one.activations / 2) and two.compute_s == pytest.approx(one.compute_s)
    assert two.comm_total_s["fsdp_all_gather"] == pytest.approx(2 * one.comm_total_s["fsdp_all_gather"])
    assert two.tokens_per_s < one.tokens_per_s and two.layout.trainer_kwargs() == {"accumulate_grad_batches": 2}
    assert one.layout.trainer_kwargs() == {} and "accumulate 2" in str(two.layout)
    budget = (one.memory + two.memory) / 2  # the whole batch does not fit, half of it does
    plan = plan_layouts(profile, None, 4, CPU, memory_budget=budget, restrict={"dp_shard": [4]},
                        activation_checkpointing=(False,), reshard_after_forward=(True,))
    assert plan.best.layout == Layout(dp_shard=4, accumulate_grad_batches=2)
    assert {p.layout.accumulate_grad_batches for p in plan.predictions} == {1, 2}  # 4 micro-batches: not needed
    assert plan.as_dict()["layouts"][0]["trainer_kwargs"] == {"accumulate_grad_batches": 2}
    without = plan_layouts(profile, None, 4, CPU, memory_budget=budget, restrict={"dp_shard": [4]},
                           activation_checkpointing=(False,), reshard_after_forward=(True,),
                           gradient_accumulation=False)
    assert {p.layout.accumulate_grad_batches for p in without.predictions} == {1}
    assert without.best.layout.cpu_offload  # nothing else fits: offload is the last resort
    with pytest.raises(TypeError, match="gradient_accumulation='no' must be True"):
        plan_layouts(profile, None, 4, CPU, gradient_accumulation="no")


def test_the_context_parallel_ring_hides_only_behind_attention():
    """The ring's next hop is in flight while a block's attention runs: its transfers hide behind the attention
    kernels' time, not the whole step's; the all-gather variant, which the engine waits for, is exposed."""
    profile = profile_model(gpt(), batch())
    gpu = Hardware("GPU", 1e14, None, 4, 2e9, 2e-5, 2e9, 2e-5, "a stand-in that overlaps")
    sheet = account(Layout(dp_shard=1, cp=4), profile, GLOBAL_BATCH, 16, "32-true")
    ring = [t for t in sheet.transfers if t.kind == "cp"]
    assert ring and all(t.overlappable and t.hides_behind == "attention" for t in ring)
    p = predict(Layout(dp_shard=1, cp=4), profile, gpu, GLOBAL_BATCH, 16)
    attention = predict_attention_seconds(sheet, gpu)
    assert 0 < attention < p.compute_s / 4
    assert p.comm_s["cp"] == pytest.approx(max(0.0, p.comm_total_s["cp"] - 0.8 * attention))
    assert p.comm_s["cp"] > 0  # the tiny model's attention is short: most of the ring shows
    allgather = CostSheet(Layout(dp_shard=1, cp=4).dims(), profile, GLOBAL_BATCH, 16)
    for technique in build_recipe(cp_algorithm="allgather"):
        technique.account(allgather)
    gathered = [t for t in allgather.transfers if t.kind == "cp"]
    assert gathered and not any(t.overlappable for t in gathered)


def predict_attention_seconds(sheet: CostSheet, hardware: Hardware) -> float:
    from lightning_par.planner.predict import _rank_costs

    return max(r[6] for r in _rank_costs(sheet, hardware.matmul_share)) / hardware.matmul_flops


def test_interleaved_schedules_weigh_every_stage_count_that_cuts_the_blocks_evenly_and_the_usual_uneven_ones():
    """12 blocks on pp 2: the schedule's default (2 per rank), 3 and 6 (equal stages) and 4 (stages of 2 and 1
    blocks, 6 blocks on each rank); 5 leaves uneven stages and is not a usual count, 8 stages per rank would need
    16 blocks."""
    plan = plan_layouts(gpt(n_layer=12), batch(), 2, CPU, restrict={"pp": [2]}, schedules=("interleaved_1f1b",),
                        activation_checkpointing=(False,))
    assert {p.layout.pp_stages_per_rank for p in plan.predictions} == {None, 3, 4, 6}
    even = plan_layouts(plan.profile, batch(), 2, CPU, restrict={"pp": [2]}, schedules=("interleaved_1f1b",),
                        activation_checkpointing=(False,), uneven_stages=False)  # Megatron-LM's interleaving
    assert {p.layout.pp_stages_per_rank for p in even.predictions} == {None, 3, 6}
    with pytest.raises(TypeError, match=r"uneven_stages='no' must be True"):
        plan_layouts(plan.profile, batch(), 2, CPU, uneven_stages="no")


@pytest.mark.parametrize("blocks, v, like", [(64, 4, 4.0), (60, 4, 15 / 4), (61, 8, 8.0), (60, 5, 5.0), (61, 2, 2.0)])
def test_uneven_stages_price_the_bubble_by_the_largest_stage(blocks, v, like):
    """The warm-up and cool-down run (pp - 1) turns of the largest stage: 60 blocks in 16 stages of 4 and 3 (15 on
    every rank) bubble as 3.75 equal stages per rank would, not 4; 61 in 32 stages of 2 and 1 (16 blocks on the
    busiest rank) as 8."""
    from lightning_par.techniques.pipeline.pipeline_parallel import bubble_fraction, pipeline_shape

    names = tuple(f"model.blocks.{i}" for i in range(blocks))
    sections, _, bubble, _ = pipeline_shape("interleaved_1f1b", names, 4, v, 8)
    assert sorted(s for rank in sections for s in rank if s.startswith("model.")) == sorted(names)
    assert max(sum(s.startswith("model.") for s in rank) for rank in sections) == -(-blocks // 4)
    assert bubble == pytest.approx(bubble_fraction("interleaved_1f1b", 4, like, 8), rel=1e-12)
    assert bubble >= bubble_fraction("interleaved_1f1b", 4, v, 8)


def test_a_layout_computes_at_the_rate_probed_for_its_tensor_parallel_split():
    """The probe measures the matmuls split as each tp degree splits them (``Hardware.matmul_by_tp``): a tp 2 layout
    computes at the tp 2 figure, the others at the whole matmuls'."""
    profile = profile_model(gpt(), batch())
    split = replace(CPU, matmul_by_tp=((2, CPU.matmul_flops / 2),))
    for sizes, slower in ((dict(tp=2, dp_shard=2), 2.0), (dict(dp_shard=4), 1.0), (dict(tp=4), 1.0)):
        layout = Layout(**sizes)
        whole, halved = (predict(layout, profile, hw, GLOBAL_BATCH // layout.dp, profile.seq_len)
                         for hw in (CPU, split))
        assert halved.compute_s == pytest.approx(slower * whole.compute_s, rel=1e-12), sizes


def test_the_memory_reserve_is_an_option_and_every_prediction_reports_its_margin():
    h100 = known_hardware("H100", gpus_per_node=4)
    default = plan_layouts(gpt(), batch(), 4, h100)
    assert default.best.budget == pytest.approx(h100.memory_bytes * 0.9)
    assert default.best.margin == pytest.approx(default.best.budget - default.best.memory)
    assert "to spare" in default.best.reason and default.best.as_dict()["margin"] == default.best.margin
    tighter = plan_layouts(gpt(), batch(), 4, h100, memory_reserve=0.25)
    assert tighter.best.budget == pytest.approx(h100.memory_bytes * 0.75)
    with pytest.raises(ValueError, match=r"memory_reserve=1.5 must be a share of device memory in \[0, 1\)"):
        plan_layouts(gpt(), batch(), 4, h100, memory_reserve=1.5)
    assert predict(Layout(), default.profile, CPU, GLOBAL_BATCH, 16).margin is None  # memory unknown


def test_find_tells_where_a_layout_ranks_and_what_it_costs():
    plan = plan_layouts(gpt(), batch(), 4, CPU)
    rank, prediction = plan.find(dp_shard=4, activation_checkpointing=False)
    assert plan.predictions[rank - 1] is prediction and prediction.layout.dp_shard == 4
    assert all(not (p.layout.dp_shard == 4 and p.layout.activation_checkpointing is False)
               for p in plan.predictions[:rank - 1])
    assert plan.find() == (1, plan.best)
    with pytest.raises(ValueError, match=r"Plan.find: \['dp'\] are not layout options"):
        plan.find(dp=4)
    with pytest.raises(ValueError, match=r"no planned layout has these options"):
        plan.find(tp=3)


def test_ranking_fitting_first_and_fastest_first():
    budget = 200_000.0  # bytes: below a full replica's model state (about 850 kB for the tiny GPT with AdamW)
    plan = plan_layouts(gpt(), batch(), 4, CPU, memory_budget=budget)
    fits = [p.fits for p in plan.predictions]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    fitting = plan.fitting
    # fastest first, within the model's resolution: nothing ranked below is more than 1 % faster
    for i, p in enumerate(fitting[:-1]):
        assert max(q.tokens_per_s for q in fitting[i + 1:]) * (1 - SPEED_RESOLUTION) <= p.tokens_per_s
    assert plan.best.memory <= budget and plan.best is fitting[0]
    with pytest.raises(ValueError, match=r"No layout of GPTModule fits memory_budget=.* the smallest needs .* GiB \("):
        plan_layouts(gpt(), batch(), 4, CPU, memory_budget=1000.0).require_fit()


def test_pipelines_with_sequence_parallelism_send_the_sequence_chunk():
    """pp x tp layouts are planned with sequence (and loss) parallelism, whose stages hand on 1/tp of the bytes."""
    plan = plan_layouts(gpt(), batch(), 4, CPU, restrict={"pp": [2], "tp": [2]}, sequence_parallel=(True,))
    assert plan.predictions and all(p.layout.sequence_parallel and p.layout.loss_parallel for p in plan.predictions)
    layout = Layout(pp=2, tp=2, pp_microbatches=2, sequence_parallel=True)
    profile = profile_model(gpt(), batch())

    def sends(lay: Layout) -> list[float]:
        return [t.nbytes for t in account(lay, profile, GLOBAL_BATCH, 16, "32-true").transfers
                if t.kind == "pp_send_recv"]

    assert sends(layout) == [b / 2 for b in sends(replace(layout, sequence_parallel=False))]


def test_autocast_alone_sends_the_residual_stream_in_fp32():
    """Under bf16-mixed without FSDP (autocast alone) the residual stream between pipeline stages and what a norm
    hands to sequence parallelism's all-gather stay fp32; with FSDP's bf16 parameters they are bf16."""
    profile = profile_model(gpt(), batch())

    def sent(lay: Layout, kind: str, precision: str) -> list[float]:
        return [t.nbytes for t in account(lay, profile, GLOBAL_BATCH // lay.dp, 16, precision).transfers
                if t.kind == kind]

    pp = Layout(pp=2, pp_microbatches=2)
    assert sent(pp, "pp_send_recv", "bf16-mixed") == sent(pp, "pp_send_recv", "32-true")
    fsdp = replace(pp, dp_shard=2)
    assert sent(fsdp, "pp_send_recv", "bf16-mixed") == [b / 2 for b in sent(fsdp, "pp_send_recv", "32-true")]
    # the blocks' forward reductions (row-parallel outputs) in bf16; the norms' outputs sequence parallelism
    # gathers and the backward reductions past autocast's casts in fp32; with FSDP all bf16
    for tp in (Layout(tp=2, sequence_parallel=True), Layout(tp=2)):
        assert sent(tp, "tp", "bf16-mixed")[0] == 0.75 * sent(tp, "tp", "32-true")[0]
        with_fsdp = replace(tp, dp_shard=2)
        assert sent(with_fsdp, "tp", "bf16-mixed")[0] == 0.5 * sent(with_fsdp, "tp", "32-true")[0]


def test_profile_counts_the_gpt_as_the_formula_does():
    """Forward FLOPs of a block: 2 x tokens x (12 d^2) for the matmuls, 4 x tokens x seq x d for attention."""
    profile = profile_model(gpt(), batch())
    d, tokens, seq = 32, GLOBAL_BATCH * 16, 16
    block = profile.sections[profile.blocks[0]]
    assert block.flops == 2 * tokens * 12 * d * d
    assert block.attention_flops == 4 * tokens * seq * d
    assert profile.optimizer_bytes_per_element == 8  # AdamW, fp32: two moments


@pytest.mark.parametrize("device, memory", [("H100", 80e9), ("H200", 141e9), ("A100-80GB", 80e9)])
def test_known_devices_plan_a_llama_8b_shape(device, memory):
    """The same model class at a real size on a cluster this machine is not: planned from the table, quickly."""
    hardware = known_hardware(device, gpus_per_node=8)
    assert abs(hardware.memory_bytes - memory) / memory < 0.1
    with torch.device("meta"):
        module = HFCausalLM("llama", hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
    ids = torch.zeros(16, 2048, dtype=torch.long, device="meta")
    plan = plan_layouts(module, (ids, ids), 16, hardware, precision="bf16-mixed")
    assert plan.best.fits and plan.best.tokens_per_s > 0
    assert any(p.layout.tp > 1 for p in plan.predictions) and all(p.layout.tp <= 8 for p in plan.predictions)


def test_bf16_true_prices_every_byte_in_bf16_whatever_dtype_the_module_was_built_in():
    """Lightning's "bf16-true" converts the module to bf16 before training: a module built in fp32 (as most are) is
    planned as that bf16 module (weights 2 bytes, AdamW's moments 2 x 2, FSDP gathering 2 bytes an element; the
    activations those of the bf16 trace, not halved again), and a profile traced in fp32 is refused for it; mixed
    precision over a module built in bf16 is priced alike."""
    with torch.device("meta"):
        module = HFCausalLM("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=1024)
    ids = torch.zeros(8, 256, dtype=torch.long, device="meta")
    hardware = known_hardware("H100", gpus_per_node=8)
    from_fp32 = plan_layouts(module, (ids, ids), 8, hardware, precision="bf16-true", restrict={"pp": [1]})
    bf16_profile = profile_model(module, (ids, ids), dtype=torch.bfloat16)
    from_bf16 = plan_layouts(bf16_profile, (ids, ids), 8, hardware, precision="bf16-true", restrict={"pp": [1]})
    assert [p.as_dict() for p in from_fp32.predictions] == [p.as_dict() for p in from_bf16.predictions]
    elements = sum(p.numel for p in bf16_profile.params)
    assert bf16_profile.dtype == torch.bfloat16 and bf16_profile.optimizer_bytes_per_element == 4
    layout = Layout(dp_shard=8)
    true = predict(layout, bf16_profile, hardware, 1, 256, precision="bf16-true")
    mixed = predict(layout, profile_model(module, (ids, ids)), hardware, 1, 256, precision="bf16-mixed")
    assert true.params == pytest.approx(2 * elements / 8, rel=0.01) and mixed.params == pytest.approx(2 * true.params)
    assert true.optimizer == pytest.approx(4 * elements / 8, rel=0.01)
    assert true.activations == predict(layout, bf16_profile, hardware, 1, 256, precision="32-true").activations
    gathered = {p: sum(t.nbytes * t.count for t in account(layout, prof, 1, 256, p).transfers
                       if t.kind == "fsdp_all_gather")
                for p, prof in (("bf16-true", bf16_profile), ("bf16-mixed", profile_model(module, (ids, ids))))}
    assert gathered["bf16-true"] == pytest.approx(gathered["bf16-mixed"])  # bf16 on the wire either way
    with pytest.raises(ValueError, match=r"precision='bf16-true' .* profile_model\(\.\.\., dtype="):
        plan_layouts(profile_model(module, (ids, ids)), (ids, ids), 8, hardware, precision="bf16-true")
    # mixed precision over weights built in bf16 keeps them so: priced as bf16-true, not halved again
    half = predict(layout, bf16_profile, hardware, 1, 256, precision="bf16-mixed")
    assert (half.params, half.optimizer, half.activations) == (true.params, true.optimizer, true.activations)
    tp = Layout(tp=8)  # without FSDP: autocast casts nothing either, its weights being bf16 already
    assert predict(tp, bf16_profile, hardware, 1, 256, precision="bf16-mixed").activations == predict(
        tp, bf16_profile, hardware, 1, 256, precision="bf16-true").activations
    # FSDP still reduces in fp32 under mixed precision: twice bf16-true's reduce-scatter bytes
    scattered = {p: sum(t.nbytes * t.count for t in account(layout, bf16_profile, 1, 256, p).transfers
                        if t.kind == "fsdp_reduce_scatter") for p in ("bf16-mixed", "bf16-true")}
    assert scattered["bf16-mixed"] == pytest.approx(2 * scattered["bf16-true"])
    assert probe_shapes(bf16_profile) == probe_shapes(profile_model(module, (ids, ids)))  # the probe's widths


class _FloatInputs(nn.Module):
    """Float inputs (not token ids), an int8 frozen table larger than the weights, no optimizer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.codes = nn.Parameter(torch.zeros(64, 512, dtype=torch.int8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + torch.ones(x.shape[-1], device=x.device)  # made in forward, in the default dtype
        return x


def test_a_bf16_trace_casts_float_inputs_and_what_forward_creates_and_ignores_integer_weights():
    """Under "bf16-true" Lightning hands the module bf16 inputs and a bf16 default dtype: the trace does the same, so
    a float-input model's activations are bf16-sized; integer weights do not make it an int8 model, and without an
    optimizer of its own it is priced with Adam's moments in bf16."""
    x = torch.zeros(4, 16, 64)
    step = lambda m, b: m(b[0]).float().square().mean()  # noqa: E731
    fp32 = profile_model(_FloatInputs(), (x, x), step=step)
    bf16 = profile_model(_FloatInputs(), (x, x), step=step, dtype=torch.bfloat16)
    assert (fp32.dtype, bf16.dtype) == (torch.float32, torch.bfloat16)
    first = bf16.blocks[0]
    assert bf16.sections[first].input_bytes == fp32.sections[first].input_bytes // 2 == 4 * 16 * 64 * 2
    assert sum(bf16.sections[b].saved.total for b in bf16.blocks) == pytest.approx(
        sum(fp32.sections[b].saved.total for b in fp32.blocks) / 2)
    assert (fp32.optimizer_bytes_per_element, bf16.optimizer_bytes_per_element) == (8.0, 4.0)
    check_profile_precision(bf16, "bf16-true")  # not refused for its int8 table
    # the probe's matmul width is the residual stream's, whatever dtype carries it (fp32 inputs into bf16 weights)
    mixed_dtypes = profile_model(_FloatInputs().to(torch.bfloat16), (x, x), step=step)
    shapes = [(64, 64, 256), (64, 256, 64)]
    assert probe_shapes(fp32) == probe_shapes(bf16) == probe_shapes(mixed_dtypes) == shapes


# ---- predictions against measurements (world 4) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def measured():
    return launch(4, measure, LAYOUTS, 4, GPTModule, {"n_layer": 4}, timeout=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_predictions_match_the_real_sharded_tensors(measured, name):
    """Model state (parameters, gradients, AdamW state: local shards) within 2 %; saved activations within 15 %.
    Checkpointing keeps the generator's state per block, and selective checkpointing matmul outputs in its own
    cache, beside autograd's saved tensors: there the activations are all the step's forward left alive until
    backward. So are they with the gathered inputs saved as chunks (``regather_sequence``: every saved tensor is then
    held by a Python object, which the scan sees)."""
    options = dict(LAYOUTS[name])
    model = options.pop("model", {})
    layout = Layout(**options)
    p = predict(layout, profile_model(gpt(**model), batch()), CPU, GLOBAL_BATCH // layout.dp, 16)
    state = max(rank[name]["state"]["total"] for rank in measured)
    kind = "live" if (layout.activation_checkpointing or layout.regather_sequence) and layout.pp == 1 else "activations"
    activations = max(rank[name][kind] for rank in measured)
    assert abs(p.model_state - state) / state <= 0.02, (p.model_state, state)
    assert abs(p.activations - activations) / activations <= 0.15, (p.activations, activations)


# ---- the strategy --------------------------------------------------------------------------------------------
def test_auto_parallel_trains_its_choice_in_parity_with_the_same_layout_by_hand(tmp_path):
    results = launch(2, auto_then_by_hand, str(tmp_path), timeout=600)
    auto, by_hand = results[0]["auto"], results[0]["by_hand"]
    assert auto["losses"] == by_hand["losses"]
    assert all(torch.equal(auto["weights"][k], by_hand["weights"][k]) for k in by_hand["weights"])
    assert results[0]["chosen"] == results[1]["chosen"]  # every rank built the same mesh
    moe, moe_by_hand = results[0]["moe_auto"], results[0]["moe_by_hand"]
    assert results[0]["moe_chosen"].ep == 2 and results[0]["moe_chosen"].strategy_kwargs()["ep"] == 2
    assert moe["losses"] == moe_by_hand["losses"]
    assert all(torch.equal(moe["weights"][k], moe_by_hand["weights"][k]) for k in moe_by_hand["weights"])
    assert (tmp_path / "plan" / "plan.png").stat().st_size > 10_000


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(tp=2), ValueError, r"AutoParallelStrategy chooses \['tp'\] itself"),
    (dict(restrict={"dp": [1]}), ValueError, r"\['dp'\] are not layout dimensions"),
    (dict(memory_budget="lots"), ValueError, r"memory_budget='lots' must be a positive number of bytes"),
    (dict(device="TPU-v9"), ValueError, r"TPU-v9"),
])
def test_auto_parallel_refuses_bad_options_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        AutoParallelStrategy(**kwargs)


def test_auto_parallel_is_registered():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="auto_parallel", logger=False)
    assert isinstance(trainer.strategy, AutoParallelStrategy)


# ---- bad models and worlds -----------------------------------------------------------------------------------
class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class DataDependent(GPTModule):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.sum() > 0:  # needs the values: a meta-device trace cannot answer
            return self.model(idx)
        return self.model(idx + 1)


def test_bad_models_and_worlds_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"NoBlocks has no nn.ModuleList .* name the shard units"):
        plan_layouts(NoBlocks(), (torch.zeros(2, 16), torch.zeros(2, 16)), 2, CPU)
    with pytest.raises(ValueError, match=r"could not trace DataDependent on the meta device"):
        module = DataDependent(**TINY_GPT)
        module.configure_model()
        plan_layouts(module, batch(), 2, CPU)
    with pytest.raises(ValueError, match=r"No layout of GPTModule fits a world of 5: .*Choose a world size"):
        plan_layouts(gpt(), batch(), 5, CPU)


# ---- the command line ----------------------------------------------------------------------------------------
def test_cli_plans_a_hugging_face_config_on_a_big_cluster(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
                                  "intermediate_size": 3584, "num_hidden_layers": 8, "num_attention_heads": 8,
                                  "num_key_value_heads": 8}))
    out = subprocess.run([sys.executable, "-m", "lightning_par.plan", "--hf-config", str(config), "--world", "1024",
                          "--device", "H100", "--seq-len", "4096", "--batch", "1024", "--json",
                          str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png"), "--top", "5",
                          "--activation-checkpointing", "none", "full", "--schedules", "1f1b"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "1024 devices" in out.stdout and "layouts in" in out.stdout
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["world_size"] == 1024 and len(record["layouts"]) > 50
    best = record["layouts"][0]
    assert best["fits"] and best["memory"] <= best["budget"]
    # none and full checkpointing weighed, selective left out
    assert {lay["strategy_kwargs"].get("activation_checkpointing", False) for lay in record["layouts"]} == {False, True}
    # the schedules asked for, no others
    assert {lay["strategy_kwargs"].get("pp_schedule") for lay in record["layouts"]} == {None, "1f1b"}
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_cli_builds_a_hugging_face_config_in_fp32_whatever_its_dtype(tmp_path):
    """Hub configs say ``torch_dtype: bfloat16``, which transformers 5 builds in: the command line builds fp32 weights
    (a Lightning run's under the mixed precisions) and leaves bf16 to ``--precision bf16-true``'s trace."""
    from lightning_par.planner.cli import _hf_model, _parser

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 4, "torch_dtype": "bfloat16"}))
    module, _ = _hf_model(_parser().parse_args(["--hf-config", str(config), "--world", "8", "--device", "H100"]))
    assert {p.dtype for p in module.parameters()} == {torch.float32}


def test_cli_plans_a_lightning_cli_project():
    out = subprocess.run([sys.executable, "-m", "lightning_par.plan", "--module", "example_projects.gpt.lit.GPTModule",
                          "--datamodule", "example_projects.gpt.data.CharDataModule", "--config",
                          "example_projects/gpt/configs/fsdp2.yaml", "--world", "4", "--device", "A100-80GB",
                          "--batch", "32", "--top", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "GPTModule" in out.stdout and "global batch 32 x 128 tokens, 4 devices" in out.stdout


HF_LAYOUTS = {  # world 2, a Hugging Face Llama (its own tp plan; the first block cuts the sequence under SP)
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "tp2_sp_ac": dict(tp=2, sequence_parallel=True, activation_checkpointing=True),
    "tp2_sp_sac": dict(tp=2, sequence_parallel=True, activation_checkpointing="selective"),
    "tp2_sp_regather": dict(tp=2, sequence_parallel=True, regather_sequence=True),
}


@pytest.fixture(scope="module")
def measured_llama():
    return launch(2, measure, HF_LAYOUTS, 2, HFCausalLM, {"arch": "llama"}, timeout=600)


@pytest.mark.parametrize("name", list(HF_LAYOUTS))
def test_hf_activations_under_sequence_parallelism_match_within_2_percent(measured_llama, name):
    """Token ids, targets and the logits the head gathers stay whole on every tp rank; with checkpointing the first
    block keeps only its sequence chunk (the cut runs before the checkpoint saves the input; it kept the whole
    embedding output before)."""
    layout = Layout(**HF_LAYOUTS[name])
    with torch.device("meta"):
        module = HFCausalLM("llama")
    ids = torch.zeros(GLOBAL_BATCH, 16, dtype=torch.long)
    p = predict(layout, profile_model(module, (ids, ids)), CPU, GLOBAL_BATCH // layout.dp, 16)
    kind = "live" if layout.activation_checkpointing or layout.regather_sequence else "activations"  # as above
    activations = max(rank[name][kind] for rank in measured_llama)
    assert abs(p.activations - activations) / activations <= 0.02, (p.activations, activations)


def test_what_a_step_holds_is_counted_once_other_threads_let_go():
    """A storage another thread drops once it gets to run (as a gloo worker drops a finished collective's buffers
    after waking the caller; the tp2_sp_ac measurement above counted one whole-sequence tensor more now and then) is
    not counted; a new one is; one alive before, or excluded (the parameters), is not. The pause between scans is
    where other threads run: here it lets the dropper go and waits for it."""
    import threading

    from lightning_par.planner.measure import live_storages, settled_new_storages

    before_step = torch.ones(64)
    before = live_storages()
    parameter, new, held = torch.ones(128), torch.ones(256), [torch.ones(512)]
    go, dropped = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(timeout=60)
        held.clear()
        dropped.set()

    def pause() -> None:
        go.set()
        dropped.wait(timeout=60)

    thread = threading.Thread(target=worker)
    thread.start()
    counted = settled_new_storages(before, {parameter.untyped_storage().data_ptr()}, pause=pause)
    thread.join()
    assert sorted(counted.values()) == [1024], counted  # `new` alone; counted at once, `held` (2,048 bytes) too
    assert before_step.sum() + parameter.sum() + new.sum() > 0


class TorchEncoderLM(pl.LightningModule):
    """A language model of torch's own ``nn.TransformerEncoderLayer``s: attention through ``nn.MultiheadAttention``,
    whose ``F.multi_head_attention_forward`` calls attention and its projections from inside an overridable Python
    function."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(64, 32)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.xfail(strict=True, reason="the trace marks attention and autocast at torch functions, and a call made "
                   "inside another overridable Python function (F.multi_head_attention_forward) escapes the marks: "
                   "the meta decomposition's attention probabilities are counted, 1.27 x the measured in fp32 and "
                   "1.32 x under CPU autocast (docs/planner.md, 'How it predicts')")
def test_activations_of_torch_multihead_attention_match():
    from lightning_par.planner.measure import saved_activations

    torch.manual_seed(0)
    module = TorchEncoderLM()
    ids = torch.randint(0, 32, (4, 16))
    prof = profile_model(module, (ids, ids))
    ratios = {}
    for precision in ("32-true", "bf16-mixed"):
        ctx, total = saved_activations()
        with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            module.training_step((ids, ids), 0)
        ratios[precision] = predict(Layout(), prof, CPU, 4, 16, precision).activations / total()
    assert all(abs(r - 1) <= 0.02 for r in ratios.values()), ratios


@pytest.mark.parametrize("model", ["gpt", "gpt_moe", "llama"])
def test_bf16_mixed_activations_under_autocast_alone_and_under_fsdp(model):
    """Without FSDP (one rank, tp or pp alone) bf16-mixed is autocast alone: what the matmul family saves is bf16
    (a copy per call of a full-precision input: q, k and v each cast the norm's output), so is what is computed
    from bf16 alone (an activation of a matmul's output); the residual stream, norms and the loss stay fp32, and a
    bf16 copy of each weight (every expert's) is saved. Halving every saved tensor predicted 0.48-0.72 of what an
    H200 measured (2026-11-26); against a real forward under CPU autocast here. Under FSDP (its bf16 parameters)
    every saved tensor is half: the rule stays there."""
    from lightning_par.planner.measure import saved_activations

    torch.manual_seed(0)
    moe = {"n_experts": 4, "moe_top_k": 2} if model == "gpt_moe" else {}  # every expert's weights cast
    module = GPTModule(**{**TINY_GPT, "n_embd": 64, **moe}) if model.startswith("gpt") else HFCausalLM("llama")
    if hasattr(module, "configure_model"):
        module.configure_model()
    ids = torch.randint(0, 32, (4, 16))
    prof = profile_model(module, (ids, ids))
    ctx, total = saved_activations()
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module.training_step((ids, ids), 0)
    measured = total()
    loss.backward()
    autocast = predict(Layout(), prof, CPU, 4, 16, "bf16-mixed").activations
    assert abs(autocast - measured) / measured <= 0.02, (autocast, measured)  # 1.000-1.003 measured
    fp32 = predict(Layout(), prof, CPU, 4, 16, "32-true").activations
    assert autocast > 0.6 * fp32  # the old uniform half would have been 0.5
    sharded_fp32 = predict(Layout(dp_shard=2), prof, CPU, 2, 16, "32-true").activations
    assert predict(Layout(dp_shard=2), prof, CPU, 2, 16, "bf16-mixed").activations == pytest.approx(0.5 * sharded_fp32)


TINY_PROJECT = {"model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "warmup_steps": 2},
                "data": {"seq_len": 32, "batch_size": 4, "max_chars": 60000}}
PLANNED_YAML = """\
trainer:
  strategy:
    class_path: lightning_par.NDParallelStrategy
    init_args:
      dp_replicate: 1
      dp_shard: 2
      cp: 1
      tp: 1
      pp: 1
      ep: 1
      pp_schedule: 1f1b
      pp_microbatches: null
      pp_stages_per_rank: null
      pp_split_points: null
      sequence_parallel: false
      loss_parallel: false
      regather_sequence: false
      async_tp: false
      cp_algorithm: ring
      cp_ulysses_size: null
      activation_checkpointing: false
      reshard_after_forward: true
      cpu_offload: false
      accumulate_unsharded: false
  accumulate_grad_batches: 2
data:
  batch_size: 2
# data.batch_size: the batch of one rank's loader step, the global batch 8 / dp 2 / accumulate 2
"""


def test_cli_yaml_trains_unchanged_under_lightning_cli_in_parity_with_the_layout_by_hand(tmp_path):
    """``--yaml`` for the tiny GPT on 2 CPU ranks (this machine probed; a memory budget that only 2 micro-batches
    fit): the file, passed as a second ``--config`` after the example's own, trains under LightningCLI as the same
    layout written by hand does (losses within 1e-5)."""
    import yaml
    from test_cli import _scalars, _train

    tiny, planned = tmp_path / "tiny.yaml", tmp_path / "plan.yaml"
    tiny.write_text(yaml.safe_dump(TINY_PROJECT))
    out = subprocess.run([sys.executable, "-m", "lightning_par.plan", "--module", "example_projects.gpt.lit.GPTModule",
                          "--datamodule", "example_projects.gpt.data.CharDataModule", "--config",
                          "example_projects/gpt/configs/fsdp2.yaml", str(tiny), "--world", "2", "--gpus-per-node",
                          "2", "--batch", "8", "--precision", "32-true", "--memory-budget", "850000", "--restrict",
                          "pp=1", "tp=1", "cp=1", "--activation-checkpointing", "none", "--reshard-after-forward", "on",
                          "--accumulate-unsharded", "off", "--yaml", str(planned)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ,
                                                                                      "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    text = planned.read_text()
    header = [line for line in text.splitlines() if line.startswith("# ")][:6]
    assert header[0].startswith("# lightning_par plan of 20") and "GPTModule, 0.036 M parameters" in text
    assert "# cluster: 2 devices, 2 per node" in text and "tokens/s per device" in text
    assert text[text.index("trainer:"):] == PLANNED_YAML, text
    # after a pipeline config: every option the layout decides is the plan's (LightningCLI keeps the first
    # config's strategy arguments that the second does not name, under another class path too)
    merged = subprocess.run([sys.executable, "example_projects/gpt/train.py", "fit", "--config",
                             "example_projects/gpt/configs/pipeline_parallel.yaml", "--config", str(planned),
                             "--print_config"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert merged.returncode == 0, merged.stderr
    init_args = yaml.safe_load(merged.stdout)["trainer"]["strategy"]["init_args"]
    assert {k: init_args[k] for k in ("dp_shard", "pp", "pp_microbatches")} == {"dp_shard": 2, "pp": 1,
                                                                                 "pp_microbatches": None}
    by_hand = tmp_path / "by_hand.yaml"
    by_hand.write_text("trainer:\n  strategy:\n    class_path: lightning_par.NDParallelStrategy\n    init_args:\n"
                       "      dp_shard: 2\n  accumulate_grad_batches: 2\ndata:\n  batch_size: 2\n")
    short = ["--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.callbacks=[]"]
    losses = []
    for config, name in ((planned, "planned"), (by_hand, "by_hand")):
        _, log_dir = _train(tmp_path / name, *short, "--config", str(config))
        losses.append([e.value for e in _scalars(log_dir)["train/loss"]])
        ran = yaml.safe_load((log_dir / "config.yaml").read_text())  # what LightningCLI ran, after the merge
        assert ran["trainer"]["strategy"]["class_path"] == "lightning_par.NDParallelStrategy"
        assert ran["trainer"]["strategy"]["init_args"]["dp_shard"] == 2
        assert ran["trainer"]["accumulate_grad_batches"] == 2
        assert ran["data"]["batch_size"] == 2 and ran["model"]["n_embd"] == 32
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=1e-5)


DOCS = ROOT / "docs" / "planner.md"
#: what changes with the machine and the day: the planning time and the config's date
_VARYING = [(r"layouts in [\d.]+ s", "layouts in ... s"), (r"plan of \d{4}-\d\d-\d\d \d\d:\d\d UTC", "plan of ...")]


def _docs_sample() -> tuple[list[str], str, str]:
    """The command of docs/planner.md's "From the command line" (its optional ``[...]`` left out) and the two blocks
    after it: what it prints and the --yaml file it writes."""
    import re
    import shlex

    text = DOCS.read_text()
    match = re.search(r"```bash\n(python -m lightning_par\.plan .*?)\n```\n(?:<!--.*?-->\n)?```text\n(.*?)```\n"
                      r"(?:.*?\n)?```yaml\n(.*?)```", text[text.index("## From the command line"):], re.S)
    assert match, "docs/planner.md: the command line's sample (a bash block, a text block, a yaml block) is missing"
    command = re.sub(r"\[.*?\]", "", match.group(1).replace("\\\n", " "))
    return shlex.split(command)[3:], match.group(2), match.group(3)


def _masked(text: str) -> str:
    import re

    for pattern, stand_in in _VARYING:
        text = re.sub(pattern, stand_in, text)
    return text


def test_cli_docs_sample_is_what_the_command_prints(tmp_path, monkeypatch, capsys):
    """docs/planner.md's sample output and config are this command's, up to the planning time and the config's date
    (``_VARYING``); ``LIGHTNING_PAR_WRITE_DOCS=1`` writes them anew. Every line fits 120 columns, the model is named
    from its config, the legend expands what the table abbreviates, and the config's layout is the table's first."""
    from lightning_par.planner.cli import main

    args, printed, written = _docs_sample()
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0
    out = capsys.readouterr().out
    config = (tmp_path / "plan.yaml").read_text()
    if os.environ.get("LIGHTNING_PAR_WRITE_DOCS"):
        text = DOCS.read_text()
        DOCS.write_text(text.replace(f"```text\n{printed}```", f"```text\n{out}```", 1)
                        .replace(f"```yaml\n{written}```", f"```yaml\n{config}```", 1))
        printed, written = out, config
    assert _masked(out) == _masked(printed), "docs/planner.md's sample output is stale: LIGHTNING_PAR_WRITE_DOCS=1"
    assert _masked(config) == _masked(written), "docs/planner.md's sample config is stale: LIGHTNING_PAR_WRITE_DOCS=1"
    lines = out.splitlines() + config.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert out.startswith("LlamaForCausalLM (llama): 8.030 B parameters") and "_CausalLM" not in out
    legend = out[out.index("Legend:"):]
    lines = out.splitlines()
    first = lines[next(i for i, line in enumerate(lines) if line.startswith("  #  tok/s/dev")) + 1]
    assert first.split()[0] in ("1", "1*") and first.split()[7] in ("off", "full", "selective")
    for word, meaning in (("dp_shard", "dp_shardN = FSDP2"), ("cp", "cpN = context parallelism"),
                          ("accumulate", "accumulate N = accumulate_grad_batches N"), ("ZeRO-2", "ZeRO-2 = FSDP")):
        if word in out[:out.index("Legend:")]:
            assert meaning in " ".join(legend.split()), word
    assert "accumulate_grad_batches" in out and "lightning_par.NDParallelStrategy(" in out
    assert "would not change the first layout" in out or "If async TP worked" in out
    assert "class_path: lightning_par.NDParallelStrategy" in config and "accumulate_grad_batches:" in config


def test_cli_leaves_async_tp_out_unless_asked_and_marks_it(capsys):
    """Async TP has never run (it needs 2+ CUDA GPUs): by default no layout uses it and one line says which would
    win if it worked; --async-tp weighs it, and the table marks (*) and explains the layouts that use it."""
    from lightning_par.planner.cli import main

    config = ["--hf-config", "llama", "--hf-override", "vocab_size=32000", "hidden_size=1024",
              "intermediate_size=3584", "num_hidden_layers=8", "num_attention_heads=8", "num_key_value_heads=8",
              "--world", "8", "--device", "H100", "--seq-len", "4096", "--batch", "8", "--restrict", "tp=8",
              "--top", "4"]
    assert main(config) == 0
    out = capsys.readouterr().out
    table = out[:out.index("Legend:")]
    assert "async TP" not in table and "*" not in table
    assert "If async TP worked (never run: it needs 2+ CUDA GPUs; --async-tp weighs it), tp8 (SP, async TP, LP) " \
           "would come first" in " ".join(out.split())
    assert main([*config, "--async-tp"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("  #  tok/s/dev")) + 1:]
    assert rows[0].startswith("  1*") and "tp8 (SP, async TP, LP)" in rows[0]
    assert "* = uses a technique never run on this hardware (async TP needs 2+ CUDA GPUs" in " ".join(out.split())
    assert "If async TP worked" not in out


@pytest.mark.parametrize("given, weighed", [(None, (False,)), (True, (True,)), (False, (False,))])
def test_auto_parallel_plans_async_tp_only_when_asked(monkeypatch, given, weighed):
    """Async TP has never run (it needs 2+ CUDA GPUs): auto_parallel with compile=True no longer weighs it unasked;
    async_tp=True plans it, as before."""
    from lightning_par.strategies import auto

    seen = {}
    monkeypatch.setattr(auto, "train_dataloader_of", lambda trainer: [batch()])
    monkeypatch.setattr(auto, "plan_layouts", lambda *args, **kwargs: seen.update(kwargs))
    options = {} if given is None else {"async_tp": given}
    strategy = AutoParallelStrategy(device="H100", gpus_per_node=8, compile=True, **options)
    strategy._lightning_module = gpt()
    strategy._plan(None)
    assert seen["async_tp"] == weighed


def first_row_speed(out: str) -> float:
    """The first layout's tokens/s per device in the command line's table."""
    lines = out.splitlines()
    row = lines[next(i for i, line in enumerate(lines) if line.startswith("  #  tok/s/dev")) + 1]
    return float(row.split()[1].replace(",", ""))


def test_a_compiled_run_is_planned_with_its_non_matmul_ops_fused(monkeypatch, capsys):
    """torch.compile fuses a step's elementwise ops: ``--compile`` and ``auto_parallel(compile=True)`` price their
    bytes at ``devices.FUSED_TRAFFIC`` of eager's, so the same layout is predicted faster on a GPU."""
    from lightning_par.devices import FUSED_TRAFFIC
    from lightning_par.planner.cli import main
    from lightning_par.strategies import auto

    config = ["--hf-config", "llama", "--hf-override", "vocab_size=32000", "hidden_size=1024",
              "intermediate_size=3584", "num_hidden_layers=4", "num_attention_heads=8", "num_key_value_heads=8",
              "--world", "8", "--device", "H100", "--seq-len", "2048", "--batch", "8", "--restrict", "dp_shard=8",
              "--top", "1"]

    assert main(config) == 0
    eager = capsys.readouterr().out
    assert main([*config, "--compile"]) == 0
    compiled = capsys.readouterr().out
    assert f"fused non-matmul ops ({FUSED_TRAFFIC:g} of eager's bytes)" in compiled and "fused" not in eager
    assert first_row_speed(compiled) > first_row_speed(eager)

    seen = {}
    monkeypatch.setattr(auto, "train_dataloader_of", lambda trainer: [batch()])
    monkeypatch.setattr(auto, "plan_layouts", lambda *args, **kwargs: seen.setdefault("hardware", []).append(args[3]))
    for compile_ in (False, True):
        strategy = AutoParallelStrategy(device="H100", gpus_per_node=8, compile=compile_)
        strategy._lightning_module = gpt()
        strategy._plan(None)
    plain, fused_hw = seen["hardware"]
    assert fused_hw.memory_bandwidth == pytest.approx(plain.memory_bandwidth / FUSED_TRAFFIC)


def test_a_float8_run_is_planned_with_float8_matmuls_and_its_casts(monkeypatch, capsys):
    """``--float8 tensorwise`` and ``AutoParallelStrategy(float8="tensorwise")`` price the converted matmuls at the
    device's float8 rate (``devices.with_float8``) and its casts at the memory bandwidth: a layout of Llama-3.1-8B's
    widths is predicted faster on an H100, and the strategy line it prints trains it with float8. Refused on an
    A100 (no float8 matmuls), naming why; under ``auto_parallel`` on a device without them (the CPU) the plain
    matmuls are priced."""
    from lightning_par.planner.cli import main
    from lightning_par.strategies import auto

    config = ["--hf-config", "llama", "--hf-override", "vocab_size=32000", "hidden_size=4096",
              "intermediate_size=14336", "num_hidden_layers=2", "num_attention_heads=32", "num_key_value_heads=8",
              "--world", "8", "--seq-len", "2048", "--batch", "64", "--restrict", "dp_shard=8", "--top", "1",
              "--compile"]

    assert main([*config, "--device", "H100"]) == 0
    plain = capsys.readouterr().out
    assert main([*config, "--device", "H100", "--float8", "tensorwise"]) == 0
    float8 = capsys.readouterr().out
    assert "float8 matmuls 1.63x" in float8 and "float8" not in plain
    assert "float8='tensorwise'" in float8.replace("\n  ", " ")
    assert first_row_speed(float8) > first_row_speed(plain)
    with pytest.raises(SystemExit, match="--float8: float8 on A100-80GB: it has no float8 matmuls"):
        main([*config, "--device", "A100-80GB", "--float8", "tensorwise"])

    from lightning_par.planner import probe

    seen = []
    monkeypatch.setattr(auto, "train_dataloader_of", lambda trainer: [batch()])
    monkeypatch.setattr(auto, "plan_layouts", lambda *args, **kwargs: seen.append(args[3]))
    # this machine's probe, as a CPU's: no float8 matmuls there
    monkeypatch.setattr(probe, "probe_hardware", lambda *args, **kwargs: Hardware(
        "cpu (x86_64, 2 threads)", 2e10, None, 8, 2e9, 2e-5, 2e9, 2e-5, "a CPU, as planner.probe names one"))
    for device in ("H100", None):  # None: this machine, probed
        strategy = AutoParallelStrategy(device=device, gpus_per_node=8, float8="tensorwise")
        strategy._lightning_module = gpt()
        strategy.parallel_devices = [torch.device("cpu")]
        strategy._plan(None)
    assert seen[0].float8_speedup == pytest.approx(1.63, abs=0.01)
    assert seen[1].float8_speedup is None


def test_cli_every_option_has_help():
    from lightning_par.planner.cli import _parser

    bare = [a.option_strings for a in _parser()._actions if not a.help and a.option_strings != ["-h", "--help"]]
    assert not bare


def test_cli_table_fits_120_columns_and_its_legend_expands_every_abbreviation(capsys):
    """Long layouts (a pipeline's schedule, stages per rank, micro-batches and options) wrap at their options; the
    legend expands each abbreviation the rows use."""
    import re

    from lightning_par.planner.cli import main

    assert main(["--hf-config", "llama", "--hf-override", "vocab_size=32000", "hidden_size=1024",
                 "intermediate_size=3584", "num_hidden_layers=8", "num_attention_heads=8", "num_key_value_heads=8",
                 "--world", "16", "--device", "H100", "--seq-len", "4096", "--batch", "16", "--restrict", "pp=2",
                 "tp=2", "--top", "12"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    table, legend = out[:out.index("Legend:")], " ".join(out[out.index("Legend:"):].split())
    assert re.search(r"\n {60,}\S", table), "no layout wrapped onto a second line"
    expected = {r"\bpp2\b": "ppN = N pipeline stages", r"\btp2\b": "tpN = tensor parallelism",
                r"\bSP\b": "SP = sequence parallelism", r"\bLP\b": "LP = loss parallelism",
                r" v\d+ m\d+": "vN mM = N pipeline stages per rank",
                r"ZeRO-1": "ZeRO-1 = FSDP gathered and reduced once",
                r"\bdp_shard\d": "dp_shardN = FSDP2", r"\bcp\d": "cpN = context parallelism",
                r"\bselective\b": "selective", r"accumulate \d": "accumulate N = accumulate_grad_batches N"}
    used = [meaning for pattern, meaning in expected.items() if re.search(pattern, table)]
    assert len(used) >= 5 and all(meaning in legend for meaning in used), (used, legend)

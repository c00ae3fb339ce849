"""Pipeline parallelism inside the Trainer: every schedule's parity with one process (pp=2 and pp=4), layer-split
model parallelism (one micro-batch), pp x dp_shard, validation, gradient clipping and accumulation, checkpoints and
resume (also into another layout), local-only materialization, the schedule timeline, and every bad input.

Two launches (world 2 and world 4) run all of it, bad inputs first: a later run succeeding in the same job shows
that each error was raised on every rank without leaving a collective half-done."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.nn.functional as F
from launch import launch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from workers import (
    SEED,
    SGDGPT,
    TINY_GPT,
    CollectiveCounts,
    assert_parity,
    assert_raised_on_every_rank,
    error_of,
    fit,
    fit_reference,
    max_loss_diff,
    max_weight_diff,
    token_dataset,
)

from example_projects.gpt.lit import GPTModule
from lightning_par import FSDP2Strategy, NDParallelStrategy, PipelineParallelStrategy
from lightning_par.callbacks import PipelineTimelineMonitor

warnings.filterwarnings("ignore", category=FutureWarning)

PP2 = {f"{s}/m{m}": (s, m) for s, m in
       [("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 4), ("interleaved_zb", 4), ("zbv", 4), ("gpipe", 1)]}
PP4 = {f"{s}/m{m}": (s, m) for s, m in
       [("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 4), ("interleaved_zb", 4), ("zbv", 8)]}
PP2_DP2 = {"1f1b/m2": ("1f1b", 2), "interleaved_1f1b/m4": ("interleaved_1f1b", 4)}
#: FSDP inside the stages reducing per micro-batch (the default) or once per step
PP2_DP2_OPTIONS = {"1f1b/m2": dict(), "interleaved_1f1b/m4": dict(accumulate_unsharded=True)}
#: optimizer steps of each parity run (the learning rate's 3 warm-up steps and 2 of its decay, every step's loss
#: compared); gradient accumulation (20 batches: across an epoch's end), checkpoint and resume (a checkpoint at step 5)
#: and the timeline keep their own
STEPS = 5


class CrossEntropyOnOutputs(GPTModule):
    """Breaks the contract: computes the loss on the outputs itself instead of through ``self.loss``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


class HeldParameters(Callback):
    """What each rank holds once the strategy has set up: parameter names and elements."""

    def on_fit_start(self, trainer, pl_module):
        self.names = sorted(n for n, _ in pl_module.named_parameters())
        self.numel = sum(p.numel() for p in pl_module.parameters())
        self.meta = any(p.is_meta for p in pl_module.parameters())


def run_validate(strategy, devices: int, n_layer: int) -> dict[str, float]:
    """``trainer.validate`` of the initial weights on batches of 4 (not the training batch size: another trace)."""
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = GPTModule(**{**TINY_GPT, "n_layer": n_layer})
    out = trainer.validate(model, DataLoader(token_dataset(32), batch_size=4))[0]
    return {k: float(v) for k, v in out.items()}


def pp(schedule: str = "1f1b", m: int = 4, **kw) -> PipelineParallelStrategy:
    return PipelineParallelStrategy(pp_schedule=schedule, pp_microbatches=m, **kw)


def _world2(ckpt_dir: str, log_dir: str) -> dict:
    out: dict = {"errors": {
        "more_stages_than_blocks": error_of(lambda: fit(pp("gpipe", 2), 2, 1, n_layer=1)),
        "interleaved_without_enough_layers": error_of(lambda: fit(pp("interleaved_zb", 4), 2, 1, n_layer=3)),
        "batch_not_divisible": error_of(lambda: fit(pp("gpipe", 3), 2, 1, n_layer=2)),
        "no_block_list": error_of(lambda: fit(pp(block_list="model.norm"), 2, 1, n_layer=2)),
        "no_loss_method": error_of(lambda: fit(pp(pp_loss_method="criterion"), 2, 1, n_layer=2)),
        "loss_outside_the_contract": error_of(lambda: fit(pp(), 2, 1, n_layer=2, module_cls=CrossEntropyOnOutputs)),
    }}
    out["parity"] = {name: fit(pp(s, m), 2, 1, n_layer=4, max_steps=STEPS) for name, (s, m) in PP2.items()}
    out["uneven_split"] = fit(pp("1f1b", 4, pp_split_points=["model.blocks.1"]), 2, 1, n_layer=4, max_steps=STEPS)
    # interleaved stages that cannot be equal (8 blocks in 6 stages: 2, 2, 1, 1, 1, 1), which the planner weighs
    out["uneven_interleaved"] = fit(pp("interleaved_1f1b", 4, pp_stages_per_rank=3), 2, 1, n_layer=8,
                                    max_steps=STEPS)
    out["activation_checkpointing"] = fit(pp("1f1b", 4, activation_checkpointing=True), 2, 1, n_layer=4,
                                          max_steps=STEPS)
    out["selective_activation_checkpointing"] = fit(pp("1f1b", 4, activation_checkpointing="selective"), 2, 1,
                                                    n_layer=4, max_steps=STEPS)
    out["clip"] = fit(pp("1f1b", 4), 2, 1, n_layer=4, module_cls=SGDGPT, gradient_clip_val=0.05, max_steps=STEPS)
    out["accumulate"] = fit(pp("gpipe", 2), 2, 1, n_layer=4, accumulate_grad_batches=2)
    held = HeldParameters()
    out["checkpointed"] = fit(pp("1f1b", 4), 2, 1, n_layer=4, ckpt_dir=ckpt_dir, ckpt_every_n_steps=5,
                              empty_init=True, callbacks=[held])
    out["held"] = {"names": held.names, "numel": held.numel, "meta": held.meta}
    ckpt = str(Path(ckpt_dir) / "step=5.ckpt")
    out["resumed"] = fit(pp("1f1b", 4), 2, 1, n_layer=4, resume_from=ckpt, empty_init=True)
    out["resumed_as_fsdp2"] = fit(FSDP2Strategy(), 2, 2, n_layer=4, resume_from=ckpt)
    out["validate"] = run_validate(pp("1f1b", 4), 2, n_layer=4)
    monitor = PipelineTimelineMonitor(every_n_steps=5, first_step=1)
    fit(pp("1f1b", 4), 2, 1, n_layer=4, max_steps=7, callbacks=[monitor],
        logger=TensorBoardLogger(log_dir, name="pp", version=0))
    out["timeline"] = {"written": [str(p) for p in monitor.written], "timelines": monitor.timelines}
    return out


def _world4() -> dict:
    out = {"pp4": {name: fit(pp(s, m), 4, 1, n_layer=8, max_steps=STEPS) for name, (s, m) in PP4.items()}}
    counts = {name: CollectiveCounts() for name in PP2_DP2}
    out["pp2_x_dp_shard2"] = {name: fit(pp(s, m, pp=2, dp_shard=2, **PP2_DP2_OPTIONS[name]), 4, 2, n_layer=4,
                                        callbacks=[counts[name]], max_steps=STEPS)
                              for name, (s, m) in PP2_DP2.items()}
    out["pp2_x_dp_shard2_collectives"] = {name: {"per_batch": c.per_batch, "fsdp_units": c.fsdp_units}
                                          for name, c in counts.items()}
    accumulated = CollectiveCounts()  # Lightning's accumulation on top of the schedule's micro-batches
    out["pp2_x_dp_shard2_accumulated"] = fit(pp("1f1b", 2, pp=2, dp_shard=2, accumulate_unsharded=True), 4, 2,
                                             n_layer=4, accumulate_grad_batches=2, callbacks=[accumulated])
    out["pp2_x_dp_shard2_accumulated"].update(per_batch=accumulated.per_batch, fsdp_units=accumulated.fsdp_units)
    # zero bubble runs backward in two passes (input, then weight gradients), each unpacking what forward saved:
    # the sequence chunks are gathered again in each
    out["pp2_x_tp2_zbv_regather"] = {
        schedule: fit(NDParallelStrategy(pp=2, tp=2, dp_shard=1, sequence_parallel=True, loss_parallel=True,
                                         regather_sequence=True, pp_schedule=schedule, pp_microbatches=4),
                      4, 1, n_layer=4, max_steps=4)
        for schedule in ("zbv", "interleaved_1f1b")}
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    ckpt_dir, log_dir = tmp_path_factory.mktemp("pp_ckpt"), tmp_path_factory.mktemp("pp_logs")
    results = launch(2, _world2, str(ckpt_dir), str(log_dir), timeout=600)
    return {"ranks": results, "log_dir": log_dir}


@pytest.fixture(scope="module")
def world4():
    return launch(4, _world4, timeout=600)


@pytest.fixture(scope="module")
def ref4():
    return fit_reference(n_layer=4, max_steps=STEPS)


@pytest.fixture(scope="module")
def ref8():
    return fit_reference(n_layer=8, max_steps=STEPS)


@pytest.mark.parametrize("name", list(PP2))
def test_pp2_every_schedule_matches_one_process(world2, ref4, name):
    for rank in world2["ranks"]:  # the logged loss is the last stage's, on every rank
        assert max_loss_diff(rank["parity"][name]["losses"], ref4["losses"]) <= 1e-5
    assert_parity(world2["ranks"][0]["parity"][name], ref4, steps=STEPS)


@pytest.mark.parametrize("name", list(PP4))
def test_pp4_every_schedule_matches_one_process(world4, ref8, name):
    assert_parity(world4[0]["pp4"][name], ref8, steps=STEPS)


def test_sequence_chunks_are_gathered_again_in_each_pass_of_a_split_backward(world4, ref4):
    """pp2 x tp2 with sequence parallelism and ``regather_sequence`` under zbv (backward in an input and a weight
    pass) matches one process; the chunks are gathered again in each pass: about twice as often as under
    interleaved 1F1B, whose one backward pass gathers each once (the stages differ: v against loop placement)."""
    runs = world4[0]["pp2_x_tp2_zbv_regather"]
    ref = {"losses": ref4["losses"][:4]}
    for schedule, result in runs.items():
        assert max_loss_diff(result["losses"], ref["losses"]) <= 1e-5, schedule
    split, single = runs["zbv"]["gathered_again"], runs["interleaved_1f1b"]["gathered_again"]
    assert 1.8 * single <= split <= 2.2 * single, (split, single)


@pytest.mark.parametrize("name", list(PP2_DP2))
def test_pp2_x_dp_shard2_matches_one_process(world4, ref4, name):
    assert_parity(world4[0]["pp2_x_dp_shard2"][name], ref4, steps=STEPS)


@pytest.mark.parametrize("name", list(PP2_DP2))
def test_pp_x_fsdp_reduces_per_micro_batch_or_once_per_step(world4, name):
    """By default each FSDP unit inside the stages reduce-scatters in every micro-batch's backward; with
    ``accumulate_unsharded`` once per step, in the last one, as torch's schedules do for a stage that is an FSDP
    module (the engine's units are each their own root). The first step is left out: there torch infers the
    backward's shapes with one more backward through the stage, outside the schedule."""
    microbatches = PP2_DP2[name][1]
    per_step = 1 if PP2_DP2_OPTIONS[name].get("accumulate_unsharded") else microbatches
    for rank in world4:
        counts = rank["pp2_x_dp_shard2_collectives"][name]
        assert counts["fsdp_units"] >= 2 and len(counts["per_batch"]) == STEPS
        reduce_scatters = [batch.get("_reduce_scatter_base_") for batch in counts["per_batch"][1:]]
        assert reduce_scatters == [per_step * counts["fsdp_units"]] * (STEPS - 1), (reduce_scatters,
                                                                                     counts["fsdp_units"])


def test_pp_x_fsdp_reduces_once_per_optimizer_step_under_gradient_accumulation(world4):
    """``accumulate_unsharded`` with Lightning's accumulation on top of the schedule: the first batch of each
    optimizer step reduces nothing, the second reduce-scatters each unit once; in parity with one process
    accumulating 2 batches."""
    assert_parity(world4[0]["pp2_x_dp_shard2_accumulated"], fit_reference(n_layer=4, accumulate_grad_batches=2),
                  steps=20)
    for rank in world4:
        run = rank["pp2_x_dp_shard2_accumulated"]
        scatters = [batch.get("_reduce_scatter_base_", 0) for batch in run["per_batch"][1:]]
        assert len(run["per_batch"]) == 20 and scatters == [run["fsdp_units"], 0] * 9 + [run["fsdp_units"]], scatters


@pytest.mark.parametrize("name", ["uneven_split", "activation_checkpointing", "selective_activation_checkpointing"])
def test_uneven_split_and_activation_checkpointing(world2, ref4, name):
    assert_parity(world2["ranks"][0][name], ref4, steps=STEPS)


def test_interleaved_stages_cut_unevenly_match_one_process(world2, ref8):
    assert_parity(world2["ranks"][0]["uneven_interleaved"], ref8, steps=STEPS)


def test_gradient_clipping_across_stages(world2):
    """SGD: the update is proportional to the clipped gradient, so a norm taken over one stage only would show."""
    assert_parity(world2["ranks"][0]["clip"], fit_reference(n_layer=4, module_cls=SGDGPT, gradient_clip_val=0.05,
                                                            max_steps=STEPS), steps=STEPS)


def test_gradient_accumulation(world2):
    result, reference = world2["ranks"][0]["accumulate"], fit_reference(n_layer=4, accumulate_grad_batches=2)
    assert len(result["losses"]) == len(reference["losses"]) == 20  # 10 optimizer steps of 2 batches
    assert_parity(result, reference, steps=20)


def test_each_rank_materializes_only_its_stages(world2):
    """With ``empty_init=True`` the model is created on the meta device; each rank then allocates its own stages'
    parameters only: disjoint names that together make the whole model."""
    full = GPTModule(**{**TINY_GPT, "n_layer": 4})
    full.configure_model()
    full_names = sorted(n for n, _ in full.named_parameters())
    held = [r["held"] for r in world2["ranks"]]
    assert not any(h["meta"] for h in held)
    assert not set(held[0]["names"]) & set(held[1]["names"])
    assert sorted(held[0]["names"] + held[1]["names"]) == full_names
    assert held[0]["numel"] + held[1]["numel"] == sum(p.numel() for p in full.parameters())
    assert "model.tok_emb.weight" in held[0]["names"] and "model.head.weight" in held[1]["names"]


def test_resume_and_resume_into_another_layout(world2):
    r = world2["ranks"][0]
    full = r["checkpointed"]
    for name in ("resumed", "resumed_as_fsdp2"):
        assert r[name]["global_step"] == 10
        assert max_loss_diff(r[name]["losses"], full["losses"][5:]) <= 1e-5, name
        assert max_weight_diff(r[name]["weights"], full["weights"]) <= 1e-5, name


def test_validate_runs_forward_only_through_the_stages(world2):
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    expected = trainer.validate(GPTModule(**{**TINY_GPT, "n_layer": 4}),
                                DataLoader(token_dataset(32), batch_size=4))[0]
    for rank in world2["ranks"]:
        assert rank["validate"].keys() == expected.keys() == {"val/loss", "val/perplexity"}
        for key, value in expected.items():
            assert abs(rank["validate"][key] - float(value)) <= 1e-5, (key, rank["validate"][key], float(value))


def test_timeline_png_tensorboard_image_and_events(world2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    timeline = world2["ranks"][0]["timeline"]
    assert [Path(p).name for p in timeline["written"]] == ["step000001.png", "step000006.png"]
    assert all(Path(p).stat().st_size > 10_000 for p in timeline["written"])
    events = EventAccumulator(str(world2["log_dir"] / "pp" / "version_0"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("pipeline/timeline")] == [1, 6]
    assert {"pipeline/idle_fraction/rank0", "pipeline/idle_fraction/rank1",
            "pipeline/idle_fraction/theory"} <= set(events.Tags()["scalars"])
    # 1F1B, pp=2, 4 micro-batches: rank r runs stage r, a forward and a backward of every micro-batch
    for rank, events_of_rank in enumerate(timeline["timelines"]):
        for kind in ("forward", "backward"):
            done = sorted((e.stage, e.microbatch) for e in events_of_rank if e.kind == kind)
            assert done == [(rank, mb) for mb in range(4)], (rank, kind, done)
        assert any(e.kind == "idle" for e in events_of_rank)


@pytest.mark.parametrize("case, pattern", [
    ("more_stages_than_blocks", r"pp=2 needs 2 stages but the model has only 1 blocks"),
    ("interleaved_without_enough_layers",
     r"pp=2 x 2 stages per rank \(schedule='interleaved_zb'\) needs 4 stages but the model has only 3 blocks"),
    ("batch_not_divisible", r"batch size 8 is not divisible by n_microbatches=3"),
    ("no_block_list", r"block_list='model.norm' is a LayerNorm, not an nn.ModuleList .* pass `block_list="),
    ("no_loss_method", r"pp_loss_method='criterion': CrossEntropyOnOutputs|pp_loss_method='criterion': GPTModule has"),
    ("loss_outside_the_contract", r"outputs.flatten: under pipeline parallelism, training_step must pass"),
])
def test_bad_input_is_refused_on_every_rank(world2, case, pattern):
    assert_raised_on_every_rank([r["errors"] for r in world2["ranks"]], case, pattern)

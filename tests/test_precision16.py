"""precision="16-mixed": fp16 autocast over fp32 weights with a loss scaler whose inf/NaN check covers every shard,
tp rank and pipeline stage, against Lightning on one device with the same plugin (plain torch GradScaler).

Lightning turns ``precision="16-mixed"`` into bf16 on CPU, so the runs pass ``MixedPrecision("16-mixed", "cpu")``
as a plugin (CPU autocast supports fp16); the strategy converts it exactly as it converts the plugin Lightning
builds from the flag on CUDA. One launch per world size; every run injects an inf into one rank's gradient (one
shard, one tp shard, one stage) at one step, or starts from a scale at which fp16 gradients overflow by themselves.

fp16 tolerance: both sides compute in fp16 (unit roundoff 2**-11 = 4.9e-4) but round at different points: tensor
parallelism rounds each rank's partial row-parallel output to fp16 before summing, micro-batches and data shards
run smaller matmuls (another accumulation order), FSDP2 may all-gather fp16 parameters. Measured over 6 SGD steps
(lr 0.5), with fp32 and with fp16 FSDP2 all-gathers: loss <= 8.1e-5, weights <= 6.8e-5, the same size as fp16 vs
fp32 in one process (6.6e-5, 4.3e-5): another set of fp16 roundings. Tolerance 2e-4 for both, about 3x the
largest measured. What a broken scaler does is far larger: a step taken that should have been skipped, or a
gradient not unscaled before clipping, moves weights by 1e-2 to 1e-1; skips are also checked exactly (on every rank
no parameter moved at the skipped step, and the scale equals the reference's after every step), and autocast to
fp16 is checked directly since parity alone cannot tell fp16 from fp32 at this size.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from launch import launch
from lightning.pytorch.plugins.precision import MixedPrecision
from precision16_workers import (
    ACCUMULATE_STEPS,
    CLIP,
    NATURAL_INIT_SCALE,
    SGDGPT16,
    SKIP_STEP,
    STEPS,
    InjectInf,
    fit16,
    fp16_plugin,
    run_cuda_world1,
    run_world2,
    run_world4,
)
from workers import GPTModule, max_loss_diff, max_weight_diff

from lightning_par import checkpoint as ckpt
from lightning_par.strategies.precision import ParallelGradScaler, ParallelMixedPrecision, to_parallel_precision

LOSS_TOL = 2e-4
WEIGHT_TOL = 2e-4
EXPECTED_CHANGED = [step != SKIP_STEP for step in range(STEPS)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("fp16_ckpt")
    return launch(2, run_world2, str(ckpt_dir)), ckpt_dir


@pytest.fixture(scope="module")
def world4():
    return launch(4, run_world4)


@pytest.fixture(scope="module")
def reference():
    return fit16(None, 1, 1, module_cls=SGDGPT16, inject=InjectInf(SKIP_STEP, "model.blocks.0.mlp.fc.weight"))


@pytest.fixture(scope="module")
def reference_clipped():
    return fit16(None, 1, 1, module_cls=SGDGPT16, gradient_clip_val=CLIP,
                 inject=InjectInf(SKIP_STEP, "model.blocks.0.norm1.weight"))


@pytest.fixture(scope="module")
def reference_accumulate2():
    return fit16(None, 1, 1, module_cls=SGDGPT16, max_steps=ACCUMULATE_STEPS, accumulate_grad_batches=2,
                 inject=InjectInf(SKIP_STEP, "model.blocks.0.mlp.fc.weight"))


@pytest.fixture(scope="module")
def reference_natural():
    return fit16(None, 1, 1, module_cls=SGDGPT16, plugin=fp16_plugin(NATURAL_INIT_SCALE))


def _assert_same_steps_as(runs: list[dict], reference: dict, expected_changed: list[bool]) -> None:
    """Every rank: the reference's scale after each step, and parameters moved exactly on the unskipped steps."""
    for rank, run in enumerate(runs):
        assert run["scaler_type"] == "ParallelGradScaler" and run["precision"] == "16-mixed", rank
        assert run["weight_dtypes"] == ["torch.float32"], f"rank {rank}: master weights must stay fp32"
        assert run["autocast"] == (True, torch.float16), f"rank {rank}: the step ran under {run['autocast']}"
        assert run["scales"] == reference["scales"], f"rank {rank}: {run['scales']} vs {reference['scales']}"
        assert run["changed"] == expected_changed, f"rank {rank}: parameters moved at {run['changed']}"
        assert run["global_step"] == reference["global_step"]


def _assert_parity(run: dict, reference: dict) -> None:
    assert max_loss_diff(run["losses"], reference["losses"]) <= LOSS_TOL, (run["losses"], reference["losses"])
    assert max_weight_diff(run["weights"], reference["weights"]) <= WEIGHT_TOL


def test_reference_skips_the_injected_step(reference):
    assert reference["autocast"] == (True, torch.float16)
    assert reference["changed"] == EXPECTED_CHANGED and reference["global_step"] == STEPS
    assert reference["scales"][SKIP_STEP] == reference["scales"][SKIP_STEP - 1] / 2  # backed off
    assert reference["scales"][1] == 2 * reference["scales"][0]  # and grown after GROWTH_INTERVAL clean steps


@pytest.mark.parametrize("name", ["fsdp2", "tp2", "pp2_1f1b"])
def test_world2_layouts_skip_on_every_rank_and_match_one_process(world2, reference, name):
    runs = [rank_result[name] for rank_result in world2[0]]
    assert [r["injected"] for r in runs].count(True) == 1, "the inf must be on one rank only"
    _assert_same_steps_as(runs, reference, EXPECTED_CHANGED)
    _assert_parity(runs[0], reference)


def test_pipeline_with_gradient_accumulation(world2, reference_accumulate2):
    """The schedule scales each micro-batch loss by 1/accumulate and by the loss scale; one unscale per step."""
    skipped_batches = [i for i, c in enumerate(reference_accumulate2["changed"]) if not c]
    assert skipped_batches == [0, 2, 3, 4], reference_accumulate2["changed"]  # no step at 0, 2, 4; 3 skipped
    runs = [rank_result["pp2_accumulate2"] for rank_result in world2[0]]
    _assert_same_steps_as(runs, reference_accumulate2, reference_accumulate2["changed"])
    _assert_parity(runs[0], reference_accumulate2)


def test_unscaled_before_clipping_with_partial_gradients(world2, reference, reference_clipped):
    """Clipping a still-scaled gradient would clip by a norm 2**16 too large: every update would be tiny."""
    runs = [rank_result["tp2_sp_clipped"] for rank_result in world2[0]]
    _assert_same_steps_as(runs, reference_clipped, EXPECTED_CHANGED)
    _assert_parity(runs[0], reference_clipped)
    assert max_weight_diff(reference_clipped["weights"], reference["weights"]) > 10 * WEIGHT_TOL  # clipping acted


def test_scaler_state_is_checkpointed_and_resumed(world2):
    """The checkpoint holds the scale and growth tracker; a run resumed with another initial scale goes on with
    the saved one (its first step grows the scale: the tracker was restored too)."""
    results, ckpt_dir = world2
    saving, resumed = results[0]["saving"], results[0]["resumed"]
    meta = torch.load(ckpt_dir / "step=4.ckpt" / ckpt.META_FILE, weights_only=False)
    state = meta["ParallelMixedPrecision"]
    assert state["scale"] == saving["scales"][3] and state["_growth_tracker"] == 1
    assert saving["changed"] == EXPECTED_CHANGED
    for rank in range(2):
        assert results[rank]["resumed"]["scales"] == saving["scales"][4:]
    assert saving["scales"][4] == 2 * saving["scales"][3]
    assert max_loss_diff(resumed["losses"], saving["losses"][4:]) <= 1e-6
    assert max_weight_diff(resumed["weights"], saving["weights"]) <= 1e-6


def test_fsdp_x_tp_inf_in_one_tp_shard_skips_everywhere(world4, reference):
    """The case torch's own GradScaler gets wrong: its DTensor rule reduces found-inf only over the mesh dims on
    which the first gradient is sharded, so the other tp rank would step."""
    runs = [rank_result["dp2_tp2"] for rank_result in world4]
    assert [r["injected"] for r in runs] == [False, False, False, True]
    _assert_same_steps_as(runs, reference, EXPECTED_CHANGED)
    _assert_parity(runs[0], reference)


def test_pp_x_fsdp_overflowing_by_itself(world4, reference_natural):
    """From 2**22 the fp16 gradients overflow: the first steps are skipped, later ones alternate with growth."""
    skipped = [not c for c in reference_natural["changed"]]
    assert skipped[0] and not all(skipped), reference_natural["changed"]
    runs = [rank_result["pp2_dp2_natural"] for rank_result in world4]
    _assert_same_steps_as(runs, reference_natural, reference_natural["changed"])
    _assert_parity(runs[0], reference_natural)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_16_mixed_flag_on_one_gpu():
    """The whole CUDA path: Lightning's own fp16 plugin from the flag, converted; CUDA autocast and scaler, NCCL."""
    result = launch(1, run_cuda_world1)[0]
    reference, run = result["reference"], result["nd"]
    assert reference["precision"] == "16-mixed" and reference["changed"] == EXPECTED_CHANGED
    assert reference["autocast"] == (True, torch.float16)
    _assert_same_steps_as([run], reference, EXPECTED_CHANGED)
    _assert_parity(run, reference)


# ---- one process: the scaler itself and the plugin conversion ------------------------------------------------


def test_torch_private_unscale_hook_is_what_we_override():
    """ParallelGradScaler overrides torch's private GradScaler._unscale_grads_ (checked on torch 2.13):
    fail loudly when its signature changes or unscale_ stops calling it."""
    params = list(inspect.signature(torch.amp.GradScaler._unscale_grads_).parameters)
    assert params == ["self", "optimizer", "inv_scale", "found_inf", "allow_fp16"], params
    assert "self._unscale_grads_(" in inspect.getsource(torch.amp.GradScaler.unscale_)

    finite, broken = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([finite, broken], lr=1.0)
    scaler = ParallelGradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    finite.grad, broken.grad = torch.full((3,), 4.0), torch.tensor([1.0, float("nan")])
    scaler.unscale_(optimizer)
    assert torch.equal(finite.grad, torch.full((3,), 0.5))  # unscaled by 1/8
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(finite.detach(), torch.ones(3)), "the step must be skipped"
    assert scaler.get_scale() == 4.0


def test_16_mixed_plugin_is_converted_with_its_scaler_settings():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25,
                                  growth_interval=7)
    plugin = to_parallel_precision(MixedPrecision("16-mixed", "cpu", scaler=scaler), "cpu")
    assert type(plugin) is ParallelMixedPrecision and plugin.precision == "16-mixed"
    ours = plugin.scaler
    assert type(ours) is ParallelGradScaler
    assert (ours.get_scale(), ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (
        1024.0, 3.0, 0.25, 7)
    with plugin.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu")


def test_scaler_state_saved_by_lightnings_own_plugin_resumes():
    plugin = ParallelMixedPrecision("16-mixed", "cpu")
    saved = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=5).state_dict()
    plugin.on_load_checkpoint({"MixedPrecision": saved})
    assert plugin.scaler.get_scale() == 512.0 and plugin.scaler.get_growth_interval() == 5



class _AdamW(GPTModule):
    def __init__(self, fused: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)


def test_bf16_mixed_clips_the_gradients_of_a_fused_optimizer():
    """Lightning's MixedPrecision refuses gradient clipping for fused optimizers under bf16 too (they unscale inside
    their step, which matters only with a loss scaler); ours clips them, as it clips the unfused AdamW's."""
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader
    from workers import TINY_GPT, token_dataset

    from lightning_par import FSDP2Strategy

    def run(fused: bool, clip: float | None) -> dict[str, torch.Tensor]:
        seed_everything(0, verbose=False)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(), precision="bf16-mixed",
                          max_steps=3, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        model = _AdamW(fused=fused, **TINY_GPT)
        trainer.fit(model, DataLoader(token_dataset(24), batch_size=8))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    fused = run(True, 0.01)
    assert max_weight_diff(fused, run(False, 0.01)) <= 1e-5  # clipped alike
    assert max_weight_diff(fused, run(True, None)) > 1e-4  # and the clip acted

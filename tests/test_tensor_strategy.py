"""TensorParallelStrategy through Lightning: parity with one process (GPT with its plan, a Hugging Face Llama with
its own plan), FSDP2 x TP, sharded clipping, checkpoints under TP resumed under TP and under FSDP2, bad input.
The technique alone (without Lightning) is tested in test_tensor_parallel_core.py."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from launch import launch
from lightning.pytorch import Trainer
from workers import (
    SGDGPT,
    assert_parity,
    assert_raised_on_every_rank,
    error_of,
    fit,
    fit_reference,
)

from lightning_par import FSDP2Strategy, TensorParallelStrategy

WORLD2 = {
    "tp2": dict(),
    "tp2_sequence_parallel": dict(sequence_parallel=True),
    "tp2_loss_parallel": dict(loss_parallel=True),
    "tp2_sp_lp": dict(sequence_parallel=True, loss_parallel=True),
    "tp2_sp_lp_regather": dict(sequence_parallel=True, loss_parallel=True, regather_sequence=True),
}
#: optimizer steps of each parity run (the learning rate's 3 warm-up steps and 2 of its decay, every step's loss
#: compared); the checkpoint resumed at step 3 runs the usual 10
STEPS = 5
WORLD4 = {
    "tp4": (dict(), 1),
    "tp4_sp_lp": (dict(sequence_parallel=True, loss_parallel=True), 1),
    "dp_shard2_x_tp2": (dict(tp=2, dp_shard=2), 2),
    "dp_shard2_x_tp2_sp_lp": (dict(tp=2, dp_shard=2, sequence_parallel=True, loss_parallel=True), 2),
    "dp_shard2_x_tp2_sp_regather": (dict(tp=2, dp_shard=2, sequence_parallel=True, regather_sequence=True), 2),
}


class TinyLlama(pl.LightningModule):
    """A Hugging Face LlamaForCausalLM built from a config (no download); TP uses the plan the model carries."""

    def __init__(self, **_: object) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


def _errors() -> dict:
    cases = {
        "heads_not_divisible": (dict(), dict(n_head=1)),
        "plan_entry_matches_nothing": (dict(tp_plan={"model.blocks.*.attn.q": "colwise", "model.nope": "rowwise"}), {}),
        "unknown_style": (dict(tp_plan={"model.blocks.*.attn.q": "diagonal"}), {}),
    }
    return {
        name: error_of(lambda s=strategy_kwargs, m=model_kwargs: fit(
            TensorParallelStrategy(**s), devices=2, dp_size=1, max_steps=1, **m))
        for name, (strategy_kwargs, model_kwargs) in cases.items()
    }


def _world2(ckpt_dir: str) -> dict:
    out = {name: fit(TensorParallelStrategy(**kw), devices=2, dp_size=1, max_steps=STEPS)
           for name, kw in WORLD2.items()}
    out["llama"] = fit(TensorParallelStrategy(), devices=2, dp_size=1, module_cls=TinyLlama, max_steps=STEPS)
    out["llama_sp"] = fit(TensorParallelStrategy(sequence_parallel=True), devices=2, dp_size=1, module_cls=TinyLlama,
                          max_steps=STEPS)
    out["llama_sp_regather"] = fit(TensorParallelStrategy(sequence_parallel=True, regather_sequence=True), devices=2,
                                   dp_size=1, module_cls=TinyLlama, max_steps=STEPS)
    out["clipped"] = fit(TensorParallelStrategy(sequence_parallel=True), devices=2, dp_size=1, module_cls=SGDGPT,
                         gradient_clip_val=0.5, max_steps=STEPS)
    out["errors"] = _errors()
    # checkpoint under TP (mid-epoch, step 3), resume under TP and under FSDP2: DCP reshards on load
    fit(TensorParallelStrategy(sequence_parallel=True), devices=2, dp_size=1, max_steps=4, ckpt_dir=ckpt_dir,
        ckpt_every_n_steps=3)
    out["resumed_tp"] = fit(TensorParallelStrategy(), devices=2, dp_size=1, resume_from=f"{ckpt_dir}/step=3.ckpt")
    out["resumed_fsdp2"] = fit(FSDP2Strategy(), devices=2, dp_size=2, resume_from=f"{ckpt_dir}/step=3.ckpt")
    return out


def _world4() -> dict:
    return {name: fit(TensorParallelStrategy(**kw), devices=4, dp_size=dp, max_steps=STEPS)
            for name, (kw, dp) in WORLD4.items()}


@pytest.fixture(scope="module")
def reference():
    return fit_reference()


@pytest.fixture(scope="module")
def parity_reference():
    return fit_reference(max_steps=STEPS)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return launch(2, _world2, str(tmp_path_factory.mktemp("tp_ckpt")))


@pytest.fixture(scope="module")
def world4():
    return launch(4, _world4)


@pytest.mark.parametrize("name", list(WORLD2))
def test_parity_world2(world2, parity_reference, name):
    assert_parity(world2[0][name], parity_reference, steps=STEPS)
    assert world2[1][name]["losses"] == world2[0][name]["losses"]
    assert (world2[0][name]["gathered_again"] > 0) == ("regather" in name)  # the option acted, and only with it


@pytest.mark.parametrize("name", list(WORLD4))
def test_parity_world4(world4, parity_reference, name):
    assert_parity(world4[0][name], parity_reference, steps=STEPS)
    assert (world4[0][name]["gathered_again"] > 0) == ("regather" in name)


@pytest.mark.parametrize("name", ["llama", "llama_sp", "llama_sp_regather"])
def test_hugging_face_model_with_its_own_plan(world2, name):
    assert_parity(world2[0][name], fit_reference(module_cls=TinyLlama, max_steps=STEPS), steps=STEPS)
    assert (world2[0][name]["gathered_again"] > 0) == ("regather" in name)


def test_gradient_clipping_under_tp(world2):
    """Sequence-parallel norm gradients are Partial DTensors, position embeddings plain: one global norm."""
    assert_parity(world2[0]["clipped"], fit_reference(module_cls=SGDGPT, gradient_clip_val=0.5, max_steps=STEPS),
                  steps=STEPS)


@pytest.mark.parametrize("name", ["resumed_tp", "resumed_fsdp2"])
def test_checkpoint_saved_under_tp_resumes_under_tp_and_fsdp2(world2, reference, name):
    assert_parity(world2[0][name], reference, steps=7)


@pytest.mark.parametrize(
    "case, error",
    [
        ("heads_not_divisible", r"ValueError: tp_plan: 'model.blocks.0.attn.q' projects to 1 heads \(out_features=32 "
                                r"/ head_dim=32 of 'model.blocks.0.attn'\), which tp=2 cannot split"),
        ("plan_entry_matches_nothing", r"ValueError: tp_plan: 'model.nope' matches no module of GPTModule"),
        ("unknown_style",
         r"ValueError: tp_plan\['model.blocks.\*.attn.q'\] = 'diagonal' is not a tensor-parallel style"),
    ],
)
def test_bad_plans_are_refused_on_every_rank(world2, case, error):
    assert_raised_on_every_rank([r["errors"] for r in world2], case, error)


def test_tp_not_dividing_the_world_is_refused():
    with pytest.raises(ValueError, match=r"cannot fill `dp_shard=-1`|multiplies to 3 processes"):
        Trainer(accelerator="cpu", devices=4, strategy=TensorParallelStrategy(tp=3), logger=False)

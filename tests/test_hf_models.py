"""Hugging Face models under context, pipeline and N-D parallelism, with no change to the model: parity with one
process (losses every step, final weights, fp32, 1e-5) for six architectures (Llama, Qwen2, Mistral with a sliding
window, Phi-3 with fused projections, Gemma, Mixtral with experts), every pipeline schedule, the 2-D mixes and
pp x dp_shard x tp at world 8; and what is refused, on every rank, before any collective."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
from hf_models import HFCausalLM
from hf_workers import ARCHS, PP_SCHEDULES, STEPS, world2, world4, world8
from launch import launch
from torch.utils.data import DataLoader
from workers import SEED, assert_parity, assert_raised_on_every_rank, fit_reference, token_dataset

pytest.importorskip("transformers", reason="needs transformers (the dev extra)")


@functools.cache
def reference(arch: str = "qwen2", **overrides) -> dict:
    return fit_reference(module_cls=HFCausalLM, max_steps=STEPS, arch=arch, **overrides)


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    return launch(2, world2, str(tmp_path_factory.mktemp("hf_ckpt")), timeout=900)


@pytest.fixture(scope="module")
def w4():
    return launch(4, world4, timeout=900)


@pytest.mark.parametrize("arch", ARCHS)
def test_context_parallel_trains_every_architecture_in_parity(w2, arch):
    assert_parity(w2[0]["cp"][arch], reference(arch), steps=STEPS)
    assert w2[1]["cp"][arch]["losses"] == w2[0]["cp"][arch]["losses"]


def test_context_parallel_allgather(w2):
    assert_parity(w2[0]["cp_allgather"], reference("llama"), steps=STEPS)


def test_the_sliding_window_is_applied():
    """Mistral's window (5 of 16 tokens) changes the model: the parity above would not hold with plain causal
    attention across ranks."""
    assert abs(reference("mistral")["losses"][-1] - reference("mistral", sliding_window=None)["losses"][-1]) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_trains_every_architecture_in_parity(w2, arch):
    assert_parity(w2[0]["pp"][arch], reference(arch), steps=STEPS)


@pytest.mark.parametrize("name", list(PP_SCHEDULES))
def test_pipeline_schedules(w2, name):
    assert_parity(w2[0]["pp_schedules"][name], reference(), steps=STEPS)


@pytest.mark.parametrize("name", ["pp_uneven", "pp_activation_checkpointing", "tp_sp_lp_activation_checkpointing",
                                  "tp_sp_selective_activation_checkpointing"])
def test_pipeline_uneven_split_and_activation_checkpointing(w2, name):
    arch = "qwen2" if name == "pp_uneven" else "llama"
    assert_parity(w2[0][name], reference(arch), steps=STEPS)


@pytest.mark.parametrize(("name", "arch"), [("cp_attention_sinks", "gpt_oss"), ("tp_sp_lp_head_norms", "qwen3"),
                                          ("tp_sp_lp_gathered_projections", "phi3"),
                                          ("tp_sp_lp_fused_qkv", "gpt_neox"),
                                          ("tp_sp_lp_linear_attention", "qwen3_5"),
                                          ("tp_sp_lp_gathered_projections_regather", "phi3"),
                                          ("tp_sp_lp_linear_attention_regather", "qwen3_5"),
                                          ("tp_learnable_activation", "apertus"),
                                          ("tp_sp_lp_attention_sinks", "granite_swa"),
                                          ("tp_latent_attention_sinks", "hy_v4"),
                                          ("tp_stacked_shared_experts", "inkling_text")])
def test_more_architectures(w2, name, arch):
    """gpt-oss's attention sinks under cp; under tp with SP and LP: Qwen3's per-head q/k norms (weights whole, gradients
    summed over tp), Phi-3's projections whose outputs its plan gathers whole (the sequence is gathered before the
    attention and MLP), GPT-NeoX's fused head-interleaved qkv projection (Megatron's GPT layer), Qwen3.5's
    linear-attention layers (their output cut back to the chunk); and Apertus's learnable activation under tp, marked
    'head_norm' in the user's plan (with SGD: 1e-8; AdamW's first steps, ~lr x sign(gradient), turn rounding in one
    v_proj's near-zero gradients into 1.4e-5). Bare per-head parameters under tp (attention sinks: split by head, the
    attention run on this rank's shards) with SP and LP, and multi-head latent attention (HY-V4's kv_a_proj_with_mqa:
    whole, its rope output's gradient summed over tp; without that sum its gradients differ across the tp ranks, which
    the strategy refuses after the first backward). Inkling's stacked shared experts (bare 3-D parameters split on the
    intermediate dim, HF's 'all_reduce' owner: output summed over tp, and the gradients of its hidden states and router
    weights too; without the latter the ranks' gradients differ, refused after the first backward) and its normalizing
    embedding (kept whole: a vocabulary split would normalize partial lookups)."""
    sgd = {"optimizer": "sgd"} if arch == "apertus" else {}
    assert_parity(w2[0][name], reference(arch, **sgd), steps=STEPS)
    assert (w2[0][name]["gathered_again"] > 0) == name.endswith("_regather")  # regather_sequence acted


def test_tied_embeddings_train_under_the_v_schedule(w2):
    """zbv keeps the first and the last stage on rank 0: the tied embedding/head weight gets both gradients."""
    assert_parity(w2[0]["zbv_tied"], reference(tie_word_embeddings=True), steps=STEPS)


@pytest.mark.parametrize("layout", ["pp", "cp"])
def test_validate(w2, layout):
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    expected = trainer.validate(HFCausalLM("qwen2"), DataLoader(token_dataset(32), batch_size=4))[0]
    for rank in w2:
        assert abs(rank["validate"][layout]["val/loss"] - float(expected["val/loss"])) <= 1e-5


def test_timeline_monitor_sees_every_micro_batch(w2):
    for rank, events in enumerate(w2[0]["timelines"]):
        for kind in ("forward", "backward"):
            done = sorted((e.stage, e.microbatch) for e in events if e.kind == kind)
            assert done == [(rank, mb) for mb in range(4)], (rank, kind, done)


@pytest.mark.parametrize("name", ["resumed_pp", "resumed_cp"])
def test_checkpoint_under_pp_resumes_under_pp_and_cp(w2, name):
    assert_parity(w2[0][name], reference(), steps=STEPS - 2)


@pytest.mark.parametrize("case, pattern", [
    ("dense_mask_under_cp", r"got an attention_mask of shape \(8, 1, 8, 8\): under context parallelism pass the 2-D"),
    ("tied_embeddings_across_ranks", r"'model.model.embed_tokens.weight' \(stage 0\) and 'model.lm_head.weight' "
                                     r"\(stage 1\) are one tied parameter.*pp_schedule='zbv'"),
    ("softcapping_under_cp", r"Gemma2ForCausalLM soft-caps its attention logits"),
    ("forward_breaks_the_contract", r"must have forward\(x\) return `self.<model>\(input_ids=x\).logits`.*"
                                    r"attention_mask are not passed on between stages"),
    ("block_list_is_not_the_plans", r"block_list='model.model.norm': Qwen2ForCausalLM is pipelined from its own "
                                    r"pipeline plan, which cuts 'model.model.layers'"),
    ("linear_attention_under_cp", r"Qwen3_5ForCausalLM has layers of type \['linear_attention'\].*Use cp=1"),
    ("sequence_parallel_with_whole_attention", r"sequence_parallel=True: 'model.model.layers.0.self_attn' "
                                               r"\(GptOssAttention\) would see only this rank's sequence chunk"),
    ("attention_bias_under_cp", r"passes \['position_bias'\] to its attention, which context-parallel attention "
                                r"does not apply"),
    ("plan_leaves_a_parameter_on_split_activations", r"the tp plan leaves \['model.model.layers.0.mlp.act_fn.alpha_p'"
                                                     r", .* whole, but their gradients differ across the tp ranks"),
])
def test_refused_on_every_rank(w2, case, pattern):
    assert_raised_on_every_rank([r["errors"] for r in w2], case, pattern)


@pytest.mark.parametrize("name", ["pp2_x_dp_shard2", "pp2_x_tp2", "pp2_x_tp2_sp_lp", "cp2_x_tp2", "cp2_x_dp_shard2"])
def test_two_dimensional_layouts(w4, name):
    assert_parity(w4[0][name], reference(), steps=STEPS)


def test_fsdp_reducing_once_per_step_trains_hugging_face_models(w4):
    """``accumulate_unsharded`` on transformers models: inside pipeline stages (Qwen2), and ZeRO-1-like over 2
    batches of accumulation on Qwen3-MoE, both in parity with one process."""
    assert_parity(w4[0]["pp2_x_dp_shard2_once"], reference(), steps=STEPS)
    assert_parity(w4[0]["dp_shard4_zero1_accumulated_moe"],
                  fit_reference(module_cls=HFCausalLM, max_steps=STEPS // 2, arch="qwen3_moe",
                                accumulate_grad_batches=2), steps=STEPS)


def test_pp_x_dp_shard_x_tp_at_world_8():
    result = launch(8, world8, timeout=900)
    assert_parity(result[0]["pp2_x_dp_shard2_x_tp2"], reference(), steps=STEPS)
    assert_parity(result[0]["pp2_x_dp_shard2_x_tp2_x_ep2"], reference("qwen3_moe"), steps=STEPS)


@pytest.mark.parametrize(("name", "arch"), [("model_parallel_tp", "llama"), ("model_parallel_dp_moe", "mixtral")])
def test_lightnings_model_parallel_arguments_train_hugging_face_models(w2, name, arch):
    """``ModelParallelStrategy(tensor_parallel_size=2)`` on a Llama (its own tp plan) and
    ``ModelParallelStrategy(data_parallel_size=2)`` on a Mixtral (FSDP2), without a configure_model."""
    assert_parity(w2[0][name], reference(arch), steps=STEPS)

"""What tests/test_hf_models.py runs in each process: Hugging Face causal LMs (tiny configs) trained by Lightning
under context, pipeline and N-D parallelism, several layouts per launch (a launch costs seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hf_models import DenseMaskHFCausalLM, HFCausalLM, MaskedHFCausalLM
from torch.utils.data import DataLoader
from workers import SEED, error_of, fit, token_dataset

from lightning_par import ModelParallelStrategy, NDParallelStrategy
from lightning_par.callbacks import PipelineTimelineMonitor
from lightning_par.techniques.context.context_hf import _attention
from lightning_par.techniques.context.context_routing import ContextParallelScope
from lightning_par.techniques.tensor.tensor import resolve_tp_plan

STEPS = 4
ARCHS = ("llama", "qwen2", "mistral", "phi3", "gemma", "mixtral")
PP_SCHEDULES = {"gpipe/m1": ("gpipe", 1), "interleaved_1f1b/m4": ("interleaved_1f1b", 4),
                "interleaved_zb/m4": ("interleaved_zb", 4), "zbv/m4": ("zbv", 4)}


def hf_fit(strategy: NDParallelStrategy, world: int, dp: int, arch: str = "qwen2", **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("max_steps", STEPS)
    kwargs.setdefault("module_cls", HFCausalLM)
    return fit(strategy, devices=world, dp_size=dp, arch=arch, **kwargs)


def validate(strategy: NDParallelStrategy, world: int, arch: str = "qwen2") -> dict[str, float]:
    """``trainer.validate`` of the initial weights on batches of 4 (another shape than training's)."""
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    out = trainer.validate(HFCausalLM(arch), DataLoader(token_dataset(32), batch_size=4))[0]
    return {k: float(v) for k, v in out.items()}


def _cp(**kw: Any) -> NDParallelStrategy:
    return NDParallelStrategy(dp_shard=1, cp=2, **kw)


def _pp(schedule: str = "1f1b", m: int = 2, **kw: Any) -> NDParallelStrategy:
    return NDParallelStrategy(dp_shard=1, pp=2, pp_schedule=schedule, pp_microbatches=m, **kw)


def world2(ckpt_dir: str) -> dict[str, Any]:
    """Every architecture under cp=2 and pp=2; the other schedules, an uneven split, activation checkpointing,
    validate, the timeline, checkpoints across layouts, and what is refused."""
    out: dict[str, Any] = {"errors": {
        "dense_mask_under_cp": error_of(lambda: hf_fit(_cp(), 2, 1, module_cls=DenseMaskHFCausalLM)),
        "tied_embeddings_across_ranks": error_of(lambda: hf_fit(_pp(), 2, 1, tie_word_embeddings=True)),
        "softcapping_under_cp": error_of(lambda: hf_fit(_cp(), 2, 1, arch="gemma2")),
        "forward_breaks_the_contract": error_of(lambda: hf_fit(_pp(), 2, 1, module_cls=MaskedHFCausalLM)),
        "block_list_is_not_the_plans": error_of(lambda: hf_fit(_pp(block_list="model.model.norm"), 2, 1)),
        "linear_attention_under_cp": error_of(lambda: hf_fit(_cp(), 2, 1, arch="qwen3_5")),
        # gpt-oss's plan in transformers names no attention projection: under SP attention would see a chunk
        "sequence_parallel_with_whole_attention": error_of(lambda: hf_fit(
            NDParallelStrategy(dp_shard=1, tp=2, sequence_parallel=True), 2, 1, arch="gpt_oss")),
    }}
    out["cp"] = {arch: hf_fit(_cp(), 2, 1, arch=arch) for arch in ARCHS}
    out["cp_allgather"] = hf_fit(_cp(cp_algorithm="allgather"), 2, 1, arch="llama")
    out["pp"] = {arch: hf_fit(_pp(), 2, 1, arch=arch) for arch in ARCHS}
    out["pp_schedules"] = {name: hf_fit(_pp(s, m), 2, 1) for name, (s, m) in PP_SCHEDULES.items()}
    out["pp_uneven"] = hf_fit(_pp(pp_split_points=["model.model.layers.1"]), 2, 1)
    out["pp_activation_checkpointing"] = hf_fit(_pp(activation_checkpointing=True), 2, 1, arch="llama")
    out["zbv_tied"] = hf_fit(_pp("zbv", 4), 2, 1, tie_word_embeddings=True)
    # the sequence cut runs on the checkpoint wrapper, before the checkpoint saves the first block's input; loss
    # parallelism keeps the model's lm_head logits sharded over the vocabulary
    out["tp_sp_lp_activation_checkpointing"] = hf_fit(
        NDParallelStrategy(dp_shard=1, tp=2, sequence_parallel=True, loss_parallel=True,
                           activation_checkpointing=True), 2, 1, arch="llama")
    # selective: the policy keeps sequence parallelism's reduce-scatters; the model's key/value cache is off
    out["tp_sp_selective_activation_checkpointing"] = hf_fit(
        NDParallelStrategy(dp_shard=1, tp=2, sequence_parallel=True, activation_checkpointing="selective"), 2, 1,
        arch="llama")
    # models beyond the six: attention sinks under cp; per-head q/k norms, whole-output (gathered) projections and
    # a hybrid's linear-attention layers under tp with sequence and loss parallelism
    out["cp_attention_sinks"] = hf_fit(_cp(), 2, 1, arch="gpt_oss")
    sp_lp = dict(dp_shard=1, tp=2, sequence_parallel=True, loss_parallel=True)
    out["tp_sp_lp_head_norms"] = hf_fit(NDParallelStrategy(**sp_lp), 2, 1, arch="qwen3")
    out["tp_sp_lp_gathered_projections"] = hf_fit(NDParallelStrategy(**sp_lp), 2, 1, arch="phi3")
    out["tp_sp_lp_fused_qkv"] = hf_fit(NDParallelStrategy(**sp_lp), 2, 1, arch="gpt_neox")
    out["tp_sp_lp_linear_attention"] = hf_fit(NDParallelStrategy(**sp_lp), 2, 1, arch="qwen3_5")
    # the sequence chunks gathered again in backward: inputs gathered by the attention and MLP modules (inner
    # activations inside them are not) and whole-output projections
    regather = dict(sp_lp, regather_sequence=True)
    out["tp_sp_lp_gathered_projections_regather"] = hf_fit(NDParallelStrategy(**regather), 2, 1, arch="phi3")
    out["tp_sp_lp_linear_attention_regather"] = hf_fit(NDParallelStrategy(**regather), 2, 1, arch="qwen3_5")
    # bare per-head parameters split by head (Granite-SWA's attention sinks, with SP and LP: the attention also
    # gathers the sequence), and multi-head latent attention with sinks (HY-V4: the rope part's gradient summed)
    out["tp_sp_lp_attention_sinks"] = hf_fit(NDParallelStrategy(**sp_lp), 2, 1, arch="granite_swa")
    out["tp_latent_attention_sinks"] = hf_fit(NDParallelStrategy(dp_shard=1, tp=2), 2, 1, arch="hy_v4")
    # stacked shared experts split on their intermediate dim ('partial_sum': output and input gradients all-reduced)
    out["tp_stacked_shared_experts"] = hf_fit(NDParallelStrategy(dp_shard=1, tp=2), 2, 1, arch="inkling_text")
    out["errors"]["attention_bias_under_cp"] = error_of(_attention_with_a_bias_under_cp)
    # Apertus's plan leaves its xIELU activation whole on split activations: found after the first backward; with
    # the activation marked 'head_norm' (whole weights, gradients summed over tp) it trains in parity
    out["errors"]["plan_leaves_a_parameter_on_split_activations"] = error_of(
        lambda: hf_fit(NDParallelStrategy(dp_shard=1, tp=2), 2, 1, arch="apertus"))
    plan = {**resolve_tp_plan(HFCausalLM("apertus"), None), "model.model.layers.*.mlp.act_fn": "head_norm"}
    out["tp_learnable_activation"] = hf_fit(NDParallelStrategy(dp_shard=1, tp=2, tp_plan=plan), 2, 1, arch="apertus",
                                            optimizer="sgd")
    # Lightning's ModelParallelStrategy arguments on a model that does not parallelize itself: the engine applies
    # the model's own tp plan (dense Llama), or FSDP2 over data_parallel_size (Mixtral, a mixture of experts)
    out["model_parallel_tp"] = hf_fit(ModelParallelStrategy(tensor_parallel_size=2), 2, 1, arch="llama")
    out["model_parallel_dp_moe"] = hf_fit(ModelParallelStrategy(data_parallel_size=2), 2, 2, arch="mixtral")
    out["validate"] = {"pp": validate(_pp(), 2), "cp": validate(_cp(), 2)}
    monitor = PipelineTimelineMonitor(every_n_steps=10, first_step=2, dirpath=str(Path(ckpt_dir) / "timeline"))
    hf_fit(_pp("1f1b", 4), 2, 1, max_steps=3, callbacks=[monitor])
    out["timelines"] = monitor.timelines
    # checkpoint at step 2 under pp; resumed under pp and under cp: DCP reshards
    hf_fit(_pp(), 2, 1, max_steps=2, ckpt_dir=ckpt_dir, ckpt_every_n_steps=2)
    ckpt = str(Path(ckpt_dir) / "step=2.ckpt")
    out["resumed_pp"] = hf_fit(_pp(), 2, 1, resume_from=ckpt)
    out["resumed_cp"] = hf_fit(_cp(), 2, 1, resume_from=ckpt)
    return out


def _attention_with_a_bias_under_cp() -> None:
    """transformers' attention call with an extra tensor (a relative position bias, as Inkling passes one)."""
    module = HFCausalLM("llama").model.model.layers[0].self_attn
    q = k = v = torch.zeros(1, 4, 8, 8)
    with ContextParallelScope(dist.group.WORLD):
        _attention(module, q, k, v, None, position_bias=torch.zeros(1, 4, 8, 16))


def world4() -> dict[str, Any]:
    """The 2-D mixes of the issue, on a Hugging Face model."""
    layouts = {
        "pp2_x_dp_shard2": (dict(pp=2, dp_shard=2), 2),
        "pp2_x_tp2": (dict(pp=2, dp_shard=1, tp=2), 1),
        # stages hand on the sequence chunk; later stages build masks and positions for the whole sequence; the
        # last stage's loss over vocabulary-sharded logits
        "pp2_x_tp2_sp_lp": (dict(pp=2, dp_shard=1, tp=2, sequence_parallel=True, loss_parallel=True,
                                 pp_schedule="interleaved_1f1b", pp_microbatches=4), 1),
        "cp2_x_tp2": (dict(cp=2, dp_shard=1, tp=2), 1),
        "cp2_x_dp_shard2": (dict(cp=2, dp_shard=2), 2),
    }
    out = {name: hf_fit(NDParallelStrategy(**kw), 4, dp) for name, (kw, dp) in layouts.items()}
    # FSDP reducing once per step: inside pipeline stages, and ZeRO-1-like over Lightning's accumulation on a
    # mixture of experts (routers leave experts without tokens: the unused gradients are taken back per step)
    out["pp2_x_dp_shard2_once"] = hf_fit(NDParallelStrategy(pp=2, dp_shard=2, accumulate_unsharded=True), 4, 2)
    out["dp_shard4_zero1_accumulated_moe"] = hf_fit(
        NDParallelStrategy(dp_shard=4, reshard_after_forward=False, accumulate_unsharded=True), 4, 4,
        arch="qwen3_moe", accumulate_grad_batches=2, max_steps=STEPS // 2)
    return out


def world8() -> dict[str, Any]:
    """The 3-D mix on a dense model, and on a mixture of experts with ep borrowed from dp_shard in each stage
    (attention under tp, experts under ep)."""
    return {"pp2_x_dp_shard2_x_tp2": hf_fit(NDParallelStrategy(pp=2, dp_shard=2, tp=2), 8, 2),
            "pp2_x_dp_shard2_x_tp2_x_ep2": hf_fit(NDParallelStrategy(pp=2, dp_shard=2, tp=2, ep=2), 8, 2,
                                                   arch="qwen3_moe")}

"""The planner against published training runs: each case is a real configuration with its published throughput,
planned from the device table (``known_hardware``, no probe), the model built on the meta device (transformers'
``LlamaConfig`` with the published sizes, or for Megatron's GPT runs the example project's GPT, which has Megatron's
GPT shape; nothing downloaded), restricted only as the published run was: the same world, global batch, sequence and
precision (and the GPUs' memory where the table's device differs), and the techniques its software had (Megatron-LM
in 2021: tensor, pipeline and plain data parallelism, full recomputation; no sharded data or context parallelism, so
``restrict`` keeps dp_shard and cp at 1 and the planner weighs full checkpointing only; NeMo AutoModel's MoE
parallelizer: no tensor or context parallelism, whole-block checkpointing).

Two things are checked per case: the tokens per second per GPU the planner predicts for the published layout
against the published figure, and where the published layout ranks in the plan. A layout is its mesh sizes
(``dp_replicate, dp_shard, cp, tp, pp``); its predicted throughput is that of the planner's best variant of those
sizes (schedule, micro-batches, activation checkpointing: the planner's choices, or the published ones where the
run fixed them), and its rank counts distinct mesh sizes, best variant each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from hf_models import HFCausalLM

from example_projects.gpt.lit import GPTModule
from lightning_par.costs.profile import ModelProfile, price_experts_as, profile_model
from lightning_par.devices import GiB, Hardware, fused, known_hardware
from lightning_par.planner.predict import RESERVE, Layout, Prediction, trace_dtype
from lightning_par.planner.search import CHECKPOINTING, PIPELINE_SCHEDULES, RESTRICTABLE, Plan, plan_layouts

_VOCAB = dict(vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=8192)
#: Llama 3.1 sizes: the models' config.json on the Hugging Face hub (meta-llama/Llama-3.1-{8B,70B,405B}), which
#: match "The Llama 3 Herd of Models" (arXiv:2407.21783), table 3
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, **_VOCAB)
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, **_VOCAB)
LLAMA_405B = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                  num_key_value_heads=8, **_VOCAB)

_TT_2412 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch 1963fc8, torchtitan 9dec370, "
            "2024-12)")
_GRAND_TETON = ("Grand Teton: 8 H100 per host over NVLink, 96 GB HBM2e at 500 W, RDMA 400 Gb/s per GPU between "
                "hosts")


@dataclass(frozen=True)
class PublishedCase:
    name: str
    source: str  # where the figure is printed
    config: str  # the run's exact configuration, as the source states it
    model: dict[str, Any]  # config fields of tests/hf_models' ``arch`` (default "llama"), GPTModule's (arch "gpt")
    world: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    published_tokens_per_s: float | None  # per GPU; None: from ``published_tflops``
    layout: dict[str, int]  # the published mesh sizes (the others are 1)
    device: str = "H100-SXM"
    inter_link: str = "roce-400"
    memory_gib: float | None = None  # the GPUs' memory when it differs from the table's device
    activation_checkpointing: bool | None = None  # fixed by the run (full AC), else None: the planner's choice
    #: whether the run pipelined its tensor-parallel collectives with their matmuls (Megatron-Core's
    #: ``--tp-comm-overlap``, torchtitan's async TP): then every sequence-parallel layout is planned with it (those
    #: that re-gather sequence chunks without: Megatron pipelines those too, which this engine cannot compile); else
    #: with none (as ``checkpointing``: what the run had)
    async_tp: bool = False
    #: whether the run's software fused the non-matmul ops (Megatron's fused kernels, Transformer Engine,
    #: torch.compile): their bytes priced at ``devices.FUSED_TRAFFIC`` of the eager trace's (``devices.fused``)
    fused_kernels: bool = False
    #: how the run's software held the experts under tp (``costs.profile.price_experts_as``: Megatron-Core's
    #: "split", ETP = TP, its default, or "folded", ETP = 1); "whole": as the engine, on every tp rank
    experts_over_tp: str = "whole"
    #: the run's gradient accumulation (torchtitan's benchmarks ran none), None: the planner's choice
    accumulate_grad_batches: int | None = None
    restrict: dict[str, list[int]] = field(default_factory=dict)
    published_tflops: float | None = None  # model TFLOP/s per GPU, where the source prints that instead
    arch: str = "llama"
    precision: str = "bf16-mixed"  # "bf16-true": the weights, gradients and optimizer state in bf16 too
    #: the dtype the run built its weights in (None: fp32, as Lightning's mixed precisions keep them)
    weights_dtype: torch.dtype | None = None
    checkpointing: tuple[bool | str, ...] = CHECKPOINTING  # the options the run's software had
    #: the run's software's other options (``plan_layouts``' keywords of the same names): a run ranks among the
    #: layouts its authors could have run (Megatron's distributed optimizer shards only optimizer state and
    #: gradients: the ZeRO-1-like variant; BLOOM's Megatron-DeepSpeed had no sequence parallelism)
    schedules: tuple[str, ...] = PIPELINE_SCHEDULES
    sequence_parallel: tuple[bool, ...] = (True, False)
    reshard_after_forward: tuple[bool, ...] = (True, False)
    accumulate_unsharded: tuple[bool, ...] = (False, True)
    #: context parallelism as the runs' software had it: the ring (torchtitan's torch CP; Llama 3's own stack
    #: gathered keys and values, priced alike at these sizes), no Ulysses all-to-all or hybrid
    cp_algorithm: tuple[str, ...] = ("ring",)
    cp_ulysses_size: tuple[int | None, ...] = (None,)
    #: whether its pipeline could cut the blocks into unequal interleaved stages (torch's pipelining, which
    #: torchtitan and NeMo AutoModel use, can; Megatron-LM's interleaved schedule needed equal ones)
    uneven_stages: bool = True
    #: the layouts its software could not run beyond ``restrict``'s sizes (a combination of them), left out
    excluded: Callable[[Layout], bool] | None = None
    #: why the planner does not meet a goal for this case (the test then expects the failure, strictly)
    known_gaps: dict[str, str] = field(default_factory=dict)


CASES = [
    PublishedCase(
        "torchtitan Llama 3.1 8B, 8 H100, FSDP",
        f"{_TT_2412}, table 1, row 'FSDP'",
        f"Llama 3.1 8B, seq 8192, local batch 2 (global 16), bf16 (FSDP param bf16, reduce fp32), selective (op) "
        f"activation checkpointing, no torch.compile, no Float8; FSDP 8; {_GRAND_TETON}",
        LLAMA_8B, world=8, global_batch=16, seq_len=8192, published_tokens_per_s=5762, layout={"dp_shard": 8},
        accumulate_grad_batches=1, memory_gib=96),
    PublishedCase(
        "torchtitan Llama 3.1 8B, 128 H100, FSDP",
        f"{_TT_2412}, table 3, row 'FSDP'",
        f"Llama 3.1 8B, seq 8192, local batch 2 (global 256), bf16, selective (op) activation checkpointing, no "
        f"torch.compile, no Float8; FSDP 128 over 16 hosts; {_GRAND_TETON}",
        LLAMA_8B, world=128, global_batch=256, seq_len=8192, published_tokens_per_s=5605,
        layout={"dp_shard": 128}, accumulate_grad_batches=1, memory_gib=96),
    PublishedCase(
        "torchtitan Llama 3.1 70B, 256 H100, FSDP 32 x TP 8",
        "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torch 38410cf9, torchtitan "
        "820504e, 2025-06), 'Llama3 70b on 256 H100s', row 'None (bfloat16)', vanilla TP",
        f"Llama 3.1 70B, seq 8192, local batch 16 per data-parallel rank (global 512), bf16, full activation "
        f"checkpointing, torch.compile, no Float8, TP without async; FSDP 32 x TP 8; {_GRAND_TETON}",
        LLAMA_70B, world=256, global_batch=512, seq_len=8192, published_tokens_per_s=597.3,
        layout={"dp_shard": 32, "tp": 8}, accumulate_grad_batches=1, memory_gib=96, activation_checkpointing=True,
        fused_kernels=True,  # torch.compile
        known_gaps={"rank": "the planner predicts layouts that avoid full activation checkpointing by splitting the "
                            "batch or the sequence (HSDP 4 x 16 x cp 2 x tp 2 with 8 micro-batches of accumulation "
                            "first, 987 tokens/s; FSDP's gathers across hosts use every NIC of a host) above FSDP 32 "
                            "x TP 8 with full checkpointing (101st, 1.13 of the published figure), whose TP "
                            "collectives it counts as exposed; torchtitan did not measure those alternatives"}),
    PublishedCase(
        "torchtitan Llama 3.1 405B, 128 H100, FSDP 16 x TP 8",
        "pytorch/torchtitan docs/performance.md at 3faaa1a0d (2024-08-23) to 4d88a8a44 (2024-12-03), 'Llama 3.1 "
        "performance numbers', row 'None' (no Float8, no async TP)",
        "Llama 3.1 405B, seq 8192, local batch 2 per data-parallel rank (global 32), bf16, full activation "
        "checkpointing; FSDP 16 x TP 8 (2D; 1D ran out of memory); 128 H100 SXM with 95 GB HBM2e at lower TDP",
        LLAMA_405B, world=128, global_batch=32, seq_len=8192, published_tokens_per_s=109,
        layout={"dp_shard": 16, "tp": 8}, accumulate_grad_batches=1, memory_gib=95, activation_checkpointing=True,
        known_gaps={"rank": "the planner ranks FSDP x context-parallel layouts without tp first (dp_shard 32 x cp 4, "
                            "145 tokens/s: the ring hides behind attention, and FSDP's gathers across 16 hosts "
                            "use the 8 NICs of each) and the published one 26th (130 tokens/s, 1.19 of the "
                            "published figure), whose TP all-gathers and reduce-scatters are exposed (1.6 s a "
                            "step); torchtitan measured 1D FSDP (out of memory) and FSDP x TP, not context "
                            "parallelism, for this model"}),
    PublishedCase(
        "Llama 3 405B pre-training, 8192 H100, TP 8 x PP 16 x DP 64",
        "The Llama 3 Herd of Models (arXiv:2407.21783), section 3.3.2, table 4, first row",
        "Llama 3 405B, seq 8192, batch 32 sequences per data-parallel rank (16M tokens per step), bf16; TP 8, CP 1, "
        "PP 16 (their interleaved schedule), DP 64 (FSDP of optimizer state and gradients); 430 TFLOP/s per GPU "
        "(43 % BF16 MFU); H100 80 GB HBM3 at 700 W, RoCE 400 Gb/s per GPU. Tokens/s per GPU = 430 TFLOP/s over the "
        "planner's own training FLOPs per token (3 x the traced forward; the paper does not print its count)",
        LLAMA_405B, world=8192, global_batch=2048, seq_len=8192, published_tokens_per_s=None, published_tflops=430,
        layout={"dp_shard": 64, "tp": 8, "pp": 16},
        known_gaps={
            "throughput": "the planner finds that only full activation checkpointing fits 80 GB (+33 % compute) at "
                          "pp 16, and prices the engine's FSDP inside the stages: reducing in every micro-batch "
                          "(32 micro-batches: 7.7 s of exposed FSDP traffic a step) or, with accumulate_unsharded, "
                          "once per step with every unit gathered and the stage's gradients unsharded (does not fit "
                          "without recomputation); its best variant, 16 micro-batches over 4 stages per rank (the 126 "
                          "layers in 64 stages of 2 and 1), has a 19 % bubble: 103 tokens/s, 0.63 of the published "
                          "figure. Meta's FSDP kept the bf16 weights whole and fitted "
                          "with less recomputation (lighter first and last stages are not modelled)",
            "rank": "the same: the planner ranks 16 pipeline stages x FSDP 16 x cp 8 x tp 4, ZeRO-1-like (157 "
                    "tokens/s per GPU: cp 8 splits the activations, no recomputation, 128 micro-batches) first and "
                    "the published layout 639th"}),
]

_MEGATRON = ("Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM' "
             "(SC '21, arXiv:2104.04473), table 1")
_SELENE = ("DGX A100 80 GB (Selene): 8 GPUs per node over NVLink/NVSwitch, 8 HDR InfiniBand 200 Gb/s per node")


def megatron_tokens_per_s(tflops: float, layers: int, hidden: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Tokens/s per GPU from the paper's teraFLOP/s per GPU, over its own FLOPs per token: equation (3),
    ``F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)`` per step of ``B s`` tokens (it counts the recomputed forward)."""
    return tflops * 1e12 / (96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden)))


#: the rows whose degrees the planner does not rank in its top three, and why
#: table 1's degrees come from the paper's heuristic (tp up to a node, then pp), not a search: the planner prices
#: narrower tp (with a pipeline where the model needs one) a few per cent faster
_MEGATRON_RANK = ("table 1's degrees come from the paper's heuristic (tp up to a node, then pp), not a search; with "
                  "full recomputation's tensor-parallel all-reduces priced (the recomputed forward sends them again) "
                  "the planner ranks narrower tp faster: {}")
#: the one fused share (``devices.FUSED_TRAFFIC``) prices Megatron-LM 2021's fused kernels (bias-GeLU, the masked
#: softmax, layer norm) as Transformer Engine's and torch.compile's, which fuse more of a step's other ops
_MEGATRON_FUSED = ("Megatron-LM 2021 fused fewer of the non-matmul ops (bias-GeLU, the masked softmax, layer norm) "
                   "than Transformer Engine and torch.compile, which the one fused share, fitted on them all, prices "
                   "alike; the narrow models, where those ops weigh most, come out too fast: {}")
_MEGATRON_GAPS = {
    1.7: {"throughput": _MEGATRON_FUSED.format("1.32 of the published (1.20 under the earlier one-share rule)")},
    3.6: {"throughput": _MEGATRON_FUSED.format("1.25 of the published (1.15 under the earlier one-share rule)")},
    7.5: {"rank": _MEGATRON_RANK.format("dp 64 x tp 2 first (2,762 tokens/s against the published layout's 2,521, "
                                        "1.14 of the published figure): 5th")},
    18.4: {"rank": _MEGATRON_RANK.format("4 pipeline stages x tp 2 first (1,057 tokens/s against 977, 1.12 of the "
                                         "published figure): 5th")},
    39.1: {"rank": _MEGATRON_RANK.format("8 pipeline stages x tp 2 first (493 tokens/s against 461, 1.08 of the "
                                         "published figure): 4th")},
}


def megatron_case(params_b: float, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
                  tflops: float) -> PublishedCase:
    """One row of the paper's table 1 (weak scaling, GPT at sequence 2048, vocabulary 51,200): the degrees it picked
    by its heuristics (tp up to a node, pp as the model needs, data parallelism for the rest) and measured."""
    return PublishedCase(
        f"Megatron-LM GPT {params_b}B, {gpus} A100, TP {tp} x PP {pp}",
        _MEGATRON,
        f"GPT {params_b}B ({heads} heads, hidden {hidden}, {layers} layers), seq 2048, batch {batch}, mixed "
        f"precision, full activation recomputation, interleaved pipeline schedule; TP {tp} x PP {pp} x DP "
        f"{gpus // (tp * pp)} (plain data parallelism); {tflops} TFLOP/s per GPU; {_SELENE}",
        dict(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads, n_embd=hidden), world=gpus,
        global_batch=batch, seq_len=2048, published_tokens_per_s=megatron_tokens_per_s(tflops, layers, hidden),
        layout={k: v for k, v in (("dp_replicate", gpus // (tp * pp)), ("tp", tp), ("pp", pp)) if v > 1},
        device="A100-80GB", inter_link="ib-hdr200", activation_checkpointing=True,
        restrict={"dp_shard": [1], "cp": [1]}, arch="gpt", precision="16-mixed", checkpointing=(True,),
        sequence_parallel=(False,),  # (Korthikanti et al. brought it to Megatron-LM in 2022)
        uneven_stages=False, fused_kernels=True, known_gaps=_MEGATRON_GAPS.get(params_b, {}))


CASES += [megatron_case(*row) for row in (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)]



#: NeMo AutoModel's published mixtures of experts (docs.nvidia.com/nemo/automodel, "Performance Summary",
#: pre-training, DGX-H100, BF16; read 2026-11), every mixture-of-experts row of its table this project builds: the
#: Hugging Face configs' sizes (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b and -120b, deepseek-ai/DeepSeek-V3,
#: moonshotai/Kimi-K2-Base), built from transformers' config classes on the meta device. Not cases: the Nemotron V3
#: rows, hybrid Mamba-2 models no test of this project builds (and its dense Llama 3 70B row)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                     tie_word_embeddings=False)
DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, q_lora_rank=1536,
                   kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
                   vocab_size=129280, max_position_embeddings=4096, tie_word_embeddings=False)
#: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer and no group-limited routing
KIMI_K2 = dict(DEEPSEEK_V3, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
               first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=163840)
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, sliding_window=128, max_position_embeddings=131072, tie_word_embeddings=False)
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)
_NEMO_AUTOMODEL = "NeMo AutoModel, docs 'Performance Summary', pre-training table, System: DGX-H100, BF16"
#: the configs committed with the table, NVIDIA-NeMo/Automodel examples/benchmark/configs/: at 79d0ccfdb (2025-10-02,
#: "Add benchmarking recipe and configs"; the table came 2025-10-06) and 2c236e081 (2025-10-08, the 1,024-GPU
#: DeepSeek-V3 config and GPT-OSS 120B's at its row's sizes) or 8d9bfb90e (2025-10-08, Qwen3's row measured again at
#: a global batch of 512); the rows unchanged since. They fix the activation checkpointing (a later config dropped it
#: for gpt-oss-20b without its row being measured again)
_NEMO_CONFIGS = "configs: NVIDIA-NeMo/Automodel examples/benchmark/configs/"
#: how NeMo AutoModel stores the weights: the model classes the configs name build them in bf16
#: (``initialize_weights(dtype=torch.bfloat16)`` then ``self.to(dtype)``), and torch.optim.Adam keeps its state alike
#: (8 bytes a parameter, not mixed precision's 16); FSDP2's policy (param bf16, reduce fp32) reduces the gradients in
#: fp32: lightning_par's "bf16-mixed" over a module built in bf16 (``weights_dtype``), as the planner prices it
_NEMO_STORAGE = ("parameters, gradients and Adam state in bf16 (NeMo's model classes initialize in bf16), gradients "
                 "reduced in fp32")
#: NeMo's dispatch (read in NeMo AutoModel's source, 2026-11): DeepEP sends a token once per destination rank, and
#: across nodes once per destination node, forwarding it over NVLink inside the node, as lightning_par's dispatch of
#: transformers' experts does; NeMo calls it synchronously (``moe_deepep_async_dispatch`` is off in these configs,
#: nothing is computed between dispatch and experts), so neither overlaps its all-to-alls with compute
_DEEPEP = ("NeMo dispatches with DeepEP, synchronously: like lightning_par it sends a token once per rank holding one "
           "of its experts, and across nodes once per node, forwarded over NVLink inside the node")


def nemo_case(name: str, row: str, config_file: str, config: str, model: dict[str, Any], arch: str,
              commit: str = "79d0ccfdb", **kwargs: Any) -> PublishedCase:
    """One row of NeMo AutoModel's table: an H100 cluster of 8-GPU nodes over 400 Gb/s InfiniBand, the weights
    built in bf16 as NeMo builds them (its FSDP reducing in fp32), the tokens routed as its benchmark gate routes
    them (``nemo_routing``), among the layouts its software could run (``_NEMO_SOFTWARE``). One step of its gradient
    accumulation is planned: a local batch, which NeMo runs as one micro-batch (its throughput is that of the
    variant run so)."""
    return PublishedCase(name, f"{_NEMO_AUTOMODEL}, row {row}; {_NEMO_CONFIGS}{config_file} at {commit}",
                         f"{config}; {_NEMO_STORAGE}; {_NEMO_GATE}; {_NEMO_SOFTWARE}", {**model, **nemo_routing(model)},
                         seq_len=4096, inter_link="ib-ndr400", arch=arch, weights_dtype=torch.bfloat16,
                         restrict={"tp": [1], "cp": [1]}, checkpointing=(False, True), excluded=nemo_cannot_run,
                         accumulate_grad_batches=1, fused_kernels=True, **kwargs)  # Transformer Engine


#: why gpt-oss's published runs use less memory than the planner predicts for them: transformers' gpt-oss has no
#: fused attention path for its sinks, so the trace (and lightning_par's engine) materializes the attention
#: probabilities, which NeMo's flex attention never saves
_GPT_OSS_ATTENTION = ("transformers' gpt-oss attends eagerly (no fused path for its sinks), saving every attention "
                      "probability, which NeMo's flex attention does not")
#: what NeMo AutoModel's MoE path, which every row's config names, could run: its parallelizer
#: (``nemo_automodel.components.moe.parallelizer.parallelize_model`` at 79d0ccfdb and 2c236e081) asserts a tensor-
#: and a context-parallel size of 1 ("not supported for DeepSeek v3 model", its Qwen3-MoE and gpt-oss models
#: alike) and checkpoints whole blocks (``apply_ac``'s op-level policy is never asked for); its recipe
#: (``recipes/llm/train_ft.py``) shards over dp_replicate x dp_shard only with a pipeline, over dp_shard alone
#: without (``nemo_cannot_run``). FSDP, expert and pipeline parallelism, accumulation and ZeRO-2-like FSDP it had
_NEMO_SOFTWARE = ("NeMo's MoE path: no tensor or context parallelism, whole-block checkpointing only, replicas only "
                  "with a pipeline")


def nemo_cannot_run(layout: Layout) -> bool:
    """HSDP without a pipeline, which NeMo's recipe could not set up (beyond ``restrict``'s sizes)."""
    return layout.dp_replicate > 1 and layout.pp == 1


#: the routing of every row (``fake_balanced_gate: true`` in each config; ``FakeBalancedGate`` in
#: nemo_automodel/components/moe/layers.py at 79d0ccfdb): token t goes to experts t k, ..., t k + k - 1 (mod E)
_NEMO_GATE = ("balanced benchmark gate: token t to the k consecutive experts t k ... t k + k - 1 (mod E), not the "
              "model's router")


def nemo_routing(model: dict[str, Any]) -> dict[str, int]:
    """NeMo's benchmark gate as group-limited routing, which the planner prices (``ranks_per_token``): each token's
    k choices fill one of E / k groups of k consecutive experts, the groups taken evenly. It sends a token to fewer
    ranks than a router's own choices would (Qwen3-30B-A3B at ep 8: 1 rank instead of 5.3; DeepSeek-V3 at ep 64: 2
    ranks of one node instead of 7.4 ranks of 4 nodes)."""
    experts = next(model[key] for key in ("num_experts", "num_local_experts", "n_routed_experts") if key in model)
    return {"n_group": experts // model["num_experts_per_tok"], "topk_group": 1}


CASES += [
    nemo_case(
        "NeMo AutoModel Qwen3-30B-A3B, 8 H100, EP 8 x FSDP 8", "'Qwen3 MoE 30B'", "qwen3_moe_30b_te_deepep.yaml",
        "Qwen3-30B-A3B, seq 4096, GBS 512 = 8 GPUs x LBS 4 x GA 16 (planned as one accumulation step: 32 "
        "sequences), EP 8, FSDP 8, full activation checkpointing, TE + DeepEP, balanced routing; 21.773 s per "
        "global step, 277 model TFLOP/s, 12,040 tokens/s per GPU",
        QWEN3_30B_A3B, "qwen3_moe", commit="8d9bfb90e", world=8, global_batch=32, published_tokens_per_s=12040,
        layout={"dp_shard": 8, "ep": 8}, activation_checkpointing=True),
    nemo_case(
        "NeMo AutoModel gpt-oss-20b, 8 H100, EP 8 x FSDP 8", "'GPT-OSS 20B'", "gptoss_20b_te_deepep.yaml",
        "gpt-oss-20b, seq 4096, GBS 256 = 8 GPUs x LBS 2 x GA 16 (planned as one accumulation step: 16 sequences), "
        "EP 8 (the config's ep_size; the table prints '-'), FSDP 8, full activation checkpointing, TE + DeepEP + "
        "flex attention, balanced routing; 10.04 s per global step, 279 model TFLOP/s, 13,058 tokens/s per GPU",
        GPT_OSS_20B, "gpt_oss", world=8, global_batch=16, published_tokens_per_s=13058,
        layout={"dp_shard": 8, "ep": 8}, activation_checkpointing=True),
    nemo_case(
        "NeMo AutoModel gpt-oss-120b, 64 H100, EP 64 x FSDP 64", "'GPT-OSS 120B'", "gptoss_120b_te_deepep.yaml",
        "gpt-oss-120b, seq 4096, GBS 512 = 64 GPUs x LBS 2 x GA 4 (planned as one accumulation step: 128 "
        "sequences), EP 64 (the config's ep_size; the table prints '-'), FSDP 64, no activation checkpointing, TE + "
        "DeepEP + flex attention, balanced routing; 4.30 s per global step, 231 model TFLOP/s, 7,626 tokens/s per "
        "GPU",
        GPT_OSS_120B, "gpt_oss", commit="2c236e081", world=64, global_batch=128, published_tokens_per_s=7626,
        layout={"dp_shard": 64, "ep": 64}, activation_checkpointing=False,
        known_gaps={
            "fits": _GPT_OSS_ATTENTION + ": 102 GiB a GPU predicted for the published variant (2 sequences without "
                    "recomputation), 84 of them activations, against 72"}),
    nemo_case(
        "NeMo AutoModel DeepSeek-V3 671B, 256 H100, PP 4 x EP 64 x FSDP 64", "'DeepSeek V3 671B' of 256 GPUs",
        "deepseek_v3_te_deepep.yaml",
        "DeepSeek-V3 671B, seq 4096, GBS 512, MBS 1, LBS 8, GA 1, PP 4 x VP 8, EP 64, FSDP 64, full activation "
        "checkpointing, TE + DeepEP, balanced routing; 8.18 s per global step, 250 model TFLOP/s, 1,002 tokens/s "
        "per GPU",
        DEEPSEEK_V3, "deepseek_v3", world=256, global_batch=512, published_tokens_per_s=1002,
        layout={"dp_shard": 64, "ep": 64, "pp": 4}, activation_checkpointing=True,
        known_gaps={"rank": (
            f"{_DEEPEP}. The published layout, predicted at 905 tokens/s (0.90 of the published figure), pays a "
            f"pipeline's bubble (0.41 s a step) and ep 64's all-to-alls across 8 nodes (1.2 s of exposed "
            f"communication); the planner ranks first FSDP 256 without a pipeline (ep 32: 1,033 tokens/s), with "
            f"full recomputation: 16th. NeMo published this mesh only")}),
    nemo_case(
        "NeMo AutoModel DeepSeek-V3 671B, 1024 H100, PP 4 x EP 64 x FSDP 256", "'DeepSeek V3 671B' of 1024 GPUs",
        "deepseek_v3_te_deepep_1024.yaml",
        "DeepSeek-V3 671B, seq 4096, GBS 8192 = 256 data-parallel ranks x LBS 8 x GA 4 (planned as one "
        "accumulation step: 2048 sequences), MBS 1, PP 4 x VP 8, EP 64, FSDP 256, full activation checkpointing, "
        "TE + DeepEP, balanced routing; 37.87 s per global step, 216 model TFLOP/s, 865 tokens/s per GPU",
        DEEPSEEK_V3, "deepseek_v3", commit="2c236e081", world=1024, global_batch=2048, published_tokens_per_s=865,
        layout={"dp_shard": 256, "ep": 64, "pp": 4}, activation_checkpointing=True,
        known_gaps={"rank": (
            f"{_DEEPEP}. The published layout, predicted at 905 tokens/s (1.05 of the published figure), ranks "
            f"22nd, behind FSDP 1,024 without a pipeline (ep 64: 1,006), as on 256 GPUs")}),
    nemo_case(
        "NeMo AutoModel Kimi K2 1T, 256 H100, PP 8 x EP 32 x FSDP 32", "'Kimi K2'", "kimi_k2_te_deepep.yaml",
        "Kimi K2 (1.04T parameters, 32B active), seq 4096, GBS 512 = 32 data-parallel ranks x LBS 8 x GA 2 "
        "(planned as one accumulation step: 256 sequences), MBS 1, PP 8 x VP 4, EP 32, FSDP 32, full activation "
        "checkpointing, TE + DeepEP, balanced routing; 8.86 s per global step, 189 model TFLOP/s, 924 tokens/s "
        "per GPU",
        KIMI_K2, "deepseek_v3", world=256, global_batch=256, published_tokens_per_s=924,
        layout={"dp_shard": 32, "ep": 32, "pp": 8}, activation_checkpointing=True,
        known_gaps={"rank": (
            f"{_DEEPEP}. The published layout, predicted at 916 tokens/s (0.99 of the published figure), loses 0.80 "
            f"s a step to its pipeline's bubble; the planner ranks FSDP 256 without a pipeline first (ep 128: "
            f"1,138): 7th")}),
]


def build(case: PublishedCase) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model on the meta device (nothing allocated) and one global batch of token ids."""
    with torch.device("meta"):
        if case.arch == "gpt":
            module = GPTModule(**case.model)
            module.configure_model()
        else:
            module = HFCausalLM(case.arch, **case.model)
    if case.weights_dtype is not None:
        module = module.to(case.weights_dtype)
    ids = torch.zeros(case.global_batch, case.seq_len, dtype=torch.long, device="meta")
    return module, (ids, ids)


def sizes(prediction: Prediction) -> tuple[int, ...]:
    return tuple(getattr(prediction.layout, k) for k in RESTRICTABLE)


def published_sizes(case: PublishedCase) -> tuple[int, ...]:
    return tuple(case.layout.get(k, 1) for k in RESTRICTABLE)


def case_hardware(case: PublishedCase, efficiency: float | None = None, memory_efficiency: float | None = None,
                  fused_traffic: float | None = None) -> Hardware:
    """The device table's hardware for the run: ``known_hardware``'s defaults unless ``efficiency`` and
    ``memory_efficiency`` say otherwise (``benchmarks/fit_time_model.py`` varies them), and where the run's software
    fused its non-matmul ops, ``devices.fused`` (at ``fused_traffic``, default ``FUSED_TRAFFIC``)."""
    table_precision = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}[case.precision]
    # their software's context parallelism runs fused attention kernels (Transformer Engine's, torch's SDPA), not
    # the engine's fp32 math path: its blocks at the fused kernels' rate
    hardware = replace(known_hardware(case.device, precision=table_precision, gpus_per_node=8,
                                      inter_link=case.inter_link, efficiency=efficiency,
                                      memory_efficiency=memory_efficiency), cp_attention_rate=None)
    return fused(hardware, fused_traffic) if case.fused_kernels else hardware


def case_budget(case: PublishedCase) -> float | None:
    """The run's memory budget where its GPUs' memory differs from the table's (None: the table's)."""
    return None if case.memory_gib is None else case.memory_gib * GiB * (1 - RESERVE)


def plan(case: PublishedCase) -> Plan:
    module, batch = build(case)
    if case.experts_over_tp != "whole":  # traced as plan_layouts traces it, then priced as the run held experts
        module = price_experts_as(profile_model(module, batch, dtype=trace_dtype(case.precision)),
                                  case.experts_over_tp)
    return plan_layouts(module, batch, case.world, case_hardware(case), precision=case.precision,
                        memory_budget=case_budget(case),
                        restrict=case.restrict, activation_checkpointing=case.checkpointing,
                        schedules=case.schedules, sequence_parallel=case.sequence_parallel,
                        reshard_after_forward=case.reshard_after_forward,
                        accumulate_unsharded=case.accumulate_unsharded,
                        async_tp=(True,) if case.async_tp else (False,), uneven_stages=case.uneven_stages,
                        cp_algorithm=case.cp_algorithm, cp_ulysses_size=case.cp_ulysses_size)


def published_variants(case: PublishedCase, predictions: list[Prediction]) -> list[Prediction]:
    """The predictions of the published layout, in their ranked order: its mesh sizes, and its checkpointing and
    accumulation where the run fixed them."""
    target = published_sizes(case)
    return [p for p in predictions if sizes(p) == target and (
        case.activation_checkpointing is None or p.layout.activation_checkpointing == case.activation_checkpointing)
        and case.accumulate_grad_batches in (None, p.layout.accumulate_grad_batches)]


def published_tokens(case: PublishedCase, profile: ModelProfile) -> float:
    """The published tokens/s per GPU: as printed, or from the printed model TFLOP/s over the traced FLOPs."""
    if case.published_tokens_per_s is not None:
        return case.published_tokens_per_s
    forward = sum(s.flops + s.attention_flops for s in profile.sections.values())
    return case.published_tflops * 1e12 / (3 * forward / profile.tokens)


def plan_case(case: PublishedCase) -> dict[str, Any]:
    """The published layout's predicted tokens/s per GPU against the published figure, and its rank."""
    result = plan(case)
    if case.excluded is not None:
        result = replace(result, predictions=[p for p in result.predictions if not case.excluded(p.layout)])
    shapes: list[tuple[int, ...]] = []
    for p in result.predictions:  # distinct mesh sizes in ranked order, best variant first
        if sizes(p) not in shapes:
            shapes.append(sizes(p))
    target = published_sizes(case)
    variants = published_variants(case, result.predictions)
    assert variants, f"{case.name}: the planner does not list the published layout {case.layout}"
    chosen = variants[0]  # the best ranked: a fitting one if any fits
    published = published_tokens(case, result.profile)
    return {
        "case": case.name, "source": case.source, "config": case.config,
        "published_tokens_per_s": published,
        "predicted_tokens_per_s": chosen.tokens_per_s, "ratio": chosen.tokens_per_s / published,
        "published_layout": str(chosen.layout), "published_sizes": sizes(chosen), "fits": chosen.fits,
        "reason": chosen.reason,
        "published_rank": shapes.index(target) + 1, "variant_rank": result.predictions.index(chosen) + 1,
        "best": str(result.best.layout), "best_tokens_per_s": result.best.tokens_per_s,
        "layouts": len(result.predictions),
    }


_RESULTS: dict[str, dict[str, Any]] = {}


def result_of(case: PublishedCase) -> dict[str, Any]:
    if case.name not in _RESULTS:
        _RESULTS[case.name] = plan_case(case)
    return _RESULTS[case.name]


def _expect(case: PublishedCase, goal: str) -> list[Any]:
    """A goal the planner does not meet for this case is expected to fail, strictly: meeting it fails the test
    too, so the reason above gets revisited."""
    gap = case.known_gaps.get(goal)
    return [pytest.mark.xfail(strict=True, reason=gap)] if gap else []


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_expect(c, "throughput")) for c in CASES])
def test_predicted_tokens_per_second_within_25_percent_of_the_published(case):
    result = result_of(case)
    assert 0.75 <= result["ratio"] <= 1.25, result


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_expect(c, "rank")) for c in CASES])
def test_the_published_layout_is_among_the_planners_top_three(case):
    result = result_of(case)
    assert result["published_rank"] <= 3, result


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=_expect(c, "fits")) for c in CASES])
def test_the_planner_lists_the_published_layout_as_fitting(case):
    """Whatever the ranking: the published run fitted its GPUs, so the planner must list its layout as fitting."""
    result = result_of(case)
    assert result["published_sizes"] == published_sizes(case) and result["fits"], result


def test_megatron_tokens_per_second_agree_with_the_papers_own_training_time():
    """The conversion of Megatron's TFLOP/s into tokens/s, checked against the paper's own arithmetic (section 5.1):
    GPT-3 175B (96 layers, hidden 12288) at 140 TFLOP/s per GPU on 1,024 A100 trains 300B tokens in 34 days."""
    days = 300e9 / (megatron_tokens_per_s(140, 96, 12288) * 1024) / 86400
    assert 33.5 <= days <= 35.0, days


def test_a_case_is_planned_with_only_its_softwares_options():
    """A run's software options reach the plan: Megatron's distributed optimizer (the ZeRO-1-like variant only: no
    layout reshards after forward, every one with several micro-batches reduces once), no sequence parallelism,
    1F1B only, no replicas (benchmarks/planner_heldout.py's BLOOM row)."""
    case = PublishedCase(
        "a small GPT as BLOOM's software ran it", "this test", "GPT 4 x 256, seq 256",
        dict(vocab_size=1024, block_size=256, n_layer=4, n_head=4, n_embd=256), world=16, global_batch=64,
        seq_len=256, published_tokens_per_s=1.0, layout={"dp_shard": 4, "tp": 2, "pp": 2}, arch="gpt",
        restrict={"dp_replicate": [1], "cp": [1]}, schedules=("1f1b",), sequence_parallel=(False,),
        reshard_after_forward=(False,), accumulate_unsharded=(True,))
    layouts = [p.layout for p in plan(case).predictions]
    assert any(layout.tp > 1 for layout in layouts) and any(layout.pp > 1 for layout in layouts)
    assert all(layout.dp_replicate == 1 and layout.cp == 1 and not layout.sequence_parallel for layout in layouts)
    assert all(layout.pp_schedule == "1f1b" for layout in layouts if layout.pp > 1)
    sharded = [layout for layout in layouts if layout.dp_shard > 1]
    assert sharded and not any(layout.reshard_after_forward for layout in sharded)
    several = [layout for layout in sharded if layout.pp > 1 or layout.accumulate_grad_batches > 1]
    assert several and all(layout.accumulate_unsharded for layout in several)

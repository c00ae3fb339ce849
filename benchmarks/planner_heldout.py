"""The planner on published runs it was not built against: held out of tests/test_planner_published.py on purpose,
so that they measure what a user meets (issue #25). Planned exactly as the test's cases are (its ``PublishedCase``
and ``plan_case``: the device table's GPU time model, matmuls at ``devices.MATMUL_STEP_SHARE`` of the device's own
matmul rate and the other ops' bytes at ``devices.BANDWIDTH_SHARE`` of its memory bandwidth, fused where the run's
software fused them; the run's world, global batch, sequence and precision),
and reported the same way: the predicted tokens/s per GPU of the published layout against the published figure, and
where that layout ranks.

The runs (collected 2026-11-25; every figure as its source prints it; fields the source does not state are taken as
said in ``ASSUMED``):

- Megatron-Core's H100 weak-scaling table (NVIDIA/Megatron-LM README, "Training Speed and Scalability", added in
  commit f2e5db4 on 2024-07-15; the table is images/model_table.png): GPT 1.7B-462B, vocabulary 131,072, sequence
  4096, on 48-6,144 H100, TP/PP/DP as printed, per-GPU model TFLOP/s (408.8-489.1, MFU 41-49 %);
- MosaicML LLM Foundry's MPT throughput tables (mosaicml/llm-foundry scripts/train/benchmarking/README.md at
  061f2c7; model shapes from scripts/train/yamls/pretrain/mpt-*.yaml): pure FSDP (FULL_SHARD), tokens/s per GPU;
- BLOOM-176B (bigscience-workshop/bigscience train/tr11-176B-ml/README.md at 00327f8): 384 A100 80GB, TP 4 x PP 12 x
  DP 8 with ZeRO-1, full activation checkpointing, 19.561 samples/s at global batch 2048.
- torchtitan's async-TP runs (pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, collected
  2026-11-26): Llama 3.1 70B on 256 H100 (FSDP 32 x TP 8, full AC) and 8B on 64 H100 (FSDP 8 x TP 8, per-op SAC),
  bf16, async TP; their vanilla-TP 70B twin is a test case.

Megatron-Core's runs overlapped their TP communication (``--tp-comm-overlap``, said beside the table): they are
planned with async TP (``PublishedCase.async_tp``), as torchtitan's async runs are; the others without.

Not used: NeMo's and Megatron-Bridge's H100 tables (FP8: the device table has no FP8 peak), Korthikanti et al. 2022
and OPT-175B (their layouts could not be read from a primary source here).

Usage: python benchmarks/planner_heldout.py [--out benchmarks/results/planner_heldout.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "tests")):  # the published cases' harness lives with the tests
    if _path not in sys.path:
        sys.path.insert(0, _path)

from test_planner_published import _GRAND_TETON, LLAMA_8B, LLAMA_70B, PublishedCase, plan_case  # noqa: E402

from benchmarks.bench_planner import plan_published  # noqa: E402
from benchmarks.common import write_json  # noqa: E402

#: what the sources leave unsaid, and what is taken for it
ASSUMED = (
    "Megatron-Core H100: 8 GPUs per node joined by 400 Gb/s InfiniBand per GPU (DGX H100), bf16 (its MFU is of the "
    "bf16 peak), Megatron's GPT layer as transformers' GPT-NeoX with sequential residuals (fused qkv, 4h GeLU MLP, "
    "rotary positions), its distributed optimizer planned as the ZeRO-1-like FSDP variant (parameters gathered once "
    "per step and kept, gradients reduced once: accumulate_unsharded without resharding after forward), the rest the "
    "planner's choice. MPT on H100: "
    "400 Gb/s InfiniBand per GPU; A100 tables: '1600 Gbps node-node interconnect (RoCE)', 200 Gb/s per GPU. BLOOM: "
    "4 Omni-Path links per node (speed not stated) taken as 100 Gb/s per GPU, ZeRO-1 planned as FSDP, ALiBi and the "
    "embedding norm left out (GPT shape).")

_MEGATRON_CORE = ("NVIDIA/Megatron-LM README, 'Training Speed and Scalability' (commit f2e5db4, 2024-07-15), "
                  "images/model_table.png")
_MPT = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (061f2c7)"
_TT_ASYNC = ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torch 38410cf9, torchtitan "
             "820504e, 2025-06)")


#: the options of the runs' software, as ``tests/test_planner_published.py`` restricts its 2021 Megatron-LM rows: a
#: published layout ranks among the layouts its authors could have run. Megatron-Core (2024-07): tensor, sequence,
#: context and pipeline parallelism (1F1B, interleaved), selective or full recomputation, and data parallelism
#: through its distributed optimizer over the whole data-parallel group (parameters whole, optimizer state and
#: gradients sharded: the ZeRO-1-like variant; Megatron-FSDP and partial distributed-optimizer instances came
#: later); its interleaved schedule needed equal stages. BLOOM's Megatron-DeepSpeed (2022): tensor and pipeline
#: (1F1B) parallelism and ZeRO-1, no sequence or context parallelism. MPT's LLM Foundry and torchtitan (2025-06)
#: run as planned by default.
MEGATRON_CORE_2024 = dict(restrict={"dp_replicate": [1]}, schedules=("1f1b", "interleaved_1f1b"),
                          reshard_after_forward=(False,), accumulate_unsharded=(True,), uneven_stages=False)
MEGATRON_DEEPSPEED_2022 = dict(restrict={"dp_replicate": [1], "cp": [1]}, schedules=("1f1b",),
                               sequence_parallel=(False,), reshard_after_forward=(False,),
                               accumulate_unsharded=(True,))


def gpt(layers: int, heads: int, hidden: int, vocab: int, seq: int) -> dict[str, int]:
    return dict(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden)


def gpt_neox(layers: int, heads: int, hidden: int, vocab: int, seq: int) -> dict[str, Any]:
    """Megatron's GPT layer: transformers' GPT-NeoX with sequential residuals (one fused, head-interleaved qkv
    projection, a 4h GeLU MLP, biases), as tests/hf_models.py's ``gpt_neox``. The example GPT keeps q, k and v
    apart, whose summed input gradients async TP cannot pipeline (docs/planner.md)."""
    return dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=layers,
                intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq)


def megatron_core(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, dp: int, gpus: int,
                  batch: int, tflops: float, mfu: int) -> PublishedCase:
    layout = {k: v for k, v in (("dp_shard", dp), ("tp", tp), ("pp", pp)) if v > 1}
    return PublishedCase(
        f"Megatron-Core GPT {size}, {gpus} H100, TP {tp} x PP {pp} x DP {dp}", _MEGATRON_CORE,
        f"GPT {size} ({heads} heads, hidden {hidden}, {layers} layers), vocab 131,072, seq 4096, batch {batch}; "
        f"{tflops} TFLOP/s per GPU, MFU {mfu} %",
        gpt_neox(layers, heads, hidden, 131072, 4096), world=gpus, global_batch=batch, seq_len=4096,
        published_tokens_per_s=None, published_tflops=tflops, layout=layout, inter_link="ib-ndr400", arch="gpt_neox",
        async_tp=True,  # the README: "tensor-parallel (--tp-comm-overlap)" communication overlapped
        fused_kernels=True,  # Transformer Engine
        **MEGATRON_CORE_2024)


def mpt(row: str, size: str, layers: int, heads: int, hidden: int, gpus: int, device: str, batch: int,
        checkpointing: bool, tokens_per_s: float, link: str) -> PublishedCase:
    return PublishedCase(
        f"MPT-{size}, {gpus} {device}, FSDP {gpus}", f"{_MPT}, {row}",
        f"MPT-{size} (mpt-{size}.yaml: {layers} layers, {heads} heads, d_model {hidden}, vocab 50,368), seq 2048, "
        f"global batch {batch}, bf16, FULL_SHARD, activation checkpointing {checkpointing}",
        gpt(layers, heads, hidden, 50368, 2048), world=gpus, global_batch=batch, seq_len=2048,
        published_tokens_per_s=tokens_per_s, layout={"dp_shard": gpus}, device=device, inter_link=link,
        activation_checkpointing=checkpointing, arch="gpt")


CASES = [megatron_core(*row) for row in (
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47),
)] + [
    mpt("table 'H100 80GB BF16'", "70b", 80, 64, 8192, 64, "H100-SXM", 2048, True, 1039, "ib-ndr400"),
    mpt("table 'H100 80GB BF16'", "30b", 48, 56, 7168, 32, "H100-SXM", 1344, True, 2308, "ib-ndr400"),
    mpt("table 'H100 80GB BF16'", "13b", 40, 40, 5120, 64, "H100-SXM", 128, False, 4800, "ib-ndr400"),
    mpt("table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'", "70b", 80, 64, 8192, 64, "A100-80GB",
        2048, True, 410, "eth-200"),
    mpt("table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'", "30b", 48, 56, 7168, 128, "A100-40GB",
        768, True, 865, "eth-200"),
    mpt("table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'", "7b", 32, 32, 4096, 128, "A100-40GB",
        2304, True, 3623, "eth-200"),
    PublishedCase(
        "BLOOM-176B, 384 A100 80GB, TP 4 x PP 12 x DP 8",
        "bigscience-workshop/bigscience train/tr11-176B-ml/README.md (00327f8), 'Throughput' and 'Replica setup'",
        "70 layers, hidden 14336, 112 heads, vocab 250,880 (padded), seq 2048, global batch 2048, MBS 2, bf16, ZeRO-1, "
        "full activation checkpointing; 19.561 samples/s on 384 GPUs",
        gpt(70, 112, 14336, 250880, 2048), world=384, global_batch=2048, seq_len=2048,
        published_tokens_per_s=19.561 * 2048 / 384, layout={"dp_shard": 8, "tp": 4, "pp": 12}, device="A100-80GB",
        inter_link="eth-100", activation_checkpointing=True, arch="gpt", fused_kernels=True,  # Megatron's kernels
        **MEGATRON_DEEPSPEED_2022),
    # torchtitan's async-TP runs (their vanilla-TP twins of the 70B is a test case): collected 2026-11-26
    PublishedCase(
        "torchtitan Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, async TP",
        f"{_TT_ASYNC}, 'Llama3 70b on 256 H100s', row 'None (bfloat16)', async TP",
        f"Llama 3.1 70B, seq 8192, local batch 16 (global 512), bf16, full activation checkpointing, torch.compile, "
        f"async TP; FSDP 32 x TP 8; {_GRAND_TETON}",
        LLAMA_70B, world=256, global_batch=512, seq_len=8192, published_tokens_per_s=652.4,
        layout={"dp_shard": 32, "tp": 8}, accumulate_grad_batches=1, memory_gib=96, activation_checkpointing=True,
        async_tp=True, fused_kernels=True),  # torch.compile
    PublishedCase(
        "torchtitan Llama 3.1 8B, 64 H100, FSDP 8 x TP 8, async TP",
        f"{_TT_ASYNC}, 'Llama3 8b on 64 H100s', row 'None (bfloat16)', async TP",
        f"Llama 3.1 8B, seq 8192, local batch 12 (global 96), bf16, per-op selective activation checkpointing, "
        f"torch.compile, async TP; FSDP 8 x TP 8; {_GRAND_TETON}",
        LLAMA_8B, world=64, global_batch=96, seq_len=8192, published_tokens_per_s=4809.4,
        layout={"dp_shard": 8, "tp": 8}, accumulate_grad_batches=1, memory_gib=96,
        activation_checkpointing="selective", async_tp=True, fused_kernels=True),  # torch.compile
]


def all_options(case: PublishedCase) -> PublishedCase:
    """The case planned with the planner's default options, not only its software's (the runs' sizes, batch,
    sequence, precision, checkpointing and async TP kept)."""
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(PublishedCase)
                if f.name in ("restrict", "schedules", "sequence_parallel", "reshard_after_forward",
                              "accumulate_unsharded", "uneven_stages")}
    return replace(case, **defaults)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_heldout.json"))
    parser.add_argument("--only", default="", help="plan only the runs whose name contains this")
    args = parser.parse_args(argv)
    if args.only and args.out == parser.get_default("out"):
        parser.error("--only plans some of the runs: give --out too (the default file holds all of them)")
    start = time.perf_counter()
    cases = [c for c in CASES if args.only in c.name]
    table, records = plan_published(cases, "held-out run")
    print(table)
    for case, record in zip(cases, records):  # where the published layout ranks with the default options
        widened = all_options(case)
        wide = record if widened == case else plan_case(widened)
        record.update(published_rank_all_options=wide["published_rank"], ratio_all_options=wide["ratio"],
                      best_all_options=wide["best"], best_over_published_all_options=wide["best_tokens_per_s"]
                      / wide["predicted_tokens_per_s"])
    within = sum(0.75 <= r["ratio"] <= 1.25 for r in records)
    top3 = sum(r["published_rank"] <= 3 for r in records)
    within_all = sum(0.75 <= r["ratio_all_options"] <= 1.25 for r in records)
    top3_all = sum(r["published_rank_all_options"] <= 3 for r in records)
    print("\n".join(f"{r['case']}: among its software's layouts rank {r['published_rank']}, ratio {r['ratio']:.3f}; "
                    f"with the default options rank {r['published_rank_all_options']}, ratio "
                    f"{r['ratio_all_options']:.3f}, first {r['best_all_options']} "
                    f"({r['best_over_published_all_options']:.3f} x)" for r in records))
    print(f"\nAmong its software's layouts: throughput within 25 %: {within} of {len(records)}, published layout in "
          f"the top three: {top3} of {len(records)}. With the planner's default options: {within_all} and {top3_all}. "
          f"{time.perf_counter() - start:.0f} s\nAssumed: {ASSUMED}")
    path = write_json(args.out, {"cases": records, "within_25_percent": within, "top_three": top3,
                                 "within_25_percent_all_options": within_all, "top_three_all_options": top3_all,
                                 "assumed": ASSUMED})
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()

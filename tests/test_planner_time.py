"""The planner's time model, rule by rule: what each technique says it sends per step (counted as the engine and
torch send it), and how a step is assembled from compute, communication and bubble on GPUs and on CPU ranks that
share their cores. The rules' effect against measurements is benchmarks/bench_planner.py's job (world 4, CPU)."""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_models import HFCausalLM
from workers import GLOBAL_BATCH, TINY_GPT

from example_projects.gpt.lit import GPTModule
from lightning_par.costs.profile import ModelProfile, Section, price_experts_as, profile_model
from lightning_par.costs.sheet import CostSheet, Transfer
from lightning_par.devices import GroupedMatmulCurve, Hardware, known_hardware
from lightning_par.planner.predict import OVERLAP, Layout, account, predict
from lightning_par.techniques.context import context
from lightning_par.techniques.context.context_sharding import block_plan, sequence_positions
from lightning_par.techniques.experts.expert_parallel import ranks_per_token
from lightning_par.techniques.sharding.fully_sharded import unit_bytes

SEQ = 16
CPU = Hardware("cpu (x86_64, 1 threads)", 2e10, None, 4, 2e9, 2e-5, 2e9, 2e-5, "as planner.probe names a CPU")
GPU = Hardware("H100-SXM", 2e10, 80 * 2**30, 4, 2e9, 2e-5, 2e9, 2e-5, "the same numbers, an accelerator")


@pytest.fixture(scope="module")
def gpt() -> ModelProfile:
    module = GPTModule(**{**TINY_GPT, "n_layer": 4})
    module.configure_model()
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    return profile_model(module, (ids, ids))


@pytest.fixture(scope="module")
def llama() -> ModelProfile:
    with torch.device("meta"):
        module = HFCausalLM("llama", num_key_value_heads=4)
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    return profile_model(module, (ids, ids))


def counts(layout: Layout, profile: ModelProfile, kind: str) -> list[tuple[str, float]]:
    sheet = account(layout, profile, GLOBAL_BATCH // layout.dp, SEQ, "32-true")
    return [(t.collective, t.count) for t in sheet.transfers if t.kind == kind]


def test_fsdp_under_a_pipeline_reduces_per_micro_batch_or_once_per_step(gpt):
    """By default the engine's FSDP units gather and reduce in every micro-batch of the schedule; with
    ``accumulate_unsharded`` the reduction waits for the last micro-batch's backward and a unit stays gathered from
    a micro-batch's backward to the next forward (the counts tests/test_pipeline_strategy.py measures)."""
    piped = Layout(dp_shard=2, pp=2, pp_schedule="1f1b", pp_microbatches=4)
    # the busiest pp rank: two blocks (one Transfer, their counts summed) and the embeddings (or the head)
    assert sorted(counts(piped, gpt, "fsdp_reduce_scatter")) == [("reduce_scatter", 4), ("reduce_scatter", 2 * 4)]
    assert sorted(counts(piped, gpt, "fsdp_all_gather")) == [("all_gather", 4 * 2), ("all_gather", 2 * 4 * 2)]
    once = replace(piped, accumulate_unsharded=True)
    assert sorted(counts(once, gpt, "fsdp_reduce_scatter")) == [("reduce_scatter", 1), ("reduce_scatter", 2)]
    assert sorted(counts(once, gpt, "fsdp_all_gather")) == [("all_gather", 4 + 1), ("all_gather", 2 * (4 + 1))]
    zero1 = replace(once, reshard_after_forward=False)
    assert sorted(counts(zero1, gpt, "fsdp_all_gather")) == [("all_gather", 1), ("all_gather", 2)]
    flat = Layout(dp_shard=4)  # without a pipeline: one micro-batch, gathered again for backward; 4 blocks + root
    assert sorted(counts(flat, gpt, "fsdp_all_gather")) == [("all_gather", 2), ("all_gather", 4 * 2)]
    assert sorted(counts(flat, gpt, "fsdp_reduce_scatter")) == [("reduce_scatter", 1), ("reduce_scatter", 4)]


def test_zero2_like_fsdp_gathers_once_and_keeps_every_unit_gathered(gpt):
    """Without resharding after forward a unit is gathered once per micro-batch (not again for backward) and stays
    whole until its backward: every unit's gathered bytes at the peak, not the two in flight."""
    zero3, zero2 = Layout(dp_shard=4), Layout(dp_shard=4, reshard_after_forward=False)
    assert sorted(counts(zero2, gpt, "fsdp_all_gather")) == [("all_gather", 1), ("all_gather", 4)]
    assert sorted(counts(zero3, gpt, "fsdp_all_gather")) == [("all_gather", 2), ("all_gather", 4 * 2)]
    sheets = {layout: account(layout, gpt, GLOBAL_BATCH // 4, SEQ, "32-true") for layout in (zero3, zero2)}
    units, experts = unit_bytes(sheets[zero2])  # 4 blocks and the root, whole; no experts
    assert experts == []
    assert len(units) == 5
    assert sheets[zero3].buffer_bytes == 2 * max(units)
    assert sheets[zero2].buffer_bytes == pytest.approx(sum(units))
    assert "reshard_after_forward" not in zero3.strategy_kwargs()
    assert zero2.strategy_kwargs()["reshard_after_forward"] is False and "ZeRO-2" in str(zero2)


def test_context_parallel_sends_per_attention_block(gpt):
    """Each block's attention runs its own ring: the message count (the latency paid) grows with the blocks."""
    cp = 4
    ring = counts(Layout(cp=cp), gpt, "cp")
    # K/V forward and backward, dK/dV in fp32, per block: the 4 equal blocks are one Transfer, their counts summed
    assert ring == [("send_recv", 4 * (2 * (cp - 1) + cp))]


def test_tensor_parallel_counts_every_collective_the_plan_makes(gpt, llama):
    """Per block two all-reduces forward and two backward; the vocabulary-parallel embedding's output; the head's
    input gradient; loss parallelism's three per token; and, under sequence parallelism, one gradient all-reduce
    per parameter that tp leaves whole (GPT: 2 norms x 4 blocks + the final norm, weight and bias each, and the
    position embedding)."""
    tp = counts(Layout(tp=4, sequence_parallel=True, loss_parallel=True), gpt, "tp")
    assert tp.count(("all_reduce", 16)) == 1  # 4 blocks x 4
    assert tp.count(("all_reduce", 3)) == 1  # loss parallelism
    assert tp.count(("all_reduce", 1)) == 2  # embedding output, head input gradient
    assert tp.count(("all_reduce", 19)) == 1  # 19 whole parameters, one message each (one Transfer of 19)
    assert len(tp) == 1 + 1 + 2 + 1
    # without sequence parallelism the norms see whole sequences; without loss parallelism the vocabulary-parallel
    # head all-gathers its logits
    no_sp = counts(Layout(tp=4), gpt, "tp")
    assert sorted(no_sp) == sorted([("all_reduce", 16), ("all_reduce", 1), ("all_reduce", 1), ("all_gather", 1)])
    hf = counts(Layout(tp=4, sequence_parallel=True), llama, "tp")  # its lm_head gathers the logits
    assert ("all_gather", 1) in hf


def message_bytes(layout: Layout, profile: ModelProfile, kind: str) -> list[float]:
    sheet = account(layout, profile, GLOBAL_BATCH // layout.dp, SEQ, "32-true")
    return sorted(t.nbytes for t in sheet.transfers if t.kind == kind)


@pytest.mark.parametrize("kind, layout", [("tp", Layout(tp=2)), ("pp_send_recv", Layout(pp=2, pp_microbatches=2))])
def test_collectives_are_priced_on_the_tokens_a_rank_holds_under_context_parallelism(gpt, kind, layout):
    """Tensor and pipeline parallelism account before context parallelism in the recipe; their messages carry a
    rank's chunk of the sequence all the same (1/cp of the tokens), as the engine sends them."""
    whole = message_bytes(layout, gpt, kind)
    chunked = message_bytes(replace(layout, cp=4), gpt, kind)
    assert whole and chunked == pytest.approx([b / 4 for b in whole])


def test_attention_is_priced_as_causal_and_sliding_window_kernels_compute_it(gpt):
    """torch's formulas count the whole score matrix; a causal kernel computes its lower triangle, a sliding-window
    one the band (Mistral's window of 5 on 16 tokens), and the share follows the planned sequence length."""
    block = gpt.sections[gpt.blocks[0]]
    assert [(causal, window) for _, causal, window in block.attention_calls] == [(True, None)]
    assert block.attention_work(SEQ) == pytest.approx(block.attention_flops * (SEQ + 1) / (2 * SEQ))
    assert block.attention_work(4096) == pytest.approx(block.attention_flops * 4097 / 8192)
    with torch.device("meta"):
        mistral = profile_model(HFCausalLM("mistral", num_key_value_heads=4),
                                (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    layer = mistral.sections[mistral.blocks[0]]
    assert [(causal, window) for _, causal, window in layer.attention_calls] == [(True, 5)]
    assert layer.attention_work(SEQ) == pytest.approx(layer.attention_flops * (5 * 6 / 2 + 11 * 5) / SEQ**2)
    # the planned step's compute: at 4x the sequence, windowed attention grows 4x, causal attention ~16x
    long = Layout()
    short_s = predict(long, mistral, GPU, GLOBAL_BATCH, SEQ).compute_s
    assert predict(long, mistral, GPU, GLOBAL_BATCH // 4, 4 * SEQ).compute_s < short_s * 1.05


def test_experts_by_grouped_matmul_count_each_routed_token_once():
    """transformers' experts run ``torch._grouped_mm`` (no FLOPs formula in torch 2.13, and a bf16-only meta kernel):
    a Qwen3-MoE block is its projections and router, plus each token's top-2 experts (gate-up 32 -> 64, down 32 ->
    32), as the formula counts them."""
    with torch.device("meta"):
        qwen3_moe = profile_model(HFCausalLM("qwen3_moe"), (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    tokens, d = GLOBAL_BATCH * SEQ, 32
    attention_and_router = 2 * tokens * (d * 32 + 2 * d * 16 + 32 * d + d * 4)  # q, k, v (2 kv heads of 8), o, gate
    experts = 2 * (2 * tokens) * (d * 64 + 32 * d)
    assert qwen3_moe.sections[qwen3_moe.blocks[0]].flops == attention_and_router + experts


def test_the_profile_records_the_experts_flops_rows_and_width():
    """Of a block's FLOPs, the experts' own (each routed row through gate-up and down), the rows routed (tokens x
    top-k) and the width those FLOPs imply (the experts' intermediate size), for transformers' experts and the
    example's grouped-mm experts alike."""
    tokens = GLOBAL_BATCH * SEQ
    with torch.device("meta"):
        qwen3_moe = profile_model(HFCausalLM("qwen3_moe", moe_intermediate_size=48),
                                  (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    block = qwen3_moe.sections[qwen3_moe.blocks[0]]
    assert block.routed_rows == 2 * tokens
    assert block.expert_flops == 2 * (2 * tokens) * (32 * 2 * 48 + 48 * 32)
    assert block.expert_width == pytest.approx(48)
    gpt_moe = GPTModule(**{**TINY_GPT, "n_layer": 2, "n_experts": 4, "moe_top_k": 2})
    gpt_moe.configure_model()
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    section = profile_model(gpt_moe, (ids, ids)).sections["model.blocks.0"]
    width = gpt_moe.model.blocks[0].mlp.experts.w_down.shape[1]  # (experts, hidden of an expert, model width)
    assert section.routed_rows == 2 * tokens and section.expert_width == pytest.approx(width)
    assert 0 < section.expert_flops < section.flops


def test_experts_with_few_rows_each_compute_slower_and_expert_parallelism_feeds_them_more():
    """On a GPU the experts' grouped matmuls run at ``grouped_mm``'s share of the matmul rate for the rows each
    expert gets: ep2 doubles them (each rank's 2 experts get the rows of both ranks), context parallelism splits
    them as data parallelism does; the CPU (no curve) and a dense model are priced as before."""
    with torch.device("meta"):
        model = HFCausalLM("qwen3_moe", moe_intermediate_size=48)
    qwen3_moe = profile_model(model, (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    curve = GroupedMatmulCurve()
    flat_gpu = replace(GPU, matmul_share=0.5)  # a pass's time half matmuls: the experts' extra is on that half
    gpu = replace(flat_gpu, grouped_mm=curve)
    blocks = [qwen3_moe.sections[b] for b in qwen3_moe.blocks]
    experts = sum(b.expert_flops for b in blocks)  # forward, the traced batch
    rates: list[float] = []
    for layout, rows_per_expert in ((Layout(dp_shard=2), GLOBAL_BATCH // 2 * SEQ * 2 / 4),
                                    (Layout(dp_shard=2, ep=2), GLOBAL_BATCH // 2 * SEQ * 2 / 4 * 2),
                                    (Layout(cp=2, ep=2), GLOBAL_BATCH * SEQ / 2 * 2 / 4 * 2),
                                    (Layout(dp_shard=2, cp=2, ep=2), GLOBAL_BATCH // 2 * SEQ / 2 * 2 / 4 * 2)):
        batch = GLOBAL_BATCH // layout.dp
        flat, sloped = predict(layout, qwen3_moe, flat_gpu, batch, SEQ), predict(layout, qwen3_moe, gpu, batch, SEQ)
        rate = curve.rate(rows_per_expert, 4 // layout.ep, 48)
        rates.append(rate)
        share = batch / GLOBAL_BATCH / layout.cp  # this rank's part of the traced batch's FLOPs
        extra = 3 * 0.5 * experts * share * (1 / rate - 1) / GPU.matmul_flops  # forward and backward
        assert sloped.compute_s - flat.compute_s == pytest.approx(extra, rel=1e-9)
    # ep2 doubles the rows of each rank's experts; cp2 splits them as dp2 does; with both, as many as without ep,
    # over fewer experts per rank (no faster: here both at the curve's cap, these experts being tiny)
    assert 0 < rates[3] <= rates[0] < rates[1] == rates[2] < 1
    assert predict(Layout(dp_shard=2), qwen3_moe, replace(CPU, grouped_mm=None), 1, SEQ).compute_s == \
        predict(Layout(dp_shard=2), qwen3_moe, CPU, 1, SEQ).compute_s
    dense = predict(Layout(dp_shard=2), profile_model_gpt4(), gpu, GLOBAL_BATCH // 2, SEQ)
    assert dense.compute_s == predict(Layout(dp_shard=2), profile_model_gpt4(), GPU, GLOBAL_BATCH // 2, SEQ).compute_s


def test_transformers_experts_are_dispatched_once_per_token_and_rank():
    """The all-to-alls of transformers' experts carry a token once per rank holding one of its choices (2 of 4
    experts over 2 ranks: 5/3 ranks a token on average), with its choices (2 x k float32); the grouped-token experts
    of the example one row per choice, as before."""
    with torch.device("meta"):
        model = HFCausalLM("qwen3_moe")
    qwen3_moe = profile_model(model, (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    block = qwen3_moe.sections[qwen3_moe.blocks[0]]
    assert block.routed_choices == 2 and ranks_per_token(4, 2, 2) == pytest.approx(5 / 3)
    assert ranks_per_token(4, 4, 2) == pytest.approx(2) and ranks_per_token(128, 8, 8) == pytest.approx(5.339, abs=1e-3)
    tokens, row = GLOBAL_BATCH * SEQ, 32 * 4  # the traced batch, fp32 rows of 32
    a2a, counts = [t for t in account(Layout(dp_shard=2, ep=2), qwen3_moe, GLOBAL_BATCH // 2, SEQ,
                                      "32-true").transfers if t.kind == "all_to_all"]
    layers = len(qwen3_moe.blocks)
    # per layer and pass: rows out, their choices out, sums back; forward and backward
    assert a2a.count == 6 * layers and (counts.nbytes, counts.count) == (2 * 2 * 8, layers)  # (tokens, choices)
    assert a2a.nbytes * a2a.count == pytest.approx(4 * layers * tokens / 2 * 5 / 3 * (row + 4 * 2))  # half a batch
    gpt_a2a, _ = [t for t in account(Layout(dp_shard=2, ep=2), profile_model_gpt4(moe=True), GLOBAL_BATCH // 2, SEQ,
                                     "32-true").transfers if t.kind == "all_to_all"]
    assert gpt_a2a.nbytes == tokens / 2 * 2 * TINY_GPT["n_embd"] * 4  # one row per choice
    assert gpt_a2a.count == 4 * 4  # 4 blocks


@pytest.mark.parametrize("experts,ep,choices,n_group", [
    (128, 8, 8, 16), (32, 8, 4, 8), (32, 2, 4, 8), (256, 64, 8, 32), (384, 32, 8, 48), (384, 8, 8, 48),
    (12, 4, 2, 3), (30, 6, 2, 5), (24, 6, 3, 4)])
def test_routing_within_one_group_against_every_choice(experts, ep, choices, n_group):
    """A token's choices confined to one group of consecutive experts (``topk_group`` 1), however groups and ranks
    align: the count equals the mean over every group and every set of choices in it of the ranks they fall on
    (the first six: NeMo AutoModel's benchmark gate, the k consecutive experts of one of E / k groups, on its runs'
    expert and ep sizes; Kimi K2's 384 at ep 32 spans 1 or 2 ranks, 4/3 on average)."""
    size, local = experts // n_group, experts // ep
    counts = [len({e // local for e in chosen}) for start in range(0, experts, size)
              for chosen in itertools.combinations(range(start, start + size), choices)]
    assert ranks_per_token(experts, ep, choices, (n_group, 1)) == pytest.approx(sum(counts) / len(counts))


def test_group_limited_routing_sends_a_token_to_fewer_ranks():
    """DeepSeek-V3's routing picks ``topk_group`` of ``n_group`` groups of consecutive experts first: the tiny
    config's 2 choices are the 2 experts of one of 2 groups, so at ep 2 (a group a rank) a token goes to exactly 1
    rank, not 5/3; at DeepSeek-V3's sizes (256 experts, 8 groups, 4 chosen, top-8) 7.36 ranks at ep 64 instead of
    7.68, and 4 of 8 nodes (a group a node, each chosen group carrying a choice) instead of 5.29."""
    with torch.device("meta"):
        model = HFCausalLM("deepseek_v3")
    profile = profile_model(model, (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    assert profile.expert_groups == (2, 1)
    assert ranks_per_token(4, 2, 2, (2, 1)) == 1.0 and ranks_per_token(4, 4, 2, (2, 1)) == 2.0
    assert ranks_per_token(256, 64, 8, (8, 4)) == pytest.approx(7.359, abs=1e-3)
    assert ranks_per_token(256, 64, 8) == pytest.approx(7.676, abs=1e-3)
    assert ranks_per_token(256, 8, 8, (8, 4)) == pytest.approx(4.0)
    assert ranks_per_token(256, 4, 8, (8, 4)) == pytest.approx(4 * (1 - 15 / 70))  # 2 whole groups a rank
    a2a = next(t for t in account(Layout(dp_shard=2, ep=2), profile, GLOBAL_BATCH // 2, SEQ, "32-true").transfers
               if t.kind == "all_to_all")
    block = profile.sections[profile.blocks[-1]]
    tokens, row = block.routed_rows / 2, block.routed_bytes / block.routed_rows
    assert a2a.nbytes == pytest.approx(tokens / 2 * (row + 4 * 2) * 2 / 3)  # 1 rank a token, half the batch


def test_across_nodes_transformers_experts_are_priced_in_two_steps():
    """ep 4 over nodes of 2 ranks: between nodes one row per token and node holding one of its 2 choices (of 4
    experts, 2 per node: 5/3 nodes a token, as 2 ranks would be), inside a node one per token and rank (2 a
    token), each step with its counts; within a node, or with ``ep_ranks_per_node=4``, one step. Between nodes
    through the rank's NIC over the 2 places, inside over the node's link."""
    from lightning_par.planner.predict import _cached_link, _transfer_time
    from lightning_par.techniques import ExpertParallel

    with torch.device("meta"):
        model = HFCausalLM("qwen3_moe")
    qwen3_moe = profile_model(model, (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    layout = Layout(dp_shard=4, ep=4)

    def steps(sheet: CostSheet) -> dict[str, list[Transfer]]:
        out: dict[str, list[Transfer]] = {}
        for t in sheet.transfers:
            if t.kind == "all_to_all":
                out.setdefault(t.collective, []).append(t)
        return out

    two = steps(account(layout, qwen3_moe, GLOBAL_BATCH // 4, SEQ, "32-true", ranks_per_node=2))
    one = steps(account(layout, qwen3_moe, GLOBAL_BATCH // 4, SEQ, "32-true", ranks_per_node=8))
    assert set(two) == {"all_to_all_between", "all_to_all_inside"} and set(one) == {"all_to_all"}
    (between, between_counts), (inside, inside_counts) = two["all_to_all_between"], two["all_to_all_inside"]
    flat, _ = one["all_to_all"]
    assert inside.nbytes == flat.nbytes and inside.count == between.count == flat.count
    assert between.nbytes == pytest.approx(flat.nbytes * ranks_per_token(4, 2, 2) / ranks_per_token(4, 4, 2))
    assert (between_counts.nbytes, inside_counts.nbytes) == (2 * 2 * 8, 2 * 2 * 8)
    sheet = CostSheet(layout.dims(), qwen3_moe, GLOBAL_BATCH // 4, SEQ, ranks_per_node=2)
    ExpertParallel(ranks_per_node=4).account(sheet)  # the user's say: one step
    assert set(steps(sheet)) == {"all_to_all"}
    hw = replace(GPU, gpus_per_node=2, inter_bandwidth=GPU.intra_bandwidth / 4)
    link = _cached_link("ep", layout.dims(), hw)
    assert link[4] == 2
    assert _transfer_time(between, *link) == pytest.approx(
        between.count * (between.nbytes / 2 / hw.inter_bandwidth + hw.inter_latency))
    assert _transfer_time(inside, *link) == pytest.approx(
        inside.count * (inside.nbytes / 2 / hw.intra_bandwidth + hw.intra_latency))


def profile_model_gpt4(moe: bool = False) -> ModelProfile:
    module = GPTModule(**{**TINY_GPT, "n_layer": 4, **(dict(n_experts=4, moe_top_k=2) if moe else {})})
    module.configure_model()
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    return profile_model(module, (ids, ids))


def test_the_grouped_matmul_curve_fits_its_measurement():
    """``GroupedMatmulCurve``'s constants against the H100 measurement they were fitted to (a change of either
    that does not fit the file fails here): off by 0.08 at most in root mean square, 0.21 at worst; the table's
    devices carry it, the CPU does not."""
    path = Path(__file__).parents[1] / "benchmarks/results/gpu_h100/grouped_mm.json"
    measured = json.loads(path.read_text())
    assert "H100" in measured["metadata"]["device"] and len(measured["rows"]) >= 40
    curve = known_hardware("H100-SXM").grouped_mm
    assert curve is not None and curve.source.startswith(str(path.relative_to(path.parents[3])))
    errors = [curve.rate(r["rows_per_expert"], r["local_experts"], r["expert_width"]) - r["ratio"]
              for r in measured["rows"]]
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) <= 0.08 and max(map(abs, errors)) <= 0.21
    assert curve.rate(64, 16, 768) < 0.2 < 0.95 < curve.rate(8192, 16, 768)  # the measured ends: 0.13 and 1.00
    assert curve.rate(64, 1, 10) == curve.rate(64, 1, 1)  # the saturation at most doubles: beyond the measured


def test_per_head_norms_reduce_their_gradients_over_tp(llama):
    """Qwen3's q/k norms ('head_norm') run on each rank's heads: 2 per layer x 4 layers, one gradient all-reduce
    each, with or without sequence parallelism."""
    with torch.device("meta"):
        module = HFCausalLM("qwen3", num_key_value_heads=4)
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    qwen3 = profile_model(module, (ids, ids))
    assert ("all_reduce", 8) in counts(Layout(tp=2), qwen3, "tp")
    assert ("all_reduce", 8) not in counts(Layout(tp=2), llama, "tp")


def test_on_a_gpu_communication_hides_behind_compute_and_the_bubble_stretches_the_step(gpt):
    p = predict(Layout(pp=4, pp_schedule="1f1b", pp_microbatches=4), gpt, GPU, GLOBAL_BATCH, SEQ)
    busy = p.compute_s + sum(p.comm_s.values())
    assert p.step_s == pytest.approx(busy / (1 - 3 / 7))  # (p - 1) / (m + p - 1)
    fsdp = predict(Layout(dp_shard=4), gpt, GPU, GLOBAL_BATCH // 4, SEQ)
    hidden = sum(fsdp.comm_total_s.values()) - sum(fsdp.comm_s.values())
    assert hidden == pytest.approx(min(sum(fsdp.comm_total_s.values()), OVERLAP * fsdp.compute_s))


def test_cpu_ranks_share_their_cores_with_communication_and_with_each_others_bubble(gpt):
    """gloo reduces on the cores that compute: nothing overlaps. The ranks share those cores: a pipeline rank's idle
    time is another's compute, so the step is the busiest rank's work."""
    for layout in (Layout(dp_shard=4), Layout(pp=4, pp_schedule="1f1b", pp_microbatches=4), Layout(cp=4)):
        p = predict(layout, gpt, CPU, GLOBAL_BATCH // layout.dp, SEQ)
        assert p.comm_s == p.comm_total_s
        assert p.bubble_s == 0.0
        assert p.step_s == pytest.approx(p.compute_s + sum(p.comm_total_s.values()))
    # the same numbers as a GPU: the pipeline is faster on shared cores, FSDP slower (its gathers no longer hide)
    piped, flat = Layout(pp=4, pp_schedule="1f1b", pp_microbatches=4), Layout(dp_shard=4)
    assert predict(piped, gpt, CPU, GLOBAL_BATCH, SEQ).step_s < predict(piped, gpt, GPU, GLOBAL_BATCH, SEQ).step_s
    assert predict(flat, gpt, CPU, 2, SEQ).step_s > predict(flat, gpt, GPU, 2, SEQ).step_s


def test_async_tp_pipelines_each_block_collective_with_its_own_matmul(gpt):
    """Async tensor parallelism: per block and micro-batch, each of the attention's and the MLP's groups sends an
    all-gather before its column-parallel matmuls and a reduce-scatter after its row-parallel one in forward, and
    the mirror in backward: as many bytes as the plain account's four all-reduces per block. Each hides behind
    (tp - 1) / tp of its matmul (the first chunk is the rank's own); what does not fit stays exposed, message by
    message."""
    from lightning_par.planner.predict import _cached_link, _transfer_time

    plain, piped = Layout(tp=4, sequence_parallel=True), Layout(tp=4, sequence_parallel=True, async_tp=True)
    sheet = account(piped, gpt, GLOBAL_BATCH, SEQ, "32-true")
    matmul = [t for t in sheet.transfers if t.hides_behind == "matmul"]
    assert len(matmul) == 4 * 2 * 4  # 4 blocks x (attention, MLP) x (gather, scatter) x (forward, backward)
    assert sum(t.count for t in matmul) == 2 * 16  # two halves of each of the plain account's 16 all-reduces
    assert sorted({t.collective for t in matmul}) == ["all_gather", "reduce_scatter"]
    tokens, (width,) = GLOBAL_BATCH * SEQ, {TINY_GPT["n_embd"]}
    # proj (h x h), q, k and v together (3h x h), fc and its proj (4h x h); the reduce-scatter of the sum of q's,
    # k's and v's input gradients has no one matmul to be fused with (0)
    assert sorted({t.behind_flops for t in matmul}) == pytest.approx(
        [0.0] + [2 * tokens * n * width * width / 4 for n in (1, 3, 4)])
    assert sum(t.behind_flops == 0 for t in matmul) == 4  # one per block
    others = [t for t in sheet.transfers if t.kind == "tp" and t.hides_behind != "matmul"]
    assert sorted((t.collective, t.count) for t in others) == sorted(
        c for c in counts(plain, gpt, "tp") if c != ("all_reduce", 16))

    shown = []
    for flops in (1e3, 3e9, 1e18):  # all hidden, some, none
        hw = replace(GPU, matmul_flops=flops)
        exposed = sum(_transfer_time(t, *_cached_link("tp", sheet.dims, hw)) for t in others)
        for t in matmul:
            seconds = _transfer_time(t, *_cached_link("tp", sheet.dims, hw))
            exposed += max(0.0, seconds - t.count * 3 / 4 * t.behind_flops / hw.matmul_rate(4))
        got = predict(piped, gpt, hw, GLOBAL_BATCH, SEQ)
        assert got.comm_s["tp"] == pytest.approx(exposed)
        shown.append(exposed - sum(_transfer_time(t, *_cached_link("tp", sheet.dims, hw)) for t in others))
        assert got.comm_total_s["tp"] == pytest.approx(predict(plain, gpt, hw, GLOBAL_BATCH, SEQ).comm_total_s["tp"])
    unfused = sum(_transfer_time(t, *_cached_link("tp", sheet.dims, GPU)) for t in matmul if not t.behind_flops)
    assert shown[0] == pytest.approx(unfused) and 0 < shown[0] < shown[1] < shown[2]
    assert predict(piped, gpt, replace(GPU, matmul_flops=1e18), GLOBAL_BATCH, SEQ).comm_s["tp"] == pytest.approx(
        predict(plain, gpt, replace(GPU, matmul_flops=1e18), GLOBAL_BATCH, SEQ).comm_s["tp"])
    # on CPU ranks nothing overlaps
    assert predict(piped, gpt, CPU, GLOBAL_BATCH, SEQ).comm_s == predict(plain, gpt, CPU, GLOBAL_BATCH, SEQ).comm_s


def test_async_tp_is_weighed_on_gpus_only_and_asks_for_compile(gpt):
    from lightning_par import NDParallelStrategy
    from lightning_par.planner.search import plan_layouts

    on_gpu = plan_layouts(gpt, None, 4, GPU)
    piped = [p for p in on_gpu.predictions if p.layout.async_tp]
    # compiled: not with context parallelism, nor with re-gathered chunks (the engine refuses both)
    assert piped and all(p.layout.tp > 1 and p.layout.sequence_parallel and p.layout.cp == 1
                         and not p.layout.regather_sequence for p in piped)
    assert any(p.layout.cp > 1 and p.layout.tp > 1 for p in on_gpu.predictions)
    for p in piped:
        kwargs = p.layout.strategy_kwargs()
        assert kwargs["compile"] is True and kwargs["async_tp"] is True
        NDParallelStrategy(**kwargs)  # what the engine takes (the CUDA check comes with the Trainer's accelerator)
    assert "async TP" in str(piped[0].layout)
    assert not any(p.layout.async_tp for p in plan_layouts(gpt, None, 4, CPU, restrict={"pp": [1]}).predictions)
    assert not any(p.layout.async_tp for p in plan_layouts(gpt, None, 4, GPU, async_tp=(False,)).predictions)
    forced = plan_layouts(gpt, None, 4, GPU, async_tp=(True,)).predictions
    assert all(p.layout.async_tp for p in forced if p.layout.tp > 1 and p.layout.sequence_parallel
               and not p.layout.regather_sequence and p.layout.cp == 1)
    with pytest.raises(ValueError, match=r"regather_sequence=\(True,\) with async_tp=\(True,\)"):
        plan_layouts(gpt, None, 4, GPU, async_tp=(True,), regather_sequence=(True,))


@pytest.mark.parametrize("arch", ["gpt", "llama", "mixtral", "qwen3_moe"])
def test_async_tp_twins_send_what_their_originals_send(arch, gpt):
    """The pipelined account and the plain one carry the same traffic on every layout, pipelines included (the
    rank with the most blocks), and mixtures of experts (whose MLP has no column/row pair: sent as before)."""
    if arch == "gpt":
        module = GPTModule(**{**TINY_GPT, "n_layer": 3})
        module.configure_model()
    else:
        with torch.device("meta"):
            module = HFCausalLM(arch)
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    profile = profile_model(module, (ids, ids))
    for layout in (Layout(tp=2, sequence_parallel=True), Layout(tp=4, sequence_parallel=True, dp_shard=2),
                   Layout(pp=2, tp=2, sequence_parallel=True, pp_schedule="zbv", pp_microbatches=2),
                   Layout(pp=2, tp=2, sequence_parallel=True, pp_microbatches=4, activation_checkpointing=True)):
        piped = replace(layout, async_tp=True)
        batch = GLOBAL_BATCH // layout.dp
        plain, twin = (predict(x, profile, GPU, batch, SEQ) for x in (layout, piped))
        assert twin.comm_total_s["tp"] == pytest.approx(plain.comm_total_s["tp"]), (arch, str(layout))
        assert twin.comm_s["tp"] <= plain.comm_s["tp"] + 1e-15, (arch, str(layout))


def _covered_by_the_engine(seq: int, cp: int, window: int | None) -> float:
    """The share of a causal score matrix the engine's blocks cover, counted as ``parallel.context._plan`` decides
    (load balanced; a block the window hides entirely skipped) on every pair of global positions."""
    n, covered = seq // cp, 0
    for rank in range(cp):
        for src in range(cp):
            blk = block_plan(rank, src, cp, n, True, True)
            if blk is None:
                continue
            pq = sequence_positions(seq, rank, cp, True)[blk.q]
            pk = sequence_positions(seq, src, cp, True)[blk.kv]
            distance = pq[:, None] - pk[None, :]
            if window is None or bool(((distance >= 0) & (distance < window)).any()):
                covered += pq.numel() * pk.numel()
    return covered / seq**2


@pytest.mark.parametrize("cp, window", [(2, None), (4, None), (8, None), (4, 4), (4, 12), (4, 20), (8, 3), (2, 100)])
def test_blockwise_work_is_what_the_context_parallel_math_path_computes(cp, window):
    """The engine's blocks are whole: of a causal score matrix each rank computes its own block and half of every
    other rank's, ``(cp + 1) / 2cp`` of the matrix; a sliding window skips the blocks it hides entirely. Checked
    against the engine's own block plan on every pair of positions of a 64-token sequence; full attention is
    computed whole."""
    seq = 64
    calls = [(100.0, True, window)]
    share = Section(attention_flops=100.0, attention_calls=calls).blockwise_work(seq, cp) / 100
    assert share == pytest.approx(_covered_by_the_engine(seq, cp, window))
    if window is None:
        assert share == pytest.approx((cp + 1) / (2 * cp))
    assert Section(attention_flops=100.0, attention_calls=[(100.0, False, None)]).blockwise_work(seq, cp) == 100.0


def test_context_parallel_attention_on_a_gpu_is_priced_as_the_engine_computes_it(gpt):
    """On a GPU the engine's cp blocks run torch's fused kernels: priced as fused (``cp_attention_rate`` None), as a
    layout without cp prices its attention. Told to run the math path (``cp_math_path``, the engine's
    ``CUDA_KERNELS = "math"``), a cp layout's attention is the math path's: its blocks' work at the GPU's fp32
    against its bf16 rate, forward once and backward 2.5 times (five matmuls against two), where the fused kernels'
    is their causal work at ATTENTION_RATE, 3 times; layouts without cp do not change. The table's H100 in bf16 has
    67 / 989; TF32 where torch's float32 matmul precision allows it; fp32 training 1."""
    assert known_hardware("H100-SXM").cp_attention_rate is None
    math = functools.partial(known_hardware, cp_math_path=True)
    assert math("H100-SXM").cp_attention_rate == pytest.approx(67 / 989)
    assert math("H100-SXM", precision="fp32").cp_attention_rate == 1.0
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert math("H100-SXM").cp_attention_rate == pytest.approx(494 / 989)
    finally:
        torch.set_float32_matmul_precision(before)
    assert math("H100-SXM", float32_matmul_precision="high").cp_attention_rate == pytest.approx(494 / 989)
    assert math("H100-SXM", float32_matmul_precision="medium").cp_attention_rate == 1.0
    with pytest.raises(ValueError, match=r"float32_matmul_precision='low' must be one of"):
        math("H100-SXM", float32_matmul_precision="low")
    with pytest.raises(ValueError, match=r"cp_attention_rate=1.5 must be in \(0, 1\]"):
        replace(GPU, cp_attention_rate=1.5)
    rate = 0.1
    math_gpu = replace(GPU, cp_attention_rate=rate)
    cp, plain = Layout(cp=2), Layout(dp_shard=2)
    fused_cp, math_cp = (predict(cp, gpt, hw, GLOBAL_BATCH, SEQ) for hw in (GPU, math_gpu))
    assert predict(plain, gpt, math_gpu, GLOBAL_BATCH // 2, SEQ).compute_s == predict(
        plain, gpt, GPU, GLOBAL_BATCH // 2, SEQ).compute_s
    blocks = [gpt.sections[b] for b in gpt.blocks]
    per_rank = GLOBAL_BATCH * SEQ / gpt.tokens * (SEQ / gpt.seq_len) / 2  # the tokens' scale, over cp ranks
    math_work = sum(b.blockwise_work(SEQ, 2) for b in blocks) * per_rank / rate * 3.5
    fused_work = sum(b.attention_work(SEQ) for b in blocks) * per_rank / 0.5 * 3
    assert math_cp.compute_s - fused_cp.compute_s == pytest.approx((math_work - fused_work) / GPU.matmul_flops)


def test_context_parallel_score_tiles_are_a_transient_and_recomputed_under_selective_checkpointing(gpt, monkeypatch):
    """The math path's scores (fp32, the rank's own block of its micro-batch: batch x heads x (seq / cp)^2) are a
    transient of three tensors, a row tile of at most ``SCORE_TILE_BYTES`` each; selective checkpointing recomputes
    the cp attention (its policy keeps fused kernels only), which without cp it keeps."""
    block = gpt.sections[gpt.blocks[0]]
    assert block.attention_scores == GLOBAL_BATCH * TINY_GPT["n_head"] * SEQ * SEQ  # traced: one whole matrix
    cp2, dp2 = (account(layout, gpt, batch, SEQ, "32-true")
                for layout, batch in ((Layout(cp=2), GLOBAL_BATCH), (Layout(dp_shard=2), GLOBAL_BATCH // 2)))
    whole = GLOBAL_BATCH * TINY_GPT["n_head"] * (SEQ // 2) ** 2 * 4
    assert cp2.buffer_bytes - dp2.buffer_bytes == pytest.approx(3 * whole)
    monkeypatch.setattr(context, "SCORE_TILE_BYTES", whole // 4)
    tiled = account(Layout(cp=2), gpt, GLOBAL_BATCH, SEQ, "32-true")
    assert tiled.buffer_bytes - dp2.buffer_bytes == pytest.approx(3 * whole / 4)
    monkeypatch.setattr(context, "SCORE_TILE_BYTES", 1)  # at least one query row
    assert account(Layout(cp=2), gpt, GLOBAL_BATCH, SEQ, "32-true").buffer_bytes - dp2.buffer_bytes == pytest.approx(
        3 * whole / (SEQ // 2))
    sac = {"cp": Layout(cp=2, activation_checkpointing="selective"),
           "dp": Layout(dp_shard=2, activation_checkpointing="selective")}
    none = {"cp": Layout(cp=2), "dp": Layout(dp_shard=2)}
    step = {k: {name: predict(layout, gpt, GPU, GLOBAL_BATCH // layout.dp, SEQ).compute_s
                for name, layout in layouts.items()} for k, layouts in (("sac", sac), ("none", none))}
    assert step["none"]["cp"] == pytest.approx(step["none"]["dp"])
    attention = sum(gpt.sections[b].attention_work(SEQ) for b in gpt.blocks) * GLOBAL_BATCH * SEQ / gpt.tokens / 0.5
    assert step["sac"]["cp"] - step["sac"]["dp"] == pytest.approx(GPU.matmul_share * attention / 2 / GPU.matmul_flops)


def test_experts_stay_whole_under_tensor_parallelism():
    """Tensor parallelism leaves the experts whole on every tp rank, which runs them on the micro-batch's tokens
    (as the dispatch account routes them): at tp 2 a rank computes half of everything else and all of the
    experts' FLOPs."""
    with torch.device("meta"):
        model = HFCausalLM("qwen3_moe")
    profile = profile_model(model, (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    experts = sum(s.expert_flops for s in profile.sections.values())
    assert experts > 0
    one, two = (predict(Layout(tp=tp), profile, GPU, GLOBAL_BATCH, SEQ).compute_s for tp in (1, 2))
    assert two == pytest.approx(one / 2 + 3 * experts / 2 / GPU.matmul_flops)


def test_experts_priced_as_other_software_holds_them_under_tensor_parallelism():
    """Published runs' software holds experts otherwise (``price_experts_as``): Megatron-Core's default splits each
    expert's width over tp ("split"), its ETP 1 spreads whole experts over the tp ranks too ("folded"). Either way a
    tp rank computes 1 / tp of the experts' FLOPs and holds 1 / tp of their weights; split gathers the routed rows
    over tp and reduce-scatters the outputs, folded sends 1 / tp of the rows over ep and nothing over tp."""
    with torch.device("meta"):
        model = HFCausalLM("qwen3_moe")
    whole = profile_model(model, (torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long),) * 2)
    experts = sum(s.expert_flops for s in whole.sections.values())
    expert_bytes = sum(p.numel * p.itemsize for p in whole.params if p.expert)
    saved = sum(s.expert_saved for s in whole.sections.values())
    assert experts > 0 and saved > 0
    layout = Layout(dp_shard=2, tp=2, ep=2)
    batch = GLOBAL_BATCH // layout.dp
    base = predict(layout, whole, GPU, batch, SEQ)
    for mode in ("split", "folded"):
        priced = price_experts_as(whole, mode)
        assert priced.experts_over_tp == mode and whole.experts_over_tp == "whole"  # a copy
        p = predict(layout, priced, GPU, batch, SEQ)
        # the experts' duplicated half leaves the compute: 3 passes of experts x (this rank's batch share) / tp
        assert base.compute_s - p.compute_s == pytest.approx(3 * experts * batch / GLOBAL_BATCH / 2
                                                             / GPU.matmul_flops, rel=1e-9)
        # parameters: the experts' whole bytes over the data ranks (2), then over tp as well
        assert base.params - p.params == pytest.approx(expert_bytes / 2 / 2, rel=1e-6)
        # activations (no sequence parallelism): half of the experts' intermediates
        assert base.activations - p.activations == pytest.approx(saved * batch / GLOBAL_BATCH / 2, rel=1e-9)
        sheet_whole, sheet = (account(layout, prof, batch, SEQ, "32-true") for prof in (whole, priced))
        rows_whole, rows = (max(t.nbytes for t in sh.transfers if t.kind == "all_to_all")
                            for sh in (sheet_whole, sheet))
        assert rows == pytest.approx(rows_whole / 2)  # each tp rank sends its sequence chunk's rows
        over_tp = [t for t in sheet.transfers if t.dim == "tp" and t.collective in ("all_gather", "reduce_scatter")
                   and t not in sheet_whole.transfers]
        assert len(over_tp) == (2 if mode == "split" else 0)
    with pytest.raises(ValueError, match="experts_over_tp='sharded'.*choose from"):
        price_experts_as(whole, "sharded")
    with pytest.raises(ValueError, match="has no experts modules"):
        price_experts_as(profile_model_gpt4(), "split")


# ---- the GPU time model: the non-matmul ops' bytes at the memory bandwidth ------------------------------------
class _Residual(torch.nn.Module):
    """x + relu(x): two non-matmul ops of known bytes (relu reads and writes one tensor, add reads two and writes
    one), no matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(()))  # a block has parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(x)


class _Routed(_Residual):
    """Gathers 3 of 64 rows and scatters them back: an indexing op moves the rows it indexes, not the whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor([0, 5, 9], device=x.device)
        picked = x[:, rows]  # aten.index: 3 rows of 64
        return x.index_add(1, rows, picked)


class _Blocks(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)  # a parameter, so that the optimizer has something
        self.blocks = torch.nn.ModuleList([block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.proj(x))


def _block_traffic(block: torch.nn.Module, x: torch.Tensor) -> int:
    profile = profile_model(_Blocks(block), (x, x), step=lambda m, b: m(b[0]).sum())
    return profile.sections["blocks.0"].memory_traffic.total


def test_the_trace_counts_each_non_matmul_ops_reads_and_writes():
    x = torch.zeros(4, 16, 8)
    n = x.numel() * 4  # one fp32 activation's bytes
    assert _block_traffic(_Residual(), x) == 2 * n + 3 * n  # relu: read, write; add: read two, write one
    x = torch.zeros(2, 64, 8)
    row = x.numel() * 4 // 64
    index = 3 * 8  # the int64 index tensor
    # the gather: the 3 rows read and written, and its index; the scatter: the 3 rows read, the 3 destination
    # rows read and written, its index; the copy index_add makes of x (out of place): x read and written
    assert _block_traffic(_Routed(), x) == (2 * 3 * row + index) + (3 * 3 * row + index) + 2 * x.numel() * 4


def test_the_memory_term_adds_the_bytes_forward_backward_and_recomputed_at_the_bandwidth(gpt):
    """With ``Hardware.memory_bandwidth`` a step also pays its non-matmul bytes: forward, backward
    (``BACKWARD_TRAFFIC`` times) and once more where activation checkpointing recomputes the blocks; software that
    fuses them (``devices.fused``) moves a share of them; without a bandwidth (the CPU) nothing changes."""
    from lightning_par.devices import fused
    from lightning_par.planner.predict import BACKWARD_TRAFFIC

    bandwidth = 1e9
    priced = replace(GPU, memory_bandwidth=bandwidth)
    blocks = [n for n in gpt.sections if n.startswith(gpt.block_list)]
    moved = {name: gpt.sections[name].memory_traffic.total * GLOBAL_BATCH / gpt.batch for name in gpt.sections}
    assert all(moved[n] > 0 for n in blocks)
    for checkpointing, again in ((False, 0.0), (True, sum(moved[n] for n in blocks))):
        layout = Layout(activation_checkpointing=checkpointing)
        plain = predict(layout, gpt, GPU, GLOBAL_BATCH, SEQ)
        with_memory = predict(layout, gpt, priced, GLOBAL_BATCH, SEQ)
        extra = ((1 + BACKWARD_TRAFFIC) * sum(moved.values()) + again) / bandwidth
        assert with_memory.compute_s - plain.compute_s == pytest.approx(extra, rel=1e-9)
        compiled = predict(layout, gpt, fused(priced, 0.25), GLOBAL_BATCH, SEQ)
        assert compiled.compute_s - plain.compute_s == pytest.approx(extra / 4, rel=1e-9)
    assert fused(GPU) is GPU and predict(Layout(), gpt, CPU, GLOBAL_BATCH, SEQ).compute_s == pytest.approx(
        predict(Layout(), gpt, replace(CPU, memory_bandwidth=None), GLOBAL_BATCH, SEQ).compute_s)
    with pytest.raises(ValueError, match="traffic=1.5 must be in"):
        fused(priced, 1.5)


def test_tensor_parallelism_splits_the_sharded_traffic_and_sequence_parallelism_the_residual(llama):
    """The bytes follow the activations' layout: a column-parallel output's ops run on 1/tp of it, the residual
    stream's on all of it on every tp rank, unless sequence parallelism splits it too."""
    priced = replace(GPU, memory_bandwidth=1e9)
    block = llama.sections[llama.blocks[0]].memory_traffic
    assert block.sharded > 0 and block.residual > 0

    def memory_time(layout: Layout) -> float:
        return (predict(layout, llama, priced, GLOBAL_BATCH, SEQ).compute_s
                - predict(layout, llama, GPU, GLOBAL_BATCH, SEQ).compute_s)

    whole, split = memory_time(Layout(tp=2)), memory_time(Layout(tp=2, sequence_parallel=True))
    assert 0 < split < whole < memory_time(Layout())


def test_the_profile_records_the_matmuls_float8_converts(gpt):
    """float8 converts the blocks' linear layers whose weights have both dimensions multiples of 16 (the tiny GPT's
    are all 32 wide; not its head, outside the blocks; a Llama's MLP 40 wide stays out): the profile holds their
    forward FLOPs, the elements of their inputs and outputs its casts read, and their weights' elements."""
    tokens = GLOBAL_BATCH * SEQ
    for name in gpt.blocks:
        linear = [p for p in gpt.params if p.section == name and len(p.shape) == 2]
        assert linear and all(d % 16 == 0 for p in linear for d in p.shape)
        section = gpt.sections[name]
        assert section.float8_flops == sum(2 * tokens * p.numel for p in linear) <= section.flops
        assert section.float8_weight_elements == sum(p.numel for p in linear)
        assert section.float8_cast_elements == sum(tokens * (p.shape[0] + p.shape[1]) for p in linear)
    assert gpt.sections["first"].float8_flops == gpt.sections["last"].float8_flops == 0  # embedding, head
    with torch.device("meta"):
        module = HFCausalLM("llama", num_key_value_heads=4, intermediate_size=40)
    ids = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    llama = profile_model(module, (ids, ids))
    weights = [p for p in llama.params if p.section == llama.blocks[0] and len(p.shape) == 2]
    aligned = [p for p in weights if not any(d % 16 for d in p.shape)]
    assert {p.fqn.split(".")[-2] for p in aligned} == {"q_proj", "k_proj", "v_proj", "o_proj"}  # not the MLP
    section = llama.sections[llama.blocks[0]]
    assert section.float8_weight_elements == sum(p.numel for p in aligned)
    assert section.float8_flops == sum(2 * tokens * p.numel for p in aligned)


def test_float8_is_priced_where_the_device_has_float8_matmuls():
    """``with_float8``: the matmuls float8 converts at FLOAT8_MATMUL_SHARE of the float8 peak's gain (an H100's
    peak is twice its bf16 one), its casts at the bandwidth share of the device's memory bandwidth; refused on a
    device without float8 matmuls (an A100, the CPU), naming why."""
    from lightning_par.devices import BANDWIDTH_SHARE, FLOAT8_MATMUL_SHARE, with_float8

    h100 = with_float8(known_hardware("H100-SXM"))
    assert h100.float8_speedup == pytest.approx(1 + FLOAT8_MATMUL_SHARE * (1979 / 989 - 1))
    assert h100.float8_cast_bandwidth == pytest.approx(3.35e12 * BANDWIDTH_SHARE)
    for hardware in (known_hardware("A100-80GB"), CPU):
        with pytest.raises(ValueError, match="has no float8 matmuls the planner knows of"):
            with_float8(hardware)


def test_float8_all_gathers_send_the_converted_weights_at_one_byte(gpt):
    """On a GPU with float8 training under FSDP's bf16 mixed precision, the engine gathers the blocks' converted
    weights in float8 (torchao's float8 all-gather): each block unit's all-gather sends 1 byte per converted
    element instead of 2, the rest (norms, the root's embeddings and head) as before; not on the CPU (gloo), not
    without float8."""
    from lightning_par.devices import with_float8

    layout, batch = Layout(dp_shard=4), GLOBAL_BATCH // 4

    def gathers(sheet: CostSheet) -> list[float]:
        return sorted(t.nbytes for t in sheet.transfers if t.kind == "fsdp_all_gather")

    plain, float8 = (account(layout, gpt, batch, SEQ, "bf16-mixed", float8_gathers=on) for on in (False, True))
    converted = gpt.sections[gpt.blocks[0]].float8_weight_elements
    assert converted > 0 and all(gpt.sections[b].float8_weight_elements == converted for b in gpt.blocks)
    # per block unit: 4 fp32 bytes gathered as 2 in bf16, of which the converted ones as 1
    block_units = len(gpt.blocks)
    saved = [p - f for p, f in zip(gathers(plain), gathers(float8))]
    assert sorted(saved, reverse=True)[:1] == [pytest.approx(converted * (4 * 0.5 - 1))]
    assert sum(s > 0 for s in saved) == 1 and max(t.count for t in float8.transfers  # one Transfer: equal blocks
                                                   if t.kind == "fsdp_all_gather") >= block_units
    def gathered_s(hardware: Hardware) -> float:
        return predict(layout, gpt, hardware, batch, SEQ, "bf16-mixed").comm_total_s["fsdp_all_gather"]

    h100 = known_hardware("H100-SXM")
    assert gathered_s(with_float8(h100)) < gathered_s(h100)
    # ranks sharing CPU cores run gloo, which gathers in bf16 whatever float8 does
    cpu_with_float8 = replace(CPU, float8_speedup=1.5, float8_cast_bandwidth=1e9)
    assert gathered_s(cpu_with_float8) == gathered_s(CPU)


@pytest.mark.parametrize("batch, measured", [(8, 1.225), (2, 1.114)])
def test_float8_gain_against_the_h200_measurement(batch, measured):
    """Compiled float8 over compiled bf16 tokens/s on 6 of Llama-3.1-8B's layers, seq 2,048, one H200
    (benchmarks/results/gpu_h200/vs_torchtitan_2026-11-28_b8.json and _2026-11-28.json, this engine's rows):
    FLOAT8_MATMUL_SHARE was fitted to batch 8 (within 0.5 %), batch 2 is held out (measured 1.114: within 2 %)."""
    from lightning_par.devices import fused, with_float8
    from lightning_par.planner.predict import trace_dtype
    from lightning_par.planner.search import plan_layouts

    with torch.device("meta"):
        module = HFCausalLM("llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, num_hidden_layers=6, vocab_size=128256)
    ids = torch.zeros(batch, 2048, dtype=torch.long)
    profile = profile_model(module, (ids, ids), dtype=trace_dtype("bf16-mixed"))
    bf16 = fused(known_hardware("H200"))

    def step(hardware: Hardware) -> float:
        plan = plan_layouts(profile, (ids, ids), 1, hardware, precision="bf16-mixed", activation_checkpointing=(False,))
        return plan.best.step_s

    ratio = step(bf16) / step(with_float8(bf16))
    assert ratio == pytest.approx(measured, rel=0.005 if batch == 8 else 0.02)

"""Tensor parallelism without Lightning: ``techniques.tensor.tensor`` on plain torch.distributed (gloo, CPU).

Parity: the tiny GPT (and a tiny Hugging Face Llama from its own plan) trained a few steps under tp = 2 and 4, with
and without sequence parallelism and loss parallelism, SGD and AdamW, must match the same model trained by one
process: loss at every step and the full final weights within 1e-5 (measured: <= 5e-7 and <= 2e-6). One launch per
world size runs every configuration; the parent asserts with the configuration's name.

Bad input: validation needs no process group, so most checks run here in one process; the ones that need a mesh or
a forward run inside the launches, on every rank, before the parity cases (which then prove no rank was left
waiting in a collective).
"""

from __future__ import annotations

import pytest
import torch
from launch import launch
from tensor_workers import BATCH, SEQ, Case, extra_cases, gpt_cases, run_all, tiny_gpt, tiny_llama
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from example_projects.gpt.model import GPT_TP_PLAN
from lightning_par.techniques.tensor.tensor import (
    build_style,
    check_tp_size,
    prefix_plan,
    resolve_tp_plan,
    validate_tp_plan,
)

TOL = 1e-5
WORLD2_CASES = gpt_cases() + extra_cases()
WORLD4_CASES = gpt_cases()


@pytest.fixture(scope="module")
def world2():
    return launch(2, run_all, 2, WORLD2_CASES)


@pytest.fixture(scope="module")
def world4():
    return launch(4, run_all, 4, WORLD4_CASES)


def _check_parity(results: list[dict], case: Case, tp: int) -> None:
    for rank, out in enumerate(results):
        r = out[case.name]
        where = f"tp={tp} rank {rank} [{case.name}]"
        assert r["loss_diff"] <= TOL, f"{where}: losses {r['losses']} vs one process {r['ref_losses']}"
        assert r["weight_diff"] <= TOL, f"{where}: final weights differ by {r['weight_diff']:.3g}"
        assert r["loss_decreased"], f"{where}: the reference did not learn, the comparison is vacuous"
        assert (r["gathered_again"] > 0) == case.regather_sequence, f"{where}: {r['gathered_again']} re-gathers"
        assert r["num_sharded"] >= 16, f"{where}: only {r['num_sharded']} parameters were sharded"
        seq = SEQ // tp if case.sequence_parallel else SEQ
        assert r["block_output_shape"][:2] == (BATCH, seq), f"{where}: block 0 output {r['block_output_shape']}"
    assert results[0][case.name]["losses"] == results[-1][case.name]["losses"], f"tp={tp} [{case.name}]: ranks differ"


@pytest.mark.parametrize("case", WORLD2_CASES, ids=lambda c: c.name)
def test_parity_tp2(world2, case):
    _check_parity(world2, case, 2)


@pytest.mark.parametrize("case", WORLD4_CASES, ids=lambda c: c.name)
def test_parity_tp4(world4, case):
    _check_parity(world4, case, 4)


def test_regathered_sequence_saves_chunks_and_gathers_them_again_in_backward(world2, world4):
    """The tiny GPT (3 blocks, 4 x 16 tokens of width 32, fp32) under sequence parallelism: with
    ``regather_sequence`` each block's two gathered inputs (attention, MLP) and the head's are saved as this rank's
    chunk, so 7 x (whole - chunk) fewer bytes are alive after forward; backward gathers each of them again (7 more
    all-gathers, none more in forward); the gradients are the same bits. A chunk modified in place after its
    gather, or any other saved tensor modified in place (autograd does not check under saved-tensor hooks), is
    refused at backward, on every rank."""
    whole = BATCH * SEQ * 32 * 4
    for tp, results in ((2, world2), (4, world4)):
        for rank, out in enumerate(results):
            e, where = out["regather"], f"tp={tp} rank {rank}"
            assert e["alive"][0] - e["alive"][1] == 7 * (whole - whole // tp), (where, e["alive"])
            assert e["forward_gathers"][0] == e["forward_gathers"][1] > 0, (where, e["forward_gathers"])
            assert e["gathers"][1] - e["gathers"][0] == 7, (where, e["gathers"])
            assert e["grad_diff"] == 0.0, where
            assert "input chunk was modified in place after forward saved it" in e["in_place"], (where, e["in_place"])
            assert "(3,) saved for backward" in e["saved_in_place"], (where, e["saved_in_place"])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("bad plan", ["'blocks.*.atn.q' matches no module", "blocks.*.attn.q"]),
        ("applied twice", ["already has DTensor parameters"]),
        ("sp uneven sequence", ["length 15", "not divisible by tp="]),
    ],
)
def test_errors_on_every_rank(world2, world4, name, expected):
    for tp, results in ((2, world2), (4, world4)):
        for rank, out in enumerate(results):
            msg = out["errors"][name]
            assert msg.startswith("ValueError") and all(e in msg for e in expected), f"tp={tp} rank {rank}: {msg!r}"


def test_errors_needing_a_mesh(world2, world4):
    assert "tied weights cannot be tensor-parallelized" in world2[1]["errors"]["tied weights"]
    assert "num_key_value_heads=2" in world4[3]["errors"]["tied weights"]  # tp=4 fails on the kv heads first
    assert "1-D tensor-parallel mesh" in world4[2]["errors"]["2-D mesh"]


# ---- one process: plan resolution, style choice, validation ---------------------------------------------------
class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


#: a stacked MLP's plan (StackedMLP below), as Hugging Face writes it for Inkling's shared experts
STACKED_PLAN = {"model": "all_reduce", "model.gate": "colwise", "model.down": "rowwise"}


def test_resolve_prefers_user_plan_then_attribute():
    holder = Holder(tiny_gpt())
    holder.tp_plan = prefix_plan(GPT_TP_PLAN, "model")
    assert resolve_tp_plan(holder, {"model.head": "colwise_rep"}) == {"model.head": "colwise_rep"}
    plan = resolve_tp_plan(holder, None)
    assert plan["model.blocks.*.attn.q"] == "colwise" and len(plan) == len(GPT_TP_PLAN)
    assert len(validate_tp_plan(holder, plan, 4)) == 4 + 3 * 10  # 4 top-level entries, 10 per block


def test_resolve_hugging_face_plan_inside_a_wrapper():
    plan = resolve_tp_plan(Holder(tiny_llama()), None)
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.lm_head"] == "colwise_gather_output"
    # sequence-parallel entries (no-ops unless sequence_parallel=True): split at layer 0, norms on shards
    assert plan["model.model.layers.0"] == "split_sequence"
    assert plan["model.model.layers.*.input_layernorm"] == "sequence_parallel"
    assert plan["model.model.layers.*.self_attn"] == "gather_sequence"
    assert plan["model.model.norm"] == "sequence_parallel"
    assert "model.model.rotary_emb" not in plan
    # the HF model passed directly: keys relative to it
    assert "model.layers.*.self_attn.q_proj" in resolve_tp_plan(tiny_llama(), None)


def test_loss_parallelism_keeps_a_hugging_face_heads_logits_sharded():
    """HF's head gathers its logits for HF's own loss, which loss parallelism cannot take (refused before); under
    loss_parallel=True its entry becomes 'vocab_parallel_head'. A plan the user gives is taken as it is."""
    holder = Holder(tiny_llama())
    gathered = resolve_tp_plan(holder, None)
    with pytest.raises(ValueError, match="loss_parallel=True needs an output layer"):
        validate_tp_plan(holder, gathered, 2, sequence_parallel=True, loss_parallel=True)
    sharded = resolve_tp_plan(holder, None, loss_parallel=True)
    assert sharded == {**gathered, "model.lm_head": "vocab_parallel_head"}
    assert validate_tp_plan(holder, sharded, 2, sequence_parallel=True, loss_parallel=True)["model.lm_head"] == (
        "vocab_parallel_head")
    given = {"model.lm_head": "colwise_rep"}
    assert resolve_tp_plan(holder, given, loss_parallel=True) == given


def test_resolve_without_any_plan():
    with pytest.raises(ValueError, match="No tensor-parallel plan for Holder.*tp_plan"):
        resolve_tp_plan(Holder(nn.Linear(4, 4)), None)
    with pytest.raises(TypeError, match="must be a dict"):
        resolve_tp_plan(Holder(nn.Linear(4, 4)), ["model"])
    with pytest.raises(TypeError, match="'model': 3"):
        resolve_tp_plan(Holder(nn.Linear(4, 4)), {"model": 3})


def test_styles_follow_sequence_and_loss_parallel():
    rowwise, rowwise_sp = build_style("rowwise"), build_style("rowwise", sequence_parallel=True)
    assert isinstance(rowwise, RowwiseParallel) and rowwise.output_layouts == (Replicate(),)
    assert rowwise_sp.output_layouts == (Shard(1),)
    assert build_style("colwise", sequence_parallel=True).input_layouts == (Shard(1),)
    assert build_style("sequence_parallel") is None and isinstance(
        build_style("sequence_parallel", sequence_parallel=True), SequenceParallel
    )
    head = build_style("vocab_parallel_head", loss_parallel=True)
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert build_style("vocab_parallel_head").output_layouts == (Replicate(),)
    assert build_style("colwise_gather_output").output_layouts == (Replicate(),)  # HF alias of colwise_rep
    assert build_style("gather") is None  # HF: our rowwise already all-reduces
    style = ColwiseParallel()
    assert build_style(style) is style
    # HF's rowwise_split_input feeds the residual stream: sequence-sharded under SP
    assert build_style("rowwise_split_input", sequence_parallel=True).output_layouts == (Shard(1),)
    # inside a module that gathered the sequence, a plain input is an inner activation of the whole sequence
    assert build_style("colwise", sequence_parallel=True, input_gathered=True).input_layouts == (Replicate(),)
    assert build_style("colwise_gather_output", sequence_parallel=True,
                       input_gathered=True).input_layouts == (Replicate(),)
    head_norm = build_style("replicated_with_grad_allreduce")  # HF alias of head_norm
    assert isinstance(head_norm, SequenceParallel) and head_norm.sequence_sharding == (Shard(0),)


def test_every_tensor_parallel_style_is_one_complete_row():
    """A style is one row of ``tensor_styles``: name, description, Hugging Face aliases, the modules it applies to,
    what it splits, its behaviour under sequence parallelism, its builder and its price, none of them defaulted;
    every builder builds in every setting, and the tables the rest of the package reads are made from the rows."""
    from dataclasses import MISSING, fields
    from itertools import product

    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_par.techniques.tensor.tensor_plan import HF_UNSUPPORTED
    from lightning_par.techniques.tensor.tensor_styles import (
        HF_ALIASES,
        HF_NOOPS,
        STYLES,
        TP_STYLES,
        BuildArgs,
        TPPrice,
        TPStyle,
    )

    assert all(f.default is MISSING and f.default_factory is MISSING for f in fields(TPStyle))
    assert list(STYLES) == list(TP_STYLES) and len(TP_STYLES) == 16
    sizes = {"linear": ("out_features", "in_features"), "embedding": ("num_embeddings", "embedding_dim")}
    for name, row in TP_STYLES.items():
        assert row.name == name and row.description, name
        assert row.applies_to in ("module", "linear", "embedding", "parameters"), name
        assert row.sp_gather in (None, "gathers", "gathers_outside"), name
        assert (row.build is None) == (row.applies_to == "parameters"), name
        assert isinstance(row.price, TPPrice) and row.price.output in (None, "sharded", "vocab", "whole", "reduced")
        assert row.price.pair in (None, "column", "row"), name
        if row.sharded_size is not None:
            attr, what = row.sharded_size
            assert attr in sizes.get(row.applies_to, ()) and what, name
        for alias in row.hf_aliases:
            assert HF_ALIASES[alias] == name and alias not in TP_STYLES and alias not in HF_UNSUPPORTED, alias
        for sp, lp, gathered in product((False, True), repeat=3):
            built = row.build(BuildArgs(sp, lp, gathered, rope_dim=2)) if row.build else None
            assert built is None or isinstance(built, ParallelStyle), name
            if row.build is not None:
                assert type(build_style(name, sequence_parallel=sp, loss_parallel=lp, input_gathered=gathered,
                                        rope_dim=2)) is type(built), name
    aliased = {alias for row in TP_STYLES.values() for alias in row.hf_aliases}
    assert set(HF_ALIASES) == aliased | set(HF_NOOPS) and not aliased & set(HF_NOOPS)
    assert all(HF_ALIASES[noop] is None for noop in HF_NOOPS)


def test_head_norm_is_for_norms():
    with pytest.raises(TypeError, match=r"'head_norm' is for norms \(and other modules on split activations\), "
                                        r"but 'model' is a Linear"):
        validate_tp_plan(Holder(nn.Linear(4, 4)), {"model": "replicated_with_grad_allreduce"}, 2)


def test_check_tp_size():
    check_tp_size(2, 4)
    check_tp_size(4, 4)
    for tp, world in ((3, 4), (8, 4), (0, 4)):
        with pytest.raises(ValueError, match=rf"tp={tp} does not fit a world of {world}.*\[1, 2, 4\]"):
            check_tp_size(tp, world)
    with pytest.raises(TypeError, match="must be an int"):
        check_tp_size("2", 4)


BAD_PLANS = {
    "heads": (lambda: tiny_gpt(n_head=2), GPT_TP_PLAN, 4, {},
              ["'blocks.0.attn.q'", "2 heads", "head_dim=16", "tp=4"]),
    "hidden width": (lambda: tiny_gpt(n_embd=36, n_head=4), {"blocks.*.attn.q": "colwise"}, 8, {},
                     ["'blocks.0.attn.q'", "out_features=36", "not divisible by tp=8"]),
    "ffn width": (lambda: tiny_gpt(), {"blocks.*.mlp.proj": "rowwise"}, 3, {},
                  ["'blocks.0.mlp.proj'", "in_features=128", "tp=3"]),
    "vocab embedding": (lambda: tiny_gpt(vocab_size=30), {"tok_emb": "vocab_parallel_embedding"}, 4, {},
                        ["'tok_emb'", "num_embeddings=30", "vocabulary"]),
    "vocab head": (lambda: tiny_gpt(vocab_size=30), {"head": "vocab_parallel_head"}, 4, {},
                   ["'head'", "out_features=30", "vocabulary"]),
    "hf kv heads": (tiny_llama, None, 4, {}, ["self_attn", "heads", "tp=4"]),
    "no match": (lambda: tiny_gpt(), {"blocks.*.mlp.fcc": "colwise"}, 2, {},
                 ["'blocks.*.mlp.fcc' matches no module of GPT", "blocks.*.mlp.fc"]),
    "relative to the wrong root": (lambda: Holder(tiny_gpt()), {"blocks.*.attn.q": "colwise"}, 2, {},
                                   ["matches no module of Holder", "model.blocks.*.attn.q", "prefix_plan"]),
    "unknown style": (lambda: tiny_gpt(), {"head": "colwize"}, 2, {}, ["'colwize' is not", "'colwise'"]),
    "hf unsupported style": (lambda: tiny_gpt(), {"head": "packed_colwise"}, 2, {},
                             ["Hugging Face style", "does not implement"]),
    "conflicting entries": (lambda: tiny_gpt(), {"blocks.*.attn.q": "colwise", "blocks.**.q": "rowwise"}, 2, {},
                            ["'blocks.0.attn.q' is matched by", "one style"]),
    "loss parallel without head": (lambda: tiny_gpt(), {"head": "colwise_rep"}, 2, {"loss_parallel": True},
                                   ["loss_parallel=True", "vocab_parallel_head"]),
    "sequence parallel without norms": (lambda: tiny_gpt(), {"blocks.*.attn.q": "colwise"}, 2,
                                        {"sequence_parallel": True}, ["sequence_parallel=True", "norm"]),
    "tied weights": (lambda: _tied_llama(), None, 2, {}, ["tied weights", "tie_word_embeddings=False"]),
    # bare parameters (no module): split only as per-head vectors, all of a module's or none
    "bare parameter rowwise": (lambda: Holder(Sinks()), {"model.sinks": "rowwise"}, 2, {},
                               ["'model.sinks'", "names bare parameters", "split only by head"]),
    "bare parameters partly split": (lambda: Holder(Sinks(scale=True)), {"model.sinks": "colwise"}, 2, {},
                                     ["'model'", "['model.scale'] have no such entry"]),
    "bare parameter heads": (lambda: Holder(Sinks(heads=3)), {"model.sinks": "colwise"}, 2, {},
                             ["model.sinks (shape (3,))", "tp=2 cannot divide"]),
    "packed bare parameter": (lambda: Holder(Sinks(packed=True)), {"model.packed": "colwise"}, 2, {},
                              ["bare parameters of 2 dimensions", "mark its owner 'model' 'partial_sum'"]),
    # stacked bare parameters inside a 'partial_sum' module (HF's 'all_reduce'): every one named, split evenly
    "partial sum without an entry": (lambda: Holder(StackedMLP()), {"model": "all_reduce", "model.gate": "colwise"},
                                     2, {}, ["'model.down' (shape (2, 8, 4)) has none", "'rowwise' (dim -1"]),
    "partial sum of a vector rowwise": (lambda: Holder(StackedMLP(bias=True)),
                                        {"model": "partial_sum", "model.gate": "colwise", "model.down": "rowwise",
                                         "model.bias": "rowwise"}, 2, {}, ["'model.bias' (shape (8,))",
                                                                           "a vector would be summed over tp"]),
    "partial sum split unevenly": (lambda: Holder(StackedMLP()), STACKED_PLAN, 3, {},
                                   ["model.gate (shape (2, 4, 8)) splits dim -2 3 ways", "tp=3 cannot divide"]),
    "partial sum with children": (lambda: Holder(StackedMLP(child=True)), STACKED_PLAN, 2, {},
                                  ["'model' is 'partial_sum'", "child modules hold parameters", "model.child.weight"]),
    "partial sum under sequence parallelism": (lambda: Holder(StackedMLP()), STACKED_PLAN, 2,
                                               {"sequence_parallel": True},
                                               ["'model' is 'partial_sum'", "sequence_parallel=False"]),
    "latent attention without a rope size": (lambda: Holder(Sinks()), {"model.kv_a": "mla_kv_a_proj"}, 2, {},
                                             ["'model.kv_a' is 'mla_kv_a_proj'", "qk_rope_head_dim"]),
}


class StackedMLP(nn.Module):
    """Stacked experts as bare 3-D parameters (Inkling's shared experts): gate (experts, hidden, dim) and down
    (experts, dim, hidden), summed over the experts and the hidden dim."""

    def __init__(self, bias: bool = False, child: bool = False) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(2, 4, 8))
        self.down = nn.Parameter(torch.zeros(2, 8, 4))
        if bias:
            self.bias = nn.Parameter(torch.zeros(8))
        if child:
            self.child = nn.Linear(8, 8)


class NormedEmbedding(nn.Embedding):
    """Inkling's embedding: its forward normalizes the lookup (a vocabulary split would normalize partial sums)."""

    def __init__(self) -> None:
        super().__init__(16, 8)
        self.norm = nn.LayerNorm(8)


class Sinks(nn.Module):
    """An attention-like module with bare per-head parameters (attention sinks) next to its projections."""

    def __init__(self, heads: int = 4, scale: bool = False, packed: bool = False) -> None:
        super().__init__()
        self.kv_a = nn.Linear(8, 8)
        self.sinks = nn.Parameter(torch.zeros(heads))
        if scale:
            self.scale = nn.Parameter(torch.ones(1))
        if packed:
            self.packed = nn.Parameter(torch.zeros(4, 8))


def test_stacked_parameters_of_a_partial_sum_module_validate():
    """HF's 'all_reduce' owner is 'partial_sum': its 'colwise' bare parameters split on dim -2, 'rowwise' on dim -1.
    Inkling's plan (stacked shared experts; its normalizing embedding's entry left out, the embedding kept whole)."""
    from hf_models import HFCausalLM

    from lightning_par.techniques.tensor.tensor_plan import partial_sum_params

    holder = Holder(StackedMLP())
    assert validate_tp_plan(holder, STACKED_PLAN, 2) == {"model": "partial_sum"}
    assert partial_sum_params(holder, STACKED_PLAN, 2) == {"model": {"gate": -2, "down": -1}}
    inkling = HFCausalLM("inkling_text")
    plan = resolve_tp_plan(inkling, None)
    assert plan["model.model.layers.*.mlp.shared_experts"] == "all_reduce"
    assert not any("embed_tokens" in key for key in plan)
    resolved = validate_tp_plan(inkling, plan, 2)
    assert resolved["model.model.layers.3.mlp.shared_experts"] == "partial_sum"
    assert partial_sum_params(inkling, plan, 2)["model.model.layers.0.mlp.shared_experts"] == {
        "gate_proj": -2, "up_proj": -2, "down_proj": -1}


def test_bare_per_head_parameters_and_latent_attention_validate():
    """'colwise' on a bare per-head vector splits it by head (applied by apply_tp, not a module entry; the owner's
    HF 'local_params' is a no-op); 'mla_kv_a_proj' reads the rope size from its attention (per-layer configs)."""
    from lightning_par.techniques.tensor.tensor_plan import head_params

    holder = Holder(Sinks())
    holder.model.qk_rope_head_dim = 4
    plan = {"model.sinks": "colwise", "model": "local_params", "model.kv_a": "mla_kv_a_proj"}
    assert validate_tp_plan(holder, plan, 2) == {"model.kv_a": "mla_kv_a_proj"}
    assert head_params(holder, plan, 2) == {"model": ["sinks"]}
BAD_TYPES = {
    "colwise on a norm": (lambda: tiny_gpt(), {"norm": "colwise"}, ["'colwise' shards an nn.Linear", "LayerNorm"]),
    "embedding style on a linear": (lambda: tiny_gpt(), {"head": "vocab_parallel_embedding"},
                                    ["shards an nn.Embedding", "'head' is a Linear"]),
    "sequence_parallel on a linear": (lambda: tiny_gpt(), {"head": "sequence_parallel"}, ["norms and dropout"]),
    "embedding that runs more": (lambda: Holder(NormedEmbedding()), {"model": "embedding_rowwise"},
                                 ["'model' (NormedEmbedding) also runs child modules", "['norm.weight', 'norm.bias']",
                                  "Drop the entry"]),
}


def _tied_llama() -> nn.Module:
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_bad_plans(name):
    build, plan, tp, flags, expected = BAD_PLANS[name]
    model = build()
    with pytest.raises(ValueError) as err:
        validate_tp_plan(model, resolve_tp_plan(model, plan) if plan is None else plan, tp, **flags)
    for part in expected:
        assert part in str(err.value), f"[{name}] {part!r} not in: {err.value}"


@pytest.mark.parametrize("name", list(BAD_TYPES))
def test_bad_module_types(name):
    build, plan, expected = BAD_TYPES[name]
    with pytest.raises(TypeError) as err:
        validate_tp_plan(build(), plan, 2)
    for part in expected:
        assert part in str(err.value), f"[{name}] {part!r} not in: {err.value}"


def test_flag_and_size_types():
    with pytest.raises(TypeError, match="sequence_parallel='yes' must be True or False"):
        validate_tp_plan(tiny_gpt(), GPT_TP_PLAN, 2, sequence_parallel="yes")
    with pytest.raises(ValueError, match="tp_size=0"):
        validate_tp_plan(tiny_gpt(), GPT_TP_PLAN, 0)


def test_good_plans_validate():
    for sp in (False, True):
        for lp in (False, True):
            resolved = validate_tp_plan(tiny_gpt(), GPT_TP_PLAN, 4, sequence_parallel=sp, loss_parallel=lp)
            assert list(resolved)[:3] == ["tok_emb", "pos_emb", "blocks.0.norm1"]  # model order
    assert validate_tp_plan(tiny_llama(), resolve_tp_plan(tiny_llama(), None), 2, sequence_parallel=True)
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    validate_tp_plan(model, GPT_TP_PLAN, 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "validation changed the model"


def test_per_head_norms_a_hugging_face_plan_omits_are_head_norms():
    """Sarvam-MoE's plan splits the attention's heads but names no entry for its per-head q/k norms (GLM-4-MoE's code
    with ``use_qk_norm``): they become 'head_norm' (whole weights, gradients summed over tp), as Qwen3's plan says
    itself; a norm over the whole hidden size is not one."""
    import transformers

    config = transformers.SarvamMoEConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        use_qk_norm=True, first_k_dense_replace=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    plan = resolve_tp_plan(model, None)
    for layer in range(2):
        for norm in ("q_norm", "k_norm"):
            assert plan[f"model.layers.{layer}.self_attn.{norm}"] == "head_norm"
    assert not any(key.endswith("layernorm") and style == "head_norm" for key, style in plan.items())
    assert validate_tp_plan(model, plan, 2)["model.layers.1.self_attn.q_norm"] == "head_norm"
    qwen3 = tiny_hf_plan_of("qwen3")
    assert qwen3["model.model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert not any(style == "head_norm" for style in qwen3.values())  # its own entries cover them


def tiny_hf_plan_of(arch: str) -> dict:
    from hf_models import HFCausalLM

    return resolve_tp_plan(HFCausalLM(arch), None)


def test_experts_a_plan_marks_moe_tp_experts_stay_whole_without_an_ep_plan():
    """LongCat-Flash's config has no ep plan, but its tp plan marks the experts module 'moe_tp_experts': its entries
    (packed experts, the identity experts) are left out, the experts stay whole, the rest of the plan stands (its
    tp2 run is in parity in benchmarks/hf_architectures.py)."""
    from benchmarks.hf_architectures import build

    model = build("longcat_flash")
    plan = resolve_tp_plan(model, None)
    assert not any(".experts" in key for key in plan)
    assert "mla_kv_a_proj" in plan.values() and "colwise" in plan.values()
    assert validate_tp_plan(model, plan, 2)["model.layers.0.self_attn.0.kv_a_proj_with_mqa"] == "mla_kv_a_proj"


def test_async_tp_switches_on_inductors_pass_and_symmetric_memory_for_the_tp_group(world2):
    """The engine's side of ``async_tp`` (running the pipelined collectives needs two CUDA GPUs: not here)."""
    assert [r["async_tp"] for r in world2] == [{"inductor_pass": True, "symmetric_memory": True}] * 2

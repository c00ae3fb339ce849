"""Expert parallelism (``NDParallelStrategy(ep=...)``) on the example GPT's mixture of experts: parity with one process.

One launch per world size runs every layout in turn. fp32 on CPU, tolerance 1e-5 (measured: ~2e-7 on losses and
~5e-7 on weights after 10 AdamW steps; dropless dispatch computes every routed token as one process does, only in
other groupings). Bad input runs first in the world-2 job: its error comes on every rank before any collective, and
the job's later runs still train.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import HFCausalLM
from launch import launch
from workers import assert_parity, error_of, fit, fit_reference

from lightning_par import NDParallelStrategy
from lightning_par.dims import ParallelDims
from lightning_par.parallel.experts import _group_by_expert

MOE = dict(n_experts=4, moe_top_k=2)
SHARED_SIGMOID = dict(n_experts=4, moe_top_k=2, moe_shared_expert=True, moe_router="sigmoid")
#: transformers' mixtures of experts, unchanged: ep from their config's base_model_ep_plan
HF_MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
WORLD4 = {  # name -> (strategy options, model options)
    "ep2_efsdp2": (dict(dp_shard=4, ep=2), MOE),
    "ep4_activation_checkpointing": (dict(dp_shard=4, ep=4, activation_checkpointing=True), MOE),
    "hsdp_ep2": (dict(dp_replicate=2, dp_shard=2, ep=2), MOE),
    "tp2_ep2_loss_parallel": (dict(dp_shard=2, tp=2, ep=2, loss_parallel=True), MOE),
    "cp2_tp2_ep2": (dict(dp_shard=1, cp=2, tp=2, ep=2), SHARED_SIGMOID),
}


def _world2(ckpt_dir: str) -> dict:
    out = {
        "ep_not_dividing_experts": error_of(lambda: fit(NDParallelStrategy(ep=2), 2, 2, n_experts=3, max_steps=1)),
        "ep_plan_matching_nothing": error_of(lambda: fit(NDParallelStrategy(ep=2), 2, 2, max_steps=1)),  # dense
        "ep2": fit(NDParallelStrategy(ep=2), 2, 2, **MOE),
        "ep2_shared_sigmoid": fit(NDParallelStrategy(ep=2), 2, 2, **SHARED_SIGMOID),
    }
    # a checkpoint written at ep2 (step 5) resumed without expert parallelism: DCP reshards the experts
    fit(NDParallelStrategy(ep=2), 2, 2, max_steps=5, ckpt_dir=ckpt_dir, ckpt_every_n_steps=5, **MOE)
    out["resumed_at_ep1"] = fit(NDParallelStrategy(), 2, 2, resume_from=f"{ckpt_dir}/step=5.ckpt", **MOE)
    for arch in HF_MOE:
        out[arch] = fit(NDParallelStrategy(ep=2), 2, 2, module_cls=HFCausalLM, arch=arch)
    return out


def _world4() -> dict:
    out = {}
    for name, (options, model) in WORLD4.items():
        out[name] = fit(NDParallelStrategy(**options), 4, options.get("dp_replicate", 1) * options["dp_shard"],
                        **model)
    return out


@pytest.fixture(scope="module")
def reference():
    return fit_reference(**MOE)


@pytest.fixture(scope="module")
def reference_shared_sigmoid():
    return fit_reference(**SHARED_SIGMOID)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return launch(2, _world2, str(tmp_path_factory.mktemp("ep_ckpt")))[0]


@pytest.fixture(scope="module")
def world4():
    return launch(4, _world4)[0]


def test_expert_parallel_world2_in_parity(world2, reference, reference_shared_sigmoid):
    assert_parity(world2["ep2"], reference)
    assert_parity(world2["ep2_shared_sigmoid"], reference_shared_sigmoid)


@pytest.mark.parametrize("arch", HF_MOE)
def test_hugging_face_mixtures_of_experts_at_ep2(world2, arch):
    """Mixtral, Qwen3-MoE, DeepSeek-V3 (latent attention, shared expert, group-limited sigmoid routing, a dense first
    layer) and gpt-oss (expert biases, attention sinks): the model's own experts forward on each rank's experts."""
    assert_parity(world2[arch], fit_reference(module_cls=HFCausalLM, arch=arch))


def test_checkpoint_from_ep2_resumes_without_expert_parallelism(world2, reference):
    assert_parity(world2["resumed_at_ep1"], reference, steps=5)


def test_bad_expert_layouts_are_refused_on_every_rank(world2):
    assert "ep=2 must divide the number of experts" in world2["ep_not_dividing_experts"]
    assert "Choose ep among [1, 3]" in world2["ep_not_dividing_experts"]
    assert "ep_plan: 'model.blocks.*.mlp.experts' matches no module" in world2["ep_plan_matching_nothing"]


@pytest.mark.parametrize("name", list(WORLD4))
def test_expert_parallel_world4_in_parity(world4, reference, reference_shared_sigmoid, name):
    assert_parity(world4[name], reference_shared_sigmoid if WORLD4[name][1] is SHARED_SIGMOID else reference)


@pytest.mark.parametrize(("sizes", "message"), [
    (dict(dp_shard=6, ep=4), "`ep=4` must divide dp_shard x cp = 6"),
    (dict(dp_shard=2, tp=2, ep=4), "Choose ep in [1, 2]"),
])
def test_ep_must_divide_the_data_and_context_ranks(sizes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("`", "`")):
        ParallelDims(**sizes).resolve(sizes.get("dp_shard", 1) * sizes.get("tp", 1))


def test_ep_refusals_at_construction():
    with pytest.raises(ValueError, match="`ep=-1` is not a valid size"):
        ParallelDims(ep=-1)
    with pytest.raises(ValueError, match="does not combine with pipeline parallelism yet"):
        NDParallelStrategy(dp_shard=2, pp=2, ep=2)


def test_rows_regrouped_from_source_rank_to_expert():
    """The dispatch's permutation: rows arrive by (source rank, local expert), the experts want (expert, source)."""
    by_source = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 source ranks x 3 local experts
    labels = [(s, e) for s in range(2) for e in range(3) for _ in range(int(by_source[s, e]))]
    order = _group_by_expert(by_source, len(labels))
    regrouped = [labels[i] for i in order.tolist()]
    assert regrouped == sorted(labels, key=lambda se: (se[1], se[0]))

"""Expert parallelism (``NDParallelStrategy(ep=...)``) on the example GPT's mixture of experts: parity with one process.

One launch per world size runs every layout in turn. fp32 on CPU, tolerance 1e-5 (measured: ~2e-7 on losses and
~5e-7 on weights after 10 AdamW steps; dropless dispatch computes every routed token as one process does, only in
other groupings). Bad input runs first in the world-2 job: its error comes on every rank before any collective, and
the job's later runs still train.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.distributed as dist
from finetune_workers import MergeAtEnd
from hf_models import HFCausalLM
from launch import launch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from workers import TINY_GPT, assert_parity, error_of, fit, fit_reference, max_weight_diff

from lightning_par import AutoParallelStrategy, ExpertBiasBalancer, NDParallelStrategy, count_dropped_choices
from lightning_par.callbacks import ExpertLoadMonitor
from lightning_par.dims import ParallelDims
from lightning_par.techniques.experts.experts import (
    TokenCounter,
    _group_by_expert,
    _TokenDispatch,
    grouped_experts,
    is_hf_experts,
    node_groups,
    runs_transformers_grouped_mm,
)

MOE = dict(n_experts=4, moe_top_k=2)
SHARED_SIGMOID = dict(n_experts=4, moe_top_k=2, moe_shared_expert=True, moe_router="sigmoid")
MOE4 = dict(n_experts=4, moe_top_k=2, n_layer=4)  # 4 blocks: 2 stages per rank for the V schedule
AUX = dict(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)  # large enough to move the routers within 10 steps
SEQUENCE_AUX = dict(moe_aux_loss_coef=0.1, moe_aux_loss="sequence")
SEQUENCE_AUX_Z = dict(**SEQUENCE_AUX, moe_z_loss_coef=0.01)
CAPACITY = dict(moe_capacity_factor=1.0)  # drops ~10 % of the tiny model's choices
CAPACITY_POSITION = dict(moe_capacity_factor=1.0, moe_token_drop_policy="position")
RATE = 1e-2  # the balancer's bias step: large enough to change routing within the 10 steps
#: transformers' mixtures of experts, unchanged: ep from their config's base_model_ep_plan
HF_MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
#: optimizer steps of the runs whose tests check parity alone (the learning rate's 3 warm-up steps and 2 of its
#: decay, every step's loss compared): Hugging Face's mixtures of experts, LoRA on experts, and the GPT layouts
#: without router losses, a balancer or a capacity. The runs whose routers must move (auxiliary losses, the bias
#: balancer), whose capacity drops tokens, the monitored ep2 run (its heat map at step 10) and the checkpoint
#: resumed at step 5 keep the usual 10
STEPS = 5
WORLD4 = {  # name -> (strategy options, model options); the pipeline layouts with the bias balancer
    "ep2_efsdp2": (dict(dp_shard=4, ep=2), MOE),
    "ep4": (dict(dp_shard=4, ep=4), MOE),
    "hsdp_ep2": (dict(dp_replicate=2, dp_shard=2, ep=2), MOE),
    "tp2_ep2_loss_parallel": (dict(dp_shard=2, tp=2, ep=2, loss_parallel=True), MOE),
    "cp2_tp2_ep2": (dict(dp_shard=1, cp=2, tp=2, ep=2), SHARED_SIGMOID),
    # and the example's auxiliary losses, counted per pipeline micro-batch over the data-parallel ranks
    "pp2_ep2_1f1b_balanced_aux": (dict(dp_shard=2, pp=2, ep=2, pp_microbatches=2), dict(**MOE4, **AUX)),
    "pp2_tp2_zbv_balanced": (dict(dp_shard=1, pp=2, tp=2, pp_schedule="zbv", pp_microbatches=2), MOE4),
    # ep borrowed from the context ranks, inside each pipeline stage
    "pp2_cp2_ep2_balanced": (dict(dp_shard=1, pp=2, cp=2, ep=2, pp_microbatches=2), MOE4),
}


class LoRAExpertsLM(HFCausalLM):
    """PEFT LoRA on attention and on the experts' stacked parameters (``target_parameters``); only adapters train."""

    def __init__(self, arch: str = "qwen3_moe", **overrides: object) -> None:
        super().__init__(arch, **overrides)
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.model, LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)


class NodesSeen(Callback):
    """How many ranks per node the expert dispatch was built with (None: one step)."""

    def on_fit_start(self, trainer, pl_module):
        nodes = trainer.strategy.expert_parallel.nodes
        self.per_node = None if nodes is None else nodes.per_node
        self.summary = trainer.strategy.expert_parallel.describe(trainer.strategy.dims)


def _monitored(log_dir: str) -> tuple[ExpertLoadMonitor, dict]:
    from lightning.pytorch.loggers import TensorBoardLogger

    monitor = ExpertLoadMonitor(log_every_n_steps=5, heatmap_every_n_steps=10)
    return monitor, dict(callbacks=[monitor], logger=TensorBoardLogger(log_dir, name="moe"))


def _world2(ckpt_dir: str) -> dict:
    monitor, logging = _monitored(ckpt_dir)
    out = {
        "ep_not_dividing_experts": error_of(lambda: fit(NDParallelStrategy(ep=2), 2, 2, n_experts=3, max_steps=1)),
        "ep_plan_matching_nothing": error_of(lambda: fit(NDParallelStrategy(ep=2), 2, 2, max_steps=1)),  # dense
        "ep2": fit(NDParallelStrategy(ep=2), 2, 2, **logging, **MOE),
        "ep2_shared_sigmoid": fit(NDParallelStrategy(ep=2), 2, 2, max_steps=STEPS, **SHARED_SIGMOID),
    }
    # a checkpoint written at ep2 (step 5) resumed without expert parallelism: DCP reshards the experts
    fit(NDParallelStrategy(ep=2), 2, 2, max_steps=5, ckpt_dir=ckpt_dir, ckpt_every_n_steps=5, **MOE)
    out["resumed_at_ep1"] = fit(NDParallelStrategy(), 2, 2, resume_from=f"{ckpt_dir}/step=5.ckpt", **MOE)
    out["ep2"]["expert_load"] = (monitor.last, monitor.last_shares, [str(p) for p in monitor.written])
    full = BackwardAllToAlls()
    out["ep2_balanced_accumulated_checkpointed"] = fit(
        NDParallelStrategy(ep=2, activation_checkpointing=True), 2, 2, accumulate_grad_batches=2,
        callbacks=[ExpertBiasBalancer(RATE), full], **MOE)
    out["ep2_balanced_accumulated_checkpointed"]["backward_all_to_alls"] = full.count
    # the example router's auxiliary losses: token counts over the global micro-batch (or each sequence)
    # selective checkpointing keeps the all-to-alls' outputs: backward runs only their reverses
    selective = BackwardAllToAlls()
    out["ep2_selective_checkpointed"] = fit(NDParallelStrategy(ep=2, activation_checkpointing="selective"), 2, 2,
                                            callbacks=[selective], max_steps=STEPS, **MOE)
    out["ep2_selective_checkpointed"]["backward_all_to_alls"] = selective.count
    out["ep2_aux_z_checkpointed"] = fit(NDParallelStrategy(ep=2, activation_checkpointing=True), 2, 2, **AUX, **MOE)
    out["cp2_sequence_aux"] = fit(NDParallelStrategy(dp_shard=1, cp=2), 2, 1, **SEQUENCE_AUX, **MOE)
    out["dp2_sequence_aux_accumulated"] = fit(NDParallelStrategy(), 2, 2, accumulate_grad_batches=2,
                                              **SEQUENCE_AUX, **MOE)
    # under pipelines: attached in every stage, scaled per pipeline micro-batch; ZBV's split backward too
    out["pp2_1f1b_aux_z"] = fit(NDParallelStrategy(dp_shard=1, pp=2, pp_microbatches=2), 2, 1, **AUX, **MOE4)
    out["pp2_zbv_sequence_aux_z_capacity"] = fit(
        NDParallelStrategy(dp_shard=1, pp=2, pp_schedule="zbv", pp_microbatches=2), 2, 1, **SEQUENCE_AUX_Z,
        **CAPACITY, **MOE4)
    # a capacity factor: each expert's room counted per sequence, the rest dropped (and logged)
    metrics = LastMetrics()
    out["ep2_capacity"] = fit(NDParallelStrategy(ep=2), 2, 2, callbacks=[metrics], **CAPACITY, **MOE)
    out["ep2_capacity"]["metrics"] = metrics.metrics
    cp_metrics = LastMetrics()  # cp splits sequences: each capacity is decided on the whole (gathered) sequence
    cp_monitor = ExpertLoadMonitor(log_every_n_steps=5, heatmap_every_n_steps=None)
    out["cp2_capacity"] = fit(NDParallelStrategy(dp_shard=1, cp=2), 2, 1, callbacks=[cp_metrics, cp_monitor],
                              **CAPACITY, **MOE)
    out["cp2_capacity"]["metrics"] = cp_metrics.metrics
    out["cp2_capacity"]["expert_load"] = cp_monitor.last
    # each block compiled: the dispatch's host sync breaks the graph, fp32 experts take the loop there
    out["ep2_compiled"] = fit(NDParallelStrategy(ep=2, compile=True), 2, 2, max_steps=STEPS, **MOE)
    # LoRA on the experts' own parameters (PEFT's target_parameters): under FSDP2 and under ep, merged and written
    out["lora_experts_fsdp2"] = fit(NDParallelStrategy(), 2, 2, module_cls=LoRAExpertsLM, arch="qwen3_moe",
                                    max_steps=STEPS)
    out["lora_experts_ep2"] = fit(NDParallelStrategy(ep=2), 2, 2, module_cls=LoRAExpertsLM, arch="qwen3_moe",
                                  callbacks=[MergeAtEnd(f"{ckpt_dir}/lora_merged")], max_steps=STEPS)
    out["lora_merged"] = f"{ckpt_dir}/lora_merged"
    # under tp (the experts whole on both ranks, attention split) and a pipeline (the adapters with their blocks)
    out["lora_experts_tp2"] = fit(NDParallelStrategy(dp_shard=1, tp=2), 2, 1, module_cls=LoRAExpertsLM,
                                  arch="qwen3_moe", max_steps=STEPS)
    out["lora_experts_pp2"] = fit(NDParallelStrategy(dp_shard=1, pp=2, pp_microbatches=2), 2, 1,
                                  module_cls=LoRAExpertsLM, arch="qwen3_moe", max_steps=STEPS)
    # the Qwen3-30B-A3B recipe's layout: ZeRO-1-like (gathered and reduced once per step) over accumulation
    out["lora_experts_ep2_zero1_accumulated"] = fit(
        NDParallelStrategy(ep=2, reshard_after_forward=False, accumulate_unsharded=True), 2, 2,
        module_cls=LoRAExpertsLM, arch="qwen3_moe", accumulate_grad_batches=2, max_steps=STEPS)
    for arch in ("qwen3_moe", "deepseek_v3"):  # experts whole on every tp rank: HF's expert tp styles left out
        out[f"{arch}_tp2"] = fit(NDParallelStrategy(dp_shard=1, tp=2), 2, 1, module_cls=HFCausalLM, arch=arch,
                                 max_steps=STEPS)
    for arch in HF_MOE:
        hf_monitor = ExpertLoadMonitor(log_every_n_steps=5, heatmap_every_n_steps=None)
        out[arch] = fit(NDParallelStrategy(ep=2), 2, 2, module_cls=HFCausalLM, arch=arch, callbacks=[hf_monitor],
                        max_steps=STEPS)
        out[arch]["expert_load"] = (hf_monitor.all_layers, hf_monitor.last_shares)
    return out


class BackwardAllToAlls(Callback):
    """How many token all-to-alls the first backward of the second step runs (its reverse all-to-alls, and those
    that activation checkpointing's recomputation runs again)."""

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == 1 and not hasattr(self, "count"):
            self.mode = CountOps(torch.ops._c10d_functional.all_to_all_single.default)
            self.mode.__enter__()

    def on_after_backward(self, trainer, pl_module):
        if getattr(self, "mode", None) is not None:
            self.mode.__exit__(None, None, None)
            self.count, self.mode = self.mode.count, None


class CountOps(TorchDispatchMode):
    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func == self.op
        return func(*args, **(kwargs or {}))


class HostSyncs(TorchDispatchMode):
    """The operators run that make a GPU wait for the host: those whose output's size or value the host must read
    (torch tags them ``dynamic_output_shape`` / ``data_dependent_output``: ``nonzero``, ``.item()``, ...), indexing by
    integer tensors excepted (only a boolean mask makes its size data-dependent). ``Tensor.tolist()`` dispatches no
    operator on the CPU and is not seen here."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tags = set(func.tags)
        if {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output} & tags and not (
                func.name().startswith("aten::index") and not any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for a in args if isinstance(a, (list, tuple)) for i in a)):
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


class LastMetrics(Callback):
    """The metrics logged in the last training step."""

    def on_train_end(self, trainer, pl_module):
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}


class ReshardsAfterForward(Callback):
    """Which FSDP units free their gathered parameters after forward (read from FSDP's own state: a test of the
    layout, through torch's private attributes, so it fails loudly if they change)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from torch.distributed.fsdp import FSDPModule

        self.units = {name: m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                      for name, m in pl_module.named_modules()
                      if name and isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None}


def _world4() -> dict:
    out = {}
    for name, (options, model) in WORLD4.items():
        check = ReshardsAfterForward()
        callbacks = [ExpertBiasBalancer(RATE)] if "balanced" in name else [check]
        out[name] = fit(NDParallelStrategy(**options), 4, options.get("dp_replicate", 1) * options["dp_shard"],
                        callbacks=callbacks, max_steps=10 if "balanced" in name else STEPS, **model)
        out[name]["reshards"] = getattr(check, "units", None)
    # the latest tokens dropped, where cp's load-balanced chunks put them out of order
    out["cp2_ep2_capacity_position"] = fit(NDParallelStrategy(dp_shard=2, cp=2, ep=2), 4, 2, **CAPACITY_POSITION,
                                           **MOE)
    # LoRA adapters whole over ep, their experts' base weights split over ep and FSDP-sharded over the other 2
    out["lora_experts_ep2_efsdp2"] = fit(NDParallelStrategy(ep=2), 4, 4, module_cls=LoRAExpertsLM, arch="qwen3_moe",
                                         max_steps=STEPS)
    # parallel folding: attention under tp, experts under ep
    out["mixtral_tp2_ep2"] = fit(NDParallelStrategy(dp_shard=2, tp=2, ep=2), 4, 2, module_cls=HFCausalLM,
                                 arch="mixtral", max_steps=STEPS)
    # ep across two nodes of 2 ranks: each token crosses once to each node holding one of its experts, then once to
    # each rank there (transformers' experts: with shared experts and group-limited routing, and LoRA on them)
    for name, module_cls, arch in (("qwen3_moe_ep4_two_nodes", HFCausalLM, "qwen3_moe"),
                                   ("deepseek_v3_ep4_two_nodes", HFCausalLM, "deepseek_v3"),
                                   ("lora_experts_ep4_two_nodes", LoRAExpertsLM, "qwen3_moe")):
        seen = NodesSeen()
        out[name] = fit(NDParallelStrategy(ep=4, ep_ranks_per_node=2), 4, 4, module_cls=module_cls, arch=arch,
                        callbacks=[seen], max_steps=STEPS)
        out[name].update(per_node=seen.per_node, summary=seen.summary)
    seen = NodesSeen()  # one host here: found from the hosts' names, one step
    fit(NDParallelStrategy(ep=4), 4, 4, module_cls=HFCausalLM, arch="qwen3_moe", callbacks=[seen], max_steps=1)
    out["one_host_per_node"] = seen.per_node
    return out


@cache
def hf_reference(arch: str) -> dict:
    return fit_reference(module_cls=HFCausalLM, arch=arch, max_steps=STEPS)


@pytest.fixture(scope="module")
def reference():
    """One process; its ExpertLoadMonitor's last report rides along (``"expert_load"``)."""
    monitor = ExpertLoadMonitor(log_every_n_steps=5, heatmap_every_n_steps=None)
    result = fit_reference(callbacks=[monitor], **MOE)
    return {**result, "expert_load": (monitor.last, monitor.last_shares)}


@pytest.fixture(scope="module")
def reference_short():
    """One process, ``STEPS`` steps."""
    return fit_reference(max_steps=STEPS, **MOE)


@pytest.fixture(scope="module")
def reference_shared_sigmoid():
    return fit_reference(max_steps=STEPS, **SHARED_SIGMOID)


@pytest.fixture(scope="module")
def reference_balanced():
    return fit_reference(callbacks=[ExpertBiasBalancer(RATE)], **MOE4)


@pytest.fixture(scope="module")
def reference_balanced_aux():
    """The global auxiliary loss counts each pipeline micro-batch: one process accumulating the two micro-batches."""
    return fit_reference(callbacks=[ExpertBiasBalancer(RATE)], micro_batches=2, **MOE4, **AUX)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return launch(2, _world2, str(tmp_path_factory.mktemp("ep_ckpt")))[0]


@pytest.fixture(scope="module")
def world4():
    return launch(4, _world4)[0]


def test_expert_parallel_world2_in_parity(world2, reference, reference_shared_sigmoid):
    assert_parity(world2["ep2"], reference)
    assert_parity(world2["ep2_shared_sigmoid"], reference_shared_sigmoid, steps=STEPS)


def test_auxiliary_losses_attach_their_gradient_as_if_added_to_the_loss():
    """One process: attach_auxiliary_loss trains the router as adding scale x the loss to the training loss does,
    and the example's balance loss is E x sum_i f_i P_i."""
    from example_projects.gpt.moe import MoE

    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, aux_loss_coef=0.5, z_loss_coef=0.1)
    moe.router.loss_scale = 0.5
    x = torch.randn(3, 8, 16)
    moe(x).square().sum().backward()
    attached = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    logits = moe.router.gate(x.reshape(-1, 16))
    probs = logits.softmax(-1)
    chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(2, dim=-1).indices, 1.0)
    balance = 4 * ((chosen.sum(0) / (24 * 2)) * probs.mean(0)).sum()
    assert torch.allclose(balance, moe.router.last_losses["aux_loss"])
    z = torch.logsumexp(logits, -1).square().mean()
    moe.router.aux_loss_coef = moe.router.z_loss_coef = 0.0
    (moe(x).square().sum() + 0.5 * (0.5 * balance + 0.1 * z)).backward()
    assert torch.allclose(moe.router.gate.weight.grad, attached, atol=1e-6)
    assert not torch.allclose(attached, moe.router.gate.weight.grad * 0)  # the losses did reach the router
    from lightning_par import attach_auxiliary_loss

    with pytest.raises(ValueError, match="loss must be a scalar tensor"):
        attach_auxiliary_loss(x, torch.ones(2))
    with pytest.raises(ValueError, match=r"scale=0 must be a positive number"):
        attach_auxiliary_loss(x, torch.ones(()), 0)


@pytest.mark.parametrize("name, model, accumulate", [
    ("ep2_aux_z_checkpointed", AUX, 1),  # counts all-reduced over the data-parallel ranks, again in recompute
    ("cp2_sequence_aux", SEQUENCE_AUX, 1),  # each sequence split over cp: its counts all-reduced over cp
    ("dp2_sequence_aux_accumulated", SEQUENCE_AUX, 2),
])
def test_router_auxiliary_losses_in_parity(world2, name, model, accumulate):
    reference = fit_reference(accumulate_grad_batches=accumulate, **model, **MOE)
    assert_parity(world2[name], reference, steps=10 * accumulate)
    plain = fit_reference(**MOE)
    assert max_weight_diff(reference["weights"], plain["weights"]) > 1e-4  # the losses changed the training


def test_router_auxiliary_losses_under_pipelines_in_parity(world2):
    """Each stage's routers attach their losses, scaled by 1 / micro-batches as the schedule scales the training loss.
    The global load-balancing loss counts each pipeline micro-batch (Megatron's choice): one process accumulating
    the same micro-batches, not one process on the whole batch (which differs by >1e-3), is its reference. The
    per-sequence loss and the z-loss do not depend on the micro-batching: one process on the whole batch."""
    micro_batched = fit_reference(micro_batches=2, **AUX, **MOE4)
    assert_parity(world2["pp2_1f1b_aux_z"], micro_batched)
    assert max_weight_diff(fit_reference(**AUX, **MOE4)["weights"], micro_batched["weights"]) > 1e-3
    assert_parity(world2["pp2_zbv_sequence_aux_z_capacity"], fit_reference(**SEQUENCE_AUX_Z, **CAPACITY, **MOE4))


def test_capacity_factor_drops_the_same_tokens_in_every_layout(world2, world4):
    """Capacities count each sequence's choices, so ep2, cp2 (which decides on the gathered sequence), cp2 x ep2
    and ZBV (above) drop what one process drops; the share dropped is logged as one process logs it, by the example
    and by the expert-load monitor (per layer, over its window and the ranks)."""
    metrics = LastMetrics()
    monitor = ExpertLoadMonitor(log_every_n_steps=5, heatmap_every_n_steps=None)
    reference = fit_reference(callbacks=[metrics, monitor], **CAPACITY, **MOE)
    for result in (world2["ep2_capacity"], world2["cp2_capacity"]):
        assert_parity(result, reference)
        dropped = result["metrics"]["train/moe_dropped"]
        assert 0.01 < dropped < 0.5 and abs(dropped - metrics.metrics["train/moe_dropped"]) < 1e-6
    logged = {k: v for k, v in world2["cp2_capacity"]["expert_load"].items() if "dropped" in k}
    alone = {k: v for k, v in monitor.last.items() if "dropped" in k}
    assert len(alone) == TINY_GPT["n_layer"] + 3 and 0.01 < alone["moe/dropped/mean"] < 0.5
    assert logged.keys() == alone.keys() and all(abs(logged[k] - alone[k]) < 1e-12 for k in alone)
    dropless = fit_reference(**MOE)["weights"]
    assert max_weight_diff(reference["weights"], dropless) > 1e-3  # dropping changed it
    by_position = fit_reference(**CAPACITY_POSITION, **MOE)
    assert_parity(world4["cp2_ep2_capacity_position"], by_position)
    assert max_weight_diff(by_position["weights"], reference["weights"]) > 1e-3  # the policies differ


def test_the_monitors_counter_sees_what_the_capacity_dropped():
    """Counted plus dropped choices per expert are the router's choices; a dropless model reports nothing."""
    from example_projects.gpt.moe import MoE

    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, capacity_factor=0.75).train()
    counter = TokenCounter([("experts", moe.experts)], torch.device("cpu"))
    x = torch.randn(3, 8, 16)
    moe(x)
    _, chosen, _ = moe.router(x.reshape(-1, 16), sequences=3)
    counts, dropped, reports = counter.summed(None)
    assert torch.equal(counts + dropped, torch.bincount(chosen.flatten(), minlength=4).double()[None])
    assert dropped.sum() == round(float(moe.last_dropped) * chosen.numel()) > 0 and reports.tolist() == [1.0]
    with torch.no_grad():  # not a training forward
        moe(x)
    counter.remove()
    moe(x)  # no longer watched
    assert counter.reports.tolist() == [1.0]
    dropless = MoE(16, 4, 2, 32).train()
    quiet = TokenCounter([("experts", dropless.experts)], torch.device("cpu"))
    dropless(x)
    assert quiet.reports.tolist() == [0.0] and quiet.dropped.sum() == 0 and quiet.counts.sum() == chosen.numel()
    with pytest.raises(TypeError, match="choices must be an integer tensor of expert indices .* got Tensor of "
                                        "torch.float32"):
        count_dropped_choices(dropless.experts, torch.zeros(3))


def test_grouped_experts_run_in_the_autocast_dtype_like_every_other_matmul():
    """torch's autocast has no rule for the grouped matmul: without the example's cast, bf16-mixed ran the experts,
    most of an MoE model's FLOPs, in fp32 (found reading the GPU benchmark's path)."""
    import torch.nn.functional as F

    from example_projects.gpt.moe import GroupedExperts

    if not hasattr(F, "grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no F.grouped_mm (the example falls back to a loop)")
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32)
    x, counts = torch.randn(12, 16), torch.tensor([5, 0, 4, 3])
    offsets = counts.cumsum(0).to(torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, counts)
        assert F.grouped_mm(x, experts.w_up, offs=offsets).dtype == torch.float32  # torch's own: no cast
    bf = [w.detach().to(torch.bfloat16) for w in (experts.w_gate, experts.w_up, experts.w_down)]
    xb = x.to(torch.bfloat16)
    expected = F.grouped_mm(F.silu(F.grouped_mm(xb, bf[0], offs=offsets)) * F.grouped_mm(xb, bf[1], offs=offsets),
                            bf[2], offs=offsets)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert experts(x, counts).dtype == torch.float32  # no autocast: fp32 as before


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_each_experts_heaviest_or_earliest_choices_per_sequence(policy):
    """Against a plain loop over sequences and experts."""
    import math

    from example_projects.gpt.moe import MoE

    torch.manual_seed(0)
    moe = MoE(16, 4, 2, 32, capacity_factor=0.75, drop_policy=policy).train()
    sequences, length, k = 3, 10, 2
    choices = torch.stack([torch.randperm(4)[:k] for _ in range(sequences * length)]).flatten()
    gates = torch.rand(sequences * length * k)
    keep = moe._within_capacity(choices, gates, sequences)
    capacity = math.ceil(0.75 * length * k / 4)
    expected = torch.zeros_like(keep)
    for seq in range(sequences):
        span = range(seq * length * k, (seq + 1) * length * k)
        for e in range(4):
            mine = [i for i in span if choices[i] == e]
            if policy == "probs":
                mine = sorted(mine, key=lambda i: -gates[i])
            expected[mine[:capacity]] = True
    assert torch.equal(keep, expected) and not keep.all()
    big = MoE(16, 4, 2, 32, capacity_factor=100.0)
    big.load_state_dict(moe.state_dict())
    dropless = MoE(16, 4, 2, 32)
    dropless.load_state_dict(moe.state_dict())
    x = torch.randn(2, 8, 16)
    assert torch.equal(big(x), dropless(x)) and float(big.last_dropped) == 0.0
    for bad, message in ((0.0, "moe_capacity_factor=0.0 must be a number > 0"),
                         ("x", "moe_capacity_factor='x' must be a number > 0")):
        with pytest.raises(ValueError, match=message):
            MoE(16, 4, 2, 32, capacity_factor=bad)
    with pytest.raises(ValueError, match=r"moe_token_drop_policy='tail': choose one of \('probs', 'position'\)"):
        MoE(16, 4, 2, 32, capacity_factor=1.0, drop_policy="tail")


def test_selective_checkpointing_keeps_the_token_all_to_alls(world2, reference_short):
    """Full checkpointing recomputes each layer's two all-to-alls in backward (communicating again) besides their two
    reverses; selective checkpointing keeps their outputs: only the reverses (and it trains in parity)."""
    layers = TINY_GPT["n_layer"]
    assert world2["ep2_balanced_accumulated_checkpointed"]["backward_all_to_alls"] == 4 * layers  # full
    assert world2["ep2_selective_checkpointed"]["backward_all_to_alls"] == 2 * layers
    assert_parity(world2["ep2_selective_checkpointed"], reference_short, steps=STEPS)


def test_expert_parallel_with_compiled_blocks_in_parity(world2, reference_short):
    assert_parity(world2["ep2_compiled"], reference_short, steps=STEPS)


@pytest.mark.parametrize("arch", HF_MOE)
def test_hugging_face_mixtures_of_experts_at_ep2(world2, arch):
    """Mixtral, Qwen3-MoE, DeepSeek-V3 (latent attention, shared expert, group-limited sigmoid routing, a dense first
    layer) and gpt-oss (expert biases, attention sinks): each token sent once per rank, the experts' math of
    transformers' grouped_mm implementation on each rank's experts (``grouped_experts``)."""
    assert_parity(world2[arch], hf_reference(arch), steps=STEPS)


def test_expert_load_monitor_counts_the_global_batch(world2, reference):
    """Under ep2 the monitor reports the same tokens per expert as in one process (counted before dispatch, summed
    over the data ranks, recompute in backward not counted twice), logs per layer and draws the heat map."""
    metrics, shares, pngs = world2["ep2"]["expert_load"]
    alone_metrics, alone_shares = reference["expert_load"]
    assert torch.equal(shares, alone_shares) and shares.shape == (3, 4)  # 3 blocks x 4 experts
    assert torch.allclose(shares.sum(dim=1), torch.ones(3, dtype=torch.float64))
    assert metrics == alone_metrics and set(metrics) >= {"moe/max_over_mean/max", "moe/idle_experts/mean",
                                                      "moe/model.blocks.0.mlp.experts/max_over_mean"}
    assert 1.0 <= metrics["moe/max_over_mean/max"] <= 4.0
    assert [p.rsplit("/", 1)[-1] for p in pngs] == ["step000010.png"]


def test_expert_load_of_hugging_face_experts(world2):
    layers, shares = world2["deepseek_v3"]["expert_load"]
    assert layers == ["model.model.layers.1.mlp.experts", "model.model.layers.2.mlp.experts",
                      "model.model.layers.3.mlp.experts"]  # the first layer is dense (first_k_dense_replace=1)
    assert torch.allclose(shares.sum(dim=1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize(("name", "arch", "world"), [("qwen3_moe_tp2", "qwen3_moe", "world2"),
                                                    ("deepseek_v3_tp2", "deepseek_v3", "world2"),
                                                    ("mixtral_tp2_ep2", "mixtral", "world4")])
def test_hugging_face_experts_under_tensor_parallelism(request, name, arch, world):
    """The models' tp plans split their experts with HF's own styles (moe_tp_experts, packed_colwise): those entries
    are left out, so attention (and dense or shared MLPs) split over tp while the experts stay whole, or split by ep;
    the plan's entries for modules this config lacks (Qwen3-MoE's dense MLP) are skipped. Tolerance 1e-5 (weights
    measured ~3e-6 after 10 AdamW steps: tp splits the attention sums; these runs take ``STEPS``)."""
    assert_parity(request.getfixturevalue(world)[name], hf_reference(arch), steps=STEPS)


@pytest.fixture(scope="module")
def reference_lora_experts():
    return fit_reference(module_cls=LoRAExpertsLM, arch="qwen3_moe", max_steps=STEPS)


def test_lora_on_the_experts_parameters_trains_under_fsdp2_and_ep(world2, world4, reference_lora_experts):
    """The adapters stack every expert's rank; under ep each rank trains its experts' slice of them (kept whole),
    in parity with one process at ep2 and at ep2 x efsdp2."""
    reference = reference_lora_experts
    for result in (world2["lora_experts_fsdp2"], world2["lora_experts_ep2"], world4["lora_experts_ep2_efsdp2"]):
        assert_parity(result, reference, steps=STEPS)
    trained = {k: v for k, v in world2["lora_experts_ep2"]["weights"].items() if "experts" in k and "lora_B" in k}
    assert {".experts.lora_B", ".experts.base_layer.lora_B"} == {k[k.index(".experts"):k.index("lora_B") + 6]
                                                                  for k in trained}  # both stacked parameters
    assert all(v.abs().max() > 1e-3 for v in trained.values())  # B starts at zero


@pytest.mark.parametrize("name", ["lora_experts_tp2", "lora_experts_pp2"])
def test_lora_on_the_experts_parameters_trains_under_tp_and_pp(world2, reference_lora_experts, name):
    """tp2 leaves the experts (and their adapters) whole on both ranks while attention and its adapters split; pp2
    carries each block's adapters to its stage (2 micro-batches of equal size: their mean is the batch's)."""
    assert_parity(world2[name], reference_lora_experts, steps=STEPS)


def test_lora_on_the_experts_under_ep_zero1_with_accumulation(world2):
    """The Qwen3-30B-A3B recipe's layout at world 2: ep2, FSDP2 gathered and reduced once per optimizer step
    (``reshard_after_forward=False, accumulate_unsharded=True``) over 2 accumulated batches, LoRA on the experts."""
    reference = fit_reference(module_cls=LoRAExpertsLM, arch="qwen3_moe", accumulate_grad_batches=2, max_steps=STEPS)
    assert_parity(world2["lora_experts_ep2_zero1_accumulated"], reference, steps=2 * STEPS)  # a loss per batch


def test_lora_on_experts_merged_from_ep2_loads_with_from_pretrained(world2, reference_lora_experts):
    """save_hf_pretrained from the ep2 run folds the experts' adapters into their stacked weights."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(world2["lora_merged"]).eval()
    peft_model = LoRAExpertsLM()
    peft_model.load_state_dict(reference_lora_experts["weights"])
    probe = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (merged(input_ids=probe).logits - peft_model.eval()(probe)).abs().max() <= 1e-5


@pytest.mark.parametrize("transposed", [False, True])
def test_expert_lora_factors_of_a_slice_are_pefts_update_of_those_experts(transposed):
    """The slice expert parallelism computes equals PEFT's own ``get_delta_weight`` there, for both layouts PEFT
    stores (experts, in, out) and (experts, out, in) parameters in: fails if PEFT changes how it stacks adapters."""
    from peft import LoraConfig, get_peft_model

    from lightning_par.parallel.lora import active_expert_adapters, expert_lora_factors, unwrap_param_wrappers

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 6, 5))
            if transposed:  # transformers' mark of experts stored (experts, in, out)
                self.is_transposed = True

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts, self.head = Experts(), torch.nn.Linear(3, 3)

    torch.manual_seed(0)
    model = get_peft_model(Model(), LoraConfig(r=3, target_parameters=["experts.w"], init_lora_weights=False))
    (wrapper,), core = unwrap_param_wrappers(model.base_model.model.experts)
    assert core.w.shape == (4, 6, 5)
    ((lora_a, lora_b, scaling),) = active_expert_adapters(wrapper)
    lhs, rhs = expert_lora_factors(wrapper, lora_a, lora_b, first=2, count=2)
    expected = wrapper.get_delta_weight("default")[2:4]
    assert expected.abs().max() > 0.1 and (scaling * lhs @ rhs - expected).abs().max() <= 1e-6


def test_checkpoint_from_ep2_resumes_without_expert_parallelism(world2, reference):
    assert_parity(world2["resumed_at_ep1"], reference, steps=5)


def test_bad_expert_layouts_are_refused_on_every_rank(world2):
    assert "ep=2 must divide the number of experts" in world2["ep_not_dividing_experts"]
    assert "Choose ep among [1, 3]" in world2["ep_not_dividing_experts"]
    assert "ep_plan: 'model.blocks.*.mlp.experts' matches no module" in world2["ep_plan_matching_nothing"]


@pytest.mark.parametrize("name", list(WORLD4))
def test_expert_parallel_world4_in_parity(world4, reference_short, reference_shared_sigmoid, reference_balanced,
                                          reference_balanced_aux, name):
    """Also the router biases the balancer moved (in the weights), under 1F1B x ep2 and ZBV x tp2: each pipeline
    rank updates its own layers' biases from the global batch's counts (not the shape-inference forward's)."""
    expected = {"pp2_tp2_zbv_balanced": reference_balanced, "pp2_cp2_ep2_balanced": reference_balanced,
                "cp2_tp2_ep2": reference_shared_sigmoid,
                "pp2_ep2_1f1b_balanced_aux": reference_balanced_aux}
    assert_parity(world4[name], expected.get(name, reference_short), steps=10 if "balanced" in name else STEPS)


@pytest.mark.parametrize("name", ["qwen3_moe_ep4_two_nodes", "deepseek_v3_ep4_two_nodes", "lora_experts_ep4_two_nodes"])
def test_expert_parallel_across_nodes_dispatches_in_two_steps_in_parity(world4, reference_lora_experts, name):
    """ep 4 as two nodes of 2 ranks (``ep_ranks_per_node=2``): between nodes once per node, inside them once per
    rank; the start-up summary says so; losses and weights are one process's (Qwen3-MoE, DeepSeek-V3 with its
    shared expert and group-limited routing, LoRA on Qwen3-MoE's experts). On one host, left to find the nodes, the
    dispatch is one step."""
    result = world4[name]
    assert result["per_node"] == 2 and "once per node across 2 nodes" in result["summary"], result["summary"]
    arch = "deepseek_v3" if name.startswith("deepseek") else "qwen3_moe"
    assert_parity(result, reference_lora_experts if name.startswith("lora") else hf_reference(arch), steps=STEPS)
    assert world4["one_host_per_node"] is None


def test_the_ranks_of_an_ep_group_per_host():
    """From every rank's host name: consecutive ranks of each ep group on one host, as many on each, else 1."""
    from lightning_par.techniques.experts.expert_parallel import _ranks_per_host

    two_nodes = ["a"] * 4 + ["b"] * 4
    assert _ranks_per_host([[0, 1, 2, 3, 4, 5, 6, 7]], two_nodes) == 4
    assert _ranks_per_host([[0, 2, 4, 6], [1, 3, 5, 7]], two_nodes) == 2  # tp 2 inside: every other rank
    assert _ranks_per_host([[0, 1, 2, 3]], two_nodes) == 4  # within one node
    assert _ranks_per_host([[0, 4, 1, 5]], two_nodes) == 1  # alternating hosts: one step
    assert _ranks_per_host([[0, 1, 2, 3, 4, 5]], ["a"] * 4 + ["b"] * 2) == 1  # uneven
    assert _ranks_per_host([[0, 1, 2, 3], [4, 5, 6, 7]], ["a", "a", "b", "b"] + ["c"] * 4) == 1  # the 2nd group
    with pytest.raises(ValueError, match=r"ep group \[2, 0\] must list its ranks in increasing order"):
        node_groups([[2, 0]], 1)


def test_experts_units_reshard_after_forward_as_the_blocks_do(world4):
    """Each experts module is an FSDP unit of its own over efsdp: it frees its gathered experts after forward like
    every block but the last (which backward needs at once); it used to keep them gathered (ZeRO-2-like)."""
    units = world4["ep2_efsdp2"]["reshards"]
    experts = {k: v for k, v in units.items() if k.endswith("mlp.experts")}
    assert len(experts) == TINY_GPT["n_layer"] and all(experts.values()), units
    blocks = sorted(k for k in units if k.startswith("model.blocks.") and k.count(".") == 2)
    assert [units[b] for b in blocks] == [True] * (len(blocks) - 1) + [False], units


def test_bias_balancer_under_gradient_accumulation_and_checkpointing(world2):
    """The biases move once per optimizer step from every micro-batch's tokens, not from recomputed forwards."""
    reference = fit_reference(callbacks=[ExpertBiasBalancer(RATE)], accumulate_grad_batches=2, **MOE)
    result = world2["ep2_balanced_accumulated_checkpointed"]
    assert_parity(result, reference, steps=20)
    biases = [v for k, v in result["weights"].items() if k.endswith("expert_bias")]
    assert len(biases) == 3 and all(b.abs().max() > 0 for b in biases)  # the balancer did move them


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
    with pytest.raises(ValueError, match=r"ep_ranks_per_node=3 must divide ep=4.*\[1, 2, 4\]"):
        NDParallelStrategy(ep=4, ep_ranks_per_node=3)
    with pytest.raises(ValueError, match=r"ep_ranks_per_node"):
        NDParallelStrategy(ep=4, ep_ranks_per_node=0)
    # auto_parallel chooses ep in setup (then checks it against the given value)
    assert AutoParallelStrategy(ep_ranks_per_node=2).expert_parallel.ranks_per_node == 2
    with pytest.raises(ValueError, match=r"moe_top_k=5 must be between 1 and n_experts=4"):
        from example_projects.gpt.lit import GPTModule

        GPTModule(n_experts=4, moe_top_k=5).configure_model()
    with pytest.raises(ValueError, match=r"n_experts=-2 must be an int >= 0"):
        GPTModule(n_experts=-2)
    with pytest.raises(ValueError, match=r"update_rate=0\) must be a positive number"):
        ExpertBiasBalancer(update_rate=0)


def test_rows_regrouped_from_source_rank_to_expert():
    """The dispatch's permutation: rows arrive by (source rank, local expert), the experts want (expert, source)."""
    by_source = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 source ranks x 3 local experts
    labels = [(s, e) for s in range(2) for e in range(3) for _ in range(int(by_source[s, e]))]
    order = _group_by_expert(by_source, len(labels))
    regrouped = [labels[i] for i in order.tolist()]
    assert regrouped == sorted(labels, key=lambda se: (se[1], se[0]))


def _per_rank_dispatch(tokens: int, k: int, experts: int, per_node: int | None = None) -> dict:
    """One rank of an ep group of the whole world: its tokens (own seed) through the per-rank dispatch (across
    nodes of ``per_node`` ranks: between them, then inside), an expert as a matrix, and the combine; the same sum
    computed here without sending anything."""
    dist.init_process_group("gloo")
    try:
        rank, ep, hidden = dist.get_rank(), dist.get_world_size(), 4
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
        weights, index = torch.rand(tokens, experts, generator=gen).softmax(-1).topk(k, dim=1)
        weights = weights.detach().requires_grad_()
        maps = torch.randn(experts, hidden, hidden, generator=torch.Generator().manual_seed(99))  # every rank's
        local = experts // ep
        nodes = None if per_node is None else node_groups([list(range(ep))], per_node)
        dispatch = _TokenDispatch(dist.group.WORLD, ep, nodes)
        mine = maps[rank * local:(rank + 1) * local]
        grad = torch.randn(tokens, hidden, generator=gen)
        with HostSyncs() as syncs:
            sent = dispatch.send_tokens(x, index, weights, local)
            out = torch.bmm(sent.expert_rows.unsqueeze(1), mine[sent.expert_index[:, 0]]).squeeze(1)
            y = dispatch.combine_tokens(out, sent, x)
            y.backward(grad)
        x_ref, w_ref = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
        y_ref = torch.einsum("tk,tkh->th", w_ref, torch.einsum("th,tkhg->tkg", x_ref, maps[index]))
        y_ref.backward(grad)
        per_place = local * (per_node or 1)  # the experts of one rank, or across nodes of one node
        places_of_token = [len(set((index[t] // per_place).tolist())) for t in range(tokens)]
        inside_rows = inside_pairs = 0
        if per_node is not None:  # the forwarded rows: one per arrived row and rank of this node holding a choice
            arrived = sent.exchanges[0].choices[:, k:].long()
            inside_pairs = sum(len(set((row[row >= 0] // local).tolist())) for row in arrived)
            inside_rows = sum(sent.exchanges[1].input_splits)
        return {"y": (y - y_ref).abs().max().item(), "x_grad": (x.grad - x_ref.grad).abs().max().item(),
                "w_grad": (weights.grad - w_ref.grad).abs().max().item(),
                "sent_rows": sum(sent.exchanges[0].input_splits), "exchanges": len(sent.exchanges),
                "inside_rows": inside_rows, "inside_pairs": inside_pairs,
                "pairs": sum(places_of_token), "choices": tokens * k, "expert_rows": sent.expert_rows.shape[0],
                "grouped": bool((sent.expert_index[1:] >= sent.expert_index[:-1]).all()), "host_syncs": syncs.ops}
    finally:
        dist.destroy_process_group()


def test_hugging_face_experts_get_each_token_once_per_rank():
    """The per-rank dispatch of transformers' experts sends a token to a rank once, whatever number of its choices
    that rank holds (DeepEP's deduplication), copies it per choice on arrival, grouped by local expert, and brings
    back one weighted sum per token and rank: the output and the gradients of the tokens and of the routing
    weights are those of the sum computed in one place (fp32, 1e-6). Forward and backward run no operator that
    waits for the host (no ``nonzero``): the split sizes' ``tolist()`` is the dispatch's one host sync, as in
    torchtitan's."""
    ranks = launch(2, _per_rank_dispatch, 16, 3, 4)
    for rank in ranks:
        assert max(rank["y"], rank["x_grad"], rank["w_grad"]) < 1e-6, rank
        assert rank["sent_rows"] == rank["pairs"] < rank["choices"], rank  # 3 choices over 2 ranks: at most 2
        assert rank["grouped"], rank
        assert rank["host_syncs"] == [], rank
    with HostSyncs() as control:  # what the recorder sees: a nonzero, a boolean mask, an item
        x = torch.tensor([1.0, 0.0])
        x.nonzero(), x[x > 0], x.sum().item(), x[torch.tensor([1])]
    assert control.ops == ["aten::nonzero", "aten::index.Tensor", "aten::_local_scalar_dense"], control.ops
    assert sum(r["expert_rows"] for r in ranks) == sum(r["choices"] for r in ranks)  # every choice computed once


def test_across_nodes_a_token_crosses_once_per_node_and_is_forwarded_inside_it():
    """An ep group of 4 ranks as 2 nodes of 2 (``NodeGroups``): a token goes to each node holding one of its
    experts once, to the rank of its own place there, which forwards it once to each rank of the node holding one;
    output and gradients are the one-place sum's (fp32, 1e-6), every choice is computed once, and no operator waits
    for the host (the two exchanges' split sizes are the two host syncs)."""
    ranks = launch(4, _per_rank_dispatch, 16, 3, 8, 2)
    for rank in ranks:
        assert max(rank["y"], rank["x_grad"], rank["w_grad"]) < 1e-6, rank
        assert rank["exchanges"] == 2, rank
        assert rank["sent_rows"] == rank["pairs"] < rank["choices"], rank  # rows between nodes: one per node
        assert rank["inside_rows"] == rank["inside_pairs"] > 0, rank  # inside: one per row and rank
        assert rank["grouped"], rank
        assert rank["host_syncs"] == [], rank
    assert sum(r["expert_rows"] for r in ranks) == sum(r["choices"] for r in ranks)


def _experts_of(arch: str) -> torch.nn.Module:
    """A tiny model's first experts module, or for the kinds no tiny model here has, the experts module alone:
    NemotronH's (no gate: up and down projections) and MuseSpark's (a norm after each expert)."""
    import transformers

    if arch == "nemotron_h_experts":
        module = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h",
                                     reason="this transformers has no NemotronH")
        NemotronHExperts = getattr(module, "NemotronHExperts", None)
        if NemotronHExperts is None:
            pytest.skip("this transformers' NemotronH has no experts module")
        config = transformers.NemotronHConfig(hidden_size=32, moe_intermediate_size=48, n_routed_experts=4,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        cls = NemotronHExperts
    elif arch == "muse_spark_experts":
        module = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark",
                                     reason="this transformers has no MuseSpark")
        MuseSparkExperts = module.MuseSparkExperts
        config = transformers.MuseSparkTextConfig(moe_hidden_size=32, moe_intermediate_size=48, num_local_experts=4,
                                                  hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=8)
        cls = MuseSparkExperts
    else:
        return next(m for m in HFCausalLM(arch).model.modules() if is_hf_experts(m))
    config._experts_implementation = "grouped_mm"
    return cls(config)


@pytest.mark.parametrize("arch", [*HF_MOE, "nemotron_h_experts", "muse_spark_experts"])
def test_grouped_experts_compute_what_transformers_grouped_mm_forward_does(arch):
    """Under ep the engine runs transformers' experts on rows the dispatch already grouped by expert
    (``grouped_experts``): the outputs and gradients of transformers' own ``grouped_mm`` forward on the same rows,
    each routing weight 1 (a change of that forward in a new transformers fails here); gated and ungated experts,
    biases, transposed and interleaved weights, a norm after the expert."""
    torch.manual_seed(0)
    experts = _experts_of(arch)
    assert runs_transformers_grouped_mm(experts), experts.config._experts_implementation
    for p in experts.parameters():  # biases too: zeros at init would hide a missing bias
        torch.nn.init.normal_(p, std=0.5)
    first = experts.gate_up_proj if experts.has_gate else experts.up_proj
    index = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    rows = torch.randn(len(index), first.shape[1 if experts.is_transposed else -1], requires_grad=True)
    ours = grouped_experts(experts, rows, index)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    mine = [rows.grad.clone()] + [p.grad.clone() for p in experts.parameters()]
    rows.grad = None
    experts.zero_grad()
    theirs = experts(rows, index.unsqueeze(1), torch.ones(len(index), 1))
    theirs.backward(grad)
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-6)
    for a, b in zip(mine, [rows.grad] + [p.grad for p in experts.parameters()]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-6)

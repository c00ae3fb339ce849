"""The FLOP count behind ``perf/tflops_per_s`` and ``perf/mfu``: hand counts, the transformer formula, Hugging Face
models of four families against torch's own ``FlopCounterMode`` (and the planner's trace), the peak table, and real
runs (one process and two) whose logged metrics are read back.

Convention tested against the formula: N = every parameter except the embedding tables (token and position), i.e.
the parameters that multiply something for each token (the untied head included). The count itself sees only
matmuls and attention, so biases and norm weights are N's only excess over it: well under 1 % at these widths.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import flops_workers as FW
import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from launch import launch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from example_projects.gpt.lit import GPTModule
from example_projects.gpt.model import GPT, GPTConfig
from lightning_par.callbacks import DeviceUtilizationMonitor
from lightning_par.callbacks.flops import (
    FlopsPerBatch,
    _tracing_types,
    count_training_flops,
    lookup_peak_flops,
    precision_kind,
)


def linear_weights(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def non_embedding_params(model: nn.Module) -> int:
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedding)


# ---------------------------------------------------------------------------------------------------------------
# the count against hand counts and the formula
# ---------------------------------------------------------------------------------------------------------------
def test_mlp_count_is_the_hand_count():
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    forward = 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4  # two matmuls of 2*m*k*n (bias adds are not counted)
    assert count_training_flops(lambda: mlp(x).sum().backward()) == 3 * forward
    # torch's FlopCounterMode counts what ran: the first layer's input needs no gradient, so one matmul less.
    # Model FLOPs (the MFU convention) count backward as 2 x forward regardless.
    with FlopCounterMode(display=False) as ran:
        mlp(x).sum().backward()
    assert ran.get_total_flops() == 3 * forward - 2 * 8 * 16 * 32


def gpt_count(cfg: GPTConfig, batch: int, wrap: Any = None) -> tuple[GPT, int]:
    torch.manual_seed(0)
    model = GPT(cfg)
    if wrap is not None:
        model.blocks = nn.ModuleList(wrap(b) for b in model.blocks)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    return model, count_training_flops(lambda: F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward())


def test_gpt_count_matches_6NT_plus_12LdsT():
    cfg = GPTConfig()  # the example's defaults: vocab 96, 4 layers, width 128, sequence 128
    batch = 2
    model, count = gpt_count(cfg, batch)
    L_, d, s = cfg.n_layer, cfg.n_embd, cfg.block_size
    tokens = batch * s
    attention = 12 * L_ * d * s * tokens  # QK^T and AV: 4*d*s per token and layer forward, x3 (causal not halved)
    # exact: the matmul weights and full attention, forward x 3
    assert count == 6 * linear_weights(model) * tokens + attention
    formula = 6 * non_embedding_params(model) * tokens + attention
    assert count == pytest.approx(formula, rel=0.05)
    assert count < formula  # biases and norm weights are in N but multiply nothing
    assert attention / count > 0.1  # the attention term is really there


def test_grouped_query_attention_counts_every_query_head():
    """SDPA with fewer key/value heads (``enable_gqa``, as transformers 5 calls it): the arithmetic of every query
    head. torch 2.11's own formula refuses these shapes; the table's formula counts them on any torch."""
    q = torch.randn(2, 8, 16, 24, requires_grad=True)
    k, v = torch.randn(2, 2, 16, 24, requires_grad=True), torch.randn(2, 2, 16, 12, requires_grad=True)
    count = count_training_flops(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum().backward())
    assert count == 3 * (2 * 2 * 8 * 16 * 16 * 24 + 2 * 2 * 8 * 16 * 16 * 12)  # Q K^T and P V, x 3


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_recomputation_is_not_counted(reentrant):
    cfg = GPTConfig(n_layer=2, n_embd=64, block_size=32)
    _, plain = gpt_count(cfg, 2)
    model, checkpointed = gpt_count(cfg, 2, wrap=lambda b: Checkpointed(b, reentrant))
    assert checkpointed == plain
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with FlopCounterMode(display=False) as ran:  # what the hardware does: the blocks' forward twice
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    assert ran.get_total_flops() > plain


def test_compiled_module_is_counted_and_stays_compiled():
    import torch._dynamo  # private, test only: whether frames were compiled

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    eager = count_training_flops(lambda: mlp(x).sum().backward())
    compiled = torch.compile(mlp)
    assert count_training_flops(lambda: compiled(x).sum().backward()) == eager
    # the counter let torch.compile compile (a mode that does not would also stop it compiling later on)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    torch._dynamo.reset()


def test_tracing_tensor_types_still_import():
    """flops.py leaves ops on FakeTensor/FunctionalTensor uncounted (DTensor's sharding propagation runs them):
    private torch classes, so this fails loudly if torch moves them."""
    fake, functional = _tracing_types()
    assert issubclass(fake, torch.Tensor) and issubclass(functional, torch.Tensor)


def test_later_batches_scale_by_tokens_else_samples():
    est = FlopsPerBatch(1000.0, tokens=100, samples=4, source="counted")
    assert est(tokens=50, samples=2) == 500.0
    assert FlopsPerBatch(1000.0, tokens=None, samples=4, source="counted")(tokens=None, samples=3) == 750.0
    assert FlopsPerBatch(1000.0, tokens=None, samples=None, source="counted")(tokens=None, samples=None) == 1000.0


# ---------------------------------------------------------------------------------------------------------------
# peak FLOP/s
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 80GB HBM3", "tf32", 494e12),
        ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
        ("NVIDIA H100 PCIe", "fp16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA H200 NVL", "fp16", 835e12),
        ("NVIDIA GH200 480GB", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA A10G", "bf16", 125e12),
        ("NVIDIA A10", "fp32", 31.2e12),
        ("Tesla T4", "fp16", 65e12),
        ("Tesla T4", "bf16", None),  # Turing has no bf16 tensor cores
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),
        ("Tesla V100-PCIE-32GB", "fp16", 112e12),
        ("Tesla V100S-PCIE-32GB", "fp16", 130e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Some CPU", "bf16", None),
    ],
)
def test_peak_table(name, precision, peak):
    assert lookup_peak_flops(name, precision) == peak


def test_precision_column():
    assert precision_kind("bf16-mixed") == precision_kind("bf16-true") == "bf16"
    assert precision_kind("16-mixed") == "fp16"
    assert precision_kind("64-true") is None and precision_kind("transformer-engine") is None
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert precision_kind("32-true") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert precision_kind("32-true") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_count_flops_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`count_flops`.*'yes'"):
        DeviceUtilizationMonitor(count_flops="yes")


# ---------------------------------------------------------------------------------------------------------------
# one process, real Trainer runs
# ---------------------------------------------------------------------------------------------------------------
class Regression(Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class MLPModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.mlp(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(root: str, module: L.LightningModule, data: Any, callbacks: list, steps: int = 6) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=2, callbacks=callbacks,
        logger=CSVLogger(root, name="csv", version=0), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
    )
    trainer.fit(module, data)
    trainer.logger.finalize("success")
    return trainer


def assert_tflops_logged(metrics: dict[str, dict[int, float]], flops: float, steps: list[int]) -> None:
    """perf/tflops_per_s = FLOPs per batch / step time, at every logging step."""
    assert sorted(metrics["perf/tflops_per_s/max"]) == steps
    for step in steps:
        fastest = metrics["perf/step_time_s/min"][step]
        assert metrics["perf/tflops_per_s/max"][step] == pytest.approx(flops / fastest / 1e12, rel=1e-5)


def test_monitor_counts_an_mlp_and_logs_tflops(tmp_path, caplog):
    monitor = DeviceUtilizationMonitor(log_every_n_steps=2)
    with caplog.at_level(logging.INFO):
        fit(str(tmp_path), MLPModule(), DataLoader(Regression(), batch_size=8), [monitor])
    hand = 3 * (2 * 8 * 16 * 32 + 2 * 8 * 32 * 4)
    assert monitor.flops_source == "counted" and monitor.flops_estimate.flops == hand
    note = "flops: counted on batch 0 (torch FlopCounterMode formulas"
    assert note in monitor.flops_note and "peak: none on cpu" in monitor.flops_note
    assert note in caplog.text  # the start-up output says how the count was obtained
    metrics = FW.read_csv_metrics(str(tmp_path / "csv" / "version_0" / "metrics.csv"))
    assert_tflops_logged(metrics, hand, [2, 4, 6])
    assert not any(k.startswith("perf/mfu") for k in metrics)  # no peak on a CPU


def test_monitor_logs_mfu_with_a_given_peak_and_nothing_when_told_not_to_count(tmp_path):
    with_peak = DeviceUtilizationMonitor(log_every_n_steps=2, peak_flops_per_device=1e11)
    fit(str(tmp_path / "a"), MLPModule(), DataLoader(Regression(), batch_size=8), [with_peak])
    m = FW.read_csv_metrics(str(tmp_path / "a" / "csv" / "version_0" / "metrics.csv"))
    for step, tflops in m["perf/tflops_per_s/max"].items():
        assert m["perf/mfu/max"][step] == pytest.approx(tflops * 1e12 / 1e11, rel=1e-6)
    off = DeviceUtilizationMonitor(log_every_n_steps=2, count_flops=False)
    fit(str(tmp_path / "b"), MLPModule(), DataLoader(Regression(), batch_size=8), [off])
    m = FW.read_csv_metrics(str(tmp_path / "b" / "csv" / "version_0" / "metrics.csv"))
    assert "perf/step_time_s/max" in m and not any(k.startswith(("perf/tflops", "perf/mfu")) for k in m)
    assert off.flops_source is None and off.flops_estimate is None


def test_counting_does_not_change_training(tmp_path):
    """Dropout on, so any extra forward or random draw would show in the weights."""
    def train(count: bool) -> tuple[dict[str, torch.Tensor], DeviceUtilizationMonitor]:
        L.seed_everything(0)
        module = GPTModule(**{**FW.GPT_ARGS, "dropout": 0.2})
        monitor = DeviceUtilizationMonitor(log_every_n_steps=2, count_flops=count)
        fit(str(tmp_path / str(count)), module, DataLoader(FW.TokenData(), batch_size=FW.BATCH), [monitor], steps=4)
        return {k: v.detach().clone() for k, v in module.state_dict().items()}, monitor

    counted, monitor = train(True)
    assert monitor.flops_estimate is not None  # it did count
    plain, _ = train(False)
    assert counted.keys() == plain.keys()
    assert all(torch.equal(counted[k], plain[k]) for k in counted)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face models: counted like any other model, against torch's FlopCounterMode over the same real step
# ---------------------------------------------------------------------------------------------------------------
#: one tiny model per family (tests/hf_models.py's configs): dense; a mixture of experts (8 experts, 2 routed per
#: token); multi-head latent attention (DeepSeek-V3: also a shared expert, a dense first layer, group-limited
#: routing); hybrid attention (gpt-oss: sliding-window and full layers with sinks, eager attention, experts)
HF_FAMILIES = {"dense": ("qwen2", {}), "moe": ("qwen3_moe", {"num_experts": 8}),
               "mla": ("deepseek_v3", {"n_routed_experts": 8}), "hybrid": ("gpt_oss", {"num_local_experts": 8})}
HF_LAYERS = 2  # gpt-oss: a sliding-window layer and a full one; DeepSeek-V3: a dense layer and a mixture
HF_BATCH, HF_SEQ = 4, 16


def grouped_mm_flops(a: Any, b: Any, *_: Any, **__: Any) -> int:
    """Shapes of ``torch._grouped_mm(a, b, offs)`` as the experts run it: 2-D x 3-D, the routed rows (grouped by
    expert) times their expert's weight; 2-D x 2-D, the weights' gradient (groups along the shared rows). Either
    way one multiply-add per row, shared element and column: the weights of experts that got no rows do nothing."""
    return 2 * a[0] * a[1] * (b[2] if len(b) == 3 else b[1])


def attention_flops(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    """A fused attention forward, ``(batch, heads, sequence, width)``: ``Q K^T`` and ``P V`` for every query head."""
    return 2 * q[0] * q[1] * q[2] * k[2] * (q[3] + v[3])


def attention_backward_flops(grad: Any, q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    """Its backward as torch prices the flash kernel's: the scores again, then dP, dV, dQ and dK."""
    return 2 * q[0] * q[1] * q[2] * k[2] * (3 * q[3] + 2 * v[3])


def torch_lacks() -> dict[Any, Any]:
    """FlopCounterMode's ``custom_mapping`` (shape formulas) for the ops these models run that its table has no
    entry for (torch 2.13): the CPU flash-attention kernel, forward and backward (torch 2.13's formulas for the CUDA
    flash kernel, written out above), and the experts' grouped matmuls (written here, apart from the monitor's
    table); transformers' own loop for grouped matmuls where it runs. Where torch's formulas for the CUDA kernels
    refuse grouped-query shapes (torch 2.11), the same formulas stand in for them."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops,
        aten._grouped_mm: grouped_mm_flops,
    }
    try:
        flop_registry[aten._scaled_dot_product_flash_attention]((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
    except AssertionError:
        for kernel in ("flash", "efficient", "cudnn"):
            mapping[getattr(aten, f"_scaled_dot_product_{kernel}_attention")] = attention_flops
            mapping[getattr(aten, f"_scaled_dot_product_{kernel}_attention_backward")] = attention_backward_flops
    ops = getattr(torch.ops, "transformers", None)
    if hasattr(ops, "grouped_mm_fallback"):
        mapping[ops.grouped_mm_fallback] = grouped_mm_flops
    if hasattr(ops, "grouped_mm_fallback_backward"):  # transformers 5.24 (input and weight gradients)
        mapping[ops.grouped_mm_fallback_backward] = lambda a, b, *_, **__: 2 * grouped_mm_flops(a, b)
    return mapping


def hf_module(family: str, **overrides: Any) -> L.LightningModule:
    pytest.importorskip("transformers")
    from hf_models import HFCausalLM

    arch, extra = HF_FAMILIES[family]
    torch.manual_seed(0)
    return HFCausalLM(arch, optimizer="sgd", **{"num_hidden_layers": HF_LAYERS, **extra, **overrides})


def hf_batches() -> DataLoader:
    from workers import token_dataset

    return DataLoader(token_dataset(num_samples=32, seq_len=HF_SEQ), batch_size=HF_BATCH)


def hf_step(module: L.LightningModule, batch: Any) -> torch.Tensor:
    x, y = batch
    return module.loss(module(x), y)


def torch_count(module: L.LightningModule, batch: Any) -> int:
    """What torch's FlopCounterMode counts over one training step (forward + backward) of ``module``."""
    with FlopCounterMode(display=False, custom_mapping=torch_lacks()) as ran:
        hf_step(module, batch).backward()
    module.zero_grad()
    return ran.get_total_flops()


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hugging_face_models_are_counted_as_torch_counts_them(tmp_path, caplog, family):
    """The FLOPs behind perf/tflops_per_s and perf/mfu, from a real fit, within 5 % of torch's FlopCounterMode over
    the same first step of the same weights. torch counts what ran: its fused-attention backward recomputes the
    scores (2.5 x the forward, model FLOPs 2 x), so it is up to 2 % above on the SDPA models and equal on the eager
    one (gpt-oss: its attention sinks have no SDPA path). Measured: 0.984 dense, 0.985 MoE, 0.987 MLA, 1 hybrid."""
    import copy

    module = hf_module(family)
    same = copy.deepcopy(module)  # the weights of the counted step: the fit changes them after it
    reference = torch_count(same, next(iter(hf_batches())))
    monitor = DeviceUtilizationMonitor(log_every_n_steps=2)
    with caplog.at_level(logging.INFO):
        fit(str(tmp_path), module, hf_batches(), [monitor], steps=2)
    flops = monitor.flops_estimate.flops
    assert monitor.flops_source == "counted" and "counted on batch 0" in caplog.text
    assert flops == pytest.approx(reference, rel=0.05)
    # the gap is torch's attention recomputation (so at most 2 % here) and, the other way, the matmuls that need no
    # gradient (transformers 5.17's rotary angles: x 3 in model FLOPs, x 1 in torch's count, 256 FLOPs here)
    assert 0.98 * reference <= flops <= 1.0001 * reference
    metrics = FW.read_csv_metrics(str(tmp_path / "csv" / "version_0" / "metrics.csv"))
    assert_tflops_logged(metrics, flops, [2])


def expert_implementations() -> list[str]:
    pytest.importorskip("transformers")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager"] + [name for name in ("grouped_mm", "batched_mm") if name in ALL_EXPERTS_FUNCTIONS]


def test_a_mixture_of_experts_counts_its_routed_experts_only():
    """Qwen3-MoE, 8 experts, 2 routed per token: exactly the hand count of what ran (attention, the dense matmuls,
    and 2 experts' matmuls per token), however transformers runs the experts (a loop over the experts that received
    tokens, ``torch._grouped_mm`` over the routed rows, ``bmm`` over the gathered weights); well under the
    6 x tokens x every non-embedding parameter that Hugging Face's ``floating_point_ops`` counts."""
    counts = {}
    for impl in expert_implementations():
        module = hf_module("moe", experts_implementation=impl)
        batch = next(iter(hf_batches()))
        counts[impl] = count_training_flops(lambda m=module, b=batch: hf_step(m, b).backward())
    model = module.model
    cfg = model.config
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    per_expert = experts[0].gate_up_proj[0].numel() + experts[0].down_proj[0].numel()  # one expert of one layer
    routers = [m.gate.weight for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    dense = linear_weights(model) + sum(w.numel() for w in routers)  # the routers are not nn.Linear
    tokens = HF_BATCH * HF_SEQ
    attention = 3 * cfg.num_hidden_layers * 4 * HF_BATCH * cfg.num_attention_heads * HF_SEQ**2 * cfg.head_dim
    routed = 6 * tokens * (dense + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert) + attention
    assert len(set(counts.values())) == 1, counts  # the same, whichever implementation ran
    # exact on transformers 5.24; 5.17 computes the rotary angles with a matmul too (384 FLOPs here)
    assert counts["eager"] == pytest.approx(routed, rel=1e-4)
    every_expert = 6 * tokens * non_embedding_params(model)
    assert routed < 0.45 * every_expert  # 2 of 8 experts: the experts are most of the parameters


def test_transformers_grouped_matmul_fallback_counts_routed_rows():
    """transformers' own loop for grouped matmuls (a custom op, used where ``torch._grouped_mm`` cannot run: e.g.
    compiled with fp32 weights) hides its matmuls from dispatch modes: it is priced as ``_grouped_mm``."""
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401 - registers the op

    ops = torch.ops.transformers
    if not hasattr(ops, "grouped_mm_fallback"):
        pytest.skip("this transformers has no grouped_mm_fallback op")
    rows = torch.randn(6, 8, requires_grad=True)
    weights = torch.randn(4, 8, 4, requires_grad=True)  # 4 experts, 3 of them receive rows
    offsets = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    counted = count_training_flops(lambda: ops.grouped_mm_fallback(rows, weights, offsets).square().sum().backward())
    assert counted == 3 * 2 * 6 * 8 * 4
    grouped = count_training_flops(lambda: torch._grouped_mm(rows, weights, offs=offsets).square().sum().backward())
    assert counted == grouped


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_planner_counts_what_the_monitor_counts(family):
    """The planner's trace (meta device, ``costs.profile``) prices the same FLOPs: routed experts only (its
    grouped matmuls see the routed rows), attention included."""
    from lightning_par.costs.profile import profile_model

    module = hf_module(family)
    batch = next(iter(hf_batches()))
    counted = count_training_flops(lambda: hf_step(module, batch).backward())
    profile = profile_model(module, batch, step=hf_step)
    sections = profile.sections.values()
    attention = sum(s.attention_flops for s in sections)
    assert 3 * (sum(s.flops for s in sections) + attention) == pytest.approx(counted, rel=1e-9)
    assert attention > 0.05 * sum(s.flops for s in sections)  # attention is in both


# ---------------------------------------------------------------------------------------------------------------
# two processes: per-device FLOPs under each layout
# ---------------------------------------------------------------------------------------------------------------
def gpt_batch_flops() -> tuple[int, int]:
    """(model FLOPs of one per-rank batch of the unparallelized GPT, the attention part of it)."""
    cfg = GPTConfig(**FW.GPT_ARGS)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (FW.BATCH, FW.SEQ))
    total = count_training_flops(lambda: F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward())
    return total, 12 * cfg.n_layer * cfg.n_embd * FW.SEQ * FW.BATCH * FW.SEQ


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "cp2"])
def test_per_device_flops_under_each_layout(tmp_path, layout):
    """dp2: each rank does a whole batch of its own. tp2, pp2, cp2: the 2 ranks share one batch, so each does half
    (the mean of the two ranks' counts: pipeline stages need not be equal)."""
    results = launch(2, FW.gpt_fit, str(tmp_path), layout, timeout=240)
    full, attention = gpt_batch_flops()
    flops = [r["flops"] for r in results]
    assert flops[0] == flops[1]  # the same on every rank
    if layout == "dp2":
        assert flops[0] == full
    elif layout in ("tp2", "pp2"):
        assert flops[0] == full / 2
    else:  # cp2: the ring skips causal attention's fully-masked blocks, so up to half the attention is not done
        assert full / 2 - attention / 4 <= flops[0] < full / 2
    assert all(r["source"] == "counted" for r in results)
    if layout != "dp2":
        assert "the mean over the 2 ranks that read the same batch" in results[0]["note"]
    # pipelines are counted on their second batch (their first runs an extra shape-inference forward): not timed
    steps = [4, 6] if layout == "pp2" else [2, 4, 6]
    assert_tflops_logged(results[0]["metrics"], flops[0], steps)
    assert not math.isnan(flops[0])

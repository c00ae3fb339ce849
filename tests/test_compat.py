"""Every private torch/Lightning API lightning_par uses (lightning_par/_compat.py), called once: a release that moves or
changes one fails here, by name, rather than deep inside a training run."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_par import _compat


class _Count(TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _Count.calls += 1
        return func(*args, **(kwargs or {}))


def test_function_modes_are_suspended_and_restored():
    with _Count():
        torch.ones(1) + 1
        before = _Count.calls
        with _compat.without_function_modes():
            torch.ones(1) + 1
        assert _Count.calls == before
        torch.ones(1) + 1
        assert _Count.calls > before


def test_dispatch_mode_sees_the_aten_ops_called_from_cpp():
    seen = []

    class Record(_compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.arange(4.0)
    with Record():
        x[x > 1]  # a boolean mask: aten.index with a bool index, the op the unused-parameter probe looks for
        x.sum().item()
    assert "index" in seen and "_local_scalar_dense" in seen, seen


def test_stage_warm_up_skips_its_own_rank():
    from torch.distributed.pipelining import PipelineStage

    stage = _compat.pipeline_stage_class()
    assert issubclass(stage, PipelineStage)
    assert callable(getattr(PipelineStage, "_get_init_p2p_neighbors_ops", None)), "the overridden method is gone"
    # the shape-inference forward that token counters must not count: one of its names exists
    assert any(callable(getattr(PipelineStage, name, None)) for name in _compat._INFERENCE_METHODS)
    assert not _compat.in_pipeline_metadata_inference()
    # FSDP units reduce once per step: every micro-batch's backward goes through this method, and ``chunks`` (set
    # when the schedule prepares the stage) is the step's micro-batch count
    import inspect

    params = inspect.signature(PipelineStage.backward_maybe_with_nosync).parameters
    assert list(params)[:3] == ["self", "backward_type", "bwd_kwargs"] and "last_backward" in params
    assert "self.chunks = num_microbatches" in inspect.getsource(inspect.getmodule(PipelineStage))


def test_graph_device_rewrite():
    graph = torch.fx.symbolic_trace(lambda x: x + torch.arange(x.size(0), device="meta"))
    _compat.move_graph_to_device(graph, torch.device("cpu"))
    assert graph(torch.zeros(3)).device.type == "cpu"


def test_train_dataloader_of_a_trainer():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, max_steps=0, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    loader = DataLoader(list(range(4)), batch_size=2)

    class Capture(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            self.loader = _compat.train_dataloader_of(trainer)

    capture = Capture()
    trainer.callbacks.append(capture)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return self.w.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer.fit(Tiny(), loader)
    assert capture.loader is loader


def test_checkpoint_wrapper_recomputes_and_names_the_wrapped_module():
    block = torch.nn.Linear(4, 4)
    wrapped = _compat.checkpoint_wrapper(block)
    assert wrapped._checkpoint_wrapped_module is block  # pipeline stages look the block up by this name
    # parameter and state-dict names stay the block's own (checkpoints load across wrapped and unwrapped layouts)
    assert [n for n, _ in wrapped.named_parameters()] == ["weight", "bias"]
    assert list(wrapped.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_the_lightning_module_reads_the_mesh_it_was_handed():
    from lightning.pytorch import LightningModule

    module, mesh = LightningModule(), object()
    _compat.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh


def test_all_to_all_single_autograd_on_one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        x = torch.arange(6.0).view(3, 2).requires_grad_()
        y = _compat.all_to_all_single_autograd(x, [3], [3], dist.group.WORLD)
        (y * 2).sum().backward()
        assert torch.equal(y, x.detach()) and torch.equal(x.grad, torch.full((3, 2), 2.0))
    finally:
        dist.destroy_process_group()


def test_local_chunk_of_a_dtensor_on_one_rank(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        whole = distribute_tensor(torch.zeros(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert _compat.local_chunk(whole) == ((0, 0), (4, 3))
    finally:
        dist.destroy_process_group()


def test_local_tensor_and_version_counter(tmp_path):
    """A DTensor's local tensor without an autograd op (the same object, even with grad on), a plain tensor itself;
    the version counter in-place ops bump, shared with detached aliases."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        whole = distribute_tensor(torch.ones(4, 3, requires_grad=True), init_device_mesh("cpu", (1,)), [Shard(0)])
        local = _compat.local_tensor(whole)
        assert type(local) is torch.Tensor and local.grad_fn is None and _compat.local_tensor(whole) is local
        plain = torch.zeros(2)
        assert _compat.local_tensor(plain) is plain
        alias, before = plain.detach(), _compat.tensor_version(plain)
        plain.add_(1)
        assert _compat.tensor_version(plain) == _compat.tensor_version(alias) == before + 1
    finally:
        dist.destroy_process_group()


def test_in_backward_is_true_only_inside_a_backward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(_compat.in_backward())
            return grad

    x = torch.ones(2, requires_grad=True)
    assert not _compat.in_backward()
    Probe.apply(x).sum().backward()
    assert seen == [True] and not _compat.in_backward()


def test_live_process_groups_lists_the_default_group_first_then_in_creation_order(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        first, second = dist.new_group([0]), dist.new_group([0])
        assert _compat.live_process_groups() == [dist.group.WORLD, first, second]
    finally:
        dist.destroy_process_group()
    assert _compat.live_process_groups() == []


def test_selective_checkpointing_passes_profiler_ranges_through():
    """A region whose recomputation opens one more profiler range than its forward (what a nested FSDP2 unit does)
    recomputes under selective checkpointing once the ranges are in torch's ignored ops."""
    from torch.utils.checkpoint import checkpoint

    from lightning_par.techniques.recompute.recompute import selective_checkpoint_contexts

    def region(x: torch.Tensor) -> torch.Tensor:
        if _compat.in_backward():
            with torch.profiler.record_function("only in the recomputation"):
                pass
        return (x @ x).sin() @ x

    _compat.ignore_profiler_ranges_in_selective_checkpointing()
    x = torch.randn(4, 4, requires_grad=True)
    checkpoint(region, x, use_reentrant=False, context_fn=selective_checkpoint_contexts).sum().backward()
    y = x.detach().requires_grad_()
    region(y).sum().backward()
    assert torch.allclose(x.grad, y.grad)
    assert len(_compat.profiler_range_ops()) == 3
    assert set(_compat.profiler_range_ops()) <= _compat.selective_checkpointing_ignored_ops()


def test_tree_leaves_and_map_flatten_an_ops_arguments():
    args = ((torch.ones(1), [2, {"k": torch.zeros(2)}]), {"out": None})
    leaves = _compat.tree_leaves(args)
    assert [type(x) for x in leaves] == [torch.Tensor, int, torch.Tensor, type(None)]
    doubled = _compat.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, args)
    assert torch.equal(doubled[0][0], torch.full((1,), 2.0)) and doubled[0][1][0] == 2


def test_async_tensor_parallel_switches_inductors_pass_on_for_a_group(tmp_path):
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    before = inductor_config._micro_pipeline_tp
    try:
        group = dist.new_group([0])
        inductor_config._micro_pipeline_tp = False
        assert not _compat.async_tensor_parallel_enabled()
        _compat.enable_async_tensor_parallel(group.group_name)
        assert _compat.async_tensor_parallel_enabled()
        assert _compat.symmetric_memory_enabled(group.group_name)
    finally:
        inductor_config._micro_pipeline_tp = before
        dist.destroy_process_group()


def test_transformers_experts_implementation_and_gate():
    """transformers' experts modules say which implementation they run, and gate their gate-up output with the
    model's own gate (Qwen3-MoE's: SiLU of the first half times the second)."""
    from hf_models import HFCausalLM

    from lightning_par._compat import (
        is_transformers_experts,
        transformers_experts_gate,
        transformers_experts_implementation,
    )
    from lightning_par.techniques.experts.experts import is_hf_experts

    experts = next(m for m in HFCausalLM("qwen3_moe").model.modules() if is_hf_experts(m))
    assert is_transformers_experts(experts) and not is_transformers_experts(torch.nn.Linear(2, 2))
    assert transformers_experts_implementation(experts) == "grouped_mm"
    assert transformers_experts_implementation(torch.nn.Linear(2, 2)) is None
    gate_up = torch.randn(5, 2 * experts.down_proj.shape[-1])
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(transformers_experts_gate(experts, gate_up), torch.nn.functional.silu(gate) * up)


def test_the_fused_attention_ops_take_the_arguments_context_parallelism_passes():
    """The private aten ops behind ``_compat.fused_attention_forward`` / ``_backward`` (CUDA kernels: their numbers
    are checked in tests/test_gpu.py); here their schemas, which the calls' positional arguments follow."""
    def names(op):
        return [a.name for a in op.default._schema.arguments]

    aten = torch.ops.aten
    assert names(aten._scaled_dot_product_flash_attention)[:5] == ["query", "key", "value", "dropout_p", "is_causal"]
    assert names(aten._scaled_dot_product_flash_attention_backward)[:14] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset"]
    assert names(aten._scaled_dot_product_efficient_attention)[:7] == [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"]
    assert names(aten._scaled_dot_product_efficient_attention_backward)[:12] == [
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
        "dropout_p", "grad_input_mask", "is_causal"]
    assert names(aten._scaled_dot_product_cudnn_attention)[:8] == [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask"]
    assert names(aten._scaled_dot_product_cudnn_attention_backward)[:15] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
        "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"]
    # the calls' arguments (None for the tensors cuDNN does not need) get past the argument parser to the
    # dispatcher, which has no CPU kernel for these ops: that refusal is the sign the arguments were accepted
    q, lse = torch.randn(1, 2, 8, 16), torch.zeros(1, 2, 8)
    for kernel in ("cudnn", "flash", "efficient"):
        with pytest.raises(NotImplementedError, match="CPU"):
            _compat.fused_attention_forward(kernel, q, q, q, 0.25, True)
        with pytest.raises(NotImplementedError, match="CPU"):
            _compat.fused_attention_backward(kernel, q, q, q, q, q, lse, 0.25, True)


def test_sdpa_kernel_choice_follows_torch_selector_and_sdpa_kernel():
    """``sdpa_kernel_choice`` (torch's private ``_fused_sdp_choice``) names a fused kernel, and None where
    ``torch.nn.attention.sdpa_kernel`` leaves only the math path; on the CPU its answer is torch's CPU flash kernel
    (the engine asks only for CUDA tensors)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16)
    assert _compat.sdpa_kernel_choice(q, q, q, True) == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        assert _compat.sdpa_kernel_choice(q, q, q, True) is None


def test_a_meta_nf4_weight_has_the_inner_tensors_of_a_real_one():
    """``meta_nf4`` (torchao's ``to_nf4`` with its chunk size raised for one call): the same inner tensors, by name,
    shape and dtype, as quantizing real values; the module's chunk size is back afterwards."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    chunk = nf4_tensor.CHUNK_SIZE
    meta = _compat.meta_nf4((512, 256), torch.float32, 64, 256)
    real = nf4_tensor.to_nf4(torch.randn(512, 256), 64, 256)
    assert nf4_tensor.CHUNK_SIZE == chunk
    names = meta.__tensor_flatten__()[0]
    assert names == real.__tensor_flatten__()[0] and meta.is_meta and meta.shape == real.shape
    for name in names:
        m, r = getattr(meta, name), getattr(real, name)
        assert (m.shape, m.dtype) == (r.shape, r.dtype), name
    assert _compat.is_quantized(real) and _compat.is_quantized(meta)
    assert not _compat.is_quantized(torch.randn(4)) and not _compat.is_quantized(torch.nn.Parameter(torch.randn(4)))


def test_autocast_accepts_meta_only_inside():
    """torch refuses autocast on "meta" (what PEFT's LoRA on parameters opens while the planner traces on meta);
    inside ``autocast_accepts_meta`` it opens (as a CPU autocast, which acts on no meta tensor), and after it
    ``torch.autocast`` is torch's own again."""
    original = torch.autocast
    with pytest.raises(RuntimeError):
        with torch.autocast(device_type="meta", enabled=False):
            pass
    x = torch.ones(2, 3, device="meta")
    with _compat.autocast_accepts_meta():
        with torch.autocast(device_type="meta", enabled=False):
            assert (x @ x.T).dtype == torch.float32 and (x @ x.T).is_meta
    assert torch.autocast is original


def test_nf4_gathers_into_a_dtensor_once_wrapped(tmp_path):
    """FSDP2 over tensor-parallel NF4 pieces passes its unsharded tp DTensor as ``out=`` to torchao's
    ``NF4Tensor.fsdp_post_all_gather``, which asserts an NF4Tensor there (torchao 0.18); once
    ``nf4_gathers_into_dtensors`` wrapped it, the DTensor's local NF4 tensor is filled as torchao fills its own
    (the gathered tensors' storages are the out's), and wrapping twice wraps once."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    original = nf4_tensor.NF4Tensor.fsdp_post_all_gather
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = nf4_tensor.to_nf4(torch.randn(256, 64), 64, 256)
        inputs, metadata = weight.fsdp_pre_all_gather(mesh)
        out = DTensor.from_local(weight, mesh, [Shard(0)], run_check=False)
        if not getattr(original, "_unwraps_dtensor", False):  # torchao's own: refuses the DTensor
            with pytest.raises(AssertionError, match="DTensor"):
                weight.fsdp_post_all_gather(inputs, metadata, torch.float32, out=out)
        _compat.nf4_gathers_into_dtensors()
        _compat.nf4_gathers_into_dtensors()
        wrapped = nf4_tensor.NF4Tensor.fsdp_post_all_gather
        assert wrapped._unwraps_dtensor and original in [c.cell_contents for c in wrapped.__closure__]
        assert weight.fsdp_post_all_gather(inputs, metadata, torch.float32, out=out) is None
    finally:
        nf4_tensor.NF4Tensor.fsdp_post_all_gather = original
        dist.destroy_process_group()


def test_inner_tensor_names_of_a_subclass_and_of_a_plain_tensor():
    """``inner_tensor_names``: the plain tensors an NF4 weight stores (by torch's subclass protocol), none for a plain
    tensor or a parameter."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    weight = nf4_tensor.to_nf4(torch.randn(256, 64), 64, 256)
    names = _compat.inner_tensor_names(weight)
    assert {"quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"} <= set(names)
    assert all(type(getattr(weight, n)) is torch.Tensor for n in names)
    assert _compat.inner_tensor_names(torch.randn(3)) == []
    assert _compat.inner_tensor_names(torch.nn.Parameter(torch.randn(3))) == []

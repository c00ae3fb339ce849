"""The private torch, Lightning and transformers APIs lightning_par cannot avoid, each behind one small function.

Each names the versions it was checked on; tests/test_compat.py calls every one of them, so a release that moves or
changes one fails there, loudly, instead of deep inside a training run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# torch 2.11-2.13: the block wrapper torchtitan also uses; ``torch.utils.checkpoint`` has the function but no module
# wrapper, and FSDP2's state-dict handling knows this one's ``_checkpoint_wrapped_module`` prefix
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

__all__ = ["all_to_all_single_autograd", "async_tensor_parallel_enabled", "checkpoint_wrapper",
           "enable_async_tensor_parallel", "fused_attention_backward", "fused_attention_forward",
           "ignore_profiler_ranges_in_selective_checkpointing",
           "in_backward", "is_transformers_experts", "live_process_groups", "local_chunk",
           "meta_nf4", "move_graph_to_device", "pipeline_stage_class", "sdpa_kernel_choice", "set_device_mesh",
           "symmetric_memory_enabled",
           "torch_dispatch_mode", "transformers_experts_gate", "transformers_experts_implementation",
           "train_dataloader_of", "tree_leaves", "tree_map", "without_function_modes"]


def train_dataloader_of(trainer: Any) -> Any:
    """The training dataloader the Trainer will use, before its loop has set it up (``fit(model, loader)``,
    ``LightningModule.train_dataloader`` or a datamodule's alike). Lightning 2.6: ``fit_loop._data_source``."""
    source = trainer.fit_loop._data_source
    loader = source.dataloader()
    if loader is None:
        raise ValueError("auto_parallel plans from one training batch, and the Trainer has no training dataloader: "
                         "pass one to trainer.fit(...) or define train_dataloader().")
    return loader


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Hand the mesh to the LightningModule, so that ``configure_model`` reads it as ``self.device_mesh``. Lightning
    2.6: the property has no setter; Lightning's own ``ModelParallelStrategy`` writes ``_device_mesh`` too."""
    module._device_mesh = mesh


@contextmanager
def without_function_modes() -> Iterator[None]:
    """Suspend the active TorchFunctionModes (e.g. the context-parallel attention routing, which a meta-device trace
    must not run). torch 2.11-2.13: ``torch._C._len/_pop/_push_on_torch_function_stack``, no public equivalent."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def all_to_all_single_autograd(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                               group: Any) -> torch.Tensor:
    """All-to-all of ``x``'s rows with uneven splits, differentiable (backward: the reverse all-to-all). torch
    2.11-2.13: ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (what torchtitan uses); the
    public ``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated in its favour."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a
    from torch.distributed._functional_collectives import wait_tensor

    return wait_tensor(a2a(x, output_splits, input_splits, group))


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward it runs is activation
    checkpointing's recompute, also inside a pipeline schedule's backward). torch 2.11-2.13:
    ``torch._C._current_graph_task_id()``, -1 outside backward; no public equivalent."""
    return torch._C._current_graph_task_id() != -1


def torch_dispatch_mode() -> type:
    """The base class of Python dispatch modes, which see every aten op a forward runs, also those called from C++
    (a boolean mask's ``index``); the public ``TorchFunctionMode`` sees only Python-level calls. torch 2.11-2.13:
    ``torch.utils._python_dispatch.TorchDispatchMode``, no public equivalent."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples, lists, dicts and namedtuples, as torch flattens an op's arguments (the same
    containers a dispatch mode receives). torch 2.11-2.13: ``torch.utils._pytree.tree_leaves``, no public
    equivalent."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def tree_map(fn: Any, tree: Any) -> Any:
    """``fn`` applied to every leaf, the containers rebuilt. torch 2.11-2.13: ``torch.utils._pytree.tree_map``."""
    from torch.utils._pytree import tree_map as apply

    return apply(fn, tree)


_metadata_inference = [0]  # > 0 while a pipeline stage runs its metadata-inference forward


def in_pipeline_metadata_inference() -> bool:
    """Whether a pipeline stage is running the forward torch uses to learn its shapes (torch 2.13 runs the stage's
    real modules once on the first step, with real inputs on the first stage and empty ones after it; not a training
    forward: routers' token counts must not see it)."""
    return _metadata_inference[0] > 0


#: the private PipelineStage methods that run the stage's modules for shapes (torch 2.13; 2.11-2.12 the second)
_INFERENCE_METHODS = ("_forward_metadata_inference", "_shape_inference")


def pipeline_stage_class() -> type:
    """``PipelineStage`` whose warm-up sends skip the stage's own rank, whose shape-inference forward is flagged
    (:func:`in_pipeline_metadata_inference`), and whose FSDP units marked ``accumulate_unsharded`` reduce their
    gradients once per step, in the last micro-batch's backward (overrides ``backward_maybe_with_nosync``, which
    every backward of a micro-batch calls, and reads ``chunks``, the step's micro-batches: torch 2.11-2.13).
    torch 2.11's schedules warm the p2p connections up by sending to each neighbouring stage, also when it is on the
    same rank (the V-shaped schedule puts stages 1 and 2 on one rank), which gloo cannot do ("Pair is not
    connected"); those stages hand activations on locally anyway. Overrides the private
    ``_get_init_p2p_neighbors_ops`` (torch 2.11-2.13; 2.13 no longer calls it by default)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        _weight_backwards = 0  # of this step's micro-batches, those whose weight gradients are computed

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            # the micro-batch the stage's module runs now, for what it takes beside its inputs (a Hugging Face
            # stage's row tables: ``pipeline_live.RowTables``)
            self.submod.chunk_id = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def _get_init_p2p_neighbors_ops(self) -> list:
            me = dist.get_rank(self.group)
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                       last_backward: bool = False) -> Any:
            # torch reduces FSDP gradients once per step only where the stage's module is itself an FSDP module
            # (its REDUCE_GRAD action); the engine shards the units inside it, each its own root, so with
            # ``accumulate_unsharded`` the last micro-batch's weight backward (counted against ``chunks``) is the one
            # that reduces theirs
            from lightning_par.techniques.sharding.fsdp import sync_gradients

            if backward_type != "input":
                self._weight_backwards += 1
            last = self._weight_backwards >= (self.chunks or 1)
            if last:
                self._weight_backwards = 0
            with sync_gradients(self.submod, last and backward_type != "input"):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    for name in _INFERENCE_METHODS:
        if hasattr(PipelineStage, name):
            setattr(Stage, name, _flagged(getattr(PipelineStage, name)))
    return Stage


def _flagged(method: Any) -> Any:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        _metadata_inference[0] += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _metadata_inference[0] -= 1

    return run


def move_graph_to_device(graph_module: torch.nn.Module, device: torch.device) -> None:
    """Point the device arguments of a traced stage's ops (``arange(..., device="meta")`` from the meta trace) at
    ``device``. torch 2.11-2.13: ``torch.distributed.pipelining._IR._modify_graph_op_device``, what
    ``Pipe.build_stage`` itself calls."""
    from torch.distributed.pipelining._IR import _modify_graph_op_device

    _modify_graph_op_device(graph_module, device)


def live_process_groups() -> list[Any]:
    """Every process group this rank belongs to, the default one first, then in the order they were created (the
    same relative order on every rank: all ranks create every group). torch 2.11-2.13: ``_world.pg_names``, the
    registry ``destroy_process_group`` empties; there is no public listing."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_names)


def local_chunk(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's part of a DTensor sits in the global tensor: (offsets, sizes), as
    torch.distributed.checkpoint plans its reads. torch 2.11-2.13: ``DTensor.__create_chunk_list__``, the dunder of
    DCP's protocol (one chunk per rank); there is no public accessor."""
    (chunk,) = tensor.__create_chunk_list__()
    return tuple(chunk.offsets), tuple(chunk.sizes)


def profiler_range_ops() -> tuple[Any, ...]:
    """The profiler's range ops (``torch.profiler.record_function``'s enter and exit), those this torch has."""
    ops = torch.ops.profiler
    found = [getattr(getattr(ops, name, None), overload, None) for name, overload in (
        ("_record_function_enter_new", "default"), ("_record_function_exit", "default"),
        ("_record_function_exit", "_RecordFunction"))]
    return tuple(op for op in found if op is not None)


def selective_checkpointing_ignored_ops() -> set[Any] | None:
    """The set of ops torch's selective checkpointing passes through without numbering them: ``SAC_IGNORED_OPS``
    in ``torch.utils.checkpoint`` (torch 2.11-2.13), ``_SAC_IGNORED_OPS`` in later sources; None if neither."""
    import torch.utils.checkpoint as checkpoint

    for name in ("SAC_IGNORED_OPS", "_SAC_IGNORED_OPS"):
        ops = getattr(checkpoint, name, None)
        if isinstance(ops, set):
            return ops
    return None


def ignore_profiler_ranges_in_selective_checkpointing() -> None:
    """Selective checkpointing (torch 2.11-2.13) numbers every op of a region in forward and again in its
    recomputation, and fails when the counts differ. FSDP2 opens one profiler range more in a nested unit's
    recomputed forward (it becomes the iteration's forward root: ``FSDP::root_pre_forward``), so a block holding an
    FSDP unit of its own (expert parallelism's experts) failed under selective checkpointing. Profiler ranges hold no
    tensor: add them to the ops it passes through (a private set; idempotent; where a torch has no such set, nothing
    changes and only that case keeps failing: tests/test_compat.py names it)."""
    ignored = selective_checkpointing_ignored_ops()
    if ignored is not None:
        ignored.update(profiler_range_ops())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, without the autograd op ``to_local()`` records mid-step (inside a saved-tensor hook
    none may run); any other tensor itself. torch 2.11-2.13: ``DTensor._local_tensor``."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def is_quantized(t: torch.Tensor) -> bool:
    """A quantized weight (QLoRA's NF4: torchao's tensor subclasses answer ``get_original_weight``), plain or a
    DTensor's local shard."""
    return hasattr(local_tensor(t), "get_original_weight")


def inner_tensor_names(t: torch.Tensor) -> list[str]:
    """The attribute names of the plain tensors a tensor subclass stores (QLoRA's NF4: codes, scales, factors, mean,
    table); [] for a plain tensor. torch 2.11-2.13: the traceable wrapper subclass protocol's
    ``__tensor_flatten__`` (what torch.compile and FSDP2 read too; documented for subclass authors, not as API)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    return list(flatten()[0]) if flatten is not None else []


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter autograd checks saved tensors against (torch 2.11-2.13: ``Tensor._version``):
    a saved-tensor hook that keeps a tensor must check it itself, since autograd does not under such hooks."""
    return t._version


def enable_async_tensor_parallel(group_name: str) -> None:
    """Turn on Inductor's micro-pipelined tensor parallelism ("async TP") for the blocks compiled after this call:
    each sequence-parallel all-gather before a matmul and reduce-scatter after one is cut into tp chunks, the
    transfer of the next chunk in flight while the current one is multiplied (symmetric memory, CUDA only). torch
    2.11-2.13: ``torch._inductor.config._micro_pipeline_tp`` (no public switch; torchtitan sets it the same way; it
    holds for the process, but the pass fuses only collectives of groups with symmetric memory) and
    ``torch.distributed._symmetric_memory.enable_symm_mem_for_group`` for the tp group (marked deprecated since 2.12,
    yet the pass skips a group until it is called: torchtitan calls it too, pytorch/pytorch#193027). A torch where
    the group is still not enabled afterwards gets a warning: its blocks would compile without the pipelining."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
    if not symmetric_memory_enabled(group_name):
        warnings.warn(f"async_tp=True: symmetric memory could not be confirmed for the tensor-parallel group "
                      f"{group_name!r} with torch {torch.__version__}; Inductor may compile the blocks without "
                      f"pipelining their collectives.", stacklevel=2)
    inductor_config._micro_pipeline_tp = True


def symmetric_memory_enabled(group_name: str) -> bool:
    """Whether Inductor's async-TP pass will fuse this group's collectives (torch 2.11-2.13:
    ``torch.distributed._symmetric_memory.is_symm_mem_enabled_for_group``; False where it does not exist)."""
    from torch.distributed import _symmetric_memory

    enabled = getattr(_symmetric_memory, "is_symm_mem_enabled_for_group", None)
    return enabled is not None and bool(enabled(group_name))


def async_tensor_parallel_enabled() -> bool:
    """Whether ``enable_async_tensor_parallel`` is in force (torch 2.11-2.13: the Inductor flag it sets)."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config._micro_pipeline_tp)


def transformers_experts_implementation(module: Any) -> str | None:
    """Which experts implementation a transformers experts module runs (``"grouped_mm"``, ``"eager"``, ...), None
    where it is not one. transformers 5.17 and 5.24: ``config._experts_implementation``, which the
    ``@use_experts_implementation`` forward dispatches on."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def transformers_experts_gate(module: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """A gated transformers experts module's gate on its gate-up projection's output (the model's own: SwiGLU,
    gpt-oss' clamped one, interleaved gate and up). transformers 5.17 and 5.24: ``_apply_gate``, which the
    decorator gives every experts class that has none."""
    return module._apply_gate(gate_up)


def is_transformers_experts(module: Any) -> bool:
    """Whether ``module`` is a transformers experts module (``@use_experts_implementation``): its init sets
    ``_is_expert_parallel`` in transformers 5.24, only ``has_gate``, ``has_bias`` and ``is_transposed`` in 5.17."""
    if not hasattr(module, "num_experts"):
        return False
    return hasattr(module, "_is_expert_parallel") or all(
        hasattr(module, name) for name in ("has_gate", "has_bias", "is_transposed"))


#: the memory-efficient kernel's lse holds its rows in tiles of this many (padded): its backward reads them so
_EFFICIENT_LSE_ROWS = 32
#: torch.nn.attention.SDPBackend's values (public enum) -> the kernel names below
_SDPA_BACKENDS = {1: "flash", 2: "efficient", 3: "cudnn"}


def sdpa_kernel_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """The fused kernel torch's SDPA would run for these tensors ("cudnn", "flash" or "efficient"), None for its
    math path: torch's private ``_fused_sdp_choice`` (torch 2.11-2.13), the selector SDPA itself calls. It honours
    ``torch.nn.attention.sdpa_kernel`` and torch's priority order (cuDNN first on Hopper and Blackwell with a recent
    cuDNN, else flash), so a block of context-parallel attention runs the kernel one SDPA call would. Asked as for
    training (the tensors marked as requiring gradients), so that the kernel's backward constraints apply too (flash
    takes no head dims over 192 in backward on sm86/sm89): the engine's blocks run without autograd."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal)
    return _SDPA_BACKENDS.get(int(choice))


def fused_attention_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of torch's fused CUDA attention kernel ``kernel`` ("cudnn", "flash" or "efficient"), lse as
    (batch, heads, rows) unpadded: the private aten ops torch's own ring attention calls per block
    (``torch.distributed.tensor.experimental``'s ``_templated_ring_attention``); their schemas are the same on torch
    2.11 and 2.13 (tests/test_compat.py). cuDNN's lse keeps a trailing dimension of 1, dropped here; like torch's
    ring attention, cuDNN is given contiguous inputs."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # a strided K/V slice gave wrong results on the efficient kernel
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3])
    if kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.size(2)]


def fused_attention_backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the fused kernel's own backward given ``out`` and ``lse`` (any out and lse: the block's rows
    of the merged ones, in context parallelism), all contiguous. lse must be contiguous (a strided slice gave wrong
    dq and dk, NaN for causal blocks, on an H200 with torch 2.11), for the memory-efficient kernel padded to its row
    tiles, for cuDNN with its trailing dimension of 1. No dropout: the seed and offset the ops take are unused."""
    no_rng = torch.empty((), dtype=torch.long, device=q.device if kernel == "cudnn" else "cpu")  # cuDNN: on the GPU
    rows = q.size(2)
    if kernel == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.float().reshape(*lse.shape, 1).contiguous(), no_rng, no_rng, None, None, None,
            rows, k.size(2), 0.0, causal, scale=scale)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, rows, k.size(2), 0.0, causal, no_rng, no_rng,
            scale=scale)
    padded = -(-rows // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS
    tiles = lse.new_zeros((*lse.shape[:2], padded), dtype=torch.float32)
    tiles[..., :rows] = lse
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, tiles, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)[:3]


def meta_nf4(shape: tuple[int, ...], dtype: torch.dtype, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """An NF4 weight of ``shape`` on the meta device (its codes, scales and factors of the sizes the values will
    need), made by torchao's own ``to_nf4``. torchao quantizes in chunks of ``CHUNK_SIZE`` (2**20) values to bound
    its workspace; on the meta device there is no workspace, but the loop still costs some 2 ms a chunk (half a
    second for one of Llama-70B's MLP weights, minutes for the model): the module's constant is raised for the one
    call. torchao 0.18 (``torchao.quantization.quantize_.workflows.nf4.nf4_tensor.CHUNK_SIZE``)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    numel = 1
    for d in shape:
        numel *= d
    saved = nf4_tensor.CHUNK_SIZE
    nf4_tensor.CHUNK_SIZE = max(saved, numel)
    try:
        return nf4_tensor.to_nf4(torch.empty(shape, dtype=dtype, device="meta"), block_size, scaler_block_size)
    finally:
        nf4_tensor.CHUNK_SIZE = saved


def nf4_gathers_into_dtensors() -> None:
    """Let FSDP2 gather NF4 weights that tensor parallelism cut (QLoRA with ``dp_shard x tp``). From its second
    all-gather of a parameter on, FSDP2 hands the extension's ``fsdp_post_all_gather`` the unsharded parameter to
    fill (``out=``; torch 2.11-2.13, ``FSDPParam.init_unsharded_param``), which over a tensor-parallel mesh is the
    tp DTensor whose local tensor is the NF4 weight; torchao 0.18's ``NF4Tensor.fsdp_post_all_gather`` asserts an
    NF4Tensor there (its float8 tensor unwraps the DTensor itself). Wrapped once per process to unwrap it the same
    way; everything else it does is unchanged."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    original = NF4Tensor.fsdp_post_all_gather
    if getattr(original, "_unwraps_dtensor", False):
        return

    def fsdp_post_all_gather(self: Any, outputs: Any, metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> Any:
        if isinstance(out, DTensor):
            out = out._local_tensor
        return original(self, outputs, metadata, param_dtype, out=out)

    fsdp_post_all_gather._unwraps_dtensor = True
    NF4Tensor.fsdp_post_all_gather = fsdp_post_all_gather


class _MetaAutocast(torch.autocast):
    """``torch.autocast(device_type="meta")``, which torch 2.11-2.13 refuse (``get_autocast_dtype("meta")``:
    "unsupported scalarType"), opened as a CPU autocast: autocast acts on no meta tensor either way."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextmanager
def autocast_accepts_meta() -> Iterator[None]:
    """Inside, ``torch.autocast`` takes the meta device, so that code opening autocast on its weights' device
    (PEFT's LoRA on parameters: ``torch.autocast(device_type=W.device.type, enabled=False)``) traces on meta (the
    planner's profile). The module attribute is swapped back on exit; the class stays a ``torch.autocast``."""
    original = torch.autocast
    torch.autocast = _MetaAutocast
    try:
        yield
    finally:
        torch.autocast = original

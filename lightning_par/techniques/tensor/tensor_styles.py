"""The tensor-parallel styles, one row each: the one place that says what a style is.

A row (:class:`TPStyle`) holds everything about a style that the rest of the package asks: its name and
description (the plan's vocabulary, :data:`STYLES`), the Hugging Face names that mean the same
(:data:`HF_ALIASES`), which modules it applies to and which of their sizes it splits (``tensor_plan``'s
validation), whether it gathers the sequence under sequence parallelism, how it is built into a torch
``ParallelStyle`` (:func:`build_style`, called by ``apply_tp``) and how the cost model prices it
(:class:`TPPrice`: read by the trace in ``costs/profile.py`` and by ``tensor_parallel.TensorParallel.account``).
A new style is one new row here, and its builder's ``ParallelStyle`` below if torch has none
(``tests/test_tensor_parallel_core.py`` checks every row is complete).

Activations between modules are plain local tensors of shape (batch, seq, ...): with ``sequence_parallel=True`` the
residual stream holds this rank's sequence chunk, otherwise the full sequence. Plain torch: no Lightning, no cost
model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_par.parallel.modules import SHRINKING_INPUT_HOOKS, local_parameters
from lightning_par.techniques.tensor.sequence_regather import first_tensor_argument

SEQ_DIM = 1  # activations are (batch, seq, hidden)


@dataclass(frozen=True)
class BuildArgs:
    """What a builder is told about the module it builds a style for."""

    sequence_parallel: bool = False
    loss_parallel: bool = False
    #: the module sits inside a 'gather_sequence' module, so under SP a plain-tensor input of a column-parallel
    #: layer is a whole sequence (an inner activation), not a chunk of the residual stream
    input_gathered: bool = False
    rope_dim: int = 0  # the rope part of an 'mla_kv_a_proj' output (``tensor_plan.mla_rope_dim``)

    @property
    def column_input(self) -> Shard | Replicate:
        """A column-parallel layer's input: a sequence chunk under SP (unless gathered already), else whole."""
        return Shard(SEQ_DIM) if self.sequence_parallel and not self.input_gathered else Replicate()

    @property
    def residual(self) -> Shard | Replicate:
        """The residual stream: sequence chunks under SP, else whole."""
        return Shard(SEQ_DIM) if self.sequence_parallel else Replicate()


@dataclass(frozen=True)
class TPPrice:
    """How the cost model sees a module of this style."""

    #: its output as the trace lays it out: split over tp ("sharded", until a row-parallel layer), split over the
    #: vocabulary ("vocab": a head's logits under loss parallelism), gathered whole, sequence included ("whole"),
    #: whole again after a reduction ("reduced"); None: as its input
    output: Literal["sharded", "vocab", "whole", "reduced"] | None = None
    saves_whole_input: bool = False  # it saves its (whole) input for the weight gradient
    reduce_scatters: bool = False  # sequence parallelism reduce-scatters its output
    #: its half of a Megatron column-then-row pair under one parent module, whose collectives the tp account
    #: prices together (``tensor_parallel._column_row_groups``)
    pair: Literal["column", "row"] | None = None


@dataclass(frozen=True)
class TPStyle:
    """One tensor-parallel style."""

    name: str
    description: str
    hf_aliases: tuple[str, ...]  # Hugging Face plan names with the same meaning
    #: what a plan entry of this style names: a module of any kind, an ``nn.Linear``, an ``nn.Embedding``, or bare
    #: parameters (applied by ``apply_tp`` on their owner, never built per module)
    applies_to: Literal["module", "linear", "embedding", "parameters"]
    #: (the module's attribute tp must divide, what it is), for a style that splits the module's weight
    sharded_size: tuple[str, str] | None
    #: under sequence parallelism: "gathers": the module all-gathers its input's sequence itself; "gathers_outside":
    #: it does unless it sits inside a 'gather_sequence' module (whose input is gathered already); None: it does not
    sp_gather: Literal["gathers", "gathers_outside"] | None
    build: Callable[[BuildArgs], ParallelStyle | None] | None  # None only for ``applies_to="parameters"``
    price: TPPrice




def _applied_by_apply_tp(_: BuildArgs) -> None:
    return None


_ROWS = (
    TPStyle(
        "colwise", "nn.Linear sharded on out_features; output stays sharded (feeds a 'rowwise'). SP: input is a "
        "sequence shard, all-gathered first",
        ("local_colwise",), "linear", ("out_features", "output features"), "gathers_outside",
        lambda a: ColwiseParallel(input_layouts=a.column_input),
        TPPrice(output="sharded", saves_whole_input=True, pair="column")),
    TPStyle(
        "rowwise", "nn.Linear sharded on in_features; output all-reduced. SP: reduce-scattered to sequence shards",
        ("local_rowwise",), "linear", ("in_features", "input features"), None,
        lambda a: RowwiseParallel(output_layouts=a.residual),
        TPPrice(output="reduced", reduce_scatters=True, pair="row")),
    TPStyle(
        "colwise_rep", "nn.Linear sharded on out_features; output all-gathered (replicated)",
        ("colwise_gather_output",), "linear", ("out_features", "output features"), "gathers_outside",
        lambda a: ColwiseParallel(input_layouts=a.column_input, output_layouts=Replicate()),
        TPPrice(output="whole", saves_whole_input=True)),
    TPStyle(
        "rowwise_rep", "nn.Linear sharded on in_features with a replicated input (each rank slices it); output "
        "all-reduced. SP: reduce-scattered to sequence shards",
        ("rowwise_split_input",), "linear", ("in_features", "input features"), None,
        # its output joins the residual stream, sequence-sharded under SP
        lambda a: RowwiseParallel(input_layouts=Replicate(), output_layouts=a.residual),
        TPPrice(output="reduced", reduce_scatters=True)),
    TPStyle(
        "vocab_parallel_embedding", "nn.Embedding sharded on the vocabulary; output all-reduced. SP: "
        "reduce-scattered to sequence shards (the sequence is split right after the embedding)",
        (), "embedding", ("num_embeddings", "vocabulary size"), None,
        lambda a: _SequenceChecked(RowwiseParallel(input_layouts=Replicate(), output_layouts=a.residual),
                                   a.sequence_parallel),
        TPPrice(output="reduced")),
    TPStyle(
        "embedding_rowwise", "Hugging Face's vocab-parallel embedding: like 'vocab_parallel_embedding' but the "
        "output always stays replicated (HF models derive positions from its length; 'split_sequence' splits later)",
        (), "embedding", ("num_embeddings", "vocabulary size"), None,
        lambda a: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        TPPrice(output="reduced")),
    TPStyle(
        "embedding_colwise", "nn.Embedding sharded on embedding_dim; output all-gathered",
        (), "embedding", ("embedding_dim", "embedding width"), None,
        lambda a: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        TPPrice(output="reduced")),
    TPStyle(
        "vocab_parallel_head", "output nn.Linear sharded on the vocabulary; with loss_parallel its output stays a "
        "vocab-sharded DTensor for torch's loss_parallel(), else it is all-gathered",
        (), "linear", ("out_features", "vocabulary size"), "gathers",
        lambda a: ColwiseParallel(input_layouts=a.residual,
                                  output_layouts=Shard(-1) if a.loss_parallel else Replicate(),
                                  use_local_output=not a.loss_parallel),
        TPPrice(output="vocab", saves_whole_input=True)),
    TPStyle(
        "sequence_parallel", "norm/dropout on the residual stream: runs on sequence shards (SP only; else "
        "untouched)",
        (), "module", None, None,
        # local output: the next module may slice or reshape it as a plain tensor (HF's lm_head input does)
        lambda a: SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=True) if a.sequence_parallel else None,
        TPPrice()),
    TPStyle(
        "replicate", "replicated module added to the residual stream (e.g. a position embedding): SP slices its "
        "output's sequence dim (dim -2) to this rank's chunk; else untouched",
        (), "module", None, None,
        lambda a: _ShardOutputSequence() if a.sequence_parallel else None,
        TPPrice()),
    TPStyle(
        "head_norm", "a module computing on this rank's share of split activations (Qwen3's per-head q/k norms, a "
        "learnable activation between 'colwise' and 'rowwise'): its weights stay whole on every rank, their "
        "gradients are summed over tp",
        ("replicated_with_grad_allreduce",), "module", None, None,
        # torch's SequenceParallel on the leading dim: weights replicated DTensors, the input declared sharded (any
        # leading dim gives the same local math), so each weight gradient is a partial sum DTensor all-reduces
        lambda a: SequenceParallel(sequence_dim=0, use_local_output=True),
        TPPrice()),
    TPStyle(
        "head_params", "for a bare parameter indexed by attention head (sinks, a per-head gate bias; 'colwise' on a "
        "parameter means the same): split on dim 0 like the heads of its module's 'colwise' projections; the "
        "module's forward runs with this rank's shards (Hugging Face's 'colwise' parameter with a 'local_params' "
        "owner)",
        (), "parameters", None, None, None, TPPrice()),
    TPStyle(
        "partial_sum", "a module whose output sums over a dimension its own bare parameters are split on (Hugging "
        "Face's 'all_reduce' owner: Inkling's stacked shared experts, gate/up 'colwise' on dim -2, down 'rowwise' on "
        "dim -1): its forward runs on this rank's shards, its output is all-reduced over tp and so are its "
        "floating-point inputs' gradients (Megatron's column- then row-parallel MLP as one module). Not under "
        "sequence parallelism",
        ("all_reduce",), "module", None, None,
        _applied_by_apply_tp,  # its bare parameters' split dims come from the plan: apply_tp applies it
        TPPrice()),
    TPStyle(
        "mla_kv_a_proj", "multi-head latent attention's kv_a_proj_with_mqa (nn.Linear): whole on every rank; the "
        "rope part of its output (config.qk_rope_head_dim, shared by every head) gets its gradient summed over tp, "
        "since each rank's heads give only their share (the latent part reaches the 'colwise' kv_b_proj, which sums "
        "it already)",
        (), "linear", None, None,
        lambda a: _SumRopeGradient(a.rope_dim),
        TPPrice()),
    TPStyle(
        "split_sequence", "SP only: the first tensor input (or `hidden_states=`) is full; keep this rank's sequence "
        "chunk",
        (), "module", None, None,
        lambda a: _FirstInput(_split_sequence, shrinks=True) if a.sequence_parallel else None,
        TPPrice()),
    TPStyle(
        "gather_sequence", "SP only: all-gather the first tensor input (or `hidden_states=`) once for the module's "
        "colwise children (one all-gather instead of one per child)",
        (), "module", None, "gathers",
        lambda a: _GatherSequence() if a.sequence_parallel else None,
        TPPrice()),
)

#: the styles by name
TP_STYLES: dict[str, TPStyle] = {row.name: row for row in _ROWS}
#: Style names and what they do (the plan's vocabulary).
STYLES: dict[str, str] = {row.name: row.description for row in _ROWS}
#: Hugging Face plan names that need nothing done (our 'rowwise' already reduces what their 'gather' gathers;
#: 'local_params' owns 'colwise' bare parameters, which 'head_params' runs on local shards)
HF_NOOPS = ("gather", "local", "local_params")
#: Hugging Face style names with the same meaning as one of ours (None: nothing to do).
HF_ALIASES: dict[str, str | None] = {
    **{alias: row.name for row in _ROWS for alias in row.hf_aliases}, **dict.fromkeys(HF_NOOPS)}


def style_row(style: str | ParallelStyle | None) -> TPStyle | None:
    """The row of a style name (ours or a Hugging Face alias of one); None for a torch ``ParallelStyle`` object, a
    no-op or an unknown name."""
    if not isinstance(style, str):
        return None
    return TP_STYLES.get(HF_ALIASES.get(style, style) or "")


def style_price(style: str | ParallelStyle | None) -> TPPrice:
    """How the cost model prices a module of this style (a torch ``ParallelStyle`` object: as nothing)."""
    row = style_row(style)
    return row.price if row is not None else TPPrice()


def build_style(
    style: str | ParallelStyle, *, sequence_parallel: bool = False, loss_parallel: bool = False,
    input_gathered: bool = False, rope_dim: int = 0,
) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for a style name (see ``STYLES``); ``None`` where there is nothing to do.
    ``input_gathered``: the module sits inside a 'gather_sequence' module, so under SP a plain-tensor input of a
    column-parallel layer is a whole sequence (an inner activation), not a chunk of the residual stream.
    ``rope_dim``: the rope part of an 'mla_kv_a_proj' output (:func:`~.tensor_plan.mla_rope_dim`)."""
    if isinstance(style, ParallelStyle):
        return style
    name = HF_ALIASES.get(style, style)
    if name is None:
        return None
    row = TP_STYLES.get(name)
    if row is None or row.build is None:
        # validate_tp_plan refused it before
        raise ValueError(f"unknown tensor-parallel style {name!r}; valid: {sorted(STYLES)}")
    return row.build(BuildArgs(sequence_parallel, loss_parallel, input_gathered, rope_dim))


# ---- the few styles torch does not have ----------------------------------------------------------------------
def _check_seq_len(tensor: torch.Tensor, dim: int, mesh: DeviceMesh, where: str) -> None:
    """Uneven sequence chunks would silently mislabel DTensor shapes: fail on every rank, before the collective."""
    if tensor.size(dim) % mesh.size():
        raise ValueError(
            f"sequence parallelism: {where} sees a sequence of length {tensor.size(dim)} (dim {dim} of shape "
            f"{tuple(tensor.shape)}), not divisible by tp={mesh.size()}. Pad or crop sequences to a multiple of "
            f"{mesh.size()}, or turn sequence_parallel off."
        )


def _split_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int = SEQ_DIM) -> torch.Tensor:
    """Full tensor -> this rank's sequence chunk (no communication; backward all-gathers the gradient)."""
    _check_seq_len(x, dim, mesh, "split_sequence")
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(dim)]).to_local()


def _gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sequence chunk -> replicated DTensor, once for all colwise children (their grads sum, one reduce-scatter)."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(SEQ_DIM)], run_check=False)
    return x.redistribute(mesh, [Replicate()])


class _FirstInput(ParallelStyle):
    """Apply ``fn`` to the module's first tensor argument, or to ``hidden_states=`` (how HF layers are called)."""

    def __init__(self, fn: Callable[[torch.Tensor, DeviceMesh], torch.Tensor], shrinks: bool = False) -> None:
        super().__init__()
        self.fn, self.shrinks = fn, shrinks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            x = first_tensor_argument(args, kwargs)
            if x is not None and args and args[0] is x:
                return (self.fn(x, device_mesh), *args[1:]), kwargs
            if x is not None:
                return args, {**kwargs, "hidden_states": self.fn(x, device_mesh)}
            raise TypeError(
                f"{type(module).__name__}: 'split_sequence'/'gather_sequence' act on the first positional tensor "
                f"argument or `hidden_states=`; this call passed neither."
            )

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        if self.shrinks:
            module.__dict__.setdefault(SHRINKING_INPUT_HOOKS, []).append((hook, handle))
        return module


class _GatherSequence(_FirstInput):
    """'gather_sequence': the input's sequence is gathered once for the module's column-parallel children. An output
    that comes out whole (its last projection gathers its output, as in Hugging Face's plans for linear-attention
    layers) is cut back to this rank's chunk for the sequence-sharded residual stream (backward all-gathers)."""

    def __init__(self) -> None:
        super().__init__(_gather_sequence)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        local_len: list[int] = []

        def remember(_mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            x = first_tensor_argument(args, kwargs)
            local_len[:] = [x.size(SEQ_DIM)] if x is not None else []

        def cut(_mod: nn.Module, _args: tuple, _kwargs: dict[str, Any], out: Any) -> Any:
            first = out[0] if isinstance(out, tuple) else out
            if (not local_len or not isinstance(first, torch.Tensor) or isinstance(first, DTensor)
                    or first.ndim < 2 or first.size(SEQ_DIM) != local_len[0] * device_mesh.size()):
                return out
            first = _split_sequence(first, device_mesh)
            return (first, *out[1:]) if isinstance(out, tuple) else first

        module.register_forward_pre_hook(remember, with_kwargs=True, prepend=True)
        module.register_forward_hook(cut, with_kwargs=True)
        return module


class _OwnShards(ParallelStyle):
    """A module's own bare parameters ``dims`` (name -> split dim) become DTensors split over tp, and its forward runs
    with this rank's shards: plain tensors its code can index and broadcast against (``_run``)."""

    def __init__(self, dims: dict[str, int]) -> None:
        super().__init__()
        self.dims = dims

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.dims.items():
            p = module.get_parameter(name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p.data, device_mesh, [Shard(dim % p.dim())]), requires_grad=p.requires_grad))
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(module, device_mesh, inner, args, kwargs)

        module.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) call it
        return module

    def _run(self, module: nn.Module, device_mesh: DeviceMesh, inner: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        with local_parameters(module):
            return inner(*args, **kwargs)


class _HeadParams(_OwnShards):
    """'head_params' on the owner of bare parameters ``names``: split on dim 0 (by head), so that its code indexes
    and broadcasts them against its local heads."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(dict.fromkeys(names, 0))


class _PartialSum(_OwnShards):
    """'partial_sum' on a module whose own parameters are split over tp (``dims``) and whose output sums over that
    split (Inkling's stacked shared experts: gate/up split on the intermediate dim, down on it too). Its output, a
    partial sum, is all-reduced (backward: identity); each floating-point tensor input is whole on every rank, but
    its gradient from this rank's shards is partial, so it is all-reduced in backward (Megatron's f and g around a
    column- then row-parallel MLP)."""

    def _run(self, module: nn.Module, device_mesh: DeviceMesh, inner: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        def whole_with_partial_gradient(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or not x.is_floating_point():
                return x
            return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])

        out = super()._run(module, device_mesh, inner, tuple(map(whole_with_partial_gradient, args)),
                           {k: whole_with_partial_gradient(v) for k, v in kwargs.items()})
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"'partial_sum' all-reduces a module's output tensor, but {type(module).__name__} "
                            f"returned {type(out).__name__}; give it another style.")
        return DTensor.from_local(out, device_mesh, [Partial()], run_check=False).redistribute(
            device_mesh, [Replicate()]).to_local()


class _SumRopeGradient(ParallelStyle):
    """'mla_kv_a_proj': the last ``rope_dim`` outputs go to every head as they are, so each tp rank's heads give
    them only part of their gradient: summed over tp in backward (Replicate in, Partial gradient back)."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(hook)
        return module


class _ShardOutputSequence(ParallelStyle):
    """'replicate' under SP: a replicated module's output (e.g. a position embedding, (seq, hidden)) is cut to this
    rank's sequence chunk (dim -2) so it adds to the sharded residual stream; backward all-gathers its gradient, so
    the replicated weights get the full, identical gradient on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _m, _args, out: _split_sequence(out, device_mesh, out.ndim - 2))
        return module


class _SequenceChecked(ParallelStyle):
    """A style whose module receives (batch, seq) inputs: checks seq % tp under SP before its first collective."""

    def __init__(self, inner: ParallelStyle, sequence_parallel: bool) -> None:
        super().__init__()
        self.inner, self.sequence_parallel = inner, sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.inner._apply(module, device_mesh)
        if self.sequence_parallel:
            name = type(module).__name__
            module.register_forward_pre_hook(
                lambda _m, args: _check_seq_len(args[0], SEQ_DIM, device_mesh, name), prepend=True
            )
        return module


# ---- quantized weights (QLoRA's NF4) --------------------------------------------------------------------------
#: the styles a quantized weight's layer may have: its piece cut along this weight dim
QUANTIZED_STYLES = {"colwise": 0, "rowwise": 1}


class QuantizedLinear(ParallelStyle):
    """'colwise' or 'rowwise' on an ``nn.Linear`` whose weight is quantized (QLoRA's NF4). DTensor can neither split
    a quantized tensor subclass nor run its matmul, so the weight is cut by the format that quantized it (``cut``:
    this rank's rows or columns, dequantizing to exactly those of the whole weight) and kept as a DTensor of that
    piece, and the layer runs on local tensors: the format's own linear (torchao's, dequantized per layer), with
    the style's collectives around it, as torch's ``ColwiseParallel``/``RowwiseParallel`` place them. The input is
    gathered in a forward pre-hook, as torch's styles do, so ``regather_sequence`` sees it."""

    def __init__(self, dim: int, cut: Callable[..., torch.Tensor], layout: Shard | Replicate,
                 shards_after: int = 1) -> None:
        super().__init__()
        #: 0: column-parallel (``layout``: its input's, a sequence chunk or whole); 1: row-parallel (``layout``: its
        #: output's, a sequence chunk or whole); ``shards_after``: FSDP's row shards of the piece, later
        self.dim, self.cut, self.layout, self.shards_after = dim, cut, layout, shards_after

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight, bias = module.weight, module.bias
        piece = self.cut(weight.data, self.dim, device_mesh.size(), device_mesh.get_local_rank(), self.shards_after)
        module.weight = nn.Parameter(DTensor.from_local(piece, device_mesh, [Shard(self.dim)], run_check=False,
                                                        shape=weight.shape, stride=weight.stride()),
                                     requires_grad=False)
        if bias is not None:  # a column-parallel bias is cut with the rows; a row-parallel one is added once, whole
            placement = Shard(0) if self.dim == 0 else Replicate()
            module.bias = nn.Parameter(distribute_tensor(bias.data, device_mesh, [placement]),
                                       requires_grad=bias.requires_grad)
        if self.dim == 0:
            module.register_forward_pre_hook(lambda _m, args: self._whole_input(args, device_mesh))
            module.forward = self._column_forward(module)
        else:
            module.forward = self._row_forward(module, device_mesh)
        return module

    def _whole_input(self, args: tuple, mesh: DeviceMesh) -> tuple:
        """The input whole on every rank (gathered from sequence chunks under SP); its gradient, partial on each
        rank (this rank's output features), summed back over tp in backward."""
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.layout], run_check=False)
        return (x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]), *args[1:])

    @staticmethod
    def _column_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        inner = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            with local_parameters(module):
                return inner(x)  # this rank's output features, a plain tensor (as ColwiseParallel's local output)
        return forward

    def _row_forward(self, module: nn.Module, mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                x = x.redistribute(mesh, [Shard(-1)]).to_local()
            with local_parameters(module):
                partial = nn.functional.linear(x, module.weight)
            out = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [self.layout])
            if module.bias is not None:
                out = out + module.bias
            return out.to_local()
        return forward


def quantized_style(style: str | ParallelStyle, cut: Callable[..., torch.Tensor], *, sequence_parallel: bool = False,
                    input_gathered: bool = False, shards_after: int = 1) -> QuantizedLinear:
    """The style a plan's 'colwise' or 'rowwise' becomes on a layer with a quantized weight."""
    args = BuildArgs(sequence_parallel, input_gathered=input_gathered)
    name = HF_ALIASES.get(style, style) if isinstance(style, str) else None
    if name == "colwise":
        return QuantizedLinear(0, cut, args.column_input, shards_after)
    return QuantizedLinear(1, cut, args.residual, shards_after)

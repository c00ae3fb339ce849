"""What a model costs, read off one forward on the meta device: the planner's input about the model.

Nothing is allocated and nothing is hand-written per model. From a meta-device copy of the user's module and one
example batch this records:

* every parameter's shape, dtype and trainability, the block list, and the pipeline stage plan of any stage count
  (the engine's own ``plan_stages`` / ``plan_hf_stages``);
* the forward FLOPs of each block and of what runs before and after the blocks (torch's ``FlopCounterMode``
  formulas), attention apart from the rest (it grows with the square of the sequence), with what each attention
  call masks: torch's formulas count the whole score matrix, a causal or sliding-window kernel does only its part;
* what selective activation checkpointing keeps of each block (the outputs of the ops its policy names,
  ``techniques.recompute.recompute.SelectivePolicy``, asked op by op as the engine's policy asks) and the matmul
  FLOPs it recomputes;
* the tensors autograd saves for backward (``saved_tensors_hooks``), per block and outside the blocks, each sorted
  by how tensor parallelism lays it out: produced downstream of a column-parallel layer and before the row-parallel
  one that reduces it (``sharded``: split over tp), the input a column-parallel layer saves, token ids and targets,
  and what follows a head that gathers its output (``gathered``: whole, also under sequence parallelism), or the
  residual stream (``residual``: whole, split over tp under sequence
  parallelism). The sort follows the model's own tensor-parallel plan, propagated op by op through the trace;
* the bytes of optimizer state per parameter element, by running the module's own ``configure_optimizers`` for one
  step on meta gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from lightning_par._compat import (
    autocast_accepts_meta,
    inner_tensor_names,
    local_tensor,
    torch_dispatch_mode,
    tree_leaves,
    tree_map,
)
from lightning_par.flop_formulas import ATTENTION_OPS, FORMULAS
from lightning_par.parallel.hf import outermost_hf_models
from lightning_par.parallel.modules import clean_name, find_block_list
from lightning_par.techniques.context.context_sharding import blockwise_share
from lightning_par.techniques.experts.experts import find_experts, num_experts_of
from lightning_par.techniques.float8.float8_layers import ALIGNMENT as FLOAT8_ALIGNMENT
from lightning_par.techniques.recompute.recompute import SelectivePolicy
from lightning_par.techniques.tensor.sequence_regather import first_tensor_argument
from lightning_par.techniques.tensor.tensor_plan import (
    gathers_its_input,
    resolve_traced_plan,
    sharded_dims,
    validate_tp_plan,
)
from lightning_par.techniques.tensor.tensor_styles import style_price

#: the sections a profile has besides its blocks: what runs before them (embeddings) and after them (final norm,
#: head, loss)
END_SECTIONS = ("first", "last")

_aten = torch.ops.aten


@dataclass
class SavedBytes:
    """Bytes autograd saves for backward at the traced (batch, sequence), by tensor-parallel layout."""

    sharded: int = 0
    gathered: int = 0  # whole on every tp rank: index tensors, a 'colwise_rep' output, partial sums
    residual: int = 0
    vocab: int = 0  # downstream of a vocabulary-parallel head: split over tp under loss parallelism
    #: a column-parallel layer's input, whole: under sequence parallelism all-gathered from the sequence chunks,
    #: and saved as this rank's chunk where they are gathered again in backward (``inputs_chunked``)
    layer_input: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        setattr(self, kind, getattr(self, kind) + nbytes)

    @property
    def total(self) -> int:
        return self.sharded + self.gathered + self.residual + self.vocab + self.layer_input

    def per_rank(self, tp: int, cp: int, sequence_sharded: bool, vocab_sharded: bool, scale: float = 1.0,
                 inputs_chunked: bool = False) -> float:
        """This rank's share for a layout, ``scale`` times the traced tokens (``CostSheet``'s ``sequence_sharded``,
        ``vocab_sharded``, ``inputs_chunked``)."""
        residual = self.residual / tp if sequence_sharded else self.residual
        vocab = self.vocab / tp if vocab_sharded else self.vocab
        layer_input = self.layer_input / tp if sequence_sharded and inputs_chunked else self.layer_input
        return scale * (self.sharded / tp + self.gathered + residual + vocab + layer_input) / cp


@dataclass
class Section:
    """One block, or what runs before (``first``) or after (``last``) the blocks."""

    flops: float = 0.0  # forward, without attention
    attention_flops: float = 0.0  # forward attention kernels, the whole score matrix (torch's formulas)
    #: each ``scaled_dot_product_attention`` call: (its share of ``attention_flops``, causal, sliding window)
    attention_calls: list[tuple[float, bool, int | None]] = field(default_factory=list)
    saved: SavedBytes = field(default_factory=SavedBytes)
    input_bytes: int = 0  # the block's input (what activation checkpointing keeps)
    #: saved layer inputs sequence parallelism gathers from chunks: what is gathered again in backward where
    #: they are saved as chunks
    regathered_inputs: int = 0
    kv_bytes: int = 0  # keys and values entering attention (what context parallelism passes around the ring)
    #: queries entering attention and the outputs leaving it (what Ulysses' all-to-all moves beside keys and values)
    qo_bytes: int = 0
    #: the most query heads of one attention call (Ulysses splits them over the cp ranks), and its key/value heads
    attention_heads: int = 0
    attention_kv_heads: int = 0
    #: the largest score matrix of one attention call, in elements (batch x heads x queries x keys): what the
    #: context-parallel math path materializes, a block of it at a time (``ContextParallel.account``)
    attention_scores: int = 0
    selective_kept: SavedBytes = field(default_factory=SavedBytes)  # outputs selective checkpointing keeps
    #: forward FLOPs (attention apart) that full and selective checkpointing run again in backward: up to the last
    #: op that saves a tensor for backward, where torch's recomputation stops
    full_recompute_flops: float = 0.0
    selective_recompute_flops: float = 0.0
    #: outputs of row-parallel layers: sequence parallelism reduce-scatters them, selective checkpointing keeps that
    reduce_scattered_bytes: int = 0
    #: the rows its experts modules receive (one per token and routing choice, hidden wide): what expert
    #: parallelism's all-to-all sends out and back, in forward and again in backward
    routed_bytes: int = 0
    routed_rows: int = 0  # those rows (tokens x routing choices)
    #: the routing choices per token where the experts module receives tokens with their choices (transformers'
    #: ``(hidden_states, top_k_index, top_k_weights)``: expert parallelism then sends a token once per rank that
    #: holds one of its experts, ``techniques.experts.expert_parallel.dispatched_bytes``); 0 where it receives rows
    #: already one per choice
    routed_choices: int = 0
    #: of ``flops``, the experts modules' own (their grouped matmuls), and the experts' width those FLOPs imply
    #: (``expert_flops / (2 x matmuls x routed_rows x hidden)``: a gated expert's three matmuls, an ungated one's
    #: two), what the planner needs to price their skinny matmuls (``devices.GroupedMatmulCurve``)
    expert_flops: float = 0.0
    expert_width: float = 0.0
    #: of ``saved``, what the experts modules save that is not as wide as the model (their matmuls' outputs, the
    #: activation's input and output: the ``expert_width``-wide intermediates), which expert tensor parallelism
    #: would split over tp (``price_experts_as``)
    expert_saved: int = 0
    #: ``saved`` as autocast alone (no half-precision parameters) leaves it: in half precision, the tensors the
    #: matmul family saves (autocast casts them first: ``LOWERED_BY_AUTOCAST``) and any other saved tensor computed
    #: from half-precision ones alone (an activation of a matmul's output); in the traced dtype, the rest (norms,
    #: the residual stream, the loss's logits). A storage both save is in both: under autocast its half-precision
    #: copy and itself are alive at once
    autocast_lowered: SavedBytes = field(default_factory=SavedBytes)
    autocast_kept: SavedBytes = field(default_factory=SavedBytes)
    #: bytes (traced dtype) of the parameters the matmul family reads: autocast saves a half-precision copy of each
    autocast_weight_bytes: int = 0
    #: bytes the forward's other ops read and write (norms, activations, residual adds, casts, rotary embeddings,
    #: routing, the loss's softmax over the vocabulary; not the matmuls, not the attention kernels, not views), by
    #: the tensor-parallel layout of their outputs: work a GPU's memory bandwidth bounds, priced apart from the
    #: matmuls' FLOPs where the hardware says how fast its memory is (``Hardware.memory_bandwidth``)
    memory_traffic: SavedBytes = field(default_factory=SavedBytes)
    #: of ``flops``, the matmuls float8 training converts (a block's linear layers whose weights have both dimensions
    #: multiples of ``float8_layers.ALIGNMENT``; not the experts), and the elements its casts read per micro-batch:
    #: those matmuls' inputs and outputs (whose gradients backward casts), and their weights
    float8_flops: float = 0.0
    float8_cast_elements: int = 0
    float8_weight_elements: int = 0

    def attention_work(self, seq_len: int) -> float:
        """``attention_flops`` as the kernels do them at sequence length ``seq_len`` (still at the traced tokens): a
        causal kernel computes the lower triangle of the score matrix, a sliding-window one the band of the window
        (flash and flex attention skip the rest; a kernel given an explicit mask tensor does not, and is counted
        whole)."""
        masked = sum(f for f, _, _ in self.attention_calls)
        return self.attention_flops - masked + sum(f * computed_share(seq_len, causal, window)
                                                   for f, causal, window in self.attention_calls)

    def blockwise_work(self, seq_len: int, cp: int) -> float:
        """``attention_flops`` as the engine's context-parallel math path computes them over ``cp`` ranks (load
        balanced, its default): whole blocks, never the lower triangle of one, so a causal score matrix costs
        ``(cp + 1) / 2cp`` of it, and a sliding window all the blocks it does not hide entirely
        (``context_sharding.blockwise_share``)."""
        masked = sum(f for f, _, _ in self.attention_calls)
        chunk = seq_len / (2 * cp)
        return self.attention_flops - masked + sum(
            f * blockwise_share(cp, chunk, window) if causal else f for f, causal, window in self.attention_calls)


def computed_share(seq_len: int, causal: bool, window: int | None) -> float:
    """The share of a (seq x seq) score matrix an attention kernel computes: query i sees keys ``i - window + 1``
    to ``i`` (causal, window), 0 to ``i`` (causal), or all of them."""
    if not causal:
        return 1.0
    w = seq_len if window is None or window <= 0 else min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len**2


#: the sliding window of the Hugging Face attention being traced (its module's ``sliding_window``), for the marker
_WINDOW: ContextVar[int | None] = ContextVar("lightning_par_attention_window", default=None)


@dataclass
class ParamInfo:
    fqn: str
    shape: tuple[int, ...]
    itemsize: float  # bytes per element as stored (not whole for 4-bit weights: ``stored_itemsize``)
    trainable: bool
    section: str  # the block it belongs to, or "first" / "last" (registered before / after the block list)
    tp_dim: int | None  # the dimension tensor parallelism splits (None: whole on every tp rank)
    expert: bool = False  # held by an experts module (stacked on dim 0, one row per expert)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ModelProfile:
    """The model's costs at the traced micro-batch (``batch`` samples of ``seq_len`` tokens)."""

    name: str
    params: list[ParamInfo]
    block_list: str
    blocks: list[str]
    sections: dict[str, Section]  # "first", each block FQN, "last"
    batch: int
    seq_len: int
    hidden_bytes: int  # one token's residual-stream activation (bytes), what stages hand on
    optimizer_bytes_per_element: float  # optimizer state per trainable parameter element
    tp_plan: dict[str, Any]  # the resolved plan (module FQN -> style) on the whole model, or {} without one
    meta_module: nn.Module = field(repr=False)  # the meta copy: stage plans and tp checks are read from it
    tp_source_plan: dict[str, Any] = field(default_factory=dict)  # the plan as given (globs), validated per tp
    tp_checks: dict[tuple, bool] = field(default_factory=dict, repr=False)
    #: the fewest experts of its experts modules (the ep sizes that fit divide it); 0: no mixture of experts
    num_experts: int = 0
    #: group-limited routing (DeepSeek-V3's ``n_group``, ``topk_group`` of its config): a token's choices fall in
    #: ``topk_group`` of ``n_group`` groups of consecutive experts; None: anywhere
    expert_groups: tuple[int, int] | None = None
    #: the dtype the floating-point weights were traced in (``profile_model``'s ``dtype``, else most of theirs)
    dtype: torch.dtype = torch.float32
    hidden_itemsize: int = 4  # the bytes of one element of the residual stream (the blocks' input)
    #: how tp ranks hold the experts: "whole" (every tp rank all of its experts, routing the micro-batch's tokens:
    #: the engine, ``techniques.tensor.tensor_plan._inside_experts``), or as other software runs them, set only by
    #: ``price_experts_as`` to price published runs: "split" (each tp rank ``1 / tp`` of every expert's width) or
    #: "folded" (whole experts, each tp rank routing its sequence chunk to expert groups that span the tp ranks)
    experts_over_tp: str = "whole"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def expert_tp_share(self, tp: int) -> float:
        """The share of its experts (weights, FLOPs, intermediates) one of ``tp`` tensor-parallel ranks holds: all of
        them as the engine runs them, ``1 / tp`` as priced for software that splits or folds them."""
        return 1.0 if self.experts_over_tp == "whole" else 1 / tp

    def param_bytes(self, trainable_only: bool = False) -> int:
        return sum(p.numel * p.itemsize for p in self.params if p.trainable or not trainable_only)


#: Megatron-Core's expert tensor parallelism: ``--expert-tensor-parallel-size`` (ETP) defaults to the tp size,
#: and before that option existed its experts were always split over tp; ETP 1 folds the tp ranks into the experts'
#: own mesh (expert groups span them; with sequence parallelism, which Megatron requires for experts under tp, each
#: tp rank routes its own sequence chunk)
EXPERTS_OVER_TP = ("split", "folded")  # ETP = TP, ETP = 1


def price_experts_as(profile: ModelProfile, experts_over_tp: str) -> ModelProfile:
    """``profile`` priced as software that holds the experts differently under tp (``ModelProfile.experts_over_tp``):
    "split", each tp rank holding and running ``1 / tp`` of each expert's width on every token of the micro-batch
    (its tp group gathers the routed rows and reduce-scatters the outputs: ``ExpertParallel.account``); "folded",
    whole experts sharded over the tp ranks as well as the data ranks, each tp rank routing ``1 / tp`` of the
    tokens. The engine runs neither (its experts stay whole on every tp rank): this prices published runs as their
    software ran them (``benchmarks/published/cases.py``), never an engine layout."""
    if experts_over_tp not in EXPERTS_OVER_TP:
        raise ValueError(f"price_experts_as: experts_over_tp={experts_over_tp!r}; choose from "
                         f"{sorted(EXPERTS_OVER_TP)} ('whole', the engine's, is how every profile is traced).")
    if not profile.num_experts:
        raise ValueError(f"price_experts_as: {profile.name} has no experts modules.")

    def split_dim(p: ParamInfo) -> int:  # the width for "split", the experts themselves for "folded"
        return 0 if experts_over_tp == "folded" else max(range(1, len(p.shape)), key=lambda d: p.shape[d])

    params = [replace(p, tp_dim=split_dim(p)) if p.expert and len(p.shape) > 1 and p.tp_dim is None else p
              for p in profile.params]
    return replace(profile, params=params, experts_over_tp=experts_over_tp)


# ---- the trace -------------------------------------------------------------------------------------------------
def _cdata(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


class _StorageMap:
    """Values keyed by a tensor's storage, forgotten when that storage dies (its address is then reused)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[StorageWeakRef, Any]] = {}

    def set(self, t: torch.Tensor, value: Any) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        self._items[ref.cdata] = (ref, value)

    def get(self, t: torch.Tensor) -> Any:
        item = self._items.get(_cdata(t))
        return None if item is None or item[0].expired() else item[1]

    def pop(self, t: torch.Tensor) -> None:
        self._items.pop(_cdata(t), None)


#: the functions autocast runs in half precision whose saved tensors the trace counts (torch's autocast op lists,
#: CUDA and CPU alike: the matmul family, convolutions, attention); everything else keeps its inputs' dtype
LOWERED_BY_AUTOCAST = frozenset({
    F.linear, F.bilinear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
    torch.Tensor.baddbmm, torch.addbmm, torch.mv, torch.addmv, torch.addr, torch.chain_matmul,
    torch.linalg.multi_dot, torch.einsum, F.prelu, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
    F.conv_transpose2d, F.conv_transpose3d, F.scaled_dot_product_attention,
})


#: ops autocast runs in fp32 whatever their inputs (torch's autocast fp32 lists, CUDA and CPU): their outputs are
#: never half precision, even of half inputs
_FP32_UNDER_AUTOCAST = frozenset(getattr(torch.ops.aten, name) for name in (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
    "norm", "cosine_similarity", "nll_loss", "nll_loss_forward", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "binary_cross_entropy_with_logits", "cdist", "renorm", "logsumexp", "prod",
    "softmax", "_softmax", "log_softmax", "_log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "sum",
    "mean", "var_mean", "rms_norm", "_fused_rms_norm") if hasattr(torch.ops.aten, name))


class _Trace(torch_dispatch_mode()):  # type: ignore[misc]
    """Counts FLOPs per section and propagates the tensor-parallel layout of every tensor, op by op."""

    def __init__(self) -> None:
        super().__init__()
        self.section = "first"
        self.sections: dict[str, Section] = {"first": Section()}
        self.layout = _StorageMap()  # storage -> "sharded", "vocab" or "whole" (gathered: not split by SP either)
        self.in_attention = False
        #: inside an experts module: (rows, the model's width x the expert's matmuls, FLOPs so far)
        self.in_experts: tuple[int, int, float] | None = None
        self.expert_input_width = 0  # the model's width, as the experts module receives its rows
        self.saved = _StorageMap()  # saved tensors stay alive until backward: their storages are not reused meanwhile
        self.params: set[int] = set()
        self.gathered_inputs = _StorageMap()
        self.regatherable_inputs = _StorageMap()  # of those, the ones sequence parallelism gathers from chunks
        self.policy = SelectivePolicy()  # selective checkpointing's, for the current block
        self.kept: dict[str, list[torch.Tensor]] = {}  # per block: outputs selective checkpointing would keep
        self.kept_lse: dict[str, list[tuple[str, int]]] = {}  # per block: attention's log-sum-exp (layout, bytes)
        self.partial_sums = _StorageMap()  # row-parallel outputs before their reduction
        self.flops_since_entry = {"full": 0.0, "selective": 0.0}  # what a recomputation of the block would run
        self.lowering = 0  # > 0 inside a function autocast lowers (``_AutocastMarker``)
        self.autocast_saved = _StorageMap()  # storage -> the ways autocast would save it ("lowered", "kept")
        self.half = _StorageMap()  # storages autocast would hold in half precision (``_propagate_half``)
        self.autocast_params: set[int] = set()  # parameters whose half-precision copy is counted

    def enter_block(self, name: str) -> None:
        self.section, self.policy = name, SelectivePolicy()
        self.flops_since_entry = {"full": 0.0, "selective": 0.0}
        self.kept.setdefault(name, [])
        self.kept_lse.setdefault(name, [])

    def _float8_candidate(self, sec: Section, args: tuple, out: torch.Tensor, flops: float) -> None:
        """A block's matmul of a parameter: what float8 training converts where the weight is aligned."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        weight = next((t for t in tensors if t.ndim == 2 and _cdata(t) in self.params), None)
        if weight is None or any(d % FLOAT8_ALIGNMENT for d in weight.shape):
            return
        sec.float8_flops += flops
        sec.float8_cast_elements += out.numel() + sum(t.numel() for t in tensors if t is not weight and t.ndim == 2)
        sec.float8_weight_elements += weight.numel()

    def kind(self, t: torch.Tensor) -> str:
        """How tensor parallelism lays ``t`` out: "sharded", "vocab", "gathered", "layer_input" or "residual"."""
        kind = self.layout.get(t) or ("layer_input" if self.regatherable_inputs.get(t)
                                      else "gathered" if self.gathered_inputs.get(t) or _is_index(t) else "residual")
        return "gathered" if kind == "whole" else kind

    def record_saved(self, t: torch.Tensor, nbytes: int | None = None) -> None:
        """One tensor autograd keeps for backward (each storage once; parameters are not activations)."""
        if _cdata(t) in self.params:
            return
        nbytes = nbytes if nbytes is not None else t.untyped_storage().nbytes()
        half = self.half.get(t)
        way = "lowered" if self.lowering or half else "kept"
        ways = self.autocast_saved.get(t) or ()
        if self.lowering and not half:
            # autocast casts a full-precision input anew for every call that lowers it (a norm's output read by
            # separate q, k and v projections: three half copies)
            self.sections[self.section].autocast_lowered.add(self.kind(t), t.numel() * t.element_size())
        elif way not in ways:  # a storage saved both ways counts in both
            self.autocast_saved.set(t, (*ways, way))
            getattr(self.sections[self.section], f"autocast_{way}").add(self.kind(t), nbytes)
        if self.saved.get(t) is not None:
            return
        self.saved.set(t, self.section)
        kind = self.kind(t)
        self.sections[self.section].saved.add(kind, nbytes)
        if (self.in_experts is not None and t.is_floating_point() and t.ndim
                and t.shape[-1] != self.expert_input_width):
            self.sections[self.section].expert_saved += nbytes
        if kind == "layer_input":
            self.sections[self.section].regathered_inputs += 1

    def _propagate_half(self, key: Any, inputs: Any, out: Any) -> None:
        """What autocast would hold in half precision: the outputs of the functions it lowers, and of any op whose
        floating inputs (0-d ones aside: they do not promote) are all half, unless autocast runs that op in fp32
        (norms, softmax, reductions, the losses). An activation function applied to a matmul's output, say,
        saves half precision too."""
        if key in _FP32_UNDER_AUTOCAST:
            return
        floats = [a for a in tree_leaves(inputs)
                  if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 0]
        if not self.lowering and (not floats or not all(self.half.get(a) for a in floats)):
            return
        viewed = {_cdata(a) for a in floats}  # a view inside a lowered call is of its full-precision input
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and _cdata(o) not in viewed:
                self.half.set(o, True)

    def record_lowered_params(self, args: Any) -> None:
        """The parameters a lowered function reads: autocast saves a half-precision copy of each (its cache keeps
        one per parameter for the forward)."""
        for a in tree_leaves(args):
            if isinstance(a, torch.Tensor) and _cdata(a) in self.params and _cdata(a) not in self.autocast_params:
                self.autocast_params.add(_cdata(a))
                # the whole parameter: a view of it (an expert's slice on meta) still has all of it cast
                self.sections[self.section].autocast_weight_bytes += a.untyped_storage().nbytes()

    def selective(self, func: Any, out: Any, flops: float | None) -> None:
        """What selective checkpointing does with this op of a block: keep its output, or recompute it."""
        if self.section not in self.kept or self.in_attention:
            return
        if flops:
            self.flops_since_entry["full"] += flops
        if self.policy.keeps(func):
            self.kept[self.section].extend(o for o in tree_leaves(out)
                                           if isinstance(o, torch.Tensor))
        elif flops:
            self.flops_since_entry["selective"] += flops

    def reduce_scattered(self, out: Any) -> None:
        """A row-parallel layer's output: partial sums, whole on every tp rank until reduced (its matmul's output,
        which selective checkpointing may keep, shares the storage)."""
        if self.section in self.kept and isinstance(out, torch.Tensor):
            self.sections[self.section].reduce_scattered_bytes += out.numel() * out.element_size()
            self.partial_sums.set(out, True)

    def classify_kept(self) -> None:
        """Sort what selective checkpointing keeps by layout, once the trace is done (a column-parallel module's
        output is marked by its forward hook, after the matmul that made it)."""
        for name, tensors in self.kept.items():
            kept, seen = self.sections[name].selective_kept, set()
            for t in tensors:
                if _cdata(t) not in seen:
                    seen.add(_cdata(t))
                    kind = "gathered" if self.partial_sums.get(t) else self.kind(t)
                    kept.add(kind, t.untyped_storage().nbytes())
            for kind, nbytes in self.kept_lse[name]:
                kept.add(kind, nbytes)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.in_attention:  # attention's own saves are the fused kernel's, recorded by _AttentionMarker
            self.record_saved(t)
            self.recomputation_reaches_here()
        return t

    def recomputation_reaches_here(self) -> None:
        """Something was saved for backward: a recomputation of the block runs at least up to here (torch stops it
        once every saved tensor is back, before the op whose inputs were saved last)."""
        if self.section in self.kept:
            sec = self.sections[self.section]
            sec.full_recompute_flops = self.flops_since_entry["full"]
            sec.selective_recompute_flops = self.flops_since_entry["selective"]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        key = getattr(func, "_overloadpacket", func)
        out = _meta_grouped_mm(func, args, kwargs) if key is _aten._grouped_mm else func(*args, **kwargs)
        formula = FORMULAS.get(key)
        flops = None
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
            sec = self.sections[self.section]
            if key in ATTENTION_OPS or self.in_attention:
                sec.attention_flops += flops
            else:
                sec.flops += flops
                if self.in_experts is not None:
                    rows, hidden, so_far = self.in_experts
                    self.in_experts = (rows, hidden, so_far + flops)
                elif key in _LINEAR_MATMULS and self.section not in END_SECTIONS:
                    self._float8_candidate(sec, args, out, flops)
        self.selective(func, out, flops)
        self._propagate_half(key, (args, kwargs), out)
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        inputs = {self.layout.get(a) for a in tensors}
        layout = next((k for k in ("sharded", "vocab", "whole") if k in inputs), None)
        outputs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if layout is not None:
            for o in outputs:
                self.layout.set(o, layout)
        if formula is None and tensors and outputs and not self.in_attention and not getattr(func, "is_view", False) \
                and key not in _NO_TRAFFIC:
            self.sections[self.section].memory_traffic.add(self.kind(outputs[0]),
                                                           _traffic(key, tensors, outputs, self.params))
        return out


#: the matmuls a linear layer runs (``F.linear`` of a 2-D or flattened input; ``addmm`` with a bias)
_LINEAR_MATMULS = frozenset({_aten.mm, _aten.addmm})

#: ops that move no bytes on a GPU (aliases, metadata) though torch does not mark them as views
_NO_TRAFFIC = frozenset({_aten.detach, _aten.lift_fresh, _aten._local_scalar_dense, _aten.alias,
                         _aten._unsafe_view, _aten.sym_size, _aten.sym_numel, _aten.sym_stride})


#: ops that read only the rows they index (their output's bytes, from wherever they are), and ops that write only
#: the rows they index into their first argument (their source's bytes, read, and the rows updated: read and written)
_GATHERS = frozenset({_aten.index, _aten.index_select, _aten.gather, _aten.embedding, _aten.masked_select})
_SCATTERS = frozenset({_aten.index_add, _aten.index_add_, _aten.index_put, _aten.index_put_, _aten.scatter,
                       _aten.scatter_, _aten.scatter_add, _aten.scatter_add_, _aten.scatter_reduce,
                       _aten.scatter_reduce_, _aten.index_copy, _aten.index_copy_, _aten.masked_scatter})


def _traffic(key: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor], params: set[int]) -> int:
    """The bytes one non-matmul op moves in memory: what it reads and writes, parameters apart (a norm reads its one
    weight vector), the indexed rows only where it indexes (a routed expert's rows, not the whole batch's, per
    expert)."""
    def nbytes(ts: Any) -> int:
        return sum(t.numel() * t.element_size() for t in ts if _cdata(t) not in params)

    if key in _GATHERS:
        return 2 * nbytes(outputs) + nbytes(t for t in inputs if _is_index(t))
    if key in _SCATTERS:  # the source read, the destination's rows read and written (out of place: on a copy)
        copy = 0 if str(key).endswith("_") else 2 * nbytes(inputs[:1])
        return (3 * nbytes(t for t in inputs[1:] if not _is_index(t)) + nbytes(t for t in inputs if _is_index(t))
                + copy)
    return nbytes(inputs) + nbytes(outputs)


def _meta_grouped_mm(func: Any, args: Any, kwargs: dict) -> Any:
    """``_grouped_mm`` on meta tensors: its meta kernel accepts only bf16 inputs (torch 2.13; CPU and CUDA run fp32
    too): traced in bf16, returned in the dtype the real kernel returns."""
    a, b = args[0], args[1]
    if a.device.type != "meta" or (a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16):
        return func(*args, **kwargs)
    out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
    return out.to(kwargs.get("out_dtype") or a.dtype)


class _AttentionMarker(TorchFunctionMode):
    """Marks the ops of ``F.scaled_dot_product_attention`` as attention. On meta it decomposes into plain matmuls,
    which would save the (seq x seq) probabilities; the fused kernels a real run uses (flash, memory-efficient, CPU
    flash) save q, k, v, the output and one fp32 log-sum-exp per query and head: those are recorded instead."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        key, value = args[1], args[2]
        section = self.trace.sections[self.trace.section]
        section.kv_bytes += key.numel() * key.element_size() + value.numel() * value.element_size()
        query = args[0]
        section.qo_bytes += query.numel() * query.element_size() * (1 + value.size(-1) / query.size(-1))
        if query.size(-3) > section.attention_heads:
            section.attention_heads, section.attention_kv_heads = query.size(-3), key.size(-3)
        section.attention_scores = max(section.attention_scores, query.numel() // query.size(-1) * key.size(-2))
        counted = section.attention_flops
        self.trace.in_attention = True
        try:
            # laid out as the fused kernels return it, (batch, seq, heads, dim) in memory: the usual
            # ``out.transpose(1, 2).contiguous()`` after attention is then a view, as in a real run
            out = func(*args, **(kwargs or {})).transpose(1, 2).contiguous().transpose(1, 2)
        finally:
            self.trace.in_attention = False
        call = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:6]), **(kwargs or {}))
        causal = bool(call.get("is_causal", False)) and call.get("attn_mask") is None
        section.attention_calls.append((section.attention_flops - counted, causal, _WINDOW.get() if causal else None))
        if torch.is_grad_enabled():
            for t in (args[0], key, value, out):
                self.trace.record_saved(t)
            self.trace.recomputation_reaches_here()
            lse = query.numel() // query.size(-1) * 4  # (batch, heads, seq) in fp32
            lse_kind = self.trace.layout.get(query) or "residual"
            self.trace.sections[self.trace.section].saved.add(lse_kind, lse)
            self.trace.sections[self.trace.section].autocast_kept.add(lse_kind, lse)  # fp32 under autocast too
            if self.trace.section in self.trace.kept:  # selective checkpointing keeps the kernel's outputs
                self.trace.kept[self.trace.section].append(out)
                self.trace.kept_lse[self.trace.section].append((lse_kind, lse))
        return out


class _AutocastMarker(TorchFunctionMode):
    """Marks what runs inside a function autocast lowers (``LOWERED_BY_AUTOCAST``), so that the trace, made in the
    model's own dtype on meta tensors (autocast does not act on them), can tell what autocast would save in half
    precision from what it would keep (``Section.autocast_lowered`` and ``autocast_kept``)."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in LOWERED_BY_AUTOCAST:
            return func(*args, **kwargs)
        if torch.is_grad_enabled():
            self.trace.record_lowered_params((args, kwargs))
        self.trace.lowering += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.trace.lowering -= 1


def _mark(saved: _StorageMap, args: tuple) -> None:
    for a in args:
        if isinstance(a, torch.Tensor):
            saved.set(a, True)


def _is_index(t: torch.Tensor) -> bool:
    """Token ids, positions and targets: whole on every tp rank (sequence parallelism splits the hidden states
    after the embedding, not its indices), split by cp only."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _set_layout(trace: _Trace, out: Any, layout: str | None) -> None:
    for o in tree_leaves(out):
        if isinstance(o, torch.Tensor):
            if layout is None:
                trace.layout.pop(o)
            else:
                trace.layout.set(o, layout)


def profile_model(module: nn.Module, batch: Any, *, block_list: str | None = None,
                  tp_plan: dict[str, Any] | None = None, step: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                  share: tuple[Any, ...] = (), dtype: torch.dtype | None = None,
                  prepare: Callable[[nn.Module, list[str]], None] | None = None) -> ModelProfile:
    """Trace ``module`` (real or meta; it is copied to meta) on one ``batch`` (one micro-batch's worth; its tensors
    are only looked at for shapes). ``step(module, batch)`` returns the loss; default: the module's
    ``training_step``, else ``loss(forward(x), y)``, else cross-entropy of ``forward(x)`` against ``y``.
    ``dtype``: the copy's floating-point weights cast to it first, as a precision that stores them so (Lightning's
    ``"bf16-true"`` converts the module before training) will have them: weights, gradients, optimizer state and
    activations are then traced at that size (``planner.predict.trace_dtype``). ``prepare(copy, blocks)``: what the
    techniques do to the parameters before training, done to the copy first (each technique's
    ``Options.before_trace``: QLoRA's 4-bit weights); a parameter stored as a tensor subclass is counted at the
    bytes of what it holds."""
    from lightning_par.techniques.pipeline.pipeline import meta_clone

    model = meta_clone(module, share=share)
    if dtype is not None:
        model.to(dtype)  # floating-point parameters and buffers only
    weights_dtype = dtype or _floating_dtype(model)
    _plan_attention(model)
    block_fqn, container = find_block_list(model, block_list)
    blocks = [f"{block_fqn}.{n}" for n in container._modules]
    if prepare is not None:
        prepare(model, blocks)
    try:
        # as loss parallelism takes it (a Hugging Face head keeps its logits sharded; without loss parallelism it
        # gathers them, which the accounts price alike): the search then weighs layouts with and without it
        source_plan = resolve_traced_plan(model, tp_plan)
        resolved = validate_tp_plan(model, source_plan, 1)
    except ValueError:
        source_plan, resolved = {}, {}
    meta_batch = tree_map(  # floating inputs in the weights' dtype, as the precision plugin converts them
        lambda t: t.to("meta", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
        if isinstance(t, torch.Tensor) else t, batch)
    trace = _Trace()
    trace.params = {_cdata(p) for p in model.parameters()}
    hidden_bytes = 0
    hidden_itemsize = 4

    hooks = []
    for i, name in enumerate(blocks):
        def enter(_m: nn.Module, args: tuple, kwargs: dict, _name: str = name) -> None:
            nonlocal hidden_bytes, hidden_itemsize
            trace.enter_block(_name)
            sec = trace.sections.setdefault(_name, Section())
            first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if isinstance(first, torch.Tensor):
                sec.input_bytes = first.untyped_storage().nbytes()
                hidden_bytes, hidden_itemsize = first.numel() * first.element_size(), first.element_size()

        def leave(_m: nn.Module, _args: tuple, _out: Any, _last: bool = i == len(blocks) - 1) -> None:
            if _last:
                trace.section = "last"  # (not a block: selective checkpointing does not apply)
                trace.sections.setdefault("last", Section())
        hooks.append(model.get_submodule(name).register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(model.get_submodule(name).register_forward_hook(leave))
    gathering = [name for name, style in resolved.items() if style == "gather_sequence"]
    for name, style in resolved.items():
        price = style_price(style)  # what the style's row says of its layouts (``tensor_styles.TPPrice``)
        sub = model.get_submodule(name)
        if price.saves_whole_input:
            hooks.append(sub.register_forward_pre_hook(lambda _m, args: _mark(trace.gathered_inputs, args)))
        if gathers_its_input(style, any(name.startswith(g + ".") for g in gathering)):
            # the input the engine gathers from the sequence chunks (and again in backward, saving the chunk)
            hooks.append(sub.register_forward_pre_hook(
                lambda _m, args, kwargs: _mark(trace.regatherable_inputs, (first_tensor_argument(args, kwargs),)),
                with_kwargs=True))
        layout = None if price.output == "reduced" else price.output  # reduced: whole again, as any input is
        if price.output is not None:
            hooks.append(sub.register_forward_hook(
                lambda _m, _a, out, _layout=layout: _set_layout(trace, out, _layout)))
        if price.reduce_scatters:
            hooks.append(sub.register_forward_hook(lambda _m, _a, out: trace.reduce_scattered(out)))
    experts = find_experts(model)
    for _, sub in experts:
        hooks.append(sub.register_forward_pre_hook(lambda m, args: _count_routed(trace, args, m)))
        hooks.append(sub.register_forward_hook(lambda _m, _a, _out: _count_expert_flops(trace)))
    try:
        with ExitStack() as stack, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(trace.pack, lambda t: t))
            stack.enter_context(trace)
            stack.enter_context(_AttentionMarker(trace))
            stack.enter_context(_AutocastMarker(trace))  # entered last, it sees attention first
            stack.enter_context(autocast_accepts_meta())
            if dtype is not None:  # tensors the forward creates, as under the precision's forward context
                stack.enter_context(default_dtype(dtype))
            try:
                loss = _run_step(model, meta_batch, step)
            except Exception as e:  # noqa: BLE001 - any failure of the user's code on meta tensors
                raise ValueError(
                    f"The planner could not trace {type(module).__name__} on the meta device ({type(e).__name__}: "
                    f"{e}). It runs one forward and loss on a meta copy of the model and the batch: the model's "
                    f"forward must not read tensor values (no `if x.sum() > 0`, no `.item()`), and the batch must be "
                    f"what training_step receives (inputs, targets). Pass a `step=fn(module, batch) -> loss` that "
                    f"computes the loss without reading values.") from e
            del loss
    finally:
        for h in hooks:
            h.remove()
    trace.classify_kept()
    sample = next(t for t in tree_leaves(meta_batch) if isinstance(t, torch.Tensor))
    sections = {k: trace.sections.get(k, Section()) for k in ("first", *blocks, "last")}
    tp_dims = sharded_dims(resolved)
    named = list(model.named_parameters())
    first_block = next((i for i, (n, _) in enumerate(named) if n.startswith(block_fqn + ".")), len(named))
    expert_prefixes = tuple(name + "." for name, _ in experts)
    return ModelProfile(
        name=type(module).__name__,
        params=[ParamInfo(n, tuple(p.shape), stored_itemsize(p), p.requires_grad,
                          _section(n, blocks, "first" if i < first_block else "last"), tp_dims.get(clean_name(n)),
                          clean_name(n).startswith(expert_prefixes) if expert_prefixes else False)
                for i, (n, p) in enumerate(named)],
        block_list=block_fqn, blocks=blocks, sections=sections, batch=int(sample.shape[0]),
        seq_len=int(sample.shape[1]) if sample.ndim > 1 else 1,
        hidden_bytes=hidden_bytes // max(1, int(sample.shape[0]) * (int(sample.shape[1]) if sample.ndim > 1 else 1)),
        optimizer_bytes_per_element=_optimizer_bytes(model, weights_dtype), tp_plan=resolved, meta_module=model,
        tp_source_plan=source_plan, num_experts=min((num_experts_of(m, n) for n, m in experts), default=0),
        expert_groups=_expert_groups(model) if experts else None, dtype=weights_dtype,
        hidden_itemsize=hidden_itemsize)


def stored_itemsize(tensor: torch.Tensor) -> float:
    """Bytes per element of what a parameter holds: its element size, or for a tensor subclass that stores other
    tensors (QLoRA's NF4: 4-bit codes, int8 scales, their factors; 0.516 bytes per weight) their bytes over its
    elements."""
    tensor = local_tensor(tensor)  # a DTensor: what its local shard holds
    names = inner_tensor_names(tensor)
    if not names or tensor.numel() == 0:
        return tensor.element_size()
    inner = [getattr(tensor, name) for name in names]
    return sum(t.numel() * t.element_size() for t in inner) / tensor.numel()


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of most of the model's floating-point weights (by count); fp32 without any."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__, default=torch.float32)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch``'s default dtype set to ``dtype`` inside, restored after (as Lightning's true precisions do)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _expert_groups(model: nn.Module) -> tuple[int, int] | None:
    """``(n_group, topk_group)`` of a Hugging Face config with group-limited routing (DeepSeek-V3, GLM-4.5, ...),
    where it limits anything (more than one group, fewer chosen)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        groups, chosen = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        if isinstance(groups, int) and isinstance(chosen, int) and 1 <= chosen < groups:
            return groups, chosen
    return None


def _count_routed(trace: _Trace, args: tuple, module: nn.Module) -> None:
    """The rows an experts module receives: ``x`` grouped by expert (torchtitan's contract) or the tokens with
    their ``top_k_index`` (transformers': each token goes to k experts)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return
    x = args[0]
    choices = args[1].shape[-1] if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].ndim == 2 else 1
    section = trace.sections.setdefault(trace.section, Section())
    section.routed_bytes += x.numel() * x.element_size() * choices
    rows = x.numel() // max(1, x.shape[-1]) * choices
    section.routed_rows += rows
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].ndim == 2:
        section.routed_choices = choices
    matmuls = 3 if getattr(module, "has_gate", True) else 2  # transformers' ungated experts: up and down only
    trace.in_experts = (rows, x.shape[-1] * matmuls, 0.0)
    trace.expert_input_width = x.shape[-1]


def _count_expert_flops(trace: _Trace) -> None:
    """The FLOPs of the experts call that just ended, and the width they imply (the mean over the section's
    calls, weighted by their FLOPs)."""
    if trace.in_experts is None:
        return
    rows, hidden, flops = trace.in_experts
    trace.in_experts = None
    section = trace.sections.setdefault(trace.section, Section())
    if flops and rows and hidden:
        width = flops / (2 * rows * hidden)  # ``hidden`` here: the model's width x the expert's matmuls
        total = section.expert_flops + flops
        section.expert_width = (section.expert_width * section.expert_flops + width * flops) / total
        section.expert_flops = total




def _section(fqn: str, blocks: list[str], outside: str) -> str:
    """The block holding parameter ``fqn``, else ``outside`` ("first"/"last": registered before/after the block
    list, as the pipeline cuts)."""
    return next((block for block in blocks if fqn.startswith(block + ".")), outside)


def _run_step(model: nn.Module, batch: Any, step: Callable[[nn.Module, Any], torch.Tensor] | None) -> torch.Tensor:
    if step is not None:
        return step(model, batch)
    x, y = batch[0], batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    loss_method = getattr(model, "loss", None)
    if callable(loss_method) and y is not None:
        return loss_method(model(x), y)
    training_step = getattr(model, "training_step", None)
    if callable(training_step):
        out = training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _optimizer_bytes(model: nn.Module, dtype: torch.dtype = torch.float32) -> float:
    """Optimizer state bytes per trainable parameter element, from one step of the module's own optimizer on meta
    gradients (AdamW: 8 in fp32). Falls back to Adam's two moments in the weights' ``dtype`` when the module
    configures none that runs on meta."""
    adam = 2.0 * dtype.itemsize
    configure = getattr(model, "configure_optimizers", None)
    if not callable(configure):
        return adam
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = configure()
            optimizer = _first_optimizer(optimizer)
            trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            for p in trainable:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            numel = sum(p.numel() for p in trainable)
            state = sum(t.numel() * t.element_size() for p in trainable for t in optimizer.state[p].values()
                        if isinstance(t, torch.Tensor) and t.numel() == p.numel())
            for p in trainable:
                p.grad = None
        return state / max(1, numel)
    except Exception:  # noqa: BLE001 - an optimizer that cannot run on meta: assume Adam
        return adam


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise TypeError(f"configure_optimizers returned {type(configured).__name__}")


# ---- Hugging Face models on the meta device --------------------------------------------------------------------
PLAN_ATTENTION = "lightning_par_plan"


def _plan_attention(model: nn.Module) -> None:
    """Hugging Face models build their mask with data-dependent checks, which meta tensors cannot answer: give the
    copy an attention that needs no mask (causal and windows are the kernel's business, as under the engine)."""
    hf_models = outermost_hf_models(model)
    if not hf_models:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(PLAN_ATTENTION, _mask_free_attention)
    for _, hf in hf_models:
        hf.set_attn_implementation(PLAN_ATTENTION)


def _mask_free_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    window = _WINDOW.set(kwargs.get("sliding_window", getattr(module, "sliding_window", None)))
    try:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=getattr(module, "is_causal", True), scale=scaling,
            enable_gqa=query.size(1) != key.size(1))
    finally:
        _WINDOW.reset(window)
    return out.transpose(1, 2).contiguous(), None



"""Tensor-parallel plans as data: the style names, where a plan comes from, and its validation.

A plan maps FQN globs (relative to the module it is applied to; ``*`` is one dotted segment, ``**`` crosses
segments) to a style name (one row of ``tensor_styles.py`` each) or a torch ``ParallelStyle``. Nothing here
communicates: validation runs on every rank before the first collective, so a bad plan fails the same way
everywhere instead of hanging.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_par.parallel.hf import hf_ep_plan, is_hf_experts, is_hf_model, outermost_hf_models
from lightning_par.parallel.lora import is_lora_layer, lora_tp_entries
from lightning_par.parallel.modules import fqn_matches
from lightning_par.techniques.tensor.tensor_styles import HF_ALIASES, STYLES, TP_STYLES

#: Hugging Face styles that need HF's own forward hooks or packed weights.
HF_UNSUPPORTED = (
    "packed_colwise", "packed_rowwise", "local_packed_rowwise", "moe_tp_experts",
    "moe_identity_expert", "grouped_gemm",
    "ep_router", "isolated",
)
_HF_NOOP_IN_HF_PLANS = ("replicate", "local", "gather")  # HF "replicate" = keep the full parameter: the default

#: a tensor-parallel plan: FQN glob -> style name or torch ``ParallelStyle`` (``planner.search.Plan`` is another
#: thing: the planner's ranked layouts)
TPPlan = Mapping[str, "str | ParallelStyle"]


#: which dimension of a parameter each ``TPStyle.sharded_size`` attribute splits (Linear weight is (out, in),
#: Embedding weight is (num, dim); a bias is split with the output features)
_DIM_OF = {"out_features": {"weight": 0, "bias": 0}, "in_features": {"weight": 1},
           "num_embeddings": {"weight": 0}, "embedding_dim": {"weight": 1}}


def sharded_dims(resolved: Mapping[str, str | ParallelStyle]) -> dict[str, int]:
    """``{parameter FQN: the dimension tensor parallelism splits}`` for a validated plan (``validate_tp_plan``'s
    result); parameters not listed stay whole on every tp rank. The planner's view of what ``apply_tp`` does."""
    out: dict[str, int] = {}
    for fqn, style in resolved.items():
        if isinstance(style, ParallelStyle):
            style = {ColwiseParallel: "colwise", RowwiseParallel: "rowwise"}.get(type(style), "")
        attr = _sharded_size(style)[0]
        for name, dim in _DIM_OF.get(attr, {}).items():
            out[f"{fqn}.{name}"] = dim
    return out


def prefix_plan(plan: TPPlan, prefix: str) -> dict[str, str | ParallelStyle]:
    """Re-root a plan: ``prefix_plan(GPT_TP_PLAN, "model")`` for a LightningModule holding the GPT as ``self.model``."""
    prefix = prefix.strip(".")
    return {f"{prefix}.{key}" if prefix else key: style for key, style in plan.items()}


def check_tp_size(tp: int, world_size: int) -> None:
    """``tp`` must be a positive int that divides the world size (the rest of the ranks are other dimensions)."""
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"tp={tp!r} ({type(tp).__name__}) must be an int: the number of ranks a layer is split over.")
    if tp < 1 or tp > world_size or world_size % tp != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"tp={tp} does not fit a world of {world_size} processes: the tensor-parallel size must divide the world "
            f"size. Choose one of {divisors}, or launch a multiple of {tp} processes."
        )


# ---- where a plan comes from ----------------------------------------------------------------------------------
def resolve_traced_plan(module: nn.Module, plan: TPPlan | None) -> dict[str, str | ParallelStyle]:
    """The plan the planner's profile traces (``costs.profile.profile_model``): ``resolve_tp_plan`` with the head
    vocabulary-parallel where the model's own plan allows it (loss parallelism then keeps its logits split)."""
    return resolve_tp_plan(module, plan, loss_parallel=True)


def resolve_tp_plan(module: nn.Module, plan: TPPlan | None, *,
                    loss_parallel: bool = False) -> dict[str, str | ParallelStyle]:
    """The plan to apply to ``module``: ``plan`` if given; else ``module.tp_plan`` (a LightningModule's attribute,
    relative to the LightningModule: ``"model.blocks.*.attn.q"``); else the Hugging Face plans of the HF models
    inside ``module``, re-rooted at ``module``. Raises a ``ValueError`` saying what to pass when there is none.

    ``loss_parallel``: a Hugging Face plan's output head, which gathers its logits for HF's own loss
    (``colwise_gather_output``), keeps them sharded over the vocabulary instead (``vocab_parallel_head``), as loss
    parallelism needs; plans the user gives are taken as they are."""
    if plan is not None:
        return _check_plan_types(plan, "tp_plan")
    own = getattr(module, "tp_plan", None)
    if own is not None and not is_hf_model(module):
        return _check_plan_types(own, f"{type(module).__name__}.tp_plan")
    found = _hf_plan(module, loss_parallel)
    if found:
        return found
    raise ValueError(
        f"No tensor-parallel plan for {type(module).__name__}: pass `tp_plan={{fqn_glob: style}}` (styles: "
        f"{sorted(STYLES)}), or set a `tp_plan` attribute on the LightningModule with keys relative to it (e.g. "
        f"`self.tp_plan = prefix_plan(GPT_TP_PLAN, 'model')`). Hugging Face models bring their own "
        f"(`config.base_model_tp_plan`); none was found here."
    )


def _hf_plan(root: nn.Module, loss_parallel: bool = False) -> dict[str, str]:
    """The plans of the outermost HF models in ``root`` (their inner modules carry the same config), translated:
    HF no-op styles dropped, sequence-parallel entries added (they do nothing unless ``sequence_parallel=True``),
    under ``loss_parallel`` the output head's logits left sharded over the vocabulary."""
    plan: dict[str, str] = {}
    for fqn, sub in outermost_hf_models(root):
        base_fqn = sub.base_model_prefix if isinstance(getattr(sub, sub.base_model_prefix, None), nn.Module) else ""
        own = getattr(sub, "tp_plan", None)  # transformers >= 5: the model's and its base model's plans merged
        if not isinstance(own, Mapping) or not own:
            own = dict(getattr(type(sub), "_tp_plan", None) or {})
            own.update(prefix_plan(sub.config.base_model_tp_plan or {}, base_fqn))
        own = {k: v for k, v in own.items() if v not in _HF_NOOP_IN_HF_PLANS and not _inside_experts(sub, k, own)}
        names = [name for name, _ in sub.named_modules() if name] + [name for name, _ in sub.named_parameters()]
        # a config family's plan names modules some of its models lack (Qwen3-MoE's dense MLP entries, for
        # configs whose every layer is a mixture of experts): the model's own plan, not a user's typo. Entries
        # naming bare parameters (attention sinks) stay: validate_tp_plan splits them or says why not
        own = {k: v for k, v in own.items() if any(fqn_matches(name, k) for name in names)}
        # a linear or embedding that also runs child modules on its output (Inkling's normed embedding): HF's
        # split would hand them partial values; it stays whole
        own = {k: v for k, v in own.items() if not any(
            fqn_matches(name, k) and _computes_more(m) for name, m in sub.named_modules() if name)}
        own.update(_missing_head_norms(sub, own))
        if loss_parallel:
            own = _head_keeps_vocab_shards(sub, own)
        if own:
            plan.update(prefix_plan({**own, **_hf_sequence_parallel_entries(sub, own)}, fqn))
    return plan


def _inside_experts(model: nn.Module, key: str, plan: Mapping[str, str]) -> bool:
    """Whether a plan entry names an experts module or a parameter in it: a module of the model's
    ``base_model_ep_plan``, or one its tp plan marks ``moe_tp_experts`` (LongCat-Flash's config has no ep plan).
    Those entries are left out: the experts stay whole on every tp rank (expert parallelism, ``ep``, splits them
    instead; attention under tp and experts under ep is Megatron's "parallel folding"), rather than being refused
    for HF's ``moe_tp_experts``/``packed_colwise`` styles (torchtitan dropped expert tensor parallelism: skinny
    matmuls and a duplicated all-to-all)."""
    experts = [*hf_ep_plan(model), *(k for k, style in plan.items() if style == "moe_tp_experts")]
    return any(key == e or key.startswith(e + ".") for e in experts)


#: the names transformers gives per-head query/key norms (a latent's norm, e.g. MLA's ``q_a_layernorm``, is not one:
#: it normalizes whole, replicated activations)
_QK_NORM = re.compile(r"(q|k|query|key)_(norm|layernorm)")


def _missing_head_norms(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """'head_norm' for the per-head query/key norms (``_QK_NORM``, a weight of ``head_dim``) of attentions whose
    projections the plan splits 'colwise' when the plan names none of them: Qwen3's plan marks its q/k norms,
    Sarvam-MoE's (GLM-4-MoE's code with ``use_qk_norm``) does not, and each tp rank would then train its norms on
    its own heads only."""
    entries = {}
    for name, attention in model.named_modules():
        head_dim = getattr(attention, "head_dim", None)
        if not isinstance(head_dim, int) or not any(
                isinstance(child, nn.Linear) and HF_ALIASES.get(style, style) == "colwise"
                for child_name, child in attention.named_children()
                for key, style in plan.items() if fqn_matches(f"{name}.{child_name}" if name else child_name, key)):
            continue
        for child_name, child in attention.named_children():
            fqn = f"{name}.{child_name}" if name else child_name
            weight = getattr(child, "weight", None)
            if (_QK_NORM.fullmatch(child_name) and isinstance(weight, torch.Tensor) and weight.shape == (head_dim,)
                    and not any(fqn_matches(fqn, key) for key in plan)):
                entries[fqn] = "head_norm"
    return entries


def _head_keeps_vocab_shards(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entry of the model's output embeddings (``get_output_embeddings()``, e.g. ``lm_head``) that gathers the
    logits whole, made ``vocab_parallel_head``: torch's ``loss_parallel()`` takes the vocabulary-sharded logits."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_fqn = next((name for name, m in model.named_modules() if m is head), None) if head is not None else None
    if not head_fqn:
        return plan
    return {key: "vocab_parallel_head" if fqn_matches(head_fqn, key) and HF_ALIASES.get(style, style) == "colwise_rep"
            else style for key, style in plan.items()}


def _hf_sequence_parallel_entries(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """For a decoder with ``base.layers``: split the sequence entering layer 0 (after HF computed positions and the
    mask from the full length), run the layers' norms and the final norm on shards, gather once per sublayer."""
    base, layers = _decoder_layers(model)
    if layers is None:
        return {}
    base_fqn = next(name for name, m in model.named_modules() if m is base)
    lp = f"{base_fqn}.layers" if base_fqn else "layers"
    entries = {f"{lp}.0": "split_sequence"}
    for index, name, child in _sublayers(layers):  # hybrid models: layers of different kinds
        if "norm" in type(child).__name__.lower():
            entries[f"{lp}.*.{name}"] = "sequence_parallel"
        elif any(
            fqn_matches(f"{lp}.{index}.{name}.{leaf}", key)
            for leaf, _ in child.named_children()
            for key, style in plan.items()
            if HF_ALIASES.get(style, style) in ("colwise", "colwise_rep")
        ):
            entries[f"{lp}.*.{name}"] = "gather_sequence"
    after_layers = False
    for name, child in base.named_children():  # final norms only: a norm before the layers sees the full sequence
        if child is layers:
            after_layers = True
        elif after_layers and "norm" in type(child).__name__.lower():
            entries[f"{base_fqn}.{name}" if base_fqn else name] = "sequence_parallel"
    return entries


def _decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList | None]:
    """A Hugging Face model's base model and its ``layers`` list (None when it has no non-empty one)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    return base, layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def _sublayers(layers: nn.ModuleList) -> list[tuple[int, str, nn.Module]]:
    """(layer index, name, module) of the first child of each name across the decoder layers."""
    seen: dict[str, tuple[int, str, nn.Module]] = {}
    for index, layer in enumerate(layers):
        for name, child in layer.named_children():
            seen.setdefault(name, (index, name, child))
    return list(seen.values())


def _check_plan_types(plan: object, what: str) -> dict[str, str | ParallelStyle]:
    if not isinstance(plan, Mapping):
        raise TypeError(f"{what} must be a dict of FQN glob -> style, got {type(plan).__name__}.")
    for key, style in plan.items():
        if not isinstance(key, str) or not isinstance(style, (str, ParallelStyle)):
            raise TypeError(
                f"{what}: entry {key!r}: {style!r} must map a str FQN glob to a style name ({sorted(STYLES)}) or a "
                f"torch ParallelStyle, got {type(key).__name__} -> {type(style).__name__}."
            )
    return dict(plan)


# ---- validation (no communication) ----------------------------------------------------------------------------
def canonical_style(style: str | ParallelStyle, key: str) -> str | ParallelStyle | None:
    """Our name for a style (HF aliases translated); ``None`` for HF's no-op styles. Unknown names raise."""
    if isinstance(style, ParallelStyle):
        return style
    if style in STYLES:
        return style
    if style in HF_ALIASES:
        return HF_ALIASES[style]
    if style in HF_UNSUPPORTED:
        raise ValueError(
            f"tp_plan[{key!r}] = {style!r} is a Hugging Face style that lightning_par does not implement (it needs "
            f"HF's own hooks or packed weights). Override this entry with one of {sorted(STYLES)} or a torch "
            f"ParallelStyle, or leave the module replicated by dropping the entry."
        )
    raise ValueError(
        f"tp_plan[{key!r}] = {style!r} is not a tensor-parallel style. Valid names: {sorted(STYLES)} "
        f"(also the Hugging Face names {sorted(HF_ALIASES)}), or pass a torch ParallelStyle object."
    )


def validate_tp_plan(
    module: nn.Module, plan: TPPlan, tp_size: int, *, sequence_parallel: bool = False, loss_parallel: bool = False,
    whole_model: bool = True,
) -> dict[str, str | ParallelStyle]:
    """Match every plan entry to modules and check that each can be split ``tp_size`` ways.

    Returns ``{module fqn: style}`` in model order (HF no-op entries dropped). Raises ``ValueError``/``TypeError``
    naming the entry, the module, the sizes and the fix. Needs no process group: call it anywhere.
    ``whole_model=False``: ``module`` is part of a model (a pipeline rank's stages), whose plan was checked whole;
    it need not hold the embedding that splits the sequence nor the head that loss parallelism needs.
    """
    plan = _check_plan_types(plan, "tp_plan")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive int.")
    for flag, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag}={value!r} must be True or False.")
    names = [name for name, _ in module.named_modules() if name]
    params = [name for name, _ in module.named_parameters()]
    resolved: dict[str, str | ParallelStyle] = {}
    source: dict[str, str] = {}
    for key, style in plan.items():
        style = canonical_style(style, key)  # first: an HF style we refuse may name a parameter, not a module
        hits = [name for name in names if fqn_matches(name, key)]
        if not hits and any(fqn_matches(p, key) for p in params):
            head_params(module, {key: plan[key]}, tp_size, all_entries=plan)  # checked here, applied by apply_tp
            continue
        if not hits:
            raise ValueError(_no_match_message(module, key, names))
        if style is None:
            continue
        for name in hits:
            if name in resolved and resolved[name] != style:
                raise ValueError(
                    f"tp_plan: module {name!r} is matched by {source[name]!r} -> {resolved[name]!r} and by {key!r} "
                    f"-> {style!r}. Give each module one style (narrow one of the globs)."
                )
            resolved[name], source[name] = style, key
    styles = set(resolved.values())  # the plan's own styles, before LoRA adapters add theirs
    if "partial_sum" in styles:
        if sequence_parallel:
            owner = next(n for n, st in resolved.items() if st == "partial_sum")
            raise ValueError(
                f"sequence_parallel=True: {owner!r} is 'partial_sum', which runs on the whole sequence of every tp "
                f"rank (its inputs are not gathered nor its output reduce-scattered). Pass sequence_parallel=False.")
        partial_sum_params(module, plan, tp_size)
    resolved = _follow_adapters(module, resolved, sequence_parallel)
    for name, style in resolved.items():
        _check_module(name, module.get_submodule(name), style, tp_size, module)
    _check_tied(module, resolved, sequence_parallel)
    if not whole_model:
        return resolved
    if loss_parallel and "vocab_parallel_head" not in styles:
        raise ValueError(
            "loss_parallel=True needs an output layer whose logits stay sharded over the vocabulary: mark it "
            "'vocab_parallel_head' in the plan (e.g. {'head': 'vocab_parallel_head'}; for Hugging Face models "
            "'...lm_head'), or pass loss_parallel=False."
        )
    if sequence_parallel and not any(isinstance(s, ParallelStyle) for s in styles):
        if "sequence_parallel" not in styles or not styles & {"vocab_parallel_embedding", "split_sequence"}:
            raise ValueError(
                "sequence_parallel=True needs a plan that says where the sequence is split and which modules run on "
                "sequence shards: mark the embedding 'vocab_parallel_embedding' (or the first block "
                "'split_sequence') and every norm/dropout on the residual stream 'sequence_parallel'. Found styles "
                f"{sorted(str(s) for s in styles)}; or pass sequence_parallel=False."
            )
    if sequence_parallel:
        _check_hf_sublayers_gather(module, resolved)
    return resolved


def _check_hf_sublayers_gather(root: nn.Module, resolved: Mapping[str, str | ParallelStyle]) -> None:
    """Under sequence parallelism each sublayer of a Hugging Face decoder layer that is not a norm sees a sequence
    chunk, so some module of it must gather the sequence (a column-parallel projection). A model whose plan leaves
    its attention or MLP whole (e.g. a plan that names only the head) cannot run sequence-parallel."""
    for _, model in outermost_hf_models(root):
        _, layers = _decoder_layers(model)
        if layers is None:
            continue
        layers_fqn = next(name for name, m in root.named_modules() if m is layers)
        for index, name, child in _sublayers(layers):
            if "norm" in type(child).__name__.lower() or next(child.parameters(), None) is None or any(
                    is_hf_experts(m) for m in child.modules()):  # experts: refused below, with their own reason
                continue
            sub = f"{layers_fqn}.{index}.{name}"
            if not any((key == sub or key.startswith(sub + ".")) and (isinstance(style, ParallelStyle)
                                                                        or _sp_gather(style) is not None)
                       for key, style in resolved.items()):
                raise ValueError(
                    f"sequence_parallel=True: {sub!r} ({type(child).__name__}) would see only this rank's sequence "
                    f"chunk, but the tp plan has no column-parallel entry in it to gather the sequence (the plan of "
                    f"{type(model).__name__} leaves it whole). Give it tensor-parallel entries (e.g. its input "
                    f"projections 'colwise', its output projection 'rowwise') in `tp_plan`, or pass "
                    f"sequence_parallel=False.")
        _refuse_experts_under_sp(layers, layers_fqn)


def _refuse_experts_under_sp(layers: nn.ModuleList, layers_fqn: str) -> None:
    """Every layer, not only the first of each kind: MoE layers often follow dense ones (DeepSeek's
    ``first_k_dense_replace``)."""
    for index, layer in enumerate(layers):
        for name, child in layer.named_children():
            if any(is_hf_experts(m) for m in child.modules()):
                raise ValueError(
                    f"sequence_parallel=True: '{layers_fqn}.{index}.{name}' ({type(child).__name__}) holds a mixture "
                    f"of experts, which tensor parallelism leaves whole on every tp rank; sequence parallelism would "
                    f"hand its router and experts a sequence chunk they do not gather. Pass sequence_parallel=False "
                    f"(split the experts with expert parallelism, `ep`, instead).")


def _follow_adapters(root: nn.Module, resolved: dict[str, str | ParallelStyle],
                     sequence_parallel: bool) -> dict[str, str | ParallelStyle]:
    """PEFT LoRA layers in the plan: the base layer keeps the style, the adapters follow it (``parallel/lora``)."""
    out: dict[str, str | ParallelStyle] = {}
    for name, style in resolved.items():
        layer = root.get_submodule(name)
        out.update(lora_tp_entries(name, layer, style, sequence_parallel) if is_lora_layer(layer) else {name: style})
    return out


def head_params(root: nn.Module, plan: TPPlan, tp: int, all_entries: TPPlan | None = None) -> dict[str, list[str]]:
    """``{owner module FQN: its parameter names}`` split by head: the plan's entries that name bare parameters (no
    module) with 'colwise' or 'head_params' (Hugging Face's attention sinks, per-head gate biases, whose owners HF
    marks 'local_params'). An owner runs on this rank's shards of all its own parameters or of none, so the entries
    (``all_entries``: the whole plan, when ``plan`` is one entry of it) must name every one; each must split by
    ``tp`` on dim 0. Raises a ValueError saying what to do otherwise."""
    entries = all_entries if all_entries is not None else plan
    params = [name for name, _ in root.named_parameters()]
    modules = [name for name, _ in root.named_modules() if name]

    def bare(key: str) -> list[str]:
        if any(fqn_matches(m, key) for m in modules):
            return []
        return [p for p in params if fqn_matches(p, key)]

    named = {p for k, s in entries.items() if HF_ALIASES.get(s, s) in ("colwise", "head_params") for p in bare(k)}
    summed = _partial_sum_owners(root, entries)
    out: dict[str, list[str]] = {}
    for key, style in plan.items():
        hits = [p for p in bare(key) if p.rpartition(".")[0] not in summed]  # split by partial_sum_params
        if not hits or canonical_style(style, key) is None:
            continue
        if HF_ALIASES.get(style, style) not in ("colwise", "head_params"):
            raise ValueError(
                f"tp_plan[{key!r}] = {style!r} names bare parameters ({hits[:2]}), not modules. A bare parameter is "
                f"split only by head: 'colwise' or 'head_params' (dim 0, as its module's column-parallel projections "
                f"split the heads). Drop the entry to keep it whole on every tp rank, or name a module.")
        packed = [p for p in hits if root.get_parameter(p).dim() != 1]
        if packed:
            raise ValueError(
                f"tp_plan[{key!r}] = {style!r} names bare parameters of {root.get_parameter(packed[0]).dim()} "
                f"dimensions ({packed[:2]}). lightning_par splits a stacked bare parameter only inside a module "
                f"whose output sums over the split dimension: mark its owner "
                f"{packed[0].rpartition('.')[0]!r} 'partial_sum' (Hugging Face's 'all_reduce'). Otherwise drop the "
                f"entry to keep it whole on every tp rank, or name a module.")
        for fqn in hits:
            owner, _, name = fqn.rpartition(".")
            own = [f"{owner}.{n}" for n, _ in root.get_submodule(owner).named_parameters(recurse=False)]
            missing = sorted(set(own) - named)
            if missing:
                raise ValueError(
                    f"tp_plan[{key!r}] splits the bare parameters of {owner!r} by head, but {missing} have no such "
                    f"entry: the module runs on this rank's shards of all its own parameters or of none. Give them "
                    f"'colwise' entries too, or drop {key!r} to keep them all whole.")
            heads = root.get_parameter(fqn).shape[0]
            if heads % tp:
                raise ValueError(
                    f"tp_plan[{key!r}]: {fqn} (shape ({heads},)) is split by head, which tp={tp} cannot divide. "
                    f"Choose a tp that divides {heads}, or drop the entry.")
            out.setdefault(owner, []).append(name)
    return out


def _partial_sum_owners(root: nn.Module, entries: TPPlan) -> set[str]:
    names = [name for name, _ in root.named_modules() if name]
    return {name for key, style in entries.items() if not isinstance(style, ParallelStyle)
            and HF_ALIASES.get(style, style) == "partial_sum" for name in names if fqn_matches(name, key)}


def partial_sum_params(root: nn.Module, plan: TPPlan, tp: int, all_entries: TPPlan | None = None
                       ) -> dict[str, dict[str, int]]:
    """``{owner FQN: {parameter name: dim}}`` for the modules ``plan`` marks 'partial_sum' (HF's 'all_reduce'):
    each of the owner's own parameters is split on the dim its bare entry in the plan (``all_entries``) says:
    'colwise' on dim -2 (dim 0 for a vector: a bias of the split dimension), 'rowwise' on dim -1. The owner's
    output is then a partial sum on every rank, as its style assumes. Raises a ValueError saying what to do when a
    parameter has no entry, the owner has child modules with parameters, or tp does not divide a split dim."""
    entries = all_entries if all_entries is not None else plan
    out: dict[str, dict[str, int]] = {}
    for owner in sorted(_partial_sum_owners(root, plan)):
        module = root.get_submodule(owner)
        children = [f"{owner}.{n}" for n, p in module.named_parameters() if "." in n]
        if children:
            raise ValueError(
                f"tp_plan: {owner!r} is 'partial_sum', whose forward runs on this rank's shards of its own bare "
                f"parameters, but its child modules hold parameters too ({children[:2]}), which would be summed "
                f"over tp ranks whole. Drop the 'partial_sum' entry (and give the children styles of their own, e.g. "
                f"'colwise'/'rowwise' linears).")
        dims = {}
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{owner}.{name}"
            styles = {HF_ALIASES.get(st, st) for k, st in entries.items() if not isinstance(st, ParallelStyle)
                      and fqn_matches(fqn, k)}
            if styles == {"colwise"}:
                dim = -2 if param.dim() > 1 else 0
            elif styles == {"rowwise"} and param.dim() > 1:
                dim = -1
            else:
                raise ValueError(
                    f"tp_plan: {owner!r} is 'partial_sum', so each of its parameters needs a bare entry saying how "
                    f"it splits: {fqn!r} (shape {tuple(param.shape)}) has {sorted(map(str, styles)) or 'none'}. "
                    f"Give it 'colwise' (split on dim -2, or dim 0 of a vector) or 'rowwise' (dim -1; a vector "
                    f"would be summed over tp), or drop the 'partial_sum' entry to keep the module whole.")
            if param.shape[dim] % tp:
                raise ValueError(
                    f"tp_plan: {fqn} (shape {tuple(param.shape)}) splits dim {dim} {tp} ways, which tp={tp} cannot "
                    f"divide. Choose a tp that divides {param.shape[dim]}, or drop the 'partial_sum' entry of "
                    f"{owner!r}.")
            dims[name] = dim
        if not dims:
            raise ValueError(f"tp_plan: {owner!r} is 'partial_sum' but has no parameters of its own to split; "
                             f"drop the entry.")
        out[owner] = dims
    return out


def mla_rope_dim(root: nn.Module, name: str) -> int:
    """``qk_rope_head_dim`` of the attention holding the 'mla_kv_a_proj' module ``name`` (its own attribute, which
    models with per-layer configs set), else of its Hugging Face model's config."""
    parent_name = name.rpartition(".")[0]
    rope = getattr(root.get_submodule(parent_name) if parent_name else root, "qk_rope_head_dim", None)
    if isinstance(rope, int) and rope > 0:
        return rope
    for fqn, model in outermost_hf_models(root):
        if not fqn or name.startswith(fqn + "."):
            try:
                rope = getattr(model.config.get_text_config(), "qk_rope_head_dim", None)
            except Exception:  # noqa: BLE001 - a per-layer config refuses the global value (transformers' own class)
                rope = None
            if isinstance(rope, int) and rope > 0:
                return rope
    raise ValueError(
        f"tp_plan: {name!r} is 'mla_kv_a_proj', which splits its output into the latent and the rope part by the "
        f"Hugging Face config's `qk_rope_head_dim`; no model config above it has one. Use 'replicate' for it, or "
        f"keep the attention whole.")


def _check_module(name: str, mod: nn.Module, style: str | ParallelStyle, tp: int, root: nn.Module) -> None:
    kind = style
    if kind == "head_params":
        raise TypeError(f"tp_plan: 'head_params' names bare parameters (e.g. '...self_attn.sinks'), but {name!r} is a "
                        f"{type(mod).__name__} module: name its parameters, or use 'colwise' for a linear layer.")
    if kind == "mla_kv_a_proj":
        mla_rope_dim(root, name)
    if isinstance(style, ParallelStyle):  # check torch's own Colwise/Rowwise objects on linears too
        kind = {ColwiseParallel: "colwise", RowwiseParallel: "rowwise"}.get(type(style), "")
        if kind and not isinstance(mod, nn.Linear):
            return
    applies_to = TP_STYLES[kind].applies_to if kind in TP_STYLES else None
    if applies_to == "linear" and not isinstance(mod, nn.Linear):
        raise TypeError(f"tp_plan: '{kind}' shards an nn.Linear, but {name!r} is a {type(mod).__name__}.")
    if applies_to == "embedding" and not isinstance(mod, nn.Embedding):
        raise TypeError(f"tp_plan: '{kind}' shards an nn.Embedding, but {name!r} is a {type(mod).__name__}.")
    if applies_to in ("linear", "embedding") and _computes_more(mod):
        raise TypeError(
            f"tp_plan: '{kind}' splits one {type(mod).__mro__[1].__name__}'s weight, but {name!r} "
            f"({type(mod).__name__}) also runs child modules with parameters ({_computes_more(mod)[:2]}) on the "
            f"split result, which would see partial values. Drop the entry to keep it whole on every tp rank.")
    if kind in ("sequence_parallel", "head_norm") and isinstance(mod, (nn.Linear, nn.Embedding)):
        what = "norms and dropout" if kind == "sequence_parallel" else "norms (and other modules on split activations)"
        raise TypeError(f"tp_plan: '{kind}' is for {what}, but {name!r} is a {type(mod).__name__}.")
    if _sharded_size(kind)[0] is not None:
        attr, what = _sharded_size(kind)
        size = getattr(mod, attr)
        if size % tp:
            raise ValueError(
                f"tp_plan: {name!r} ({type(mod).__name__}, {attr}={size}) is '{kind}', which splits its {what} "
                f"{tp} ways, but {size} is not divisible by tp={tp}. Choose a tp that divides {size}, or a model "
                f"size divisible by {tp}."
            )
    if kind == "colwise":
        _check_heads(name, mod, tp, root)


def _computes_more(mod: nn.Module) -> list[str]:
    """The parameters of a linear or embedding's child modules (Inkling's embedding normalizes its lookup inside
    its own forward): a split of the weight would hand them partial values."""
    return [n for n, _ in mod.named_parameters() if "." in n] if isinstance(mod, (nn.Linear, nn.Embedding)) else []


def _check_tied(root: nn.Module, resolved: Mapping[str, str | ParallelStyle], sequence_parallel: bool) -> None:
    """A parallelized module's parameters are replaced by DTensors: a weight it shares (tied embeddings) would
    silently become two independent copies."""
    owners: dict[int, list[str]] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        for p_name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{name}.{p_name}" if name else p_name)
    for name, style in resolved.items():
        replaces = (isinstance(style, ParallelStyle) or _sharded_size(style)[0] is not None
                    or style == "partial_sum" or (style == "sequence_parallel" and sequence_parallel))
        for p in root.get_submodule(name)._parameters.values() if replaces else ():
            if p is not None and len(owners[id(p)]) > 1:
                raise ValueError(
                    f"tp_plan: {name!r} ('{style}') shares a parameter with other modules ({owners[id(p)]}): tied "
                    f"weights cannot be tensor-parallelized (they would become independent copies). Untie them "
                    f"(Hugging Face: tie_word_embeddings=False) or drop the plan entries of the tied modules."
                )


def _check_heads(name: str, linear: nn.Module, tp: int, root: nn.Module) -> None:
    """A colwise q/k/v projection must split whole heads: its parent's ``head_dim`` (and HF config) tell heads."""
    parent_name = name.rpartition(".")[0]
    parent = root.get_submodule(parent_name) if parent_name else root
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and linear.out_features % head_dim == 0:
        heads = linear.out_features // head_dim
        if heads % tp:
            raise ValueError(
                f"tp_plan: {name!r} projects to {heads} heads (out_features={linear.out_features} / head_dim="
                f"{head_dim} of {parent_name!r}), which tp={tp} cannot split into whole heads. Choose a tp that "
                f"divides {heads}, or a model with a multiple of {tp} heads."
            )
    config = getattr(parent, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        try:
            heads = getattr(config, attr, None)
        except Exception:  # noqa: BLE001 - transformers' per-layer configs refuse the global value (their own error
            continue  # class): the head_dim check above covers each layer
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"tp_plan: attention {parent_name!r} has {attr}={heads} (config of {type(parent).__name__}), which "
                f"tp={tp} cannot split into whole heads. Choose a tp that divides {heads}."
            )


def _no_match_message(module: nn.Module, key: str, names: list[str]) -> str:
    generic = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names})
    close = difflib.get_close_matches(key, generic, n=3, cutoff=0.5)
    hint = f" Did you mean {close}?" if close else f" Some of its modules: {generic[:6]}."
    return (
        f"tp_plan: {key!r} matches no module of {type(module).__name__}.{hint} Plan keys are FQN globs relative to "
        f"the module TP is applied to (`*` = one dotted segment, `**` = any number); a LightningModule's plan starts "
        f"at the LightningModule (e.g. 'model.blocks.*.attn.q': use prefix_plan(plan, 'model'))."
    )


def gathers_its_input(style: str | ParallelStyle, input_gathered: bool) -> bool:
    """Under sequence parallelism: does a module of this style all-gather its input's sequence itself (a
    column-parallel layer not inside a 'gather_sequence' module, a vocabulary-parallel head, a 'gather_sequence'
    module)? ``input_gathered``: it sits inside a 'gather_sequence' module. What ``regather_sequence`` saves as
    chunks, and what the planner prices so."""
    gather = _sp_gather(HF_ALIASES.get(style, style) if isinstance(style, str) else style)
    return gather == "gathers" or (gather == "gathers_outside" and not input_gathered)


def _sharded_size(style: str | ParallelStyle | None) -> tuple[str | None, str | None]:
    """(the module attribute tp must divide, what it is) of a style that splits its module's weight: the row's
    ``sharded_size`` (our names only: a validated plan's); else ``(None, None)``."""
    row = TP_STYLES.get(style) if isinstance(style, str) else None
    return row.sharded_size if row is not None and row.sharded_size else (None, None)


def _sp_gather(style: str | ParallelStyle | None) -> str | None:
    """The row's ``sp_gather`` (our names only); None for anything else."""
    row = TP_STYLES.get(style) if isinstance(style, str) else None
    return row.sp_gather if row is not None else None

"""Expert parallelism: each rank of an ``ep`` group holds ``num_experts / ep`` of a mixture-of-experts layer's experts,
and tokens travel to their expert's rank and back by all-to-all (dropless: every routed token is computed).

Two contracts of an experts module, every parameter of which has the experts on dim 0:

- grouped tokens (torchtitan's ``GroupedExperts``, the example GPT's): ``forward(x, num_tokens_per_expert)`` with
  ``x`` the routed tokens, one row per (token, choice), grouped by expert in expert order, and
  ``num_tokens_per_expert`` a 1-D integer tensor of the group sizes. The module reads its weights through
  :func:`local_experts` (only its own experts take part in its grouped matmul);
- Hugging Face transformers' experts (``@use_experts_implementation``: Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss, ...):
  ``forward(hidden_states, top_k_index, top_k_weights)`` -> the weighted sum of each token's experts. Under ep a
  token travels once to each rank holding at least one of its experts (DeepEP's deduplication: with k choices over
  d ranks, d rows instead of k), its choices on that rank beside it; there it is copied once per choice, grouped
  by local expert, and run through this rank's experts (the module's weights swapped for their local shards while
  it runs; the model's code is not changed): by :func:`grouped_experts`, the math of transformers' ``grouped_mm``
  experts implementation on rows already grouped, where the model uses it, else by the module's own forward, each
  row with its local expert and weight 1. The outputs are weighted and summed per token on that rank, and one sum
  per token and rank comes back. Across nodes (:class:`NodeGroups`) a token crosses to each node holding one of
  its experts once, to the rank of the same place in that node, which forwards it inside the node once per rank
  (DeepEP's internode dispatch, with torch's all-to-alls): the bytes on the slow links are one row per token and
  node, not per token and rank.

:func:`apply_expert_parallel` splits the parameters ``Shard(0)`` over the ``ep`` mesh (DTensors, so that checkpoints
reshard across ep sizes) and wraps the forward: before it the tokens go to the ranks of their experts (all-to-alls:
the counts, then the rows, and for transformers' experts the choices), after it they come back.

Gradients: an expert's weight gradient sums the tokens of all ``ep`` ranks of its group, each rank's loss being the
mean over its own batch; data parallelism (FSDP, last in the recipe) averages it over the other data ranks only. So
the experts' part of backward is scaled by ``1/ep`` (their output gradient), and the gradient that flows back to the
tokens by ``ep`` again: the weights get the average over every data-parallel rank, everything else is unchanged.
FSDP's own divide factor would do the first half, but torch versions divide differently on a one-rank mesh.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_par._compat import (
    all_to_all_single_autograd,
    in_backward,
    in_pipeline_metadata_inference,
    transformers_experts_gate,
    transformers_experts_implementation,
)
from lightning_par.parallel.hf import experts_core, hf_ep_plan, is_hf_experts
from lightning_par.parallel.lora import active_expert_adapters, expert_lora_factors, unwrap_param_wrappers
from lightning_par.parallel.modules import clean_name, fqn_matches, local_parameters
from lightning_par.parallel.unused_parameters import not_a_routing_decision


def num_experts_of(module: nn.Module, fqn: str) -> int:
    """The expert count of an experts module: the dim 0 its parameters share. Refuses a module without
    parameters or whose parameters disagree (it is then not an experts module in the sense above)."""
    sizes = {name: p.shape[0] if p.ndim else 0 for name, p in experts_core(module).named_parameters()}
    if not sizes or len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise ValueError(
            f"ep_plan: `{fqn}` ({type(module).__name__}) is not an experts module: expert parallelism splits the "
            f"parameters of an experts module on dim 0 (one row per expert), and its parameters' dim 0 are {sizes}. "
            f"Name the module that holds the stacked expert weights (e.g. `model.blocks.*.mlp.experts`).")
    return next(iter(sizes.values()))


def find_experts(root: nn.Module, plan: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``root``, by ``plan`` (FQN globs), else ``root.ep_plan``, else the Hugging Face models'
    ``base_model_ep_plan``: (FQN without wrapper prefixes, module). Also after activation checkpointing wrapped
    the blocks; under pipeline parallelism only this rank's (the other stages' modules are left without tensors)."""
    patterns = list(plan or getattr(root, "ep_plan", None) or hf_ep_plan(root))
    found = []
    for fqn, module in root.named_modules():
        name = clean_name(fqn)
        if name and any(fqn_matches(name, pattern) for pattern in patterns) and any(
                True for _ in module.parameters()):
            found.append((name, module))
    return found


class TokenCounter:
    """Counts the (token, choice) rows each experts module is given per expert, in training forwards (not in
    activation checkpointing's recompute, which runs inside backward), before any expert-parallel dispatch (its hook
    runs first), nor in the forward a pipeline stage runs for its shapes. ``counts``: (modules, experts) float64 on
    ``device``, this rank's tokens only. ``dropped``: the same for the choices a capacity dropped before they reached
    the module, as the model reports them (:func:`count_dropped_choices`); ``reports``: how many forwards reported
    (0 for a model that never drops)."""

    def __init__(self, experts: list[tuple[str, nn.Module]], device: torch.device) -> None:
        self.names = [name for name, _ in experts]
        width = max((num_experts_of(m, name) for name, m in experts), default=0)  # DTensor shapes are global
        self.counts = torch.zeros(len(experts), width, dtype=torch.float64, device=device)
        self.dropped = torch.zeros_like(self.counts)
        self.reports = torch.zeros(len(experts), dtype=torch.float64, device=device)
        self._hf = [is_hf_experts(module) for _, module in experts]
        self._handles = [
            module.register_forward_pre_hook(lambda m, args, kwargs, i=i: self._count(i, args, kwargs),
                                             with_kwargs=True, prepend=True)
            for i, (_, module) in enumerate(experts)]
        self._modules = [module for _, module in experts]
        for i, module in enumerate(self._modules):
            _DROP_COUNTERS.setdefault(module, []).append((self, i))

    def _count(self, layer: int, args: tuple, kwargs: dict) -> None:
        if not _counted_forward():
            return
        second = (list(args) + list(kwargs.values()))[1].detach()
        if self._hf[layer]:  # the routed expert of every (token, choice)
            second = torch.bincount(second.reshape(-1), minlength=self.counts.shape[1])
        self.counts[layer, : second.numel()] += second.to(self.counts)

    def count_dropped(self, layer: int, choices: torch.Tensor) -> None:
        self.dropped[layer] += torch.bincount(choices.detach().reshape(-1).long(),
                                              minlength=self.dropped.shape[1]).to(self.dropped)
        self.reports[layer] += 1

    def zero_(self) -> None:
        for t in (self.counts, self.dropped, self.reports):
            t.zero_()

    def summed(self, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counts, dropped, reports) summed over the ranks of ``group`` (one collective; ``None``: the world, or no
        process group at all): the ranks that read different tokens."""
        width = self.counts.shape[1]
        total = torch.cat([self.counts, self.dropped, self.reports.unsqueeze(1)], dim=1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=group)
        return total[:, :width], total[:, width:2 * width], total[:, -1]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._modules:
            _DROP_COUNTERS[module] = [(c, i) for c, i in _DROP_COUNTERS.get(module, []) if c is not self]


#: the counters watching each experts module (weak: a finished fit's model is not kept alive)
_DROP_COUNTERS: weakref.WeakKeyDictionary[nn.Module, list[tuple[TokenCounter, int]]] = weakref.WeakKeyDictionary()


def _counted_forward() -> bool:
    """A training forward that routes tokens: not a recompute in backward, not a pipeline's shape inference."""
    return torch.is_grad_enabled() and not in_backward() and not in_pipeline_metadata_inference()


def count_dropped_choices(experts: nn.Module, choices: torch.Tensor) -> None:
    """Tell the expert-load monitor which (token, choice) rows a capacity dropped before they reached ``experts``
    (the experts module the ``ep_plan`` names): ``choices`` holds the expert index of each dropped row (any shape,
    this rank's rows). Call it in every training forward that applies a capacity, also when nothing was dropped
    (an empty tensor), so that the monitor logs the share dropped per layer and per expert. Does nothing when no
    :class:`~lightning_par.callbacks.ExpertLoadMonitor` watches ``experts``."""
    if not isinstance(choices, torch.Tensor) or choices.is_floating_point():
        raise TypeError(f"count_dropped_choices: choices must be an integer tensor of expert indices (one per dropped "
                        f"choice), got {type(choices).__name__}"
                        f"{f' of {choices.dtype}' if isinstance(choices, torch.Tensor) else ''}.")
    watchers = _DROP_COUNTERS.get(experts)
    if not watchers or not _counted_forward():
        return
    for counter, layer in watchers:
        counter.count_dropped(layer, choices)


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh, nodes: NodeGroups | None = None) -> str:
    """Split ``module``'s experts over ``ep_mesh`` (1-D) and route its tokens to them (see the module docstring;
    ``nodes``: the ep group across nodes, for transformers' experts). Returns the path from ``module`` to the module
    holding the experts' parameters ("" unless LoRA wraps it)."""
    wrappers, core = unwrap_param_wrappers(module)
    for name, param in list(core.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]), requires_grad=param.requires_grad)
        core.register_parameter(name, sharded)
    # one per module: its forward never nests
    dispatch = _TokenDispatch(ep_mesh.get_group(), ep_mesh.size(), nodes if is_hf_experts(core) else None)
    if is_hf_experts(core):
        _route_hf_experts(module, dispatch)
    elif wrappers:
        raise ValueError(
            f"expert parallelism: LoRA adapters on the parameters of {type(core).__name__} (PEFT's "
            f"target_parameters) are split by expert only for Hugging Face transformers' experts modules. Train them "
            f"with ep=1 (FSDP2 shards the experts and their adapters), or keep LoRA off these experts.")
    else:
        module.register_forward_pre_hook(dispatch.send, with_kwargs=True)
        module.register_forward_hook(dispatch.receive)
    return ".".join(["base_layer"] * len(wrappers))


def _route_hf_experts(module: nn.Module, dispatch: _TokenDispatch) -> None:
    """Replace the instance's forward: send each token once to every rank holding one of its experts, with its
    choices there (:meth:`_TokenDispatch.send_tokens`), run this rank's experts on them (:func:`grouped_experts`
    where the model uses transformers' ``grouped_mm`` implementation, else the model's own forward), weight their
    outputs and sum them per token and source rank, send those sums back and add them up per token.

    With LoRA on the experts' parameters, ``module`` is PEFT's outermost ``ParamWrapper``: the experts module inside
    is called (so that FSDP's hooks on it gather its shard) and runs on this rank's experts, each parameter adapted
    by its slice of the adapters (:func:`_local_shards`)."""
    wrappers, core = unwrap_param_wrappers(module)
    num_experts = core.num_experts
    local = num_experts // dispatch.ep
    if wrappers:
        core_forward = core.forward

        def adapted(*args: torch.Tensor) -> torch.Tensor:
            with _local_shards(core, local, wrappers, dispatch):
                return core_forward(*args)

        core.forward, inner = adapted, core
    else:
        inner = module.forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        with not_a_routing_decision():
            sent = dispatch.send_tokens(hidden_states, top_k_index, top_k_weights, local)
        rows = sent.expert_rows
        if wrappers:
            out = inner(rows, sent.expert_index, rows.new_ones(rows.shape[0], 1))
        else:
            with _local_shards(module, local):
                if runs_transformers_grouped_mm(module):
                    out = grouped_experts(module, rows, sent.expert_index[:, 0])
                else:
                    out = inner(rows, sent.expert_index, rows.new_ones(rows.shape[0], 1))
        with not_a_routing_decision():
            return dispatch.combine_tokens(out, sent, hidden_states)

    module.forward = forward


def runs_transformers_grouped_mm(module: nn.Module) -> bool:
    """Whether ``module``'s forward is transformers' ``grouped_mm`` experts implementation (the default of models
    built by transformers 5 where torch has a grouped matmul), whose math :func:`grouped_experts` repeats."""
    return (transformers_experts_implementation(module) == "grouped_mm" and hasattr(module, "is_transposed")
            and hasattr(module, "down_proj") and hasattr(module, "has_gate"))


def grouped_experts(module: nn.Module, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each row through its expert, as transformers' ``grouped_mm`` experts forward computes it (gate-up or up
    projection with its bias, the module's gate or activation, down projection with its bias, the optional norm
    after the expert), for rows already grouped by expert (``experts``, non-decreasing): under ep the dispatch
    grouped them, so the copies transformers' forward makes to sort the rows, weight them and put them back (a
    third of its time on an H100 at large loads, benchmarks/bench_grouped_mm.py --hf) are left out. The outputs
    are the forward's with every routing weight 1 (``tests/test_expert_parallel.py`` compares them per model)."""
    local = module.num_experts
    # histc, not bincount: no host sync on a GPU (histc counts integers on CUDA, floats on the CPU)
    counts = torch.histc(experts.float() if experts.device.type in ("cpu", "mps") else experts.int(), bins=local,
                         min=0, max=local - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    first, bias = (("gate_up_proj", "gate_up_proj_bias") if module.has_gate else ("up_proj", "up_proj_bias"))
    has_bias = getattr(module, "has_bias", False)
    out = _grouped_linear(rows, getattr(module, first), offsets, getattr(module, bias)[experts] if has_bias else None,
                          module.is_transposed)
    out = transformers_experts_gate(module, out) if module.has_gate else module.act_fn(out)
    out = _grouped_linear(out, module.down_proj, offsets, module.down_proj_bias[experts] if has_bias else None,
                          module.is_transposed)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None,
                    transposed: bool) -> torch.Tensor:
    """``x`` by each group's weight (``(experts, in, out)`` if ``transposed``, else ``(experts, out, in)``), in the
    weight's dtype (torch's grouped matmul has no autocast rule: transformers casts the same way)."""
    w = weight if transposed else weight.transpose(-2, -1)
    x = x.to(w.dtype)
    if _has_grouped_mm(x, w):
        out = F.grouped_mm(x, w, offs=offsets)
    else:  # a loop over the groups where torch has no grouped matmul for these tensors
        ends = offsets.tolist()
        out = torch.cat([x[start:end] @ w[i] for i, (start, end) in enumerate(zip([0, *ends[:-1]], ends))])
    return out if bias is None else out + bias


def _has_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs these operands (transformers' own conditions): on a GPU of compute
    capability 8.0 or more, on the CPU with 16-byte aligned storage, and in compiled code only in bf16."""
    if not hasattr(F, "grouped_mm") or (torch.compiler.is_compiling() and w.dtype != torch.bfloat16):
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type != "cpu" or x.data_ptr() % 16 == 0 == w.data_ptr() % 16


class _SentTokens(NamedTuple):
    """What :meth:`_TokenDispatch.send_tokens` hands the experts, and what :meth:`~_TokenDispatch.combine_tokens`
    needs to bring their outputs home."""

    expert_rows: torch.Tensor  # one row per (received token, choice on this rank), grouped by local expert
    expert_index: torch.Tensor  # (rows, 1): each row's local expert
    weights: torch.Tensor  # each row's routing weight
    received_row: torch.Tensor  # each row's received token (its row in what arrived)
    received: int  # tokens that arrived
    exchanges: list[_TokenExchange]  # the all-to-alls that brought them: one, or across nodes two (between, inside)


class _TokenExchange(NamedTuple):
    """One all-to-all of :func:`_exchange`: what arrived, and what :func:`_exchange_back` needs to send sums back."""

    rows: torch.Tensor  # one row per (token, this rank) pair sent here
    choices: torch.Tensor  # (rows, 2k) float: each choice's weight, then its expert among this rank's (-1: none)
    arrived_choices: int  # choices of this rank's among them
    input_splits: list[int]
    output_splits: list[int]
    token_of_pair: torch.Tensor  # each sent (token, rank) pair's token
    tokens: int  # the tokens sent from (the sums come back to as many rows)
    group: dist.ProcessGroup


class NodeGroups(NamedTuple):
    """An ep group across nodes, ``per_node`` of its ranks in each (ep rank ``e`` on node ``e // per_node``):
    ``between`` joins the ranks of this one's place in every node, ``inside`` the ranks of this one's node."""

    between: dist.ProcessGroup
    inside: dist.ProcessGroup
    per_node: int


@contextmanager
def _local_shards(module: nn.Module, local_experts: int, wrappers: Sequence[nn.Module] = (),
                  dispatch: _TokenDispatch | None = None) -> Iterator[None]:
    """The module's parameters as their local shards while its own forward runs, and ``num_experts`` the local
    count; put back afterwards. With LoRA ``wrappers``, each adapted parameter is its shard plus this rank's experts'
    slice of the adapters' update (PEFT's own fold, ``W + scaling * lhs @ rhs`` in one ``baddbmm``). The adapters stay
    whole on every rank of the ep group, each training its experts' slice: their gradient is multiplied by ``ep``,
    which undoes the dispatch's ``1/ep`` (data parallelism then averages it over every data rank, ep's included)."""
    saved, module.num_experts = module.num_experts, local_experts
    try:
        with local_parameters(module):
            for wrapper in wrappers:
                _adapt_local_shard(module, wrapper, local_experts, dispatch)
            yield
    finally:
        module.num_experts = saved


def _adapt_local_shard(module: nn.Module, wrapper: nn.Module, local_experts: int, dispatch: _TokenDispatch) -> None:
    name = wrapper.parameter_name
    weight = module._parameters[name]
    first = dispatch.rank * local_experts
    for lora_a, lora_b, scaling in active_expert_adapters(wrapper):
        lora_a, lora_b = (_ScaleGradient.apply(w, float(dispatch.ep)) for w in (lora_a, lora_b))
        lhs, rhs = expert_lora_factors(wrapper, lora_a, lora_b, first, local_experts)
        weight = torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=scaling)
    module._parameters[name] = weight


def node_groups(ep_groups: Sequence[Sequence[int]], per_node: int) -> NodeGroups:
    """This rank's :class:`NodeGroups`, from every ep group's global ranks in ep order, ``per_node`` consecutive ones
    in each node. Every rank calls it with the same lists: the process groups are created collectively. The ranks
    of each group must increase (a process group numbers its ranks in increasing order: then a rank's number in
    it is its place)."""
    for group in ep_groups:
        if list(group) != sorted(group) or len(group) % per_node:
            raise ValueError(f"node_groups: the ep group {list(group)} must list its ranks in increasing order and "
                             f"hold a multiple of per_node={per_node} of them.")
    inside = [list(group[i:i + per_node]) for group in ep_groups for i in range(0, len(group), per_node)]
    between = [list(group[j::per_node]) for group in ep_groups for j in range(per_node)]
    mine_inside, _ = dist.new_subgroups_by_enumeration(inside)
    mine_between, _ = dist.new_subgroups_by_enumeration(between)
    return NodeGroups(mine_between, mine_inside, per_node)


class _TokenDispatch:
    """The all-to-alls around one experts module. State from the forward's start to its end (the splits, the
    permutation) lives here; a module's forward never interleaves with another forward of itself."""

    def __init__(self, group: dist.ProcessGroup, ep: int, nodes: NodeGroups | None = None) -> None:
        self.group, self.ep, self.rank, self.nodes = group, ep, dist.get_rank(group), nodes
        self._pending: list[tuple[list[int], list[int], torch.Tensor]] = []

    def send(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x, counts = _routed_args(args, kwargs)
        with not_a_routing_decision():  # tokens move, every expert weight stays in use
            return self._send(x, counts)

    def _send(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[tuple, dict]:
        local_experts = counts.numel() // self.ep
        # how many rows each rank sends to each of this rank's experts: [ep (source), local experts]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        sent_counts, received_counts = counts.tolist(), received.tolist()  # the one host sync per layer
        input_splits = [sum(sent_counts[r * local_experts:(r + 1) * local_experts]) for r in range(self.ep)]
        output_splits = [sum(received_counts[r * local_experts:(r + 1) * local_experts]) for r in range(self.ep)]
        rows = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, self.group)
        # received: by source rank, then by local expert; the experts want them by local expert
        by_source = received.view(self.ep, local_experts)
        order = _group_by_expert(by_source, rows.shape[0])
        self._pending.append((input_splits, output_splits, order))
        return (_ScaleGradient.apply(rows[order], float(self.ep)), by_source.sum(dim=0)), {}

    def receive(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        input_splits, output_splits, order = self._pending.pop()
        output = _ScaleGradient.apply(output, 1.0 / self.ep)
        by_source = torch.empty_like(output).index_copy(0, order, output)  # undo the grouping by expert
        return all_to_all_single_autograd(by_source.contiguous(), input_splits, output_splits, self.group)

    def send_tokens(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    local_experts: int) -> _SentTokens:
        """Send each token once to each rank that holds at least one of its chosen experts (:func:`_exchange`);
        across nodes once to each node, then inside it once to each rank. On arrival each token is copied once per
        choice, grouped by local expert for the experts' grouped matmul."""
        k = top_k_index.shape[1]
        if self.nodes is None:
            exchanges = [_exchange(hidden_states, top_k_index, top_k_weights, local_experts, self.group, self.ep)]
        else:
            between = _exchange(hidden_states, top_k_index, top_k_weights, local_experts * self.nodes.per_node,
                                self.nodes.between, self.ep // self.nodes.per_node)
            inside = _exchange(between.rows, between.choices[:, k:].long(), between.choices[:, :k], local_experts,
                               self.nodes.inside, self.nodes.per_node)
            exchanges = [between, inside]
        last = exchanges[-1]
        expert_of = last.choices[:, k:].long()
        received_row, slot = (expert_of >= 0).nonzero_static(size=last.arrived_choices).unbind(1)
        experts = expert_of[received_row, slot]
        order = experts.argsort(stable=True)  # grouped by local expert, in arrival order within each
        received_row, slot, experts = received_row[order], slot[order], experts[order]
        expert_rows = _ScaleGradient.apply(last.rows[received_row], float(self.ep))
        return _SentTokens(expert_rows, experts.unsqueeze(1), last.choices[received_row, slot], received_row,
                           last.rows.shape[0], exchanges)

    def combine_tokens(self, output: torch.Tensor, sent: _SentTokens, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' outputs weighted and summed per received token, sent back (one row per token and rank, as
        they came; across nodes summed on the forwarding rank first) and summed per token: the experts' weighted sum
        for every token of this rank."""
        output = _ScaleGradient.apply(output, 1.0 / self.ep)
        weighted = output * sent.weights.unsqueeze(-1).to(output.dtype)
        sums = weighted.new_zeros(sent.received, weighted.shape[-1]).index_add(0, sent.received_row, weighted)
        for exchange in reversed(sent.exchanges):  # (summed in the experts' output dtype on the way)
            sums = _exchange_back(sums, exchange)
        return sums.to(hidden_states.dtype)


def _exchange(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              local_experts: int, group: dist.ProcessGroup, size: int) -> _TokenExchange:
    """Send each token once to each rank of ``group`` (``size`` ranks, ``local_experts`` experts each) that holds
    at least one of its chosen experts (DeepEP's deduplication, with torch's all-to-all: a token whose k choices fall
    on d ranks travels d times, not k), with its choices on that rank (expert there, weight; -1 and 0 for the
    others) in a small float tensor beside it. A choice of -1 is for none of the group's ranks (a choice another
    node's ranks compute)."""
    tokens = top_k_index.shape[0]
    chosen = (top_k_index >= 0).long()
    rank_of_choice = torch.where(top_k_index >= 0, top_k_index // local_experts, 0)
    hit = torch.zeros(tokens, size, dtype=torch.long, device=top_k_index.device).scatter_add_(
        1, rank_of_choice, chosen) > 0
    # per destination rank, the tokens sent there and the choices they carry: one all-to-all of the counts and
    # the exchange's one host sync, after which every size is known (nonzero_static: no sync of its own)
    choices_to = torch.zeros(size, dtype=torch.long, device=top_k_index.device).scatter_add_(
        0, rank_of_choice.flatten(), chosen.flatten())
    counts = torch.stack([hit.sum(dim=0), choices_to], dim=1)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    both = torch.cat([counts, received]).tolist()
    input_splits, output_splits = [n for n, _ in both[:size]], [n for n, _ in both[size:]]
    rank_of_pair, token_of_pair = hit.t().nonzero_static(size=sum(input_splits)).unbind(1)  # by rank, token
    on_rank = (rank_of_choice[token_of_pair] == rank_of_pair.unsqueeze(1)) & (chosen[token_of_pair] > 0)
    choices = torch.cat([torch.where(on_rank, top_k_weights[token_of_pair].float(), 0.0),
                         torch.where(on_rank, top_k_index[token_of_pair] % local_experts, -1).float()], dim=1)
    rows = all_to_all_single_autograd(hidden_states[token_of_pair].contiguous(), output_splits, input_splits, group)
    choices = all_to_all_single_autograd(choices, output_splits, input_splits, group)
    return _TokenExchange(rows, choices, sum(c for _, c in both[size:]), input_splits, output_splits, token_of_pair,
                     tokens, group)


def _exchange_back(sums: torch.Tensor, exchange: _TokenExchange) -> torch.Tensor:
    """One sum per row that ``exchange`` brought, sent back to where it came from and added up per token there."""
    back = all_to_all_single_autograd(sums.contiguous(), exchange.input_splits, exchange.output_splits,
                                      exchange.group)
    return back.new_zeros(exchange.tokens, back.shape[-1]).index_add(0, exchange.token_of_pair, back)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _routed_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    values = list(args) + list(kwargs.values())
    if len(values) != 2 or not all(isinstance(v, torch.Tensor) for v in values):
        raise TypeError(
            "expert parallelism: an experts module is called as `experts(x, num_tokens_per_expert)` (tokens grouped "
            f"by expert, and the group sizes); it was called with {len(values)} arguments of types "
            f"{[type(v).__name__ for v in values]}.")
    return values[0], values[1]


def _group_by_expert(by_source: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that regroups rows laid out by (source rank, local expert) into (local expert, source rank)."""
    counts = by_source.flatten()
    starts = (counts.cumsum(0) - counts).view_as(by_source)  # where each (source, expert) group begins
    lengths = by_source.t().flatten()  # in the new order: expert-major
    new_starts = lengths.cumsum(0) - lengths
    shift = torch.repeat_interleave(starts.t().flatten() - new_starts, lengths, output_size=total)
    return torch.arange(total, device=by_source.device) + shift


def local_experts(weight: Any) -> torch.Tensor:
    """This rank's experts of a weight: the local shard of an expert-parallel DTensor, the tensor itself otherwise."""
    return weight.to_local() if isinstance(weight, DTensor) else weight  # (isinstance: what torch.compile traces)


class _AttachedLoss(torch.autograd.Function):
    """Identity on ``output``; in backward, ``loss`` gets the gradient ``scale``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_auxiliary_loss(output: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``output`` unchanged, with ``loss`` (a scalar computed from the layer's router) trained by the backward that
    reaches ``output``: its gradient is ``scale`` (:func:`auxiliary_loss_scale`: the factor the training loss of one
    forward is scaled by). The auxiliary loss never has to reach the training step's return value, so it works in any
    layer of any layout, pipeline stages included (Megatron's ``MoEAuxLossAutoScaler`` does the same)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"attach_auxiliary_loss: loss must be a scalar tensor (the layer's summed auxiliary losses), "
                         f"got {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}; reduce it first.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"attach_auxiliary_loss: scale={scale!r} must be a positive number "
                         f"(lightning_par.auxiliary_loss_scale(trainer), as the training loss is scaled).")
    return _AttachedLoss.apply(output, loss, scale)


def auxiliary_loss_scale(trainer: Any) -> float:
    """The ``scale`` for :func:`attach_auxiliary_loss` in this run: ``1 / accumulate_grad_batches`` (Lightning scales
    the training loss so), and under pipeline parallelism also ``1 / pp_microbatches`` (each pipeline micro-batch is
    a forward of its own, whose loss the schedule scales so). Read it after setup (``on_fit_start``)."""
    pipeline = getattr(trainer.strategy, "pipeline", None)
    micro_batches = pipeline.n_microbatches if pipeline is not None else 1
    return 1.0 / (trainer.accumulate_grad_batches * micro_batches)

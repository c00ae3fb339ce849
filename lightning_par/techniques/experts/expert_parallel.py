"""Expert parallelism as a technique of the engine: the experts modules of the ``ep_plan`` split over the ``ep`` mesh
(borrowed from ``dp_shard x cp``), their tokens dispatched by all-to-all; FSDP (last in the recipe) then shards them
over the ranks left (``efsdp``)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from functools import lru_cache

import torch.distributed as dist
from torch import nn

from lightning_par.checks import check_positive_int, check_str_list
from lightning_par.costs.profile import Section
from lightning_par.costs.sheet import CostSheet, Transfer
from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import fqn_matches, match_modules
from lightning_par.techniques.experts.experts import (
    NodeGroups,
    apply_expert_parallel,
    hf_ep_plan,
    is_hf_experts,
    node_groups,
    num_experts_of,
)
from lightning_par.techniques.technique import Options, Target, Technique

#: an int64 count (the dispatch's split sizes)
COUNT_BYTES = 8


@dataclass(frozen=True)
class ExpertParallelOptions(Options):
    """Expert parallelism's options, under the names ``NDParallelStrategy`` takes them (the one source of their
    defaults; ``docs/strategies.md``'s option table names each)."""

    ep_plan: list[str] | None = None
    ep_ranks_per_node: int | None = None

    def build(self) -> ExpertParallel:
        return ExpertParallel(self.ep_plan, self.ep_ranks_per_node)


class ExpertParallel(Technique):
    """Each rank of an ``ep`` group holds ``num_experts / ep`` experts of every experts module the plan names (FQN
    globs or class names; default: the LightningModule's ``ep_plan`` attribute). Dropless: every routed token is
    computed by its expert, so the result is the one-process result.

    An ep group across nodes dispatches transformers' experts' tokens in two steps (``NodeGroups``): once per node
    between nodes, then inside the node once per rank. ``ranks_per_node``: how many ranks of an ep group share a
    node; None finds it from the hosts' names (the same number on every node, consecutive in the group, else one
    step); ``ep`` or 1 dispatch in one step."""

    def __init__(self, plan: list[str] | None = None, ranks_per_node: int | None = None) -> None:
        self.plan = check_str_list("ep_plan", plan, "FQN globs or class names of experts modules",
                                   ["model.blocks.*.mlp.experts"])
        self.ranks_per_node = check_positive_int("ep_ranks_per_node", ranks_per_node, allow_none=True)
        self.nodes: NodeGroups | None = None

    def check(self, dims: ParallelDims) -> None:
        """(With ``ep > 1``: auto_parallel checks again once it has chosen ``ep``.)"""
        if self.ranks_per_node is not None and dims.ep > 1 and dims.ep % self.ranks_per_node:
            raise ValueError(
                f"ep_ranks_per_node={self.ranks_per_node} must divide ep={dims.ep}: the ranks of an ep group that "
                f"share a node. Choose one of {[d for d in range(1, dims.ep + 1) if dims.ep % d == 0]}, or leave it "
                f"unset (found from the hosts).")

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if dims.ep == 1:
            return
        plan = self.plan if self.plan is not None else getattr(target.module, "ep_plan", None)
        if not plan:
            named = hf_ep_plan(target.whole)
            plan = [p for p in named if _matches_some_module(target.whole, p)]  # configs may turn experts off
            if named and not plan:
                raise ValueError(
                    f"ep={dims.ep}: the model has no experts modules (its Hugging Face config names {named} for "
                    f"expert parallelism, and none exists: a config built without mixture-of-experts layers). "
                    f"Use ep=1.")
        if not plan:
            raise ValueError(
                f"ep={dims.ep} needs to know which modules are the experts: give `ep_plan` (FQN globs of the experts "
                f"modules, e.g. ['model.blocks.*.mlp.experts']) to the strategy, or an `ep_plan` attribute to "
                f"{type(target.module).__name__} (Hugging Face models bring theirs: `config.base_model_ep_plan`).")
        plan = check_str_list("ep_plan", list(plan), "FQN globs or class names of experts modules",
                              ["model.blocks.*.mlp.experts"])
        everywhere = match_modules(target.whole, plan, "ep_plan")  # the whole model: every rank checks the same
        for fqn, module in everywhere:
            experts = num_experts_of(module, fqn)
            if experts % dims.ep:
                raise ValueError(
                    f"ep={dims.ep} must divide the number of experts: `{fqn}` has {experts}. Choose ep among "
                    f"{[d for d in range(1, experts + 1) if experts % d == 0]}.")
        mine = [fqn for fqn, _ in everywhere if target.keep is None
                or any(fqn == owner or fqn.startswith(owner + ".") for owner in target.keep)]
        ep_mesh = dims.expert_mesh()["ep"]
        # (every rank decides alike: ``everywhere`` is the whole model's)
        self.nodes = self._node_groups(dims) if any(is_hf_experts(m) for _, m in everywhere) else None
        # FSDP's experts units are the modules holding the experts' parameters (LoRA's wrappers stay in the block's)
        target.experts = [".".join(filter(None, (fqn, apply_expert_parallel(target.module.get_submodule(fqn),
                                                                              ep_mesh, self.nodes)))) for fqn in mine]

    def _node_groups(self, dims: ParallelDims) -> NodeGroups | None:
        """The process groups of the two-step dispatch, where the ep groups span nodes with more than one of their
        ranks in each (every rank decides alike, from every rank's host name: the groups are created together)."""
        mesh = dims.expert_mesh().mesh  # (pp, dp_replicate, efsdp, ep, tp): every ep group, in ep order
        groups = mesh.movedim(3, -1).reshape(-1, dims.ep).tolist()
        per_node = self.ranks_per_node
        if per_node is None:
            hosts: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            per_node = _ranks_per_host(groups, hosts)
        if per_node in (1, dims.ep):
            return None
        return node_groups(groups, per_node)

    def describe(self, dims: ParallelDims) -> str | None:
        if dims.ep == 1:
            return None
        across = ("" if self.nodes is None else f"; transformers' experts dispatched once per node across "
                  f"{dims.ep // self.nodes.per_node} nodes, then once per rank inside each of {self.nodes.per_node}")
        return (f"expert parallel (ep={dims.ep}, experts FSDP-sharded over {dims.dp_shard * dims.cp // dims.ep}"
                f"{across})")

    def account(self, sheet: CostSheet) -> None:
        """The dispatch's all-to-alls: per layer with experts, the routed rows out to their experts and back (and
        for transformers' experts their choices out, a message of its own), in forward and again in backward (and
        in the recomputed forward under full activation checkpointing), each leaving ``(ep - 1) / ep`` of its bytes
        to other ranks with the router's load even: one row per token and choice,
        or for transformers' experts one per token and rank holding one of its experts, with its choices
        (:func:`dispatched_bytes`). Memory is unchanged (the experts are sharded over ``efsdp x ep``, as many ranks
        as FSDP would use); what ep saves, FSDP's account prices: each rank gathers only its own experts, over
        ``efsdp`` (selective checkpointing keeps the all-to-alls' outputs: the activations' prediction adds them).
        Every layer sends its own messages, so each pays the link's latency, as does the all-to-all of the counts
        before them (per layer, in every forward: recomputed ones too, selective checkpointing keeps only the rows'
        all-to-alls). Across nodes (``sheet.ranks_per_node``; transformers' experts) in two steps: between nodes one
        row per token and node holding one of its experts (:func:`dispatched_bytes` over ``ep / per_node`` places),
        inside them one per token and rank, each step with its counts. Not priced: the host sync after the counts
        (one per layer, step and forward), and an uneven load."""
        dims = sheet.dims
        experts = sheet.profile.num_experts
        if dims.ep == 1 or not experts:
            return
        ranks = sheet.rank_sections or [list(sheet.profile.sections)]

        def sent(names: list[str], places: int) -> list[float]:
            return [dispatched_bytes(sheet.profile.sections[s], experts, places, sheet.activation_scale,
                                     sheet.profile.expert_groups) for s in names]

        # the pipeline rank routing the most (dense first layers route nothing: not the rank with most sections)
        routing = [[s for s in set(sections) if sheet.profile.sections[s].routed_bytes] for sections in ranks]
        busiest = max(routing, key=lambda names: sum(sent(names, dims.ep)))
        routed = sent(busiest, dims.ep)
        if not routed:
            return
        layers = len(routed)
        per_rank = any(section.routed_choices for section in sheet.profile.sections.values())
        # per layer and pass: the rows out and back, and for transformers' experts their choices out too (a message
        # of its own, whose weights' gradient comes back in backward); the bytes spread over the messages
        messages = 3 if per_rank else 2
        # tensor parallelism leaves the experts whole: every tp rank routes the micro-batch's tokens (its cp chunk)
        nbytes = sum(routed) / layers * sheet.token_scale / dims.cp * 2 / messages
        m = sheet.microbatches * layers
        if sheet.profile.experts_over_tp != "whole" and dims.tp > 1:
            # priced as software that splits or folds the experts over tp (``costs.profile.price_experts_as``,
            # Megatron-Core's all-to-all dispatcher): each tp rank sends its sequence chunk's rows; split, its tp
            # group gathers what arrived, every tp rank runs its slice of the experts on all of it, and the outputs
            # are reduce-scattered before they go back; in forward and in backward (and in a full recomputation)
            nbytes /= dims.tp
            rows = sum(routed) / layers * sheet.token_scale / dims.cp
            for collective in ("all_gather", "reduce_scatter") if sheet.profile.experts_over_tp == "split" else ():
                sheet.transfers.append(Transfer("tp", "tp", collective, rows, 2 * m, False, recomputed_full=m))
        # in forward and in backward; the recomputed forward sends its messages again under full checkpointing
        # (selective keeps the all-to-alls' outputs: lightning_par.techniques.recompute.recompute.KEPT_OPS)
        per_node = self._ranks_per_node(sheet) if per_rank else dims.ep
        if 1 < per_node < dims.ep:  # two steps: the bytes between nodes are those of ep / per_node places
            between = sum(sent(busiest, dims.ep // per_node))
            steps = [("all_to_all_between", between / sum(routed) * nbytes, dims.ep // per_node),
                     ("all_to_all_inside", nbytes, per_node)]
        else:
            steps = [("all_to_all", nbytes, dims.ep)]
        for collective, step_bytes, places in steps:
            sheet.transfers.append(Transfer("all_to_all", "ep", collective, step_bytes, 2 * messages * m, False,
                                            recomputed_full=messages * m))
            # the counts: per destination rank, the tokens and choices (transformers' experts) or the rows per
            # expert
            counts = COUNT_BYTES * (2 * places if per_rank else experts)
            sheet.transfers.append(Transfer("all_to_all", "ep", collective, counts, m, False, recomputed_full=m,
                                            recomputed_selective=m))

    def _ranks_per_node(self, sheet: CostSheet) -> int:
        """The ranks of an ep group in one node, as the engine finds them (or as ``ranks_per_node`` says)."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        return dispatch_ranks_per_node(sheet.dims, sheet.ranks_per_node)


def dispatch_ranks_per_node(dims: ParallelDims, devices_per_node: int | None) -> int:
    """The ranks of an ep group per node where the engine's host detection dispatches in two steps (nodes of
    ``devices_per_node`` consecutive ranks; None: unknown), else ``ep``: one step."""
    if devices_per_node is None:
        return dims.ep
    per_node = dims.members_per_node("ep", devices_per_node)
    return per_node if dims.ep % per_node == 0 else dims.ep


def _ranks_per_host(groups: list[list[int]], hosts: list[str | None]) -> int:
    """How many consecutive ranks of every ep group share a host, the same in every group and on every host (1: the
    hosts do not cut the groups so, and the dispatch is one step)."""
    ep = len(groups[0])
    first = groups[0]
    per_host = next((i for i in range(1, ep) if hosts[first[i]] != hosts[first[0]]), ep)
    for group in groups:
        blocks = [group[i:i + per_host] for i in range(0, ep, per_host)]
        names = [hosts[block[0]] for block in blocks]
        if ep % per_host or len(set(names)) != len(names) or any(hosts[r] != hosts[b[0]] for b in blocks for r in b):
            return 1
    return per_host


@lru_cache(maxsize=1024)
def ranks_per_token(experts: int, ep: int, choices: int, groups: tuple[int, int] | None = None) -> float:
    """How many of the ``ep`` ranks a token's ``choices`` distinct experts (of ``experts``, ``experts / ep`` per
    rank) fall on, on average with the router's choices even: ``ep x (1 - C(E - E/ep, k) / C(E, k))``. With
    group-limited routing (``groups``: ``(n_group, topk_group)``) the choices fall in the chosen groups only: in one
    group, exactly (:func:`_ranks_within_one_group`); else where a rank holds whole groups, the ranks holding a
    chosen group (each chosen group carries a choice: its score is its best experts'); where a group spans several
    ranks, the same count over the chosen groups' experts and ranks."""
    if groups is not None:
        n_group, chosen = groups
        if chosen == 1 and experts % n_group == 0 and experts % ep == 0 and choices <= experts // n_group:
            return _ranks_within_one_group(experts, ep, choices, n_group)
        if n_group % ep == 0 and chosen <= choices:
            return ranks_per_token(n_group, ep, chosen)
        if ep % n_group == 0 and experts % n_group == 0:
            return ranks_per_token(experts * chosen // n_group, ep * chosen // n_group, choices)
    local = experts // ep
    missed = 1.0  # the chance that none of the k choices is one of a given rank's experts
    for i in range(choices):
        missed *= max(0.0, (experts - local - i) / (experts - i))
    return ep * (1.0 - missed)


def _ranks_within_one_group(experts: int, ep: int, choices: int, n_group: int) -> float:
    """The ranks a token's ``choices`` fall on when they all lie in one group of ``experts / n_group`` consecutive
    experts (each group as likely, the choices even within it), however the groups and the ranks' ``experts / ep``
    consecutive experts align: per group, each rank holding ``h`` of its ``g`` experts is hit with probability
    ``1 - C(g - h, k) / C(g, k)``. A group of k experts taken whole is NeMo AutoModel's balanced benchmark gate
    (token t to experts t k ... t k + k - 1, mod E)."""
    size, local = experts // n_group, experts // ep
    hit = 0.0
    for start in range(0, experts, size):
        for rank in range(start // local, (start + size - 1) // local + 1):
            held = min(start + size, (rank + 1) * local) - max(start, rank * local)
            missed = 1.0
            for i in range(choices):
                missed *= max(0.0, (size - held - i) / (size - i))
            hit += 1.0 - missed
    return hit / n_group


def dispatched_bytes(section: Section, experts: int, ep: int, activation_scale: float = 1.0,
                     groups: tuple[int, int] | None = None) -> float:
    """The bytes one all-to-all of the dispatch sends for ``section``'s traced micro-batch under expert parallelism
    ``ep`` (activations at ``activation_scale`` of the traced dtype): one row per token and choice (grouped-token
    experts), or for transformers' experts one per token and rank holding one of its choices, each with those
    choices (2 x k float32: local expert and weight, out in forward and back as their gradient, so half of it per
    transfer on average); ``groups``: group-limited routing (:func:`ranks_per_token`)."""
    if not section.routed_choices or ep == 1:
        return section.routed_bytes * activation_scale
    k = section.routed_choices
    tokens = section.routed_rows / k
    row = section.routed_bytes / section.routed_rows * activation_scale  # one token's hidden row
    return tokens * ranks_per_token(experts, ep, k, groups) * (row + 4 * k)


def _matches_some_module(root: nn.Module, pattern: str) -> bool:
    return any(fqn_matches(name, pattern) for name, _ in root.named_modules() if name)

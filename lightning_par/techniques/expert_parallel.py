"""Expert parallelism as a technique of the engine: the experts modules of the ``ep_plan`` split over the ``ep`` mesh
(borrowed from ``dp_shard x cp``), their tokens dispatched by all-to-all; FSDP (last in the recipe) then shards them
over the ranks left (``efsdp``)."""

from __future__ import annotations

from torch import nn

from lightning_par.checks import check_str_list
from lightning_par.costs.profile import Section
from lightning_par.costs.sheet import CostSheet, Transfer
from lightning_par.dims import ParallelDims
from lightning_par.parallel.experts import apply_expert_parallel, hf_ep_plan, num_experts_of
from lightning_par.parallel.modules import fqn_matches, match_modules
from lightning_par.techniques.technique import Target, Technique

#: an int64 count (the dispatch's split sizes)
COUNT_BYTES = 8


class ExpertParallel(Technique):
    """Each rank of an ``ep`` group holds ``num_experts / ep`` experts of every experts module the plan names (FQN
    globs or class names; default: the LightningModule's ``ep_plan`` attribute). Dropless: every routed token is
    computed by its expert, so the result is the one-process result."""

    def __init__(self, plan: list[str] | None = None) -> None:
        self.plan = check_str_list("ep_plan", plan, "FQN globs or class names of experts modules",
                                   ["model.blocks.*.mlp.experts"])

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
        # FSDP's experts units are the modules holding the experts' parameters (LoRA's wrappers stay in the block's)
        target.experts = [".".join(filter(None, (fqn, apply_expert_parallel(target.module.get_submodule(fqn),
                                                                              ep_mesh)))) for fqn in mine]

    def describe(self, dims: ParallelDims) -> str | None:
        if dims.ep == 1:
            return None
        return f"expert parallel (ep={dims.ep}, experts FSDP-sharded over {dims.dp_shard * dims.cp // dims.ep})"

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
        all-to-alls). Not priced: the host sync after the counts (one per layer and forward), and an uneven load."""
        dims = sheet.dims
        experts = sheet.profile.num_experts
        if dims.ep == 1 or not experts:
            return
        ranks = sheet.rank_sections or [list(sheet.profile.sections)]
        # the pipeline rank routing the most (dense first layers route nothing: not the rank with most sections)
        routed = max(([dispatched_bytes(sheet.profile.sections[s], experts, dims.ep, sheet.activation_scale)
                       for s in set(sections) if sheet.profile.sections[s].routed_bytes] for sections in ranks),
                     key=sum)
        if not routed:
            return
        layers = len(routed)
        per_rank = any(section.routed_choices for section in sheet.profile.sections.values())
        # per layer and pass: the rows out and back, and for transformers' experts their choices out too (a message
        # of its own, whose weights' gradient comes back in backward); the bytes spread over the messages
        messages = 3 if per_rank else 2
        # tensor parallelism leaves the experts whole: every tp rank routes the micro-batch's tokens (its cp chunk)
        nbytes = sum(routed) / layers * sheet.token_scale / dims.cp * 2 / messages
        # in forward and in backward; the recomputed forward sends its messages again under full checkpointing
        # (selective keeps the all-to-alls' outputs: lightning_par.parallel.recompute.KEPT_OPS)
        m = sheet.microbatches * layers
        sheet.transfers.append(Transfer("all_to_all", "ep", "all_to_all", nbytes, 2 * messages * m, False,
                                        recomputed_full=messages * m))
        # the counts: per destination rank, the tokens and choices (transformers' experts) or the rows per expert
        counts = COUNT_BYTES * (2 * dims.ep if per_rank else experts)
        sheet.transfers.append(Transfer("all_to_all", "ep", "all_to_all", counts, m, False, recomputed_full=m,
                                        recomputed_selective=m))


def ranks_per_token(experts: int, ep: int, choices: int) -> float:
    """How many of the ``ep`` ranks a token's ``choices`` distinct experts (of ``experts``, ``experts / ep`` per
    rank) fall on, on average with the router's choices even: ``ep x (1 - C(E - E/ep, k) / C(E, k))``."""
    local = experts // ep
    missed = 1.0  # the chance that none of the k choices is one of a given rank's experts
    for i in range(choices):
        missed *= max(0.0, (experts - local - i) / (experts - i))
    return ep * (1.0 - missed)


def dispatched_bytes(section: Section, experts: int, ep: int, activation_scale: float = 1.0) -> float:
    """The bytes one all-to-all of the dispatch sends for ``section``'s traced micro-batch under expert parallelism
    ``ep`` (activations at ``activation_scale`` of the traced dtype): one row per token and choice (grouped-token
    experts), or for transformers' experts one per token and rank holding one of its choices, each with those
    choices (2 x k float32: local expert and weight, out in forward and back as their gradient, so half of it per
    transfer on average)."""
    if not section.routed_choices or ep == 1:
        return section.routed_bytes * activation_scale
    k = section.routed_choices
    tokens = section.routed_rows / k
    row = section.routed_bytes / section.routed_rows * activation_scale  # one token's hidden row
    return tokens * ranks_per_token(experts, ep, k) * (row + 4 * k)


def _matches_some_module(root: nn.Module, pattern: str) -> bool:
    return any(fqn_matches(name, pattern) for name, _ in root.named_modules() if name)

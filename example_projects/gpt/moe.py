"""A mixture-of-experts feed-forward layer for the example GPT: a token-choice top-k router, the experts as stacked
weights run by one grouped matmul, and an optional shared expert (DeepSeek's) that every token passes through.

Nothing here knows about parallelism beyond two courtesies: the experts read their weights through
``lightning_par.local_experts`` (under expert parallelism each rank holds some of the experts and is handed only
their tokens), and a capacity per sequence is decided on the whole sequence (``lightning_par.whole_sequence``: under
context parallelism each rank holds a part of it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par import (
    attach_auxiliary_loss,
    count_dropped_choices,
    local_experts,
    local_sequence,
    whole_sequence,
)

ROUTER_SCORES = ("softmax", "sigmoid")
#: the load-balancing loss counts the tokens per expert over the whole global micro-batch (Switch Transformer,
#: Megatron's "global" aux loss), or per sequence (DeepSeek-V3's complementary sequence-wise loss)
AUX_LOSS_SCOPES = ("global", "sequence")
#: which routed tokens an expert over capacity drops: those of lowest router weight, or the latest in the sequence
DROP_POLICIES = ("probs", "position")


class Router(nn.Module):
    """Scores every expert for every token and keeps the top ``top_k``: softmax over the experts (Mixtral, Qwen3-MoE)
    or a sigmoid per expert whose top-k weights are then normalized to sum to one (DeepSeek-V3).

    ``expert_bias`` is added to the scores to choose the experts, not to weight them (DeepSeek-V3's auxiliary-loss-free
    balancing): zeros unless a balancer moves it (``lightning_par.ExpertBiasBalancer``).

    In training, two optional losses train the router (attached to the layer's output by
    ``lightning_par.attach_auxiliary_loss``, so they need no path to the training step): the load-balancing loss
    ``aux_loss_coef * E * sum_i f_i P_i`` (``f_i`` the share of routed rows expert ``i`` got, ``P_i`` its mean
    normalized score), counted over the global micro-batch or per sequence (``aux_loss``), and the router z-loss
    ``z_loss_coef * mean(logsumexp(logits)^2)`` (ST-MoE). The token counts are all-reduced over ``count_groups``
    (the data/context-parallel ranks for the global loss, the context-parallel ranks for the per-sequence one; set by
    the LightningModule), so every layout trains the router as one process does."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str, aux_loss_coef: float = 0.0,
                 aux_loss: str = "global", z_loss_coef: float = 0.0) -> None:
        super().__init__()
        if aux_loss not in AUX_LOSS_SCOPES:
            raise ValueError(f"moe_aux_loss={aux_loss!r}: choose one of {AUX_LOSS_SCOPES}.")
        for name, value in (("moe_aux_loss_coef", aux_loss_coef), ("moe_z_loss_coef", z_loss_coef)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number >= 0 (0 turns the loss off).")
        self.aux_loss_coef, self.aux_loss, self.z_loss_coef = float(aux_loss_coef), aux_loss, float(z_loss_coef)
        self.count_groups: dict[str, object] = {}  # "global" / "sequence" -> process group (None: one process)
        self.loss_scale = 1.0  # lightning_par.auxiliary_loss_scale: as the training loss of one forward is scaled
        self.last_losses: dict[str, torch.Tensor] = {}
        if score not in ROUTER_SCORES:
            raise ValueError(f"moe_router={score!r} is not a router score; choose one of {ROUTER_SCORES}.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_top_k={top_k} must be between 1 and n_experts={num_experts}: each token chooses "
                             f"top_k distinct experts.")
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.score = top_k, score
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def reset_parameters(self) -> None:  # the buffer, when the model is materialized from the meta device
        self.expert_bias.zero_()

    def forward(self, tokens: torch.Tensor, sequences: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens, dim), ``sequences`` of equal length -> weights and expert indices, both (tokens, top_k), and
        the auxiliary losses to train (None: none)."""
        logits = self.gate(tokens).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.score == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # no graph, nothing to train; on the meta device (a pipeline's trace and shape inference) no values either
        train = self.training and torch.is_grad_enabled() and not tokens.is_meta
        losses = self._losses(logits, scores, experts, sequences) if train else None
        return weights.to(tokens.dtype), experts, losses

    def _losses(self, logits: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, sequences: int
                ) -> torch.Tensor | None:
        total, self.last_losses = None, {}
        if self.z_loss_coef:
            self.last_losses["z_loss"] = torch.logsumexp(logits, dim=-1).square().mean()
            total = self.z_loss_coef * self.last_losses["z_loss"]
        if self.aux_loss_coef:
            self.last_losses["aux_loss"] = self._balance_loss(scores, experts, sequences)
            aux = self.aux_loss_coef * self.last_losses["aux_loss"]
            total = aux if total is None else total + aux
        self.last_losses = {k: v.detach() for k, v in self.last_losses.items()}
        return total

    def _balance_loss(self, scores: torch.Tensor, experts: torch.Tensor, sequences: int) -> torch.Tensor:
        """``E * sum_i f_i P_i``. The counts (no gradient) are summed over the ranks holding the rest of the global
        micro-batch (or of each sequence); ``P_i`` stays this rank's mean: the ranks' gradients, averaged by data
        parallelism, then add up to one process's."""
        num_experts = scores.shape[-1]
        probs = scores / scores.sum(dim=-1, keepdim=True)  # sigmoid scores normalized per token (softmax: as is)
        chosen = torch.zeros_like(probs).scatter_(-1, experts, 1.0)  # (tokens, E): 1 where a token chose e
        per = "global" if self.aux_loss == "global" else "sequence"
        if per == "global":
            counts, probs_mean, rows = chosen.sum(0), probs.mean(0), chosen.new_tensor(float(chosen.shape[0]))
        else:
            counts = chosen.view(sequences, -1, num_experts).sum(1)  # (sequences, E)
            probs_mean = probs.view(sequences, -1, num_experts).mean(1)
            rows = chosen.new_tensor(float(chosen.shape[0] // sequences))
        group = self.count_groups.get(per)
        if group is not None:
            for t in (counts, rows):
                torch.distributed.all_reduce(t, group=group)
        shares = counts / (rows * self.top_k)
        return num_experts * (shares * probs_mean).sum(-1).mean()


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forward networks as three stacked weights, run as one grouped matmul over the
    tokens grouped by expert (a loop over the experts where ``torch.nn.functional.grouped_mm`` is missing)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=1 / math.sqrt(w.shape[1]))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x``: (routed tokens, dim), grouped by expert in expert order; ``num_tokens_per_expert``: the group
        sizes."""
        w_gate, w_up, w_down = (local_experts(w) for w in (self.w_gate, self.w_up, self.w_down))
        offsets = num_tokens_per_expert.cumsum(0).to(torch.int32)
        h = F.silu(grouped_mm(x, w_gate, offsets)) * grouped_mm(x, w_up, offsets)
        return grouped_mm(h, w_down, offsets)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` times ``w[e]``, for every expert ``e``: one grouped matmul (torch's,
    whose rows must start at multiples of 16 bytes: the width is checked), else a loop over the experts. On the meta
    device (a pipeline split and the planner trace the model there; torch's grouped matmul takes only bf16 there)
    every row is multiplied by the first expert's weight: the shapes, FLOPs and saved tensors of the grouped matmul
    (no values exist to be wrong; gathering a weight per row would save rows x in x out)."""
    if x.is_meta:
        return x @ w[0]
    x, w = autocast_operands(x, w)
    # torch.compile traces the grouped matmul with its meta kernel, which takes only bf16 (torch 2.13): other dtypes
    # take the loop there
    traceable = x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    if hasattr(F, "grouped_mm") and (x.shape[-1] * x.element_size()) % 16 == 0 and x.shape[0] > 0 and traceable:
        return F.grouped_mm(x, w, offs=offsets)
    starts = [0, *offsets.tolist()]
    return torch.cat([x[starts[e]:starts[e + 1]] @ w[e] for e in range(w.shape[0])]) if w.shape[0] else x


def autocast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under autocast (Lightning's ``bf16-mixed`` and ``16-mixed``), the operands in its dtype, as autocast casts a
    matmul's: torch's autocast has no rule for the grouped matmul (torch 2.11-2.13), so the experts, most of an MoE
    model's FLOPs, would otherwise run in fp32 while every other matmul runs in bf16."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, w
    dtype = torch.get_autocast_dtype(kind)
    return x.to(dtype), w.to(dtype)


def check_capacity(capacity_factor: float | None, drop_policy: str) -> None:
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0):
        raise ValueError(f"moe_capacity_factor={capacity_factor!r} must be a number > 0 (a capacity of 0 would drop "
                         f"every token; 1.0 is the balanced load; null: dropless).")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"moe_token_drop_policy={drop_policy!r}: choose one of {DROP_POLICIES}.")


class MoE(nn.Module):
    """Route each token to ``top_k`` of ``num_experts`` experts, weight their outputs by the router's weights, and
    add the shared expert's output when there is one.

    Dropless by default: every choice is computed. With a ``capacity_factor`` each expert takes at most
    ``ceil(capacity_factor x tokens x top_k / num_experts)`` choices of each sequence (GShard's capacity, with the
    sequence as the group: what is dropped does not depend on how the batch is split over ranks or pipeline
    micro-batches); the rest are dropped (the token keeps its residual and shared expert), chosen by
    ``drop_policy``: the lowest router weights (``"probs"``, Megatron's default) or the latest tokens
    (``"position"``). ``last_dropped``: the share of choices the last training forward dropped."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int, score: str = "softmax",
                 shared_expert: bool = False, aux_loss_coef: float = 0.0, aux_loss: str = "global",
                 z_loss_coef: float = 0.0, capacity_factor: float | None = None, drop_policy: str = "probs") -> None:
        super().__init__()
        check_capacity(capacity_factor, drop_policy)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.last_dropped: torch.Tensor | None = None
        self.num_experts = num_experts
        self.router = Router(dim, num_experts, top_k, score, aux_loss_coef, aux_loss, z_loss_coef)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim)) if shared_expert \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        sequences = shape[0] if x.dim() == 3 else 1
        weights, experts, losses = self.router(tokens, sequences=sequences)
        choices, gates = experts.flatten(), weights.flatten()  # (tokens * top_k,), token-major
        token_of = torch.arange(choices.numel(), device=choices.device) // self.router.top_k
        if self.capacity_factor is not None and not tokens.is_meta:  # meta (a pipeline's trace): no values to drop
            keep = self._within_capacity(choices, gates, sequences)
            if self.training and torch.is_grad_enabled():
                self.last_dropped = 1.0 - keep.float().mean().detach()
                count_dropped_choices(self.experts, choices[~keep])  # for the ExpertLoadMonitor, per expert
            choices, gates, token_of = choices[keep], gates[keep], token_of[keep]
        order = choices.argsort(stable=True)  # the choices grouped by expert
        counts = torch.histc(choices.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        token_of = token_of[order]
        out = self.experts(tokens[token_of], counts) * gates[order].unsqueeze(-1)
        y = torch.zeros_like(tokens).index_add(0, token_of, out)
        if self.shared is not None:
            y = y + self.shared(tokens)
        if losses is not None:
            y = attach_auxiliary_loss(y, losses, self.router.loss_scale)
        return y.view(shape)

    def _within_capacity(self, choices: torch.Tensor, gates: torch.Tensor, sequences: int) -> torch.Tensor:
        """Which of the token-major ``choices`` each expert has room for, per sequence: decided on the whole
        sequences (gathered over the context-parallel ranks, each keeping its part of the answer)."""
        k = self.router.top_k
        whole = (whole_sequence(t.view(sequences, -1, k)).flatten() for t in (choices, gates))
        keep = self._room(*whole, sequences)
        return local_sequence(keep.view(sequences, -1, k)).flatten()

    def _room(self, choices: torch.Tensor, gates: torch.Tensor, sequences: int) -> torch.Tensor:
        per_sequence = choices.numel() // sequences
        capacity = math.ceil(self.capacity_factor * per_sequence / self.num_experts)
        chosen = F.one_hot(choices, self.num_experts).view(sequences, per_sequence, self.num_experts)
        if self.drop_policy == "position":  # the choice's place among its expert's choices in the sequence
            place = (chosen.cumsum(dim=1) - 1).mul_(chosen).sum(dim=-1)
            return place.flatten() < capacity
        weight = gates.view(sequences, per_sequence, 1).float().masked_fill(chosen == 0, -math.inf)
        kept = weight.topk(min(capacity, per_sequence), dim=1).indices  # each expert's heaviest choices
        room = torch.zeros_like(chosen, dtype=torch.bool).scatter_(1, kept, True) & chosen.bool()
        return room.any(dim=-1).flatten()

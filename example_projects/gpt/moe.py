"""A mixture-of-experts feed-forward layer for the example GPT: a token-choice top-k router, the experts as stacked
weights run by one grouped matmul, and an optional shared expert (DeepSeek's) that every token passes through.

Nothing here knows about parallelism beyond one courtesy: the experts read their weights through
``lightning_par.local_experts`` (under expert parallelism each rank holds some of the experts and is handed only
their tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_par import local_experts

ROUTER_SCORES = ("softmax", "sigmoid")


class Router(nn.Module):
    """Scores every expert for every token and keeps the top ``top_k``: softmax over the experts (Mixtral, Qwen3-MoE)
    or a sigmoid per expert whose top-k weights are then normalized to sum to one (DeepSeek-V3).

    ``expert_bias`` is added to the scores to choose the experts, not to weight them (DeepSeek-V3's auxiliary-loss-free
    balancing): zeros unless a balancer moves it (``lightning_par.ExpertBiasBalancer``)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str) -> None:
        super().__init__()
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

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, dim) -> weights and expert indices, both (tokens, top_k)."""
        logits = self.gate(tokens).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.score == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(tokens.dtype), experts


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
    # torch.compile traces the grouped matmul with its meta kernel, which takes only bf16 (torch 2.13): other dtypes
    # take the loop there
    traceable = x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    if hasattr(F, "grouped_mm") and (x.shape[-1] * x.element_size()) % 16 == 0 and x.shape[0] > 0 and traceable:
        return F.grouped_mm(x, w, offs=offsets)
    starts = [0, *offsets.tolist()]
    return torch.cat([x[starts[e]:starts[e + 1]] @ w[e] for e in range(w.shape[0])]) if w.shape[0] else x


class MoE(nn.Module):
    """Route each token to ``top_k`` of ``num_experts`` experts (dropless: every choice is computed), weight their
    outputs by the router's weights, and add the shared expert's output when there is one."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int, score: str = "softmax",
                 shared_expert: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.router = Router(dim, num_experts, top_k, score)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim)) if shared_expert \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = self.router(tokens)
        choices = experts.flatten()  # (tokens * top_k,), token-major
        order = choices.argsort(stable=True)  # the choices grouped by expert
        counts = torch.histc(choices.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        token_of = order // self.router.top_k
        out = self.experts(tokens[token_of], counts) * weights.flatten()[order].unsqueeze(-1)
        y = torch.zeros_like(tokens).index_add(0, token_of, out)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(shape)

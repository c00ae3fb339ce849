"""A small decoder-only transformer (nanoGPT-shaped): embeddings, an nn.ModuleList of blocks, a norm and a head.

Nothing here knows about parallelism, with two courtesies: attention derives its local head count from the width of
its projections (tensor parallelism splits heads), and positions come from ``context_positions`` (context
parallelism splits the sequence; without it that is ``arange``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from example_projects.gpt.moe import MoE
from lightning_par.techniques.context.context_routing import context_positions


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    n_experts: int = 0  # > 0: every block's MLP is a mixture of experts (moe.py)
    moe_top_k: int = 2
    moe_hidden: int = 0  # each expert's hidden width; 0: 2 x n_embd
    moe_router: str = "softmax"
    moe_shared_expert: bool = False
    moe_aux_loss_coef: float = 0.0  # the load-balancing loss's weight (0: off)
    moe_aux_loss: str = "global"  # counted over the global micro-batch, or "sequence"
    moe_z_loss_coef: float = 0.0  # the router z-loss's weight (0: off)
    moe_capacity_factor: float | None = None  # None: dropless; else each expert's room per sequence (moe.py)
    moe_token_drop_policy: str = "probs"  # over capacity, drop the lowest router weights, or "position": the latest


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}.")
        self.head_dim = cfg.n_embd // cfg.n_head
        # no q/k/v biases (as in Llama): a key bias has an identically-zero gradient under softmax, and Adam turns
        # that zero-plus-rounding-noise into updates that differ from run to run
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        # heads on this rank = local width / head_dim (all heads without tensor parallelism)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = MLP(cfg) if cfg.n_experts == 0 else MoE(
            cfg.n_embd, cfg.n_experts, cfg.moe_top_k, cfg.moe_hidden or 2 * cfg.n_embd, cfg.moe_router,
            cfg.moe_shared_expert, cfg.moe_aux_loss_coef, cfg.moe_aux_loss, cfg.moe_z_loss_coef,
            cfg.moe_capacity_factor, cfg.moe_token_drop_policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab)."""
        if idx.size(1) > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds block_size={self.cfg.block_size}.")
        # global positions of this rank's tokens: arange(T) unless context parallelism split the sequence
        pos = context_positions(idx.size(1), idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


#: Tensor-parallel plan for lightning_par's ``apply_tp`` (keys relative to :class:`GPT`; a LightningModule holding
#: the GPT as ``self.model`` uses ``prefix_plan(GPT_TP_PLAN, "model")``). One plan serves both layouts: with
#: ``sequence_parallel=True`` the embedding output, norms and ``pos_emb``'s output are split over the sequence, and
#: ``gather_sequence`` all-gathers each attention/MLP input once; without it those entries do nothing.
GPT_TP_PLAN: dict[str, str] = {
    "tok_emb": "vocab_parallel_embedding",
    "pos_emb": "replicate",
    "blocks.*.norm1": "sequence_parallel",
    "blocks.*.attn": "gather_sequence",
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.norm2": "sequence_parallel",
    "blocks.*.mlp": "gather_sequence",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "norm": "sequence_parallel",
    "head": "vocab_parallel_head",
}

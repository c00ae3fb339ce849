"""Hugging Face causal LMs built from tiny configs (no download), inside the plain LightningModule a user writes.

The module follows the README's contract and nothing else: ``forward(x)`` returns the model's logits, ``loss`` is a
method, and no line of it knows about parallelism (no position ids, no masks, no stage logic).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

# vocab 32 and sequences of 16 match tests/workers.py's token_dataset; 4 layers so that pp=2 x 2 stages per rank fit
_COMMON = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    # a sliding window narrower than the sequence: its mask differs from plain causal attention
    "mistral": ("MistralConfig", {"sliding_window": 5}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 4, "pad_token_id": 0}),  # fused qkv and gate_up projections
    "gemma": ("GemmaConfig", {"head_dim": 8}),  # scaled embeddings, GeGLU
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # mixture of experts
    # soft-capped attention logits (which transformers' SDPA path refuses too): refused by context parallelism
    "gemma2": ("Gemma2Config", {"head_dim": 8}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),  # per-head q/k norms ('replicated_with_grad_allreduce' in its plan)
    # attention sinks (a learned logit per head in every softmax), sliding and full layers, experts; no tp plan
    "gpt_oss": ("GptOssConfig", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 8}),
    # hybrid: three linear-attention (gated delta rule) layers, then full attention
    "qwen3_5": ("Qwen3_5TextConfig", {"head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                      "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    # a learnable activation (xIELU) between the MLP's column- and row-parallel layers, which its tp plan leaves whole
    "apertus": ("ApertusConfig", {"head_dim": 8}),
    # Megatron's GPT layer (one fused, head-interleaved qkv projection, a 4h GeLU MLP, biases) with sequential
    # residuals; the planner's stand-in for Megatron-Core's published GPT runs (benchmarks/planner_heldout.py)
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": 4, "use_parallel_residual": False, "rotary_pct": 1.0}),
}
#: more mixtures of experts, for expert parallelism (tests/test_expert_parallel.py)
TINY_CONFIGS.update({
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
    # multi-head latent attention, a shared expert, group-limited sigmoid routing, a dense first layer
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                                         "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                                         "head_dim": 4}),
    # attention sinks (a bare per-head parameter) in sliding and full layers
    "granite_swa": ("GraniteSWAConfig", {"sliding_window": 8}),
    # multi-head latent attention with sinks and an indexer, a shared expert, a dense first layer
    "hy_v4": ("HYV4Config", {"num_key_value_heads": 4, "head_dim": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1,
                             "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
                             "v_head_dim": 8, "qk_head_dim": 8, "pad_token_id": 0, "bos_token_id": 1,
                             "eos_token_id": 2, "index_head_dim": 8, "index_n_heads": 4}),
    # stacked shared experts (bare 3-D parameters, HF's 'all_reduce' owner), an embedding that normalizes its
    # lookup, short convolutions and a relative position bias in the attention
    "inkling_text": ("InklingTextConfig", {"head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                                           "swa_head_dim": 8, "sliding_window_size": 8, "rel_extent": 32,
                                           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2,
                                           "moe_intermediate_size": 32, "pad_token_id": 0}),
})
_EAGER = ("gemma2", "gpt_oss", "granite_swa", "hy_v4")  # no SDPA path in transformers


def tiny_hf_model(arch: str, **overrides: Any) -> torch.nn.Module:
    import transformers

    config_cls, extra = TINY_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra, **overrides})
    attention = "eager" if arch in _EAGER else "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)


class HFCausalLM(pl.LightningModule):
    """A user's LightningModule around a Hugging Face causal LM."""

    def __init__(self, arch: str = "llama", lr: float = 3e-3, optimizer: str = "adamw", **overrides: Any) -> None:
        super().__init__()
        self.lr, self.optimizer = lr, optimizer
        self.model = tiny_hf_model(arch, **overrides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", self.loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "sgd":  # updates in proportion to gradients: rounding in tiny gradients stays tiny
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


class DenseMaskHFCausalLM(HFCausalLM):
    """Passes a dense 4-D (batch, 1, seq, seq) causal mask of its own, which no rank can hold whole under context
    parallelism."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        mask = torch.ones(x.size(0), 1, n, n, dtype=torch.bool, device=x.device).tril()
        return self.model(input_ids=x, attention_mask=mask).logits


class MaskedHFCausalLM(HFCausalLM):
    """Passes an all-ones attention mask: harmless in one process, but nothing a pipeline stage hands on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, attention_mask=torch.ones_like(x)).logits

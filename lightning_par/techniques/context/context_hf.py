"""Context parallelism for Hugging Face transformers models, through transformers' own extension points.

A transformers model picks its attention by name (``config._attn_implementation``) from ``AttentionInterface`` and
builds its mask with the function of the same name in ``AttentionMaskInterface``. :func:`route_attention` registers
one name in both and gives it to the model. While a :class:`ContextParallelScope` is active (a training or
validation step of a context-parallel strategy), the attention is :func:`context_parallel_attention` over the cp group
(causal, sliding windows on global positions, GQA) and no dense mask is built at all; outside one (e.g. ``generate``
after training) both calls go to the implementation the model had before, so the model behaves exactly as it did.

Rotary embeddings need each token's global position: a pre-hook on the model fills ``position_ids`` with this rank's
positions (:func:`context_positions`), so the user's module passes nothing context-parallel specific.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.hf import is_hf_model
from lightning_par.techniques.context.context import context_parallel_attention
from lightning_par.techniques.context.context_routing import active_scope, context_positions

ATTENTION = "lightning_par_context_parallel"
_ORIGINAL: dict[int, str] = {}  # id(config) -> the attention implementation the model had


def route_attention(model: nn.Module) -> None:
    """Make ``model`` (a transformers model) use context-parallel attention inside a scope. Refuses, with the
    reason, what it cannot run exactly; raises before any communication."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = type(model).__name__
    if not model._can_set_attn_implementation():
        raise ValueError(
            f"{name} does not route its attention through transformers' AttentionInterface, so context parallelism "
            f"cannot replace it. Use a model whose attention does (Llama, Qwen2, Mistral, Phi-3, Gemma, ... in "
            f"transformers >= 4.48), or cp=1.")
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{name} soft-caps its attention logits (attn_logit_softcapping={config.attn_logit_softcapping}), which "
            f"context-parallel attention does not implement. Set config.attn_logit_softcapping=None, or use cp=1.")
    other = sorted(set(_layer_types(config)) - _CP_LAYER_TYPES)
    if other:
        raise ValueError(
            f"{name} has layers of type {other} (config.layer_types): their sequence mixing (recurrent/linear "
            f"attention, sparse or compressed attention) is not attention over whole keys, which context parallelism "
            f"splits; it supports {sorted(_CP_LAYER_TYPES - {'dense', 'sparse'})} layers. Use cp=1 for this model.")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; context parallelism supports decoder-only and "
                         f"encoder-only self-attention models. Use cp=1.")
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    if config._attn_implementation != ATTENTION:
        _ORIGINAL[id(config)] = config._attn_implementation or "sdpa"
        for sub in model.modules():  # every config of the model (sub-models may carry their own)
            if is_hf_model(sub) and sub.config._attn_implementation != ATTENTION:
                _ORIGINAL[id(sub.config)] = sub.config._attn_implementation or "sdpa"
        model.set_attn_implementation(ATTENTION)
    _install_position_hook(model)


#: ``config.layer_types`` entries context-parallel attention computes exactly (the MLP kinds say nothing of attention)
_CP_LAYER_TYPES = {"full_attention", "sliding_attention", "dense", "sparse"}
#: tensors transformers passes to every attention function that carry no change to its math
_HARMLESS_TENSOR_KWARGS = {"position_ids", "cache_position"}


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    return [t for t in types if isinstance(t, str)] if isinstance(types, (list, tuple)) else []


def _original(config: Any) -> str:
    return _ORIGINAL.get(id(config), "sdpa")


# ---- the two functions transformers calls -------------------------------------------------------------------
def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, is_causal: bool | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q, k, v (batch, heads, local seq, head dim) -> (batch, seq, heads, dim)."""
    scope = active_scope()
    if scope is None:
        from transformers import AttentionInterface

        original = AttentionInterface().get_interface(_original(module.config), None)
        if original is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as original
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        sliding_window=sliding_window, is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{where}: attention logit soft-capping is not supported by context-parallel attention.")
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported by context-parallel attention; set "
                         f"the model's attention_dropout to 0.")
    if attention_mask is not None:
        raise ValueError(
            f"{where} received an attention mask of shape {tuple(attention_mask.shape)}: a dense mask cannot follow "
            f"the keys around the cp group. Under context parallelism pass no attention_mask (causal and sliding-"
            f"window masks are applied from the tokens' global positions).")
    if not causal and sliding_window is not None:
        raise ValueError(f"{where}: a bidirectional sliding window is not supported by context-parallel attention.")
    packed = [name for name in ("cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(name) is not None]
    if packed:
        raise ValueError(f"{where} received {packed}: packed sequences with per-sequence boundaries are not supported "
                         f"by context-parallel attention. Pass whole, equal-length sequences.")
    extra = sorted(k for k, v in kwargs.items()
                   if isinstance(v, torch.Tensor) and k not in _HARMLESS_TENSOR_KWARGS and k != "s_aux")
    if extra:  # e.g. a relative position bias: a (q, k) term that would have to travel around the ring too
        raise ValueError(f"{where} passes {extra} to its attention, which context-parallel attention does not "
                         f"apply (it computes softmax(q k^T) v with causal/sliding masks and attention sinks). Use "
                         f"cp=1 for this model.")
    out = context_parallel_attention(query, key, value, group=scope.group, is_causal=causal,
                                     algorithm=scope.algorithm, load_balance=scope.load_balance, scale=scaling,
                                     window=sliding_window, sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _mask(batch_size: int, q_length: int, kv_length: int, *args: Any, attention_mask: torch.Tensor | None = None,
          config: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask-interface signature. Inside a scope: no dense mask (the attention applies causality and
    windows itself); a padding mask that hides tokens is refused. Outside: the original implementation's mask."""
    if active_scope() is None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        original = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(_original(config))
        if original is None:
            return attention_mask
        return original(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, config=config,
                        **kwargs)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "context parallelism got an attention_mask that hides tokens (padding): padded batches are not supported "
            "under context parallelism. Pack or crop sequences to the same length and pass no attention_mask.")
    if q_length != kv_length:
        raise ValueError(f"context parallelism runs self-attention over whole sequences; got {q_length} queries and "
                         f"{kv_length} keys (a KV cache?). Use cp=1 for generation.")
    return None


# ---- global positions for rotary embeddings ------------------------------------------------------------------
def _install_position_hook(model: nn.Module) -> None:
    if getattr(model, "_lightning_par_position_hook", False):
        return
    signature = inspect.signature(model.forward)

    def fill_positions(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        scope = active_scope()
        if scope is None:
            return None
        bound = signature.bind_partial(*args, **kwargs)
        ids, embeds = bound.arguments.get("input_ids"), bound.arguments.get("inputs_embeds")
        local = ids if ids is not None else embeds
        if local is None:
            return None
        expected = context_positions(local.shape[1], local.device).unsqueeze(0)
        given = bound.arguments.get("position_ids")
        if given is None:
            bound.arguments["position_ids"] = expected
            return bound.args, bound.kwargs
        if given.shape[-1] != expected.shape[-1] or not bool((given == expected).all()):
            raise ValueError(
                f"{type(_module).__name__} got position_ids that are not the global positions of this rank's tokens "
                f"(packed sequences or offsets?); under context parallelism leave position_ids out (they are filled "
                f"in) or pass the global positions of the whole sequence, sharded like the inputs.")
        return None

    model.register_forward_pre_hook(fill_positions, with_kwargs=True)
    model._lightning_par_position_hook = True


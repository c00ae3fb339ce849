"""Context parallelism for Hugging Face transformers models, through transformers' own extension points.

A transformers model picks its attention by name (``config._attn_implementation``) from ``AttentionInterface`` and
builds its mask with the function of the same name in ``AttentionMaskInterface``. :func:`route_attention` registers
one name in both and gives it to the model. While a :class:`ContextParallelScope` is active (a training or
validation step of a context-parallel strategy), the attention is :func:`context_parallel_attention` over the cp group
(causal, sliding windows on global positions, GQA) and no dense mask is built at all; outside one (e.g. ``generate``
after training) both calls go to the implementation the model had before, so the model behaves exactly as it did.

Rotary embeddings need each token's global position: a pre-hook on the model fills ``position_ids`` with this rank's
positions (:func:`context_positions`), so the user's module passes nothing context-parallel specific. Packed rows
(``position_ids`` that restart at each document, as ``DataCollatorWithFlattening`` and TRL's packing give them, or
``cu_seq_lens_q``) keep their positions, and their documents are found as transformers finds them in one process (a
new document wherever the position does not go up by one; only without a padding mask and with ``use_cache=False``,
as transformers does); a 2-D ``attention_mask`` hides its padding as keys. Both are gathered into whole rows once
per forward.
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
#: tensors transformers passes to every attention function that carry no change to its math (packed rows'
#: boundaries are the scope's documents: the model's pre-hook read them)
_HARMLESS_TENSOR_KWARGS = {"position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                           "max_length_k"}


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
    extra = sorted(k for k, v in kwargs.items()
                   if isinstance(v, torch.Tensor) and k not in _HARMLESS_TENSOR_KWARGS and k != "s_aux")
    if extra:  # e.g. a relative position bias: a (q, k) term that would have to travel around the ring too
        raise ValueError(f"{where} passes {extra} to its attention, which context-parallel attention does not "
                         f"apply (it computes softmax(q k^T) v with causal/sliding masks and attention sinks). Use "
                         f"cp=1 for this model.")
    out = context_parallel_attention(query, key, value, is_causal=causal, scale=scaling, window=sliding_window,
                                     sinks=kwargs.get("s_aux"), **scope.attention_kwargs())
    return out.transpose(1, 2).contiguous(), None


def _mask(batch_size: int, q_length: int, kv_length: int, *args: Any, attention_mask: torch.Tensor | None = None,
          config: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask-interface signature. Inside a scope: no dense mask (the attention applies causality,
    windows, documents and padding itself, from the tables the model's pre-hook gathered). Outside: the original
    implementation's mask."""
    if active_scope() is None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        original = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(_original(config))
        if original is None:
            return attention_mask
        return original(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, config=config,
                        **kwargs)
    if q_length != kv_length:
        raise ValueError(f"context parallelism runs self-attention over whole sequences; got {q_length} queries and "
                         f"{kv_length} keys (a KV cache?). Use cp=1 for generation.")
    scope = active_scope()
    if getattr(scope, "_documents_to_confirm", None) is not None:
        _confirm_documents(scope, kwargs.get("mask_function"))
    return None


#: what one rank saw of the model's own mask function at a document boundary of its tokens
_UNSEEN, _NOT_APPLIED, _APPLIED = 0, 1, 2


def _confirm_documents(scope: Any, mask_function: Any) -> None:
    """Keep the packed rows' documents only if the model's mask keeps them apart, as in one process.

    transformers finds documents from ``position_ids`` only in models that pass them to their mask functions
    (most do; gpt-oss, for one, does not, and attends across documents in one process). Its ``mask_function`` here
    is built from this rank's positions: each rank asks it about two neighbouring tokens of its own on either side
    of a position break (a query and the key just before it, which plain causality shows): hidden means the
    model's mask separates documents. The ranks agree by one small all-reduce (a rank without such a pair has no
    say); where none has one, the documents are kept (the usual case)."""
    local = scope._documents_to_confirm
    local = local.unsqueeze(0) if local.dim() == 1 else local
    scope._documents_to_confirm = None
    seen = torch.tensor(_UNSEEN)
    breaks = (torch.diff(local, dim=-1) != 1).nonzero()
    if mask_function is not None and len(breaks):
        b, j = (int(i) for i in breaks[0])
        with torch.no_grad():
            shown = mask_function(torch.tensor(b), torch.tensor(0), torch.tensor(j + 1), torch.tensor(j))
        seen = torch.tensor(_NOT_APPLIED if bool(shown) else _APPLIED)
    torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX, group=scope.group)
    if int(seen) == _NOT_APPLIED:
        scope.documents = None


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
        extra = bound.arguments.get("kwargs") or {}
        given, mask = bound.arguments.get("position_ids"), bound.arguments.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                f"{type(_module).__name__} got an attention_mask of shape {tuple(getattr(mask, 'shape', ()))}: under "
                f"context parallelism pass the 2-D (batch, seq) padding mask (1 token, 0 padding), sharded with the "
                f"batch, or none; a dense mask cannot follow the keys around the cp group.")
        if given is not None and given.shape[-1] != local.shape[1]:
            raise ValueError(
                f"{type(_module).__name__} got position_ids of length {given.shape[-1]} for {local.shape[1]} tokens "
                f"on this rank: under context parallelism pass them in the batch (sharded with the inputs) or "
                f"leave them out (they are filled in).")
        cu_seq_lens = extra.get("cu_seq_lens_q")
        if cu_seq_lens is not None and given is None:
            raise ValueError(
                f"{type(_module).__name__} got cu_seq_lens_q without position_ids: under context parallelism pass the "
                f"packed rows' position_ids too (DataCollatorWithFlattening gives both), which carry the documents.")
        # transformers finds documents from the positions only where no padding mask is given and no key/value cache
        # is made (``use_cache=False``, as trainers set it for packed rows): the same rows behave as in one process
        packed = given if mask is None and not _makes_cache(_module, bound.arguments, extra) else None
        # kept only if the model's own mask function separates them (``_confirm_documents``, at its first call)
        scope.set_tokens(packed, mask, confirm=True)
        if given is None:
            bound.arguments["position_ids"] = context_positions(local.shape[1], local.device).unsqueeze(0)
            return bound.args, bound.kwargs
        return None

    model.register_forward_pre_hook(fill_positions, with_kwargs=True)
    model._lightning_par_position_hook = True


def _makes_cache(model: nn.Module, arguments: dict[str, Any], extra: dict[str, Any]) -> bool:
    """Whether this forward runs with a key/value cache (transformers' models make one where ``use_cache``, given
    or the config's, is on and none was passed)."""
    if arguments.get("past_key_values", extra.get("past_key_values")) is not None:
        return True
    use_cache = arguments.get("use_cache", extra.get("use_cache"))
    return bool(getattr(model.config, "use_cache", False) if use_cache is None else use_cache)

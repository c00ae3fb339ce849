"""The LightningModule around a Hugging Face causal LM trained from scratch: the package's
:class:`lightning_par.lm.CausalLM`, with the model's config built from a model type and sizes instead of read from
a Hub ID or directory. Parallelism is the strategy's business, chosen in the YAML config; the model's own plans
(``base_model_tp_plan``, ``base_model_pp_plan``) and attention interface are what lightning_par uses, so nothing
here knows about tensor, context or pipeline parallelism.

To fine-tune a pretrained model, use ``CausalLM(model=<Hub ID or directory>)`` itself (``docs/finetuning.md``).
"""

from __future__ import annotations

from typing import Any

from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, PretrainedConfig

from example_projects.gpt.lit import padded_vocab_size
from lightning_par.lm import CausalLM


class HFCausalLMModule(CausalLM):
    """Next-token training of a ``transformers`` causal LM built from a config (``AutoConfig.for_model``).

    Args:
        model_type: a transformers model type with a causal-LM head: ``llama``, ``qwen2``, ``mistral``, ...
        vocab_size: the tokenizer's vocabulary (linked from the data module by ``train.py``).
        vocab_multiple: the model's vocabulary is padded to a multiple of this (tensor parallelism needs ``tp`` to
            divide it); the extra logits are never targets, so they only learn to stay small.
        max_seq_len: the model's ``max_position_embeddings`` (linked from ``data.seq_len``).
        num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads: the size.
        config_overrides: any other field of the model's config, e.g. ``{"rope_theta": 500000.0}``.
        meta_init: under a lightning_par strategy, build the model on the meta device: the strategy then allocates
            and initializes (with transformers' own ``_init_weights``) only this rank's shards and stages. Other
            strategies get a model built in memory.
        lr, weight_decay, warmup_steps, adam_eps: AdamW with linear warmup then cosine decay to lr/10 at the last
            step; ``max_steps`` (linked from ``trainer.max_steps``) is the trainer's.
    """

    def __init__(self, model_type: str = "llama", vocab_size: int = 97, vocab_multiple: int = 64,
                 max_seq_len: int = 128, num_hidden_layers: int = 4, hidden_size: int = 128,
                 intermediate_size: int = 384, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                 config_overrides: dict[str, Any] | None = None, meta_init: bool = True, lr: float = 3e-3,
                 weight_decay: float = 0.1, warmup_steps: int = 20, max_steps: int = 1000,
                 adam_eps: float = 1e-8) -> None:
        super().__init__(model=None, config_overrides=config_overrides, load_weights=False, learning_rate=lr,
                         weight_decay=weight_decay, eps=adam_eps, warmup_steps=warmup_steps, meta_init=meta_init)

    def build_config(self) -> PretrainedConfig:
        """The model's config from the options. Override to start from another, e.g. ``AutoConfig.from_pretrained``."""
        hp = self.hparams
        if not isinstance(hp.model_type, str) or hp.model_type not in CONFIG_MAPPING:
            raise ValueError(f"model_type={hp.model_type!r} is not a transformers model type. Use one with a "
                             f"causal-LM head, e.g. 'llama', 'qwen2', 'mistral', 'gemma', 'phi3' (all of them: "
                             f"transformers.CONFIG_MAPPING).")
        fields = dict(vocab_size=padded_vocab_size(hp.vocab_size, hp.vocab_multiple),
                      max_position_embeddings=hp.max_seq_len, num_hidden_layers=hp.num_hidden_layers,
                      hidden_size=hp.hidden_size, intermediate_size=hp.intermediate_size,
                      num_attention_heads=hp.num_attention_heads, num_key_value_heads=hp.num_key_value_heads,
                      tie_word_embeddings=False, use_cache=False)  # no key/value cache: nothing here generates
        config = AutoConfig.for_model(hp.model_type, **{**fields, **(hp.config_overrides or {})})
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"model_type={hp.model_type!r} has no causal-LM model in transformers "
                             f"(AutoModelForCausalLM cannot build it). Use e.g. 'llama', 'qwen2' or 'mistral'.")
        return config

"""Materializing a model created on the meta device (parallel/init.py), one process: each module initialized by its
own rule (reset_parameters, transformers' _init_weights, PEFT's LoRA init), seeded per FQN, metrics left alone."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_hf_model
from torch import nn

from lightning_par.parallel.init import initialize, materialize


def test_plain_modules_use_reset_parameters_seeded_by_name():
    with torch.device("meta"):
        a, b = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert materialize(a, torch.device("cpu"), seed=3) == []
    materialize(b, torch.device("cpu"), seed=3)
    assert torch.equal(a[0].weight, b[0].weight) and torch.equal(a[1].weight, torch.ones(4))
    c = nn.Sequential(nn.Linear(4, 4))
    initialize(c, seed=4)
    assert not torch.equal(c[0].weight, a[0].weight)  # another seed, other values


def test_metrics_next_to_meta_modules_are_not_touched():
    from torchmetrics.text import Perplexity

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.perplexity = Perplexity()
            with torch.device("meta"):
                self.linear = nn.Linear(4, 4)

    module = Module()
    state = module.perplexity.total_log_probs
    before = (state.data_ptr(), state.clone())
    materialize(module, torch.device("cpu"))
    after = module.perplexity.total_log_probs
    assert after.data_ptr() == before[0] and torch.equal(after, before[1])
    assert not module.linear.weight.is_meta


def test_hugging_face_modules_use_the_models_own_init():
    """transformers' norms have no reset_parameters and its rotary inv_freq is computed, not stored."""
    real = tiny_hf_model("llama")
    with torch.device("meta"):
        meta = tiny_hf_model("llama")
    assert materialize(meta, torch.device("cpu")) == []
    rotary = "model.rotary_emb.inv_freq"
    assert torch.equal(meta.get_buffer(rotary), real.get_buffer(rotary))
    assert torch.equal(meta.model.norm.weight, torch.ones_like(meta.model.norm.weight))
    std = float(meta.model.layers[0].mlp.up_proj.weight.std())
    assert abs(std - real.config.initializer_range) < 0.005  # transformers' normal(0, initializer_range)


def test_lora_adapters_start_as_the_base_model():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = get_peft_model(tiny_hf_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    materialize(model, torch.device("cpu"))
    a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert torch.count_nonzero(b) == 0 and torch.count_nonzero(a) == a.numel()

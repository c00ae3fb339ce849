"""Selective activation checkpointing in one process: what its policy keeps and recomputes, against full
checkpointing and none (counted op by op in the real backward), the same gradients, a Hugging Face model's key/value
cache turned off, and bad modes refused. Parity under every strategy is in the strategies' own test files."""

from __future__ import annotations

import pytest
import torch
from hf_models import HFCausalLM
from torch.utils._python_dispatch import TorchDispatchMode
from workers import TINY_GPT

from example_projects.gpt.lit import GPTModule
from lightning_par import NDParallelStrategy
from lightning_par.costs.profile import profile_model
from lightning_par.dims import ParallelDims
from lightning_par.techniques import ActivationCheckpointing, Target
from lightning_par.techniques.recompute.recompute import MATMUL_OPS


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMUL_OPS
        return func(*args, **(kwargs or {}))


def gpt(mode: bool | str) -> GPTModule:
    torch.manual_seed(0)
    module = GPTModule(**{**TINY_GPT, "n_layer": 2})
    module.configure_model()
    ActivationCheckpointing(mode).apply(Target(module, torch.device("cpu"), "32-true"), ParallelDims(1, 1, 1, 1, 1))
    return module


def backward_matmuls(mode: bool | str) -> tuple[int, int, list[torch.Tensor]]:
    """Matmuls of the forward, of the backward (recomputation included), and the gradients."""
    module = gpt(mode)
    ids = torch.randint(0, TINY_GPT["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(1))
    with CountMatmuls() as forward:
        loss = module.loss(module(ids), ids)
    with CountMatmuls() as backward:
        loss.backward()
    return forward.count, backward.count, [p.grad for p in module.parameters()]  # (names differ: the wrapper's)


def test_selective_recomputes_every_other_matmul_of_a_block():
    """Each block runs q, k, v, the attention projection, MLP in and out. torch stops a recomputation once every
    saved tensor is back, before the MLP's out (only its input is saved): full checkpointing recomputes the first
    five, selective only the two of those its policy did not keep (k, the attention projection)."""
    forward, none, grads = backward_matmuls(False)
    _, full, full_grads = backward_matmuls(True)
    _, selective, selective_grads = backward_matmuls("selective")
    blocks = 2
    assert forward == 6 * blocks + 1  # + the head
    assert full - none == 5 * blocks
    assert selective - none == 2 * blocks
    for grad, full_grad, selective_grad in zip(grads, full_grads, selective_grads, strict=True):
        assert torch.equal(full_grad, grad) and torch.equal(selective_grad, grad)


def test_the_planner_counts_what_the_recomputation_runs():
    """The profile asks the engine's policy op by op and stops where torch does: the matmuls counted above."""
    ids = torch.zeros(4, 16, dtype=torch.long)
    profile = profile_model(gpt(False), (ids, ids))
    block = profile.sections[profile.blocks[0]]
    square = 2 * 4 * 16 * TINY_GPT["n_embd"] ** 2  # one d x d matmul over the batch's tokens
    assert block.selective_recompute_flops == 2 * square  # k, the attention projection
    assert block.full_recompute_flops == 4 * square + 4 * square  # q, k, v, projection; MLP in (d x 4d)


def test_hugging_face_models_train_without_their_key_value_cache_under_checkpointing():
    module = HFCausalLM("llama")
    assert module.model.config.use_cache  # transformers' default: the cache would grow in each recomputation
    ActivationCheckpointing("selective").apply(Target(module, torch.device("cpu"), "32-true"),
                                               ParallelDims(1, 1, 1, 1, 1))
    assert module.model.config.use_cache is False
    module(torch.randint(0, 32, (2, 16))).float().sum().backward()  # the recomputation runs the forward's ops


@pytest.mark.parametrize("mode", ["partial", 1, None])
def test_bad_modes_are_refused(mode):
    with pytest.raises(ValueError, match=rf"activation_checkpointing={mode!r} is not an activation checkpointing "
                                         r"mode. Use True \(or 'full'"):
        NDParallelStrategy(activation_checkpointing=mode)

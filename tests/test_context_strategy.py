"""ContextParallelStrategy: training parity with one process (the attention alone is tested in
test_context_attention.py), and the inputs it must refuse.

The GPT example is unchanged but for taking positions from ``context_positions``: its
``F.scaled_dot_product_attention`` is routed to the distributed attention by the strategy.
"""

import pytest
import torch
import torch.nn.functional as F
from launch import launch
from lightning.pytorch import Trainer
from workers import (
    GPTModule,
    assert_parity,
    assert_raised_on_every_rank,
    error_of,
    fit,
    fit_reference,
)

from lightning_par import ContextParallelStrategy

WORLD2 = {
    "cp2_ring": dict(),
    "cp2_allgather": dict(cp_algorithm="allgather"),
    "cp2_ring_no_load_balance": dict(cp_load_balance=False),
    "cp2_ring_activation_checkpointing": dict(activation_checkpointing=True),
    "cp2_ring_selective_activation_checkpointing": dict(activation_checkpointing="selective"),
    "cp2_ring_compile": dict(compile=True),
}
#: optimizer steps of each parity run (the learning rate's 3 warm-up steps and 2 of its decay, every step's loss
#: compared)
STEPS = 5
WORLD4 = {
    "cp4_ring": (dict(), 1),
    "cp4_allgather": (dict(cp_algorithm="allgather"), 1),
    "dp_shard2_x_cp2": (dict(cp=2, dp_shard=2), 2),
}


class ExplicitMaskGPT(GPTModule):
    """Attention with an explicit mask, which context-parallel attention cannot honour."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        h = self.model.tok_emb(x).unsqueeze(1)
        mask = torch.ones(x.size(1), x.size(1), dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask).sum()


class MaskedTargetsGPT(GPTModule):
    """The tiny GPT whose targets below 12 are not counted (-100, as prompt masking or padding labels): each cp
    rank's half of a sequence then holds its own number of counted tokens."""

    def loss(self, logits, targets):
        return super().loss(logits, targets.masked_fill(targets < 12, -100))


def _errors(cases: dict) -> dict:
    return {
        name: error_of(lambda kw=kwargs: fit(ContextParallelStrategy(), devices=2, dp_size=1, max_steps=2, **kw))
        for name, kwargs in cases.items()
    }


def _world2() -> dict:
    out = {name: fit(ContextParallelStrategy(**kw), devices=2, dp_size=1, max_steps=STEPS)
           for name, kw in WORLD2.items()}
    out["cp2_masked_targets"] = fit(ContextParallelStrategy(), devices=2, dp_size=1, module_cls=MaskedTargetsGPT,
                                    max_steps=STEPS)
    out["errors"] = _errors({
        "seq_not_divisible": dict(seq_len=14),
        "explicit_mask": dict(module_cls=ExplicitMaskGPT),
    })
    return out


def _world4() -> dict:
    return {name: fit(ContextParallelStrategy(**kw), devices=4, dp_size=dp, max_steps=STEPS)
            for name, (kw, dp) in WORLD4.items()}


@pytest.fixture(scope="module")
def reference():
    return fit_reference(max_steps=STEPS)


@pytest.fixture(scope="module")
def world2():
    return launch(2, _world2)


@pytest.fixture(scope="module")
def world4():
    return launch(4, _world4)


@pytest.mark.parametrize("name", list(WORLD2))
def test_parity_world2(world2, reference, name):
    assert_parity(world2[0][name], reference, steps=STEPS)
    assert world2[1][name]["losses"] == world2[0][name]["losses"]


@pytest.mark.parametrize("name", list(WORLD4))
def test_parity_world4(world4, reference, name):
    assert_parity(world4[0][name], reference, steps=STEPS)


@pytest.mark.parametrize(
    "case, error",
    [
        ("seq_not_divisible", r"ValueError: tensor.size\(1\) \(the global sequence length\) = 14 cannot be split"),
        ("explicit_mask", r"ValueError: .*attn_mask"),
    ],
)
def test_bad_inputs_are_refused_on_every_rank(world2, case, error):
    assert_raised_on_every_rank([r["errors"] for r in world2], case, error)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Trainer(accelerator="cpu", devices=4, strategy=ContextParallelStrategy(cp=3), logger=False),
         r"multiplies to 3 processes, but the world size is 4"),
        (lambda: ContextParallelStrategy(cp_algorithm="tree"), r"cp_algorithm='tree' is not one of"),
        (lambda: ContextParallelStrategy(cp_seq_dim=0), r"cp_seq_dim=0 must be"),
    ],
)
def test_bad_configuration_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.fixture(scope="module")
def masked_reference():
    return fit_reference(module_cls=MaskedTargetsGPT, max_steps=STEPS)


def test_labels_of_minus_100_give_one_process_loss(world2, masked_reference):
    """With -100 targets the cp ranks' halves of a sequence count different numbers of tokens: the loss and the
    gradients are still one process's mean over all counted tokens (each rank's cross-entropy is its sum over the
    group's count), not the mean of the ranks' means."""
    assert_parity(world2[0]["cp2_masked_targets"], masked_reference, steps=STEPS)

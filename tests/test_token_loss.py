"""Token-weighted losses (issue #47): with targets of -100 at uneven places, the loss and the gradients are one
process's mean over the counted tokens of the global batch: always across a pipeline's micro-batches (and context
parallelism's sequence parts, tests/test_context_strategy.py), and across data-parallel ranks and gradient
accumulation with ``loss_normalization="tokens"``; the default ``"mean"`` keeps each rank's own mean there.

SGD, not AdamW: Adam's update hardly changes when a step's gradients are all scaled alike, and a wrong count over an
accumulation window is such a scale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from launch import launch
from workers import (
    SGDGPT,
    assert_parity,
    assert_raised_on_every_rank,
    error_of,
    fit,
    fit_reference,
    max_loss_diff,
    max_weight_diff,
)

from lightning_par import FSDP2Strategy, NDParallelStrategy, PipelineParallelStrategy
from lightning_par.parallel.token_loss import TokenLoss, TokenMeanScope


class MaskedBatchGPT(SGDGPT):
    """The tiny GPT (SGD) whose targets below 12 are not counted (-100, as prompt masking or padding): set in
    ``training_step``, before the loss method, so each rank and micro-batch holds its own number of counted tokens."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x, y.masked_fill(y < 12, -100)), batch_idx)


class MaskedInLossGPT(SGDGPT):
    """Masks inside the loss method: under a pipeline the targets are counted before the loss sees them."""

    def loss(self, logits, targets):
        return super().loss(logits, targets.masked_fill(targets < 12, -100))


def pp(schedule: str, m: int, **kw) -> PipelineParallelStrategy:
    return PipelineParallelStrategy(pp_schedule=schedule, pp_microbatches=m, **kw)


#: world 2: name -> (strategy, dp size, accumulate_grad_batches)
WORLD2 = {
    "pp2_gpipe_m4": (lambda: pp("gpipe", 4), 1, 1),
    "pp2_1f1b_m4": (lambda: pp("1f1b", 4), 1, 1),
    "pp2_1f1b_m2_accumulate2_tokens": (lambda: pp("1f1b", 2, loss_normalization="tokens"), 1, 2),
    "dp2_tokens": (lambda: FSDP2Strategy(loss_normalization="tokens"), 2, 1),
    "dp2_mean": (lambda: FSDP2Strategy(), 2, 1),
    "dp2_accumulate2_tokens": (lambda: FSDP2Strategy(loss_normalization="tokens"), 2, 2),
}
WORLD4 = {
    "pp2_x_dp2_tokens": (lambda: NDParallelStrategy(pp=2, dp_shard=2, pp_schedule="1f1b", pp_microbatches=2,
                                                    loss_normalization="tokens"), 2),
    "pp2_x_cp2": (lambda: NDParallelStrategy(pp=2, cp=2, dp_shard=1, pp_schedule="gpipe", pp_microbatches=2), 1),
    "cp2_x_dp2_tokens": (lambda: NDParallelStrategy(cp=2, dp_shard=2, loss_normalization="tokens"), 2),
    # the head's output split over the vocabulary: the cross-entropy's sum is a DTensor
    "pp2_x_tp2_loss_parallel": (lambda: NDParallelStrategy(pp=2, tp=2, dp_shard=1, loss_parallel=True,
                                                           pp_schedule="1f1b", pp_microbatches=2), 1),
}
STEPS = 6


def _world2() -> dict:
    out = {"errors": {
        "masked_in_the_loss": error_of(lambda: fit(pp("gpipe", 2), 2, 1, n_layer=2, max_steps=1,
                                                   module_cls=MaskedInLossGPT)),
    }}
    for name, (make, dp, accumulate) in WORLD2.items():
        out[name] = fit(make(), 2, dp, n_layer=2, max_steps=STEPS, module_cls=MaskedBatchGPT,
                        accumulate_grad_batches=accumulate)
    return out


def _world4() -> dict:
    return {name: fit(make(), 4, dp, n_layer=2, max_steps=STEPS, module_cls=MaskedBatchGPT)
            for name, (make, dp) in WORLD4.items()}


@pytest.fixture(scope="module")
def world2():
    return launch(2, _world2)


@pytest.fixture(scope="module")
def world4():
    return launch(4, _world4)


@pytest.fixture(scope="module")
def reference():
    """One process, the whole global batch: its mean over all counted tokens."""
    return fit_reference(n_layer=2, max_steps=STEPS, module_cls=MaskedBatchGPT)


@pytest.mark.parametrize("name", ["pp2_gpipe_m4", "pp2_1f1b_m4"])
def test_pipeline_micro_batches_are_one_batch(world2, reference, name):
    """The micro-batches' counts differ; the loss on every rank and the weights are one process's mean over the
    batch's counted tokens, not the mean of the micro-batches' means."""
    for rank in world2:
        assert max_loss_diff(rank[name]["losses"], reference["losses"]) <= 1e-5
    assert_parity(world2[0][name], reference, steps=STEPS)


def test_pipeline_mean_of_micro_batch_means_would_differ(reference):
    """Four micro-batches, each its own mean, averaged (what the schedule did before): not one process's loss."""
    means = fit_reference(n_layer=2, max_steps=STEPS, module_cls=MaskedBatchGPT, micro_batches=4)
    assert max_weight_diff(means["weights"], reference["weights"]) > 1e-4


def test_data_parallel_tokens_is_one_process(world2, reference):
    assert_parity(world2[0]["dp2_tokens"], reference, steps=STEPS)


def test_data_parallel_mean_stays_each_ranks_own_mean(world2, reference):
    """The default: each rank's mean over its own counted tokens, averaged over the ranks (DDP's convention): one
    process accumulating the ranks' batches one by one; which differs from the tokens' mean."""
    per_rank = fit_reference(n_layer=2, max_steps=STEPS, module_cls=MaskedBatchGPT, micro_batches=2, ranks=2)
    assert_parity(world2[0]["dp2_mean"], per_rank, steps=STEPS)
    assert max_weight_diff(world2[0]["dp2_mean"]["weights"], reference["weights"]) > 1e-4


@pytest.fixture(scope="module")
def whole_window():
    """One process taking the 16 samples of two accumulated batches of 8 at once."""
    return fit_reference(n_layer=2, max_steps=STEPS, module_cls=MaskedBatchGPT, global_batch=16)


@pytest.mark.parametrize("name", ["dp2_accumulate2_tokens", "pp2_1f1b_m2_accumulate2_tokens"])
def test_accumulation_tokens_is_one_process_on_the_whole_window(world2, whole_window, name):
    """Two accumulated batches of 8 under ``"tokens"``: the weights of one process taking the 16 samples at once
    (each micro-batch's logged loss stays its own global mean)."""
    whole = whole_window
    result = world2[0][name]
    assert len(result["losses"]) == 2 * STEPS
    assert max_weight_diff(result["weights"], whole["weights"]) <= 1e-5


def test_a_loss_method_that_masks_the_targets_itself_is_refused_under_a_pipeline(world2):
    assert_raised_on_every_rank([r["errors"] for r in world2], "masked_in_the_loss",
                                r"ValueError: under pipeline parallelism a mean F.cross_entropy in `loss` .* Shift or "
                                r"mask the targets before calling `self.loss`")


@pytest.mark.parametrize("name", list(WORLD4))
def test_combinations_world4(world4, reference, name):
    assert_parity(world4[0][name], reference, steps=STEPS)


def test_bad_loss_normalization_is_refused():
    with pytest.raises(ValueError, match=r"loss_normalization='sum' is not one of \['mean', 'tokens'\]"):
        NDParallelStrategy(loss_normalization="sum")


def test_token_loss_window_on_one_process():
    """The accumulation window's arithmetic alone: two micro-batches with different counts; each value is its own
    mean, and after the window's rescale the gradient is that of the sum over both counts."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 5, requires_grad=True)
    targets = torch.randint(0, 5, (2, 6))
    targets[0, :4] = -100
    token_loss = TokenLoss(None)
    values = []
    for k in range(2):
        token_loss.start_micro_batch(accumulate=2)
        with TokenMeanScope(token_loss):
            loss = F.cross_entropy(logits[k], targets[k])
        token_loss.end_micro_batch()
        values.append(loss.detach())
        (loss / 2).backward()  # Lightning divides by accumulate_grad_batches
    token_loss.end_window([logits])
    whole = logits.detach().clone().requires_grad_()
    F.cross_entropy(whole.flatten(0, 1), targets.flatten()).backward()
    for k in range(2):
        expected = F.cross_entropy(logits[k].detach(), targets[k])
        assert torch.allclose(values[k], expected)
    assert torch.allclose(logits.grad, whole.grad, atol=1e-7)


def test_a_second_cross_entropy_in_an_accumulated_micro_batch_is_refused():
    """Across accumulation one count per micro-batch joins the window: a second mean cross-entropy would count twice."""
    logits, targets = torch.randn(4, 5), torch.tensor([0, -100, 2, 3])
    token_loss = TokenLoss(None)
    token_loss.start_micro_batch(accumulate=2)
    with TokenMeanScope(token_loss):
        F.cross_entropy(logits, targets)
        with pytest.raises(ValueError, match=r"computed a second one\. Compute the second loss with reduction='sum'"):
            F.cross_entropy(logits, targets)

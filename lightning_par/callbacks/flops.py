"""Model FLOPs per batch for MFU, counted. The peak FLOP/s of known GPUs live in :mod:`lightning_par.devices`
(re-exported here: ``PEAK_FLOPS``, ``lookup_peak_flops``, ``precision_kind``).

What is counted, and why (the definition PaLM's appendix B gives and torchtitan and Megatron-LM use):

- *Model* FLOPs: forward + backward of the model as written, with no activation-checkpointing recomputation (that is
  hardware work the model does not need) and backward = 2 x forward (the gradients of the inputs and of the
  weights each cost one matmul of the forward's size). So a training batch costs ``3 x forward``, which for a
  dense transformer is ``6 N T + 12 L d s T`` (N matmul parameters, T tokens, L layers, width d, sequence length s).
  Only matmuls, convolutions and attention are counted (torch's ``FlopCounterMode`` formulas): the rest is small.
- What *ran*: a mixture of experts counts each token's ``top_k`` routed experts (and the shared ones), not all ``E``
  (the experts' ops see only the routed rows, whichever implementation runs them: a loop of ``F.linear`` per expert,
  ``torch._grouped_mm`` over the routed rows, or ``bmm`` over the gathered weights); attention counts its two
  matmuls over the full ``s x s`` scores (causal and sliding-window masks are not halved, as in torch's table), for
  the fused kernels (SDPA, flash, flex) and for eager attention's explicit matmuls alike; latent attention (MLA)
  counts its low-rank projections and its own head widths; linear-attention layers count the matmuls they run.
- Per *device*: the FLOPs one rank does for one of its batches. Under tensor, context or pipeline parallelism the
  ranks that share a batch share its work, so the MFU of each is the whole model's FLOPs for that batch divided by
  the number of those ranks (as torchtitan divides by the non-data-parallel size).

How it is counted: :class:`ForwardFlopCounter` watches the real training step of the first batch (no extra forward,
so no random numbers, parameters or collectives change) and adds up the FLOPs of the forward ops *this rank runs*:
the local shards inside DTensor ops (tensor parallelism), this rank's sequence chunk (context parallelism), its
stages (pipeline parallelism). Ops run by the autograd engine (backward and activation recomputation) are left out.
The ranks that share a batch then average their counts (:func:`mean_over_batch_sharers`): that average is the whole
model's FLOPs per batch over the number of sharers, with the pipeline's unequal stages evened out.

Hugging Face models are counted the same way. Their own estimate (``floating_point_ops``: 6 x tokens x every
non-embedding parameter) is not used: it counts every expert of a mixture of experts as active (about 9x on
Qwen3-30B-A3B) and leaves attention out. Against ``FlopCounterMode`` over the same real step (forward + backward,
tests/test_flops.py; docs/monitoring.md has the ratios) the count is within 3 % for dense, MoE, MLA and
hybrid-attention models: torch prices a fused attention backward at 2.5 x its forward (the kernel recomputes the
scores), model FLOPs at 2 x, so the gap grows with attention's share of the work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.module_tracker import ModuleTracker

from lightning_par._compat import torch_dispatch_mode
from lightning_par.devices import PEAK_FLOPS, lookup_peak_flops, precision_kind  # noqa: F401 - re-exported
from lightning_par.flop_formulas import formula_for  # torch's FlopCounterMode table and the kernels it lacks

#: FLOPs of a training batch per forward FLOP: forward + backward (2 x forward).
TRAINING_PER_FORWARD = 3

#: ``is_bw`` is torch's public test for "the autograd engine is running this op" (backward, and the recomputation
#: of checkpointed activations, which happens inside backward). The tracker is never entered: only asked.
_ENGINE = ModuleTracker()


def _tracing_types() -> tuple[type, ...]:
    """Tensor subclasses that trace rather than compute (DTensor's sharding propagation runs ops on FakeTensors):
    their ops are not counted. Private torch modules, checked on torch 2.13; tests/test_flops.py fails if moved."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return FakeTensor, FunctionalTensor


class ForwardFlopCounter(torch_dispatch_mode()):  # type: ignore[misc]
    """While active, adds the FLOPs of the forward ops this rank runs to :attr:`forward_flops`.

    DTensor ops are declined (``NotImplemented``), so DTensor runs them and its local ops come back here with the
    local shapes. Ops on the meta device or on tracing tensors, and ops of the autograd engine, are not counted. A
    formula that fails sets :attr:`error` and never disturbs the step it watches.
    """

    def __init__(self) -> None:
        super().__init__()
        self.forward_flops = 0
        self.error: str | None = None
        self._tracing = _tracing_types()

    #: higher-order ops (flex attention, ``cond``) come here too, run as they would without the mode
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # False (the default) makes torch.compile fall back to eager while the mode is on *and* mark those frames
        # as never to compile again (torch 2.13). True lets compiled code run as compiled; the matmul and attention
        # kernels it calls through aten (inductor's default) are still seen.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor computes on local shards; those ops come back to this mode
        key = getattr(func, "_overloadpacket", func)  # a higher-order op is its own key (flex_attention)
        formula = formula_for(key)
        plain = all(t is torch.Tensor or t is nn.Parameter for t in types)
        if plain and formula is None and key is not func:  # a composite op: count what it is made of
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None and self._counts(types, args):
            try:
                self.forward_flops += int(formula(*args, **kwargs, out_val=out))
            except Exception as err:  # noqa: BLE001 - a counting problem must not break the training step
                self.error = f"{key}: {err!r}"
        return out

    def _counts(self, types: Any, args: Any) -> bool:
        if _ENGINE.is_bw or any(issubclass(t, self._tracing) for t in types):
            return False
        return not any(isinstance(a, torch.Tensor) and a.is_meta for a in args)


def count_training_flops(step: Callable[[], Any]) -> int:
    """Model FLOPs (3 x forward) of running ``step()`` once on this rank; ``step`` may run backward too (it is not
    counted). E.g. ``count_training_flops(lambda: model(x).sum().backward())``."""
    counter = ForwardFlopCounter()
    with counter:
        step()
    if counter.error is not None:
        raise RuntimeError(f"FLOP counting failed on {counter.error}")
    return TRAINING_PER_FORWARD * counter.forward_flops


# ---------------------------------------------------------------------------------------------------------------
# ranks that share a batch
# ---------------------------------------------------------------------------------------------------------------
def mean_over_batch_sharers(local: float, dims: Any) -> tuple[float, int]:
    """Collective (one small all_gather, every rank): the mean of ``local`` over the ranks that read the same batch
    (same data-parallel coordinate of lightning_par's ``ParallelDims``), and how many they are. NaN on every rank if
    any rank has NaN, so that all ranks log flops or none does."""
    from lightning_par.callbacks.cross_rank import gather_values

    mine = float(dims.coordinates()["dp"])
    rows = gather_values([mine, float(local)])
    if any(math.isnan(v) for _, v in rows):
        return math.nan, len(rows)
    shared = [v for dp, v in rows if dp == mine]
    return sum(shared) / len(shared), len(shared)


@dataclass(frozen=True)
class FlopsPerBatch:
    """The count of one batch, scaled to later batches by their tokens (else samples): attention's share grows
    with the sequence length, so a batch of another shape is an estimate, exact for the matmuls."""

    flops: float  # per device, for the counted batch
    tokens: float | None
    samples: float | None
    source: str  # "given" or "counted"

    def __call__(self, tokens: float | None, samples: float | None) -> float:
        if self.tokens and tokens is not None:
            return self.flops * tokens / self.tokens
        if self.samples and samples is not None:
            return self.flops * samples / self.samples
        return self.flops


#: How the start-up line names each source (``{batch}``: the training batch that was counted).
SOURCE_TEXT = {
    "given": "given (flops_per_batch)",
    "counted": "counted on batch {batch} (torch FlopCounterMode formulas: this rank's forward ops x 3, backward "
    "and recomputation left out)",
}

"""Activation checkpointing and ``torch.compile`` of blocks: the two techniques that wrap each block alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_par.checks import check_bool, check_checkpointing
from lightning_par.costs.sheet import CostSheet
from lightning_par.dims import ParallelDims
from lightning_par.parallel.hf import outermost_hf_models
from lightning_par.parallel.sequence_scope import recompute_in_active_scope
from lightning_par.techniques.recompute.recompute import (
    ContextFn,
    apply_activation_checkpointing,
    combine_contexts,
    selective_checkpoint_contexts,
)
from lightning_par.techniques.technique import Options, Target, Technique, planned


@dataclass(frozen=True)
class ActivationCheckpointingOptions(Options):
    """Activation checkpointing's option, under the name ``NDParallelStrategy`` takes it (the one source of its
    default; ``docs/strategies.md``'s option table names it)."""

    activation_checkpointing: bool | str = planned(
        False, weigh=(False, "selective", True), flag="the options to weigh (default: all three)",
        flag_values={"none": False, "selective": "selective", "full": True})

    COLUMN = ("AC", 9, "activation checkpointing")

    def label(self, dims: ParallelDims) -> list[str]:
        return {"none": [], "full": ["AC"], "selective": ["SAC"]}[self._mode()]

    def column(self) -> str:
        return {"none": "off", "full": "full", "selective": "selective"}[self._mode()]

    def recomputes(self) -> bool:
        return self._mode() != "none"

    @staticmethod
    def choices(sizes: Mapping[str, int], weighed: Mapping[str, tuple], profile: Any) -> list[dict[str, Any]]:
        return [{"activation_checkpointing": mode} for mode in weighed["activation_checkpointing"]]

    def _mode(self) -> str:
        value = self.activation_checkpointing
        return "selective" if value == "selective" else "full" if value else "none"

    def build(self) -> ActivationCheckpointing:
        return ActivationCheckpointing(self.activation_checkpointing)


@dataclass(frozen=True)
class CompileOptions(Options):
    """``torch.compile``'s option, under the name ``NDParallelStrategy`` takes it."""

    compile: bool = False

    def build(self) -> Compile:
        return Compile(self.compile)


class ActivationCheckpointing(Technique):
    """Recompute each block's activations in backward: all of them (``True`` / ``"full"``), or all but the outputs
    of every other matmul and of attention (``"selective"``: torchtitan's op-level policy, most of the memory saved
    for a fraction of the recomputation). Before FSDP, so FSDP's all-gathers run around the recomputation; the
    recomputation re-enters the context-parallel scope the forward ran in (if any)."""

    def __init__(self, enabled: bool | str = False) -> None:
        self.mode = check_checkpointing("activation_checkpointing", enabled)
        self.enabled = self.mode != "none"
        #: whether ``compile`` compiles the checkpointed blocks afterwards (the recipe says; torch.compile takes
        #: only torch's own recomputation contexts)
        self.compiled = False

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if not self.enabled:
            return
        contexts: list[ContextFn] = []
        # the recomputation runs in autograd's backward: it must re-enter the context-parallel scope, and a packed
        # documents' mask (``parallel/documents``: not under compile, whose blocks take torch's contexts only)
        if dims.cp > 1 or not self.compiled:
            contexts.append(recompute_in_active_scope)
        if self.mode == "selective":
            contexts.append(selective_checkpoint_contexts)
        context_fn = combine_contexts(*contexts) if contexts else None  # (compile wants torch's own contexts)
        apply_activation_checkpointing(target.module, target.blocks, context_fn=context_fn)
        for _, model in outermost_hf_models(target.module):
            # as transformers' own gradient_checkpointing_enable: a key/value cache would grow again in each
            # recomputation (full checkpointing then recomputed attention over twice the keys, sliced back; the
            # selective one finds ops the forward did not run)
            model.config.use_cache = False

    def describe(self, dims: ParallelDims) -> str | None:
        return {"none": None, "full": "activation checkpointing",
                "selective": "selective activation checkpointing (matmul and attention outputs kept)"}[self.mode]

    def account(self, sheet: CostSheet) -> None:
        """Full: a block keeps only its input until backward, which recomputes its forward (one more forward pass)
        and holds one block's activations at a time. Selective: the block also keeps the outputs the policy names,
        and backward recomputes only the rest (the profile measured both). The recomputation sends the blocks'
        forward collectives again (the earlier techniques' transfers say how many; selective keeps some outputs)."""
        sheet.checkpointing = self.mode
        if self.mode == "none":
            return
        if sheet.regathered_in_blocks is not None:
            sheet.transfers.remove(sheet.regathered_in_blocks)
        for t in list(sheet.transfers):
            count = t.recomputed_full if self.mode == "full" else t.recomputed_selective
            if count:
                sheet.transfers.append(t.copy_with(count=count, recomputed=False))


class Compile(Technique):
    """``torch.compile`` each block: every block reuses one compiled graph, and FSDP's hooks (applied later) stay
    outside it. Context-parallel attention is left out of the graphs (``torch.compiler.disable``): a block compiles
    into the graphs before and after it, and the attention with its collectives runs eagerly between them."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = check_bool("compile", enabled)

    def apply(self, target: Target, dims: ParallelDims) -> None:
        if self.enabled:
            for name in target.blocks:
                target.module.get_submodule(name).compile()

    def describe(self, dims: ParallelDims) -> str | None:
        return "torch.compile per block" if self.enabled else None

"""What every parallel technique is to the engine: its options, its checks, how it applies itself, and what it
needs while a step runs.

:class:`~lightning_par.strategies.nd.NDParallelStrategy` is an ordered list of these. Each technique wraps what the
earlier ones produced, so the order is part of the recipe (``techniques/recipe.py``): pipeline split, tensor
parallel, context parallel, expert parallel, activation checkpointing, compile, FSDP (torchtitan's order, for the same
reasons, with expert parallelism after the attention's techniques and before the wrappers). A technique that is off
for a layout (its size is 1, its flag False) does nothing in every hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from lightning_par.dims import ParallelDims
from lightning_par.parallel.modules import find_block_list, match_modules
from lightning_par.parallel.quantized_cut import QuantizedCut

if TYPE_CHECKING:
    from lightning_par.costs.sheet import CostSheet


@dataclass
class Target:
    """The part of the model the techniques act on, handed down the recipe.

    Without pipeline parallelism it is the whole LightningModule. The pipeline split (first in the recipe) narrows
    it to this rank's stages: ``keep`` then names the modules this rank runs, ``whole`` is a meta-device copy of the
    whole model (plans are validated against it, so every rank checks the same thing), and there is no FSDP root
    (each stage module is its own).
    """

    module: nn.Module
    device: torch.device  # where tensors still on the meta device are materialized
    precision: str  # the Trainer's precision flag, e.g. "bf16-mixed"
    block_list: str | None = None  # the user's block_list option (None: found automatically)
    whole: nn.Module | None = None  # None: ``module`` itself
    keep: list[str] | None = None  # FQNs of the modules this rank runs; None: all of them
    fsdp_root: nn.Module | None = None  # set in __post_init__ to ``module`` unless a pipeline cleared it
    experts: list[str] = field(default_factory=list)  # FQNs of the expert-parallel modules (FSDP: their own mesh)
    pretrained: str | None = None  # a checkpoint the weights are read from once the shards have memory
    #: how tensor parallelism cuts the quantized weights (set by the technique that quantized them; None: none are)
    quantized_cut: QuantizedCut | None = None
    _blocks: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.whole is None:
            self.whole = self.module
        if self.fsdp_root is None and self.keep is None:
            self.fsdp_root = self.module

    @property
    def blocks(self) -> list[str]:
        """FQNs of the blocks this rank runs (the block list's entries), resolved once, before any wrapping."""
        if self._blocks is None:
            block_fqn, container = find_block_list(self.module, self.block_list)
            self._blocks = [f"{block_fqn}.{name}" for name in container._modules]
        return self._blocks

    def narrow(self, keep: list[str], blocks: list[str], whole: nn.Module) -> None:
        """Restrict the later techniques to this rank's pipeline stages."""
        self.keep, self._blocks, self.whole, self.fsdp_root = keep, blocks, whole, None

    def units(self, patterns: list[str] | None) -> list[str]:
        """FSDP shard units: the modules this rank runs under pipeline parallelism (each its own root); else the
        given class names / FQN globs, or every block."""
        if self.keep is not None:
            return list(self.keep)
        if patterns is not None:
            return [fqn for fqn, _ in match_modules(self.module, patterns, "shard_units")]
        return self.blocks


class Technique:
    """Base class: every hook does nothing, so a technique implements only what it is about."""

    def check(self, dims: ParallelDims) -> None:
        """Refuse what cannot work with this layout (called on every rank before any collective: at construction
        with the sizes as given, ``-1`` included, and again once the world size has resolved them)."""

    def setup_environment(self, dims: ParallelDims) -> None:
        """Once the process group and the mesh exist, before the model is touched."""

    def apply(self, target: Target, dims: ParallelDims) -> None:
        """Transform ``target.module`` in place (or narrow ``target`` for the techniques after this one)."""

    def step_context(self, dims: ParallelDims) -> AbstractContextManager | None:
        """Entered around every step method and around backward; None when there is nothing to enter."""
        return None

    def after_optimizer_step(self) -> None:
        """After every optimizer step (float8's scales for the next all-gathers)."""

    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of a batch that every rank of the technique's group received whole."""
        return batch

    def describe(self, dims: ParallelDims) -> str | None:
        """A few words for the start-up summary; None when the technique is off."""
        return None

    def account(self, sheet: CostSheet) -> None:
        """For the planner: write what this technique does to memory and communication into ``sheet`` (called in
        the engine's order, with the layout's resolved sizes in ``sheet.dims``)."""


def planned(default: Any, *, weigh: tuple | None = None, flag: str | None = None,
            flag_values: Mapping[str, Any] | None = None) -> Any:
    """A field of an options dataclass that the planner decides, so that every layout carries its value
    (``planner.predict.Layout``), shows it (``Options.label``) and passes it on (``Options.layout_kwargs``).

    ``weigh``: the values ``plan_layouts`` weighs by default; the option is then one of its keyword arguments (the
    values to weigh), and ``flag`` the help text of the planner's command-line flag for it (``--name-with-dashes``;
    ``flag_values`` names the values there, default ``both`` / ``on`` / ``off``)."""
    return field(default=default, metadata={"planned": True, "weigh": weigh, "flag": flag,
                                            "flag_values": flag_values})


class Options:
    """Base of every technique's options dataclass (``techniques/recipe.OPTIONS``): the one place an option is
    named, with its default, beside the technique that reads it. Besides ``build`` (the technique object), it
    says how a layout of the planner shows and passes on its values: the planner asks these hooks and names no
    option itself."""

    #: the planner table's legend entries for this technique's words (``label``): (regex over a layout's text,
    #: meaning), shown where a row matches
    LEGEND: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: options the engine has never run, with why: the planner weighs them only when asked, and its table marks
    #: the layouts that turn them on
    UNTRIED: ClassVar[dict[str, str]] = {}
    #: a column of the planner's table instead of words in the layout: (heading, width, what it stands for)
    COLUMN: ClassVar[tuple[str, int, str] | None] = None

    def build(self) -> Technique:
        raise NotImplementedError

    def label(self, dims: ParallelDims) -> list[str]:
        """The words a layout of these options shows after its sizes (``planner.predict.Layout.__str__``)."""
        return []

    def column(self) -> str:
        """This layout's cell of the table's column (``COLUMN``)."""
        return ""

    def layout_kwargs(self, dims: ParallelDims) -> dict[str, Any]:
        """What a layout of these options passes ``NDParallelStrategy`` (``Layout.strategy_kwargs``): by default
        every planned option whose value is not its default."""
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if f.metadata.get("planned") and getattr(self, f.name) != f.default}

    def recomputes(self) -> bool:
        """Whether the blocks' forward runs again in backward (activation checkpointing)."""
        return False

    def before_trace(self, module: nn.Module, blocks: list[str]) -> None:
        """What these options do to the model's parameters before training, done to the planner's meta copy of it
        before it is traced, so the profile holds the bytes training will hold (QLoRA's 4-bit base weights)."""

    def restrict(self) -> dict[str, list[int]]:
        """Sizes the planner must keep to with these options (``AutoParallelStrategy``): what they do not combine
        with yet."""
        return {}

    @staticmethod
    def choices(sizes: Mapping[str, int], weighed: Mapping[str, tuple], profile: Any) -> list[dict[str, Any]]:
        """The values of these options the planner enumerates for a set of ``sizes`` (``planner.search``:
        ``weighed``, what it was asked to weigh, by option; ``profile``, the model's ``ModelProfile``): one dict
        of option values per choice."""
        return [{}]

    @staticmethod
    def force(layout: Any, weighed: Mapping[str, tuple]) -> Any:
        """``layout`` as what is weighed alone makes every layout (e.g. re-gathered chunks wherever sequence
        parallelism is, when only they are weighed)."""
        return layout

    def untried(self) -> list[str]:
        """Why, for each option set here that the engine has never run (``UNTRIED``)."""
        return [why for name, why in self.UNTRIED.items() if getattr(self, name)]

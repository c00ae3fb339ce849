"""AutoParallelStrategy: the layout chosen by the planner, at setup, then trained by the engine.

Every rank profiles the model on the meta device, probes the hardware (a second or two of matmuls and collectives,
all ranks together) or takes it from the table of known devices, and ranks every valid layout; rank 0's choice is
broadcast so that every rank builds the same mesh. The start-up output names the choice with its predicted memory
and step time next to the runner-up; ``plot_dir`` also writes the plan's picture (and logs it to TensorBoard).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par._compat import train_dataloader_of
from lightning_par.checks import check_bool, check_checkpointing
from lightning_par.planner.predict import Layout
from lightning_par.planner.search import RESTRICTABLE, UNTRIED, WEIGH, Plan, plan_layouts
from lightning_par.strategies.nd import NDParallelStrategy
from lightning_par.techniques import build_recipe
from lightning_par.techniques.recipe import option_names, options_of, planned_options
from lightning_par.techniques.tensor.tensor_parallel import TensorParallelOptions, check_async_tp_device

#: what the planner decides and a user may not fix here: the sizes, and the planned options that ``plan_layouts``
#: does not weigh as asked (the pipeline's shape, loss parallelism, offload); the weighed ones a user fixes
_OWN = (*RESTRICTABLE, *(name for name in planned_options() if name not in WEIGH))


class AutoParallelStrategy(NDParallelStrategy):
    """Chooses the layout (``pp x dp_replicate x dp_shard x cp x tp``, schedule, micro-batches, activation
    checkpointing, offload) that the planner predicts fastest among those that fit, and trains it. With
    ``compile=True`` it plans without context parallelism (not compiled yet). Async tensor parallelism, which has
    never run (it needs 2+ CUDA GPUs), is planned only when asked for: ``async_tp=True``.

    Args:
        memory_budget: bytes (or a string such as ``"20GiB"``) one device may use; default: the device's memory
            less 10 %. On CPU there is no default: every layout fits.
        restrict: sizes allowed per dimension, e.g. ``{"pp": [1], "tp": [1, 2]}``.
        activation_checkpointing: force it: ``False``, ``True`` (full) or ``"selective"`` (default: the planner
            decides among the three).
        sequence_parallel: force it on or off where the planner picks ``tp > 1`` (default: it weighs both).
        regather_sequence: force it on or off where the planner picks sequence parallelism (default: it weighs
            it for the layouts that do not fit without it; never with ``compile=True``).
        async_tp: Inductor's async tensor parallelism where the planner picks sequence parallelism: ``True``
            plans it (needs ``compile=True`` and CUDA); default off: it has never run (it needs 2+ CUDA GPUs), so
            the planner does not recommend it unasked.
        device: plan for a known device (``lightning_par.devices``) instead of measuring this machine.
        gpus_per_node: ranks per node (default: the devices per node the Trainer was given).
        plot_dir: write the plan's picture there (and to a TensorBoard logger).
        **kwargs: every other ``NDParallelStrategy`` option (``pretrained``, ``block_list``, ``tp_plan``, ...).
    """

    def __init__(self, memory_budget: float | str | None = None, restrict: Mapping[str, Iterable[int]] | None = None,
                 activation_checkpointing: bool | str | None = None, device: str | None = None,
                 gpus_per_node: int | None = None, plot_dir: str | None = None,
                 sequence_parallel: bool | None = None, regather_sequence: bool | None = None,
                 async_tp: bool | None = None, **kwargs: Any) -> None:
        given = sorted(set(kwargs) & set(_OWN))
        if given:
            raise ValueError(f"AutoParallelStrategy chooses {given} itself; restrict the sizes it may choose with "
                             f"restrict={{'tp': [1, 2]}} (or use NDParallelStrategy to set the layout by hand).")
        self.memory_budget = _parse_bytes(memory_budget)
        self.restrict = {k: [int(x) for x in v] for k, v in (restrict or {}).items()}
        unknown = set(self.restrict) - set(RESTRICTABLE)
        if unknown:
            raise ValueError(f"restrict={dict(restrict or {})!r}: {sorted(unknown)} are not layout dimensions; use "
                             f"{RESTRICTABLE}.")
        # the planner's choices fixed here (None: it weighs them), and those given as strategy options
        if activation_checkpointing is not None:
            check_checkpointing("activation_checkpointing", activation_checkpointing)
        forced = {name: check_bool(name, value) for name, value in (
            ("sequence_parallel", sequence_parallel), ("regather_sequence", regather_sequence),
            ("async_tp", async_tp)) if value is not None}
        if activation_checkpointing is not None:
            forced["activation_checkpointing"] = activation_checkpointing
        TensorParallelOptions.check_forced(forced, bool(kwargs.get("compile")))
        self.weigh = {name: (value,) for name, value in {**forced, **kwargs}.items() if name in WEIGH}
        if device is not None:
            from lightning_par.devices import lookup_device

            lookup_device(device)  # an unknown name fails here, on every rank, before anything is launched
        self.plan_device, self.gpus_per_node, self.plot_dir = device, gpus_per_node, plot_dir
        self._options = {k: v for k, v in kwargs.items() if k in option_names()}
        self.plan: Plan | None = None
        super().__init__(dp_shard=-1, **kwargs)

    @property
    def layout_known(self) -> bool:
        return False  # chosen in setup, once the model and the data exist

    def _validate_configuration(self) -> None:
        super()._validate_configuration()
        for name in UNTRIED:  # (async tensor parallelism, on CUDA symmetric memory)
            check_async_tp_device(any(self.weigh.get(name, (False,))), self.root_device.type)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """While the layout is being planned there is no mesh: a ``train_dataloader`` that builds its own
        ``DistributedSampler`` from these (as under every fixed layout) is read under a provisional single-replica
        view, for one example batch; Lightning builds the loader again once the layout is chosen."""
        if not self.dims.has_mesh:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    def setup(self, trainer: pl.Trainer) -> None:
        self.plan = self._plan(trainer)
        layout = self._agree(self.plan.require_fit().layout)
        self.dims = layout.dims().resolve(self.num_nodes * self.num_processes)
        self._use_recipe(build_recipe(**{**self._options, **_recipe_options(layout)}))
        for technique in self.techniques:  # the chosen layout against every option (experts per node, ...), on
            technique.check(self.dims)     # every rank alike: the layout is agreed
        self.build_mesh()
        rank_zero_info(self._summary())
        if self.plot_dir is not None:
            from lightning_par.planner.picture import save_plan_picture

            save_plan_picture(self.plan, self.plot_dir, trainer)
        super().setup(trainer)

    def _plan(self, trainer: pl.Trainer) -> Plan:
        from lightning_par.devices import fused, known_hardware, with_float8
        from lightning_par.planner.probe import precision_family, probe_dtype, probe_hardware, probe_shapes, tp_degrees

        module = self.lightning_module
        assert module is not None
        batch = next(iter(train_dataloader_of(trainer)))
        per_node = self.gpus_per_node or self.num_processes
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        from lightning_par.costs.profile import profile_model
        from lightning_par.planner.predict import trace_dtype

        fixed = options_of(self._options)  # what the user set: its effect on the parameters is traced (4-bit weights)
        profile = profile_model(module, batch, block_list=self.block_list, share=(trainer,),
                                dtype=trace_dtype(precision),
                                prepare=lambda copy, blocks: [o.before_trace(copy, blocks) for o in fixed])
        if self.plan_device is not None:
            hardware = known_hardware(self.plan_device, precision=precision_family(precision), gpus_per_node=per_node)
        else:
            shapes = probe_shapes(profile)
            hardware = probe_hardware(self.root_device, probe_dtype(precision), shapes, per_node,
                                      tp_sizes=tp_degrees(shapes, per_node))
        if self.compile.enabled:  # its non-matmul ops fused (a GPU's memory term; nothing to change on the CPU)
            hardware = fused(hardware)
        if any(getattr(o, "float8", None) == "tensorwise" for o in fixed):
            try:  # the converted matmuls at the device's float8 rate, the casts at its memory bandwidth
                hardware = with_float8(hardware)
            except ValueError:
                pass  # no float8 matmuls here (the CPU: float8 for correctness only): priced as plain matmuls
        weigh = dict(self.weigh)  # what the user fixed; the planner weighs the rest
        TensorParallelOptions.auto_weigh(weigh, bool(self.compile.enabled))
        for name in UNTRIED:  # never run (Inductor's async tensor parallelism): only when asked for
            weigh.setdefault(name, (False,))
        restrict = dict(self.restrict)
        for options in fixed:  # what does not compose with tp yet (8-bit layers, 4-bit weights)
            restrict.update(options.restrict())
        return plan_layouts(profile, batch,
                            self.num_nodes * self.num_processes, hardware, precision=precision,
                            batch_is_global=False, memory_budget=self.memory_budget, restrict=restrict,
                            block_list=self.block_list, gradient_accumulation=False,  # a loader batch: a micro-batch
                            **weigh)

    def _agree(self, layout: Layout) -> Layout:
        """Rank 0's choice on every rank (every rank plans alike, but measured numbers may differ in the last
        digit: one small broadcast makes the mesh the same everywhere)."""
        if not dist.is_initialized():
            return layout
        box = [asdict(layout)]
        dist.broadcast_object_list(box, src=0)
        return Layout(**box[0])

    def _summary(self) -> str:
        assert self.plan is not None
        best = self.plan.best
        lines = [f"lightning_par auto_parallel: chose {best.layout} out of {len(self.plan.predictions)} layouts "
                 f"({self.plan.hardware.source}); ranked by tokens/s per device: the dataloader's batch goes to "
                 f"each data-parallel rank, so a layout with less data parallelism takes fewer samples per step",
                 f"  chosen:    {best.tokens_per_s:,.0f} tokens/s per device; {best.reason}"]
        if len(self.plan.predictions) > 1:
            second = self.plan.predictions[1]
            lines.append(f"  runner-up: {second.layout}: {second.tokens_per_s:,.0f} tokens/s per device; "
                         f"{second.reason}")
        return "\n".join(lines)


def _recipe_options(layout: Layout) -> dict[str, Any]:
    """The layout's technique options: what ``NDParallelStrategy(**layout.strategy_kwargs())`` gets, less the sizes
    (one translation of a layout into options, for users and for this strategy alike)."""
    return {k: v for k, v in layout.strategy_kwargs().items() if k not in RESTRICTABLE}


def _parse_bytes(value: float | str | None) -> float | None:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
        text = value.strip().lower().replace(" ", "")
        for unit in sorted(units, key=len, reverse=True):
            if text.endswith(unit):
                try:
                    return float(text[: -len(unit)]) * units[unit]
                except ValueError:
                    break
    raise ValueError(f"memory_budget={value!r} must be a positive number of bytes or a size such as '20GiB'.")


"""The Trainer side of fault-tolerant replica groups (``NDParallelStrategy(fault_tolerance=...)``).

What the strategy does with them, step by step:

* **join**: the first quorum is formed when the training data is set up (after a ``ckpt_path`` restore, before the
  loops read their progress). A group that (re)joins a running job receives a live group's model, optimizer,
  scheduler and loop progress there, so its sampler skips the batches already trained, as after a checkpoint
  restore, and it trains the very step it joined, with its own batch.
* **every step**: a quorum before the first micro-batch; after backward the gradients are averaged over the live
  groups; the step is applied only if every rank of every live group finished it, else the optimizer sees no
  gradients (the step is skipped on every rank alike; the batch counts as consumed and the learning-rate schedule
  advances, as for any skipped step).
* **data**: each group reads a fixed shard of every epoch. The shard of a group that is down is not trained for
  those steps (never re-assigned, never repeated).
* **checkpoints and logs**: the live group of lowest index writes checkpoints (with torchft's step); loggers run on
  group 0's rank 0 only, so one set of logs exists.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer

from lightning_par.dims import ParallelDims
from lightning_par.parallel.fault_tolerance import (
    FaultTolerance,
    ReplicaGroups,
    data_shard,
    load_module_state,
    load_optimizer_state,
    module_state,
    optimizer_state,
)

CHECKPOINT_KEY = "fault_tolerance"


class _LoopSnapshot(Callback):
    """Keeps the loops' progress as a checkpoint written at ``on_train_batch_end`` would (what a peer sends)."""

    def __init__(self) -> None:
        self.loops: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "lightning_par.fault_tolerance.loops"

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.loops = copy.deepcopy(trainer.fit_loop.state_dict())


class FaultTolerantTraining:
    """One replica group's side of the quorum, called by the strategy at its hooks."""

    def __init__(self, options: FaultTolerance, num_groups: int) -> None:
        self.options = options.resolve(num_groups)
        self.num_groups = num_groups
        self.groups: ReplicaGroups | None = None
        self._snapshot = _LoopSnapshot()
        self._trainer: pl.Trainer | None = None
        self._in_step = False  # a quorum is open (started, not yet committed)
        self._joining = False  # the quorum open now is this group's first: a peer's loop progress applies
        self._joined = False

    @property
    def replica_id(self) -> int:
        assert self.options.replica_id is not None
        return self.options.replica_id

    def sampler_kwargs(self, dims: ParallelDims) -> dict[str, int]:
        num_replicas, rank = data_shard(self.replica_id, self.num_groups, dims.mesh("dp").get_local_rank(),
                                        dims.dp_size)
        return {"num_replicas": num_replicas, "rank": rank}

    def start(self, trainer: pl.Trainer, strategy: Any, layout: dict[str, Any]) -> None:
        """Create the torchft manager; the model and the optimizers exist (``setup``)."""
        optimizers = strategy.plain_optimizers()
        if len(optimizers) > 1:
            raise ValueError(f"fault_tolerance works with one optimizer; configure_optimizers returned "
                             f"{len(optimizers)}. Combine their parameter groups into one optimizer.")
        self._trainer, self._layout = trainer, layout
        if self._snapshot not in trainer.callbacks:
            trainer.callbacks.append(self._snapshot)
        env = strategy.cluster_environment
        self.groups = ReplicaGroups(self.options, strategy.global_rank, strategy.world_size, env.main_address,
                                    env.main_port, strategy.root_device, self._state, self._load)

    # ---- the state a live group sends and a joining one loads ------------------------------------------------
    def _state(self) -> dict[str, Any]:
        trainer = self._trainer
        assert trainer is not None and trainer.lightning_module is not None
        return {
            "layout": self._layout,
            "model": module_state(trainer.lightning_module),
            "optimizers": [optimizer_state(o) for o in trainer.strategy.plain_optimizers()],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "loops": self._snapshot.loops,
        }

    def _load(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        assert trainer is not None and trainer.lightning_module is not None
        if state["layout"] != self._layout:
            raise ValueError(
                f"FaultTolerance: replica group {self.replica_id} has the layout {self._layout}, but the live groups "
                f"have {state['layout']}. Every replica group must run the same model with the same strategy "
                f"sizes and the same number of processes; relaunch this group with theirs.")
        load_module_state(trainer.lightning_module, state["model"])
        for optimizer, sent in zip(trainer.strategy.plain_optimizers(), state["optimizers"]):
            load_optimizer_state(optimizer, sent)
        for config, sent in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(sent)
        if self._joining and state["loops"] is not None:
            trainer.fit_loop.load_state_dict(state["loops"])
            self._snapshot.loops = copy.deepcopy(state["loops"])

    # ---- the hooks ---------------------------------------------------------------------------------------------
    def join(self) -> None:
        """The first quorum of a fit (see the module docstring); later calls do nothing."""
        if self._in_step or self.groups is None or self._joined:
            return
        self._joining = True
        try:
            self._open_step()
        finally:
            self._joining = False
        self._joined = True

    def before_batch(self) -> None:
        """Open the step's quorum before its first micro-batch (once per optimizer step)."""
        if not self._in_step:
            self._open_step()

    def _open_step(self) -> None:
        assert self.groups is not None
        self.groups.start_step()
        self._in_step = True

    def wrap_closure(self, closure: Any, optimizer: Optimizer) -> Any:
        """``closure`` (forward and backward), then the gradients averaged over the live groups and the vote: a
        step that cannot be committed reaches the optimizer without gradients, so it changes nothing."""
        groups = self.groups
        assert groups is not None

        def step_closure() -> Any:
            result = closure()
            groups.average_gradients(p for g in optimizer.param_groups for p in g["params"])
            committed = groups.commit()
            self._in_step = False
            if not committed:
                optimizer.zero_grad(set_to_none=True)
            return result

        return step_closure

    @property
    def writes_checkpoints(self) -> bool:
        """Only the live group of lowest index writes (every group holds the same state); outside training (no
        quorum any more), group 0."""
        if self.groups is None:
            return self.replica_id == 0
        return self.groups.group_index == 0

    def teardown(self) -> None:
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None

"""Fault-tolerant replica groups on torchft: plain torch, usable without Lightning.

The data-parallel replicate dimension is cut into replica groups, each its own torch.distributed job (its own
``torchrun``) holding the whole model in its own layout (FSDP, tp, pp, cp, ep inside the group). Across groups,
torchft's ``Manager`` forms a quorum with a Lighthouse every step: the live groups average their gradients over a
process group that torchft rebuilds when a group dies or rejoins, a step is applied only where every rank of every
live group could commit it, and a rejoining group receives the state of a live one over the network instead of
reading a checkpoint. Rank ``r`` of one group talks only to rank ``r`` of the others: every group has the same
layout, so their local shards correspond one to one.

torchft is optional (``pip install "lightning_par[ft]"``) and imported only here, only when used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.checks import check_positive_int

#: Environment variables a launcher sets per replica group (torchft's own name for the Lighthouse).
REPLICA_ID_ENV = "REPLICA_GROUP_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def import_torchft() -> Any:
    """torchft, or an ImportError that names the extra to install."""
    try:
        import torchft
    except ImportError as e:
        raise ImportError(
            "fault_tolerance=FaultTolerance(...) needs torchft, which is not installed. Install the extra: "
            "pip install 'lightning_par[ft]' (torchft>=0.2)."
        ) from e
    return torchft


@dataclass
class FaultTolerance:
    """Options of the fault-tolerant replica dimension (torchft). ``dp_replicate`` of the strategy is the number of
    replica groups; each group is launched as its own job with ``replica_id`` set.

    Args:
        replica_id: this group's index in ``[0, dp_replicate)``; default: the ``REPLICA_GROUP_ID`` environment
            variable. It fixes which shard of the data the group reads (see :func:`data_shard`).
        lighthouse: the Lighthouse's address, e.g. ``"http://host:29510"``; default: ``TORCHFT_LIGHTHOUSE``.
        min_replicas: the fewest live groups a step needs to be applied; a step with fewer is skipped on all.
        timeout: seconds a cross-group collective, commit vote or state transfer may take before the step is given
            up (the groups then form a new quorum without the one that did not answer).
        quorum_timeout: seconds to wait for a quorum (for ``min_replicas`` groups to be there).
    """

    replica_id: int | None = None
    lighthouse: str | None = None
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0

    def resolve(self, num_groups: int) -> FaultTolerance:
        """A copy with the environment's defaults filled in, checked against ``num_groups`` (``dp_replicate``)."""
        replica_id = self.replica_id
        if replica_id is None:
            if REPLICA_ID_ENV not in os.environ:
                raise ValueError(
                    f"FaultTolerance: replica_id is not set and neither is the {REPLICA_ID_ENV} environment variable. "
                    f"Launch each replica group with {REPLICA_ID_ENV}=<0..{num_groups - 1}> or pass replica_id=.")
            raw = os.environ[REPLICA_ID_ENV]
            if not raw.isdigit():
                raise ValueError(f"FaultTolerance: {REPLICA_ID_ENV}={raw!r} must be a group index in "
                                 f"[0, {num_groups}).")
            replica_id = int(raw)
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or not 0 <= replica_id < num_groups:
            raise ValueError(f"FaultTolerance: replica_id={replica_id!r} must be an int in [0, dp_replicate="
                             f"{num_groups}). Number the replica groups 0..{num_groups - 1}.")
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(f"FaultTolerance: lighthouse is not set and neither is {LIGHTHOUSE_ENV}. Start one "
                             f"(`torchft_lighthouse --min_replicas 1`) and pass lighthouse='http://host:29510'.")
        if not lighthouse.startswith(("http://", "https://")):
            raise ValueError(f"FaultTolerance: lighthouse={lighthouse!r} must be an address like "
                             f"'http://host:29510'.")
        check_positive_int("FaultTolerance.min_replicas", self.min_replicas)
        if self.min_replicas > num_groups:
            raise ValueError(f"FaultTolerance: min_replicas={self.min_replicas} exceeds dp_replicate={num_groups} "
                             f"(the number of replica groups): no step could ever be applied. Lower min_replicas.")
        for name in ("timeout", "quorum_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"FaultTolerance: {name}={value!r} must be a positive number of seconds.")
        return FaultTolerance(replica_id, lighthouse, self.min_replicas, float(self.timeout),
                              float(self.quorum_timeout))


def data_shard(replica_id: int, num_groups: int, group_dp_rank: int, group_dp_size: int) -> tuple[int, int]:
    """``(num_replicas, rank)`` for the data sampler: every group owns a fixed shard of each epoch (as torchft's and
    torchtitan's samplers do), so a group that is down leaves its shard of those steps untrained and no other group
    reads it twice."""
    return num_groups * group_dp_size, replica_id * group_dp_size + group_dp_rank


def local_view(tensor: Tensor) -> Tensor:
    """The tensor this rank holds (its shard of a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReplicaGroups:
    """This rank's membership in the replica groups: the torchft ``Manager`` and the three things a step asks of it.

    ``state`` returns this rank's part of the training state (plain tensors: local shards) and ``load`` applies one
    received from a peer; the peer is the same group rank of a live group, so the shards line up.
    """

    def __init__(self, options: FaultTolerance, group_rank: int, group_world_size: int, store_addr: str,
                 store_port: int, device: torch.device, state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None]) -> None:
        torchft = import_torchft()
        timeout = timedelta(seconds=options.timeout)
        if device.type == "cuda":
            process_group = torchft.ProcessGroupNCCL(timeout=timeout)
        else:
            process_group = torchft.ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = torchft.Manager(
                pg=process_group, load_state_dict=load, state_dict=state, min_replica_size=options.min_replicas,
                use_async_quorum=False,  # a rejoining group trains the step it joins (see the strategy's docs)
                timeout=timeout, quorum_timeout=timedelta(seconds=options.quorum_timeout),
                connect_timeout=timeout, rank=group_rank, world_size=group_world_size, store_addr=store_addr,
                store_port=store_port, lighthouse_addr=options.lighthouse,
                replica_id=f"lightning_par_{options.replica_id}")
        except Exception as e:  # torchft raises its own RuntimeError text; say which option to check
            raise RuntimeError(
                f"FaultTolerance: replica group {options.replica_id} could not reach the Lighthouse at "
                f"lighthouse={options.lighthouse!r} within timeout={options.timeout:g} s ({e}). Start it first "
                f"(`torchft_lighthouse --min_replicas {options.min_replicas} --bind [::]:29510`) and check the "
                f"address.") from e
        self.options = options

    def start_step(self) -> None:
        """Join this step's quorum; a group that is behind (rejoining) receives a live group's state here."""
        self.manager.start_quorum()

    @property
    def participants(self) -> int:
        """Live replica groups contributing to this step."""
        return self.manager.num_participants()

    @property
    def group_index(self) -> int | None:
        """This group's rank among the live groups of this step (``None`` if it sits the step out)."""
        return self.manager.participating_rank()

    def average_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Average this rank's gradient shards over the live groups, in place, in one flat buffer per dtype (one
        collective per dtype, not one per parameter)."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in parameters:
            if p.grad is not None:
                grad = local_view(p.grad)
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()
            for grad, averaged in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                grad.copy_(averaged.view_as(grad))

    def commit(self) -> bool:
        """Whether every rank of every live group finished this step's collectives: apply the step only then."""
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        """Steps committed so far (the same on every live group)."""
        return self.manager.current_step()

    def state_dict(self) -> dict[str, int]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def module_state(module: nn.Module) -> dict[str, Tensor]:
    """This rank's tensors of ``module``'s state dict, as plain local tensors (copies, safe to send)."""
    return {k: local_view(v).detach().clone() for k, v in module.state_dict().items() if isinstance(v, Tensor)}


@torch.no_grad()
def load_module_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a peer's :func:`module_state` into ``module``'s own tensors, in place (shards stay where they are)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"FaultTolerance: the state received from a live replica group lacks {missing[:5]}: the "
                         f"groups run different models. Launch every group with the same model and layout.")
    mine = {k: local_view(v) for k, v in own.items() if isinstance(v, Tensor)}
    differ = [f"{k}: {tuple(state[k].shape)} there, {tuple(v.shape)} here" for k, v in mine.items()
              if state[k].shape != v.shape]
    if differ:
        raise ValueError(f"FaultTolerance: the live replica groups hold tensors of other shapes ({differ[:3]}): the "
                         f"groups run different models or layouts. Launch every group with the same ones.")
    for name, tensor in mine.items():
        tensor.copy_(state[name])


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with every DTensor replaced by its local shard."""
    sd = optimizer.state_dict()
    state = {i: {k: local_view(v).detach().clone() if isinstance(v, Tensor) else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a peer's :func:`optimizer_state`: shards that belong to a DTensor parameter become DTensors again, laid
    out as that parameter is."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt = {}
    for i, entry in state["state"].items():
        param = params[int(i)]
        rebuilt[i] = {k: _like(param, v) for k, v in entry.items()}
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})


def _like(param: Tensor, value: Any) -> Any:
    if isinstance(param, DTensor) and isinstance(value, Tensor) and value.shape == param.to_local().shape:
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value

"""``lightning_par.ModelParallelStrategy``: Lightning's ``ModelParallelStrategy``, argument for argument and mesh
name for mesh name, on lightning_par's engine. A user switches by changing one import."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_par import checkpoint as ckpt
from lightning_par import lightning_checkpoints as lightning_ckpt
from lightning_par.checks import check_bool
from lightning_par.dims import ParallelDims
from lightning_par.strategies.nd import NDParallelStrategy

_NOT_LIGHTNINGS = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


def _check_size(name: str, value: Any) -> int | Literal["auto"]:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"ModelParallelStrategy: {name}={value!r} must be a positive number of processes or 'auto'.")


class ModelParallelStrategy(NDParallelStrategy):
    """Drop-in for ``lightning.pytorch.strategies.ModelParallelStrategy``: change the import, keep the code.

    The LightningModule's ``self.device_mesh`` is Lightning's 2-D mesh (``"data_parallel"``, ``"tensor_parallel"``),
    so a ``configure_model`` written for Lightning runs unchanged and, seeded alike, draws the same random numbers
    (its step losses equal Lightning's). Checkpoints are written in Lightning's layout (a sharded directory, or one
    file with ``save_distributed_checkpoint=False``), so Lightning resumes them too; Lightning's checkpoints resume
    here, under this or any other lightning_par layout. What lightning_par adds comes with it: exact mid-epoch
    resume, atomic checkpoints, the Trainer's precision flag, clean exits, and, when ``configure_model`` does not
    parallelize, the engine's FSDP2 and tensor parallelism (``tp_plan`` and NDParallelStrategy's other options pass
    through as keyword arguments).

    Args:
        data_parallel_size: ranks of the data-parallel dimension (FSDP shards over it). ``"auto"``: the number of
            nodes when both sizes are ``"auto"`` (Lightning's rule), else what ``tensor_parallel_size`` leaves.
        tensor_parallel_size: ranks of the tensor-parallel dimension. ``"auto"``: the devices per node when both
            are ``"auto"``, else what ``data_parallel_size`` leaves.
        save_distributed_checkpoint: each rank writes its shards into a directory (``True``), or rank 0 writes one
            file with the full weights and optimizer state (``False``).
        process_group_backend, timeout: as Lightning's.
        **kwargs: NDParallelStrategy's options, except the sizes (Lightning's mesh has only these two dimensions:
            for pipeline or context parallelism use NDParallelStrategy).
    """

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: float | timedelta = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        sizes = [name for name in _NOT_LIGHTNINGS if name in kwargs and kwargs[name] != 1]
        if sizes:
            raise TypeError(f"ModelParallelStrategy takes Lightning's data_parallel_size and tensor_parallel_size, "
                            f"not {sizes}: for pipeline, context or hybrid-sharded layouts use NDParallelStrategy.")
        kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_LIGHTNINGS}
        self._data_parallel_size = _check_size("data_parallel_size", data_parallel_size)
        self._tensor_parallel_size = _check_size("tensor_parallel_size", tensor_parallel_size)
        self._save_distributed_checkpoint = check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
        self._lightning_mesh: DeviceMesh | None = None
        super().__init__(dp_shard=-1, tp=1, process_group_backend=process_group_backend, timeout=timeout, **kwargs)

    def _validate_configuration(self) -> None:
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        if dp == "auto" and tp == "auto":  # Lightning's rule: tensor parallel within a node, data across nodes
            dp, tp = self.num_nodes, self.num_processes
        self.dims = ParallelDims(dp_shard=-1 if dp == "auto" else dp, tp=-1 if tp == "auto" else tp)
        super()._validate_configuration()
        # resolved, as Lightning's strategy holds them after setup (code that reads them finds numbers)
        self._data_parallel_size, self._tensor_parallel_size = self.dims.dp_size, self.dims.tp

    @property
    def device_mesh(self) -> DeviceMesh:
        """Lightning's 2-D mesh ``("data_parallel", "tensor_parallel")`` over this layout's groups."""
        if self._lightning_mesh is None:
            self._lightning_mesh = self.dims.lightning_mesh()
        return self._lightning_mesh

    # ---- checkpoints in Lightning's layout ------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        # full weights on rank 0 (a collective), as Lightning's strategy does
        return self._model_state(StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        if self._save_distributed_checkpoint:  # torch's nested form, keyed by FQN: what Lightning writes
            return get_optimizer_state_dict(self.model, optimizer)
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return lightning_ckpt.index_keyed(state) if self.global_rank == 0 else {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options.")
        path = Path(self.broadcast(os.fspath(filepath)))
        if self.is_global_zero:  # written beside, then renamed into place: never half a file under the name
            partial = ckpt.partial_path(path)
            partial.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as file:  # a file object: torch names the archive inside, not the hidden path
                torch.save(checkpoint, file)
            ckpt.replace_dir(partial, path)
        self.barrier()

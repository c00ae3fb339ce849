"""The Lightning adapter every lightning_par strategy derives from.

It owns what Lightning expects of a strategy: launching (Lightning's own subprocess launcher, torchrun, SLURM
through its cluster environments), the process group, the ParallelDims mesh, the data-parallel sampler,
collectives for logging, meta-device materialization, and sharded checkpoints. *What* is done to the model is the
subclass's ``parallelize`` (see :class:`~lightning_par.strategies.nd.NDParallelStrategy`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_par import checkpoint as ckpt
from lightning_par import lightning_checkpoints as lightning_ckpt
from lightning_par._compat import is_quantized, set_device_mesh
from lightning_par.checks import check_bool
from lightning_par.collectives import raise_on_every_rank, settle_process_groups
from lightning_par.dims import ParallelDims
from lightning_par.hub import resolve_pretrained
from lightning_par.known_warnings import silence_known_warnings
from lightning_par.parallel.init import materialize
from lightning_par.strategies.precision import to_parallel_precision
from lightning_par.strategies.resume import resumable_train_dataloader
from lightning_par.strategies.startup_summary import layout_summary
from lightning_par.strategies.user_errors import explain_head_count_errors, foreach_problems

# optimizer state keyed by parameter FQN, param-group settings included ("param_groups.<fqn>.lr"): the form that
# stays meaningful when ranks hold different parameters (pipeline stages) and when a checkpoint changes layout
_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _materialize_metric_defaults(module: nn.Module, device: torch.device) -> None:
    """torchmetrics metrics built under ``init_module(empty_init=True)`` keep their reset values on the meta device
    (``Metric._defaults`` and states are no parameters or buffers, so materialization leaves them). Every built-in
    sum/count/mean state starts
    at zero: materialize them as zeros and warn, since a custom metric might start elsewhere."""
    from torchmetrics import Metric

    for name, metric in module.named_modules():
        if not isinstance(metric, Metric):
            continue
        meta = [k for k, v in metric._defaults.items() if isinstance(v, Tensor) and v.is_meta]
        if not meta and metric.device.type != "meta":
            continue
        for key in meta:
            metric._defaults[key] = torch.zeros_like(metric._defaults[key], device=device)
            setattr(metric, key, metric._defaults[key].clone())
        metric._device = device
        rank_zero_warn(
            f"Metric {name!r} was created on the meta device; its states {meta} were reset to zeros. Create metrics "
            f"outside `trainer.init_module(empty_init=True)` if they must start from other values."
        )


def _check_optimizers(model: nn.Module, optimizers: list[Optimizer], device: torch.device) -> None:
    """Before the first step, the same verdict on every rank (one small all-reduce per optimizer; a pipeline stage may
    see what another does not):

    * a ``foreach`` step over DTensor and plain parameters together is refused (torch fails at the first step);

    * an optimizer with nothing to train is refused;
    * an empty parameter group is refused: torch's sharded optimizer state (flattened by FQN) cannot be loaded back
      into it, so its checkpoints could not be resumed;
    * frozen parameters handed to an optimizer are named in a warning: they get no gradient, hence no update and no
      state from torch's optimizers (harmless, but almost always ``self.parameters()`` where the trainable ones were
      meant, and an optimizer that updates parameters without gradients would change them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    for i, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        frozen = [names.get(id(p), "?") for p in params if not p.requires_grad]
        empty = [j for j, group in enumerate(optimizer.param_groups) if not group["params"]]
        flags = torch.tensor([float(len(frozen) < len(params)), float(bool(empty))], device=device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags[0]:
            raise ValueError(f"optimizer {i} ({type(optimizer).__name__}) was given only frozen parameters "
                             f"(requires_grad=False, e.g. {frozen[:3]}): nothing would train. Pass the trainable "
                             f"ones: `[p for p in self.parameters() if p.requires_grad]`.")
        if flags[1]:
            raise ValueError(f"optimizer {i} ({type(optimizer).__name__}) has an empty parameter group (on this rank: "
                             f"{empty or 'none, on another rank'}): its checkpoints could not be resumed. Leave empty "
                             f"groups out (e.g. a no-decay group when only matrices train, as under LoRA).")
        if frozen:
            rank_zero_warn(f"optimizer {i} ({type(optimizer).__name__}) was given {len(frozen)} frozen parameters "
                           f"(requires_grad=False, e.g. {frozen[:3]}). They get no gradient, so torch's optimizers "
                           f"neither update them nor keep state for them; pass only the trainable ones "
                           f"(`[p for p in self.parameters() if p.requires_grad]`) to make that explicit.")
    raise_on_every_rank(foreach_problems(model, optimizers))


_EXIT = {"failed": False}  # set by on_exception: a failing rank leaves at once, without waiting for its peers


def _destroy_process_group() -> None:
    """At exit: wait until every rank is done, settle every gloo group, then take the process groups down.

    Without the wait a rank that finishes first destroys its gloo pairs (and rank 0 its TCPStore) while a peer still
    talks to them. Without the settling (``collectives.settle_process_groups``), a gloo worker that frees a tensor's
    Python object while the interpreter finalizes ends by forced unwinding through a ``noexcept`` destructor:
    ``terminate called without an active exception`` (SIGABRT, exit -6/134) after a run that succeeded, about one
    job in 300 on a busy 2-core machine. The waits are bounded (gloo's monitored barrier names a rank that never
    arrives)."""
    if not dist.is_initialized():
        return
    if not _EXIT["failed"] and dist.get_world_size() > 1:
        try:
            settle_process_groups()
        except Exception as e:  # noqa: BLE001 - a peer that died: nothing to wait for, still tear down
            print(f"[lightning_par] at exit, not every rank arrived: {e}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


class BaseParallelStrategy(ParallelStrategy):
    """Lightning plumbing shared by all lightning_par strategies; subclasses implement :meth:`parallelize`.

    Args:
        dims: the layout; its product must equal ``num_nodes * devices``.
        process_group_backend: ``"nccl"`` on CUDA and ``"gloo"`` on CPU by default.
        timeout: seconds (or a ``timedelta``) a collective may wait before the job fails instead of hanging.
        pretrained: a directory Hugging Face ``save_pretrained`` wrote, or a Hub ID (``"Qwen/Qwen3-8B"``: its
            snapshot in the Hugging Face cache, fetched once; ``HF_HUB_OFFLINE=1`` reads only the cache; config,
            safetensors and tokenizer files only): after the model is sharded and given memory,
            each rank reads its own slices of those weights (``lightning_par.load_hf_weights``). A checkpoint
            resumed with ``fit(ckpt_path=...)`` is restored afterwards and wins.
        save_trainable_only: checkpoints hold the trainable parameters (and their optimizer state) only, e.g. the
            LoRA adapters of a fine-tuning run; resuming one needs the frozen weights from ``pretrained``.
    """

    def __init__(
        self,
        dims: ParallelDims,
        process_group_backend: str | None = None,
        timeout: float | timedelta = 1800.0,
        pretrained: str | os.PathLike | None = None,
        save_trainable_only: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        silence_known_warnings()
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"dims must be a lightning_par.ParallelDims, got {type(dims).__name__}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            if timeout <= 0:
                raise ValueError(f"timeout={timeout} must be a positive number of seconds, e.g. timeout=600.")
            timeout = timedelta(seconds=float(timeout))
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout={timeout!r} must be seconds (a number) or a datetime.timedelta.")
        if process_group_backend is not None and process_group_backend not in ("nccl", "gloo", "mpi", "xccl"):
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is not a torch.distributed backend. "
                f"Use 'nccl' on CUDA, 'gloo' on CPU, or leave it None to choose by accelerator."
            )
        self.dims = dims
        self.pretrained = None if pretrained is None else str(ckpt.check_hf_directory(
            resolve_pretrained(pretrained, parameter="pretrained")))
        self.save_trainable_only = check_bool("save_trainable_only", save_trainable_only)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._parallelized_by_hand = False  # configure_model applied the parallelism itself (Lightning's way)

    # ---- what Lightning asks of a parallel strategy -------------------------------------------------------
    @property
    def is_distributed(self) -> bool:  # makes Lightning add a DistributedSampler (see distributed_sampler_kwargs)
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.dims.world_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Only data-parallel ranks read different samples; TP/CP/PP ranks of one replica read the same ones."""
        return {"num_replicas": self.dims.dp_size, "rank": self.dims.mesh("dp").get_local_rank()}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def restore_checkpoint_after_setup(self) -> bool:  # sharded state can only be loaded into the sharded model
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:  # load_checkpoint restores the optimizers itself
        return False

    # ---- validation before anything is launched -----------------------------------------------------------
    def _configure_launcher(self) -> None:
        # Lightning calls this in Trainer.__init__ on every process, after accelerator, devices and precision are
        # known and before any process group exists: the place to refuse a bad configuration on every rank.
        self._validate_configuration()
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _validate_configuration(self) -> None:
        world_size = self.num_nodes * self.num_processes
        self.dims = self.dims.resolve(world_size)
        device_type = self.root_device.type
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        if backend == "nccl" and device_type != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs CUDA devices, but the accelerator is {device_type!r}. "
                f"Use process_group_backend='gloo' (or leave it None) on CPU, or run with accelerator='cuda'."
            )
        self._process_group_backend = backend
        self.precision_plugin = to_parallel_precision(self.precision_plugin, device_type)

    # ---- process group and mesh ---------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if not dist.is_initialized():
            _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
            # a process that exits with its gloo/NCCL group alive can abort in the group's thread destructors
            # ("terminate called without an active exception", exit code -6) after training succeeded
            atexit.register(_destroy_process_group)
        if self.layout_known:
            self.build_mesh()

    @property
    def layout_known(self) -> bool:
        """Whether ``self.dims`` is final when the process group starts (it is not for a strategy that plans its
        layout from the model: :class:`~lightning_par.strategies.auto.AutoParallelStrategy` builds the mesh in
        ``setup``)."""
        return True

    def build_mesh(self) -> None:
        """The DeviceMesh of ``self.dims``, handed to the LightningModule as ``self.device_mesh``."""
        self.dims.build_mesh(self.root_device.type)
        self.precision_plugin.pipeline_group = self.dims.mesh("pp").get_group() if self.dims.pp > 1 else None
        assert self.lightning_module is not None
        set_device_mesh(self.lightning_module, self.device_mesh)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ---- model setup --------------------------------------------------------------------------------------
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` (``trainer.init_module(empty_init=True)``) creates parameters on the meta device;
        they are materialized shard by shard after :meth:`parallelize`, so no rank ever holds the full model."""
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: a user coming from Lightning's ``ModelParallelStrategy`` asks the mesh for
        its dimension names; say what they are called here instead of torch's bare KeyError."""
        try:
            yield
        except KeyError as e:
            if not any(name in str(e) for name in ("data_parallel", "tensor_parallel")):
                raise
            raise KeyError(
                f"{e.args[0]} -- `data_parallel` and `tensor_parallel` are the mesh names of Lightning's "
                f"ModelParallelStrategy. Use `lightning_par.ModelParallelStrategy` (the same arguments and mesh "
                f"names), or lightning_par's names on {type(self).__name__}'s mesh: FSDP over "
                f"`self.trainer.strategy.dims.fsdp_mesh()`, tensor parallelism over `self.device_mesh['tp']`."
            ) from None

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.parallelize(self.model)
        self._materialize(self.model)
        ckpt.load_pretrained(self.model, self.pretrained, fill_quantized=self.fill_quantized)
        self._check_data_parallel_consistency(self.model)
        summary = layout_summary(self.dims, self.model, str(self._process_group_backend), self.describe(),
                                 self.describe_rank())
        if summary is not None:
            rank_zero_info(summary)
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            _check_optimizers(self.model, self.optimizers, self.root_device)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def parallelize(self, module: pl.LightningModule) -> None:
        """Apply the strategy's techniques to ``module`` in place. The base class applies none."""

    #: how ``pretrained=`` fills a quantized base weight from the checkpoint's whole tensor (QLoRA's NF4 under the
    #: engine); None: the model holds none
    fill_quantized: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def describe(self) -> str:
        """One line on what :meth:`parallelize` applied, for the start-up summary."""
        return type(self).__name__

    def describe_rank(self) -> str:
        """What this rank holds beyond its parameter shards, for its row of the start-up summary."""
        return ""

    def _materialize(self, module: nn.Module) -> None:
        if self._parallelized_by_hand:
            # Lightning's ModelParallelStrategy way: every module re-initialized in module order from the global
            # random stream, so what the model draws afterwards (its own re-initialization, dropout) is what it
            # draws under Lightning. Every rank starts from rank 0's stream: the copies of a replicated tensor
            # start equal even when the ranks were seeded differently (a no-op when seed_everything seeded them)
            torch.set_rng_state(self.broadcast(torch.get_rng_state()))
            missing = materialize(module, self._materialization_device())
        else:
            # the engine: one seed on every rank (rank 0's), and each module's values depend on its name, not on
            # what was initialized before it nor on which pipeline stage holds it
            seed = self.broadcast(torch.initial_seed()) % 2**31
            missing = materialize(module, self._materialization_device(), seed=seed)
        if missing:
            rank_zero_warn(f"Modules of type {missing} were created on the meta device and have no reset_parameters() "
                           f"to initialize them: their tensors hold uninitialized memory. Give them a "
                           f"reset_parameters(), or load weights into them.")
        _materialize_metric_defaults(module, self._materialization_device())
        self.model_to_device()

    def _materialization_device(self) -> torch.device:
        """Where parameters created on the meta device are materialized."""
        return self.root_device

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _check_data_parallel_consistency(self, module: nn.Module) -> None:
        """Refuse a model that would train silently wrong: with several ranks holding the same weights (data or
        context parallel), every parameter must be managed over those ranks (a DTensor whose mesh spans them),
        else each rank trains its own copy and the replicas drift apart without any error."""
        if self.dims.dp_replicate * self.dims.dp_shard * self.dims.cp == 1:
            return
        replica_ranks = set(self.dims.mesh("dp_cp").mesh.flatten().tolist())
        for name, param in module.named_parameters():
            if is_quantized(param) and not param.requires_grad:
                continue  # frozen NF4 weights FSDP leaves whole where it shards over one rank (apply_fsdp): no training
            mesh_ranks = set(param.device_mesh.mesh.flatten().tolist()) if isinstance(param, DTensor) else set()
            if not replica_ranks <= mesh_ranks:
                held = f"DTensor on ranks {sorted(mesh_ranks)}" if mesh_ranks else "plain tensor"
                raise ValueError(
                    f"Parameter {name!r} is neither sharded nor replicated over the data-parallel ranks "
                    f"{sorted(replica_ranks)} (it is a {held}): each rank would train its own copy. "
                    f"If you parallelize by hand in `configure_model`, apply `fully_shard(..., "
                    f"mesh=self.trainer.strategy.dims.fsdp_mesh())` to the whole model (`self.device_mesh"
                    f"['data_parallel']` under lightning_par.ModelParallelStrategy); or leave `configure_model` free "
                    f"of parallelization and let the strategy apply it."
                )

    # ---- steps --------------------------------------------------------------------------------------------
    def step_context(self) -> AbstractContextManager:
        """Entered around every step method and around backward (activation recomputation happens there).
        Subclasses return their techniques' runtime contexts (context-parallel attention, loss parallel)."""
        return nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context(), explain_head_count_errors(self.lightning_module, self.dims.tp):
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context(), explain_head_count_errors(self.lightning_module, self.dims.tp):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context():
            return super().predict_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        with self.step_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def process_dataloader(self, dataloader: Any) -> Any:
        """Resume mid-epoch exactly: skip the batches the restored checkpoint already trained on."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return resumable_train_dataloader(dataloader, trainer)

    # ---- collectives --------------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, DTensor):  # e.g. a loss computed under loss parallelism: replicated, make it plain
            tensor = tensor.full_tensor()
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        group = dist.group.WORLD if group is None else group
        if dist.get_world_size(group) == 1:  # one rank: the reduction is the value itself
            return tensor
        # Lightning's _sync_ddp without its barrier before the all-reduce: on NCCL a barrier blocks the host until
        # the device has caught up (a host sync in every step that logs with sync_dist=True); the all-reduce agrees
        divide = False
        if isinstance(reduce_op, str):
            reduce_op = "avg" if reduce_op == "mean" else reduce_op
            divide = reduce_op.lower() == "avg" and dist.get_backend(group) == "gloo"  # gloo has no AVG
            reduce_op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, reduce_op.upper())
        dist.all_reduce(tensor, op=reduce_op, group=group)
        if divide:  # in place, as Lightning's
            size = dist.get_world_size(group)
            return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
        return tensor

    # ---- failures -----------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Name the failing rank on stderr, and end the other local ranks now rather than at the timeout."""
        _EXIT["failed"] = True
        print(
            f"[lightning_par] rank {self.global_rank} failed: {type(exception).__name__}: {exception}",
            file=sys.stderr,
            flush=True,
        )
        if isinstance(self._launcher, _SubprocessScriptLauncher) and self.local_rank == 0:
            self._launcher.kill(9)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints --------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._model_state(StateDictOptions(cpu_offload=False))

    def _model_state(self, options: StateDictOptions) -> dict[str, Any]:
        """The model's state dict as ``options`` ask for it; only the trainable tensors with save_trainable_only."""
        assert self.model is not None
        state = get_model_state_dict(self.model, options=options)
        if self.save_trainable_only:
            keep = ckpt.trainable_names(self.model)
            state = {k: v for k, v in state.items() if k in keep}
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint, where the sharded model exists

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=_OPTIMIZER_OPTIONS)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options (it writes DCP).")
        path = Path(self.broadcast(str(filepath)))
        state = checkpoint.pop("state_dict")
        # frozen 4-bit base weights are left out, each with its fingerprint (see lightning_par.checkpoint)
        checkpoint[ckpt.QUANTIZED] = ckpt.quantized_fingerprints(state)
        tensors = {"state_dict": {k: v for k, v in state.items() if k not in checkpoint[ckpt.QUANTIZED]}}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = optimizer_state
        checkpoint[ckpt.TRAINABLE_ONLY] = self.save_trainable_only
        assert self.model is not None  # the groups let to_lightning_checkpoint write Lightning's layout offline
        checkpoint[lightning_ckpt.PARAM_GROUPS] = lightning_ckpt.param_group_names(
            self.model, self.plain_optimizers(), self.dims.pp > 1)
        ckpt.save_sharded(tensors, checkpoint, path)

    def plain_optimizers(self) -> list[Optimizer]:
        """The torch optimizers inside Lightning's ``LightningOptimizer`` wrappers."""
        return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        assert self.model is not None
        if os.path.isfile(path):  # single-file Lightning checkpoint: one process's save, or consolidate_checkpoint
            return ckpt.load_single_file(self.model, self.plain_optimizers(), path, _OPTIMIZER_OPTIONS,
                                         self.dims.pp > 1, weights_only)
        path = ckpt.check_complete(path)
        model_sd = get_model_state_dict(self.model)
        saved_meta = ckpt.read_meta(path)
        trainable_only = bool(saved_meta.get(ckpt.TRAINABLE_ONLY, False))
        stored = ckpt.stored_shapes(path, "state_dict.")
        # frozen 4-bit base weights: never in a checkpoint; the model's must be the ones it was saved from (an
        # adapters-only checkpoint names none: the frozen weights are left out below anyway)
        quantized: dict[str, Any] = {}
        if not trainable_only:
            quantized = ckpt.quantized_fingerprints(model_sd)
            ckpt.check_quantized_weights(path, saved_meta.get(ckpt.QUANTIZED, {}), quantized, set(stored))
        model_sd = {k: v for k, v in model_sd.items() if k not in quantized}
        if trainable_only:  # adapters only: the frozen weights stay as pretrained= (or the init) left them
            keep = ckpt.trainable_names(self.model)
            model_sd = {k: v for k, v in model_sd.items() if k in keep}
        shapes = {k: v.shape for k, v in model_sd.items() if isinstance(v, Tensor)}
        if self.dims.pp > 1:  # each rank holds its stages: compare the whole model (the union) on every rank
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, shapes)
            shapes = {k: v for part in parts for k, v in part.items()}
        (ckpt.check_same_trainable if trainable_only else ckpt.compare_shapes)(path, stored, shapes)
        tensors: dict[str, Any] = {"state_dict": model_sd}
        optimizers = self.plain_optimizers()
        nested: dict[str, list[dict[str, Any]]] = {}  # param groups stored in Lightning's layout, by optimizer key
        for i, optimizer in enumerate(optimizers):
            key = f"optimizer_{i}"
            tensors[key] = get_optimizer_state_dict(self.model, optimizer, options=_OPTIMIZER_OPTIONS)
            if lightning_ckpt.stores_nested_groups(path, key):
                nested[key] = lightning_ckpt.nested_param_groups(path, key)
                tensors[key] = {k: v for k, v in tensors[key].items() if not k.startswith("param_groups.")}
        meta = ckpt.load_sharded(tensors, path)
        problems = []
        for key, groups in nested.items():  # each parameter takes its stored group's options (lr, betas, ...)
            optimizer = optimizers[int(key.split("_")[1])]
            flat = get_optimizer_state_dict(self.model, optimizer, options=_OPTIMIZER_OPTIONS)
            groups_only = {k: v for k, v in flat.items() if k.startswith("param_groups.")}
            problems += lightning_ckpt.fill_flat_param_groups(groups_only, groups, f"ckpt_path={str(path)!r}")
            tensors[key].update(groups_only)
        raise_on_every_rank(problems)
        set_model_state_dict(self.model, tensors["state_dict"],
                             options=StateDictOptions(strict=not (trainable_only or quantized)))
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(self.model, optimizer, tensors[f"optimizer_{i}"], options=_OPTIMIZER_OPTIONS)
        return meta

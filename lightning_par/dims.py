"""ParallelDims: the one description of a parallel layout, and the DeviceMesh built from it."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

#: Mesh dimensions, outermost first. Pipeline stages are outermost (they talk least, point to point),
#: tensor parallelism innermost (it talks most, so its ranks should share the fastest link).
MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: Derived (flattened) meshes and the base dimensions each one spans.
FLAT_MESHES = {
    "dp": ("dp_replicate", "dp_shard"),  # shards the batch: each of its ranks reads different samples
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP shards parameters over it (cp ranks hold the same weights)
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # the loss and the gradients are averaged over it
}

#: The experts' mesh (only with ``ep > 1``): the same ranks, the data/context-parallel ranks ``dp_shard x cp`` cut
#: into ``efsdp x ep`` (ep innermost, so each expert group is ranks next to each other), as torchtitan lays it out.
#: Experts are split over ``ep`` and FSDP-sharded over ``efsdp`` (and replicated over ``dp_replicate``).
EXPERT_MESH_DIM_NAMES = ("pp", "dp_replicate", "efsdp", "ep", "tp")
_EXPERT_DIMS = ("efsdp", "ep")


@dataclass
class ParallelDims:
    """Sizes of the five parallel dimensions; their product is the world size. ``ep`` (expert parallelism) is not a
    sixth: it borrows its ranks from ``dp_shard x cp``, which it must divide.

    ``-1`` on exactly one of the five means "whatever is left of the world size". Call :meth:`resolve` with the
    world size to fill it in and validate, then :meth:`build_mesh` once the process group exists.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        fills = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "ep" and value == -1:
                raise ValueError("ParallelDims: `ep=-1` is not a valid size: expert parallelism borrows its ranks "
                                 "from dp_shard x cp. Pass a positive size that divides dp_shard x cp.")
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"ParallelDims: `{f.name}` must be an int, got {value!r} ({type(value).__name__}). "
                    f"Pass a positive size, or -1 to fill it from the world size."
                )
            if value == -1:
                fills.append(f.name)
            elif value < 1:
                raise ValueError(
                    f"ParallelDims: `{f.name}={value}` is not a valid size. "
                    f"Pass a positive size, or -1 to fill it from the world size."
                )
        if len(fills) > 1:
            raise ValueError(
                f"ParallelDims: only one dimension may be -1 (filled from the world size), got -1 for {fills}. "
                f"Give explicit sizes to all but one of them."
            )
        self._mesh: DeviceMesh | None = None
        self._flat_meshes: dict[str, DeviceMesh] = {}
        self._expert_mesh: DeviceMesh | None = None

    # ---- sizes ---------------------------------------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIM_NAMES}

    def resolve(self, world_size: int) -> ParallelDims:
        """Return a copy with the ``-1`` dimension filled in, checking that the product equals ``world_size``."""
        sizes = self.sizes()
        known = math.prod(v for v in sizes.values() if v != -1)
        fill = [name for name, v in sizes.items() if v == -1]
        if fill:
            if world_size % known != 0:
                raise ValueError(
                    f"ParallelDims: cannot fill `{fill[0]}=-1`: the other sizes {self._describe(sizes)} multiply to "
                    f"{known}, which does not divide the world size {world_size}. "
                    f"Choose sizes whose product divides {world_size}."
                )
            sizes[fill[0]] = world_size // known
        elif known != world_size:
            raise ValueError(
                f"ParallelDims: the layout {self._describe(sizes)} multiplies to {known} processes, but the world "
                f"size is {world_size}. Change the sizes so that their product is {world_size} "
                f"(or set one of them to -1), or launch {known} processes."
            )
        borrowed = sizes["dp_shard"] * sizes["cp"]
        if borrowed % self.ep != 0:
            fits = [d for d in range(1, borrowed + 1) if borrowed % d == 0]
            raise ValueError(
                f"ParallelDims: `ep={self.ep}` must divide dp_shard x cp = {borrowed} in the layout "
                f"{self._describe(sizes)}: expert parallelism borrows its ranks from the data/context-parallel ranks. "
                f"Choose ep in {fits}, or give dp_shard x cp a multiple of {self.ep}."
            )
        return ParallelDims(**sizes, ep=self.ep)

    @staticmethod
    def _describe(sizes: dict[str, int]) -> str:
        return " x ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "all 1"

    @property
    def resolved(self) -> bool:
        """Whether every size is known (no ``-1`` left)."""
        # (no dict: the planner asks this some 150,000 times at 8,192 GPUs)
        return -1 not in (self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp)

    def _check_resolved(self) -> None:
        if not self.resolved:
            raise RuntimeError("ParallelDims: call `resolve(world_size)` before asking for sizes or meshes.")

    @property
    def world_size(self) -> int:
        self._check_resolved()
        return math.prod(self.sizes().values())

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples (the batch is sharded over them)."""
        self._check_resolved()
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters are sharded or replicated by FSDP (any data-parallel or context-parallel degree)."""
        self._check_resolved()
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def __str__(self) -> str:
        return self._describe(self.sizes()) + (f" (ep={self.ep} within dp_shard x cp)" if self.ep > 1 else "")

    def mesh_size(self, name: str) -> int:
        """Size of a base, flattened or experts' mesh dimension, from the sizes alone (no mesh needed)."""
        if name in _EXPERT_DIMS:
            return self.ep if name == "ep" else self.dp_shard * self.cp // self.ep
        return math.prod(getattr(self, d) for d in FLAT_MESHES.get(name, (name,)))

    def within_node(self, name: str, ranks_per_node: int) -> bool:
        """Whether each group of mesh dimension ``name`` lies within one node of ``ranks_per_node`` consecutive
        ranks: the mesh is row-major over MESH_DIM_NAMES, so a group spans its own size times the sizes of every
        dimension inside it (the experts' mesh cuts the same ranks: ``efsdp x ep`` spans ``dp_shard x cp``)."""
        if name in _EXPERT_DIMS:
            return self.group_stride(name) * self.mesh_size(name) <= ranks_per_node
        outermost = MESH_DIM_NAMES.index(FLAT_MESHES.get(name, (name,))[0])
        return math.prod(getattr(self, d) for d in MESH_DIM_NAMES[outermost:]) <= ranks_per_node

    def members_per_node(self, name: str, ranks_per_node: int) -> int:
        """How many ranks of one group of mesh dimension ``name`` share a node of ``ranks_per_node`` consecutive
        ranks: all of them within a node, else those ``group_stride`` apart that one node holds (at least one)."""
        size, stride = self.mesh_size(name), self.group_stride(name)
        if self.within_node(name, ranks_per_node):
            return size
        return max(1, min(size, ranks_per_node // stride))

    def group_stride(self, name: str) -> int:
        """How many ranks apart the members of a group of mesh dimension ``name`` are: the product of the sizes of
        every dimension inside it (the mesh is row-major over MESH_DIM_NAMES, the experts' over
        EXPERT_MESH_DIM_NAMES)."""
        if name in _EXPERT_DIMS:
            return self.tp * (self.ep if name == "efsdp" else 1)
        innermost = MESH_DIM_NAMES.index(FLAT_MESHES.get(name, (name,))[-1])
        return math.prod(getattr(self, d) for d in MESH_DIM_NAMES[innermost + 1:])

    # ---- mesh ----------------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str, backend: str | None = None) -> DeviceMesh:
        """Build the world mesh over all five dims (size-1 dims included, so every name always resolves) and the
        flattened meshes of :data:`FLAT_MESHES`. Needs an initialized default process group."""
        self._check_resolved()
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialized torch.distributed process group.")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims: layout {self} is for {self.world_size} processes, but the process group has "
                f"{dist.get_world_size()}."
            )
        shape = tuple(getattr(self, name) for name in MESH_DIM_NAMES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
        self._flat_meshes = {flat_name: mesh[dims]._flatten(flat_name) for flat_name, dims in FLAT_MESHES.items()}
        self._mesh = mesh
        if self.ep > 1:  # the same ranks, laid out for the experts (a mesh of its own: its own process groups)
            expert_shape = (self.pp, self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            self._expert_mesh = DeviceMesh(device_type, mesh.mesh.reshape(expert_shape),
                                           mesh_dim_names=EXPERT_MESH_DIM_NAMES)
        return mesh

    @property
    def has_mesh(self) -> bool:
        """Whether ``build_mesh`` ran (a strategy that plans its layout builds it only in setup)."""
        return self._mesh is not None

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims: the mesh is built in the strategy's setup; it is not available yet.")
        return self._mesh

    def mesh(self, name: str) -> DeviceMesh:
        """A 1-D mesh by name: one of :data:`MESH_DIM_NAMES` or :data:`FLAT_MESHES`."""
        if name not in MESH_DIM_NAMES and name not in FLAT_MESHES:
            raise ValueError(
                f"ParallelDims: unknown mesh {name!r}; choose one of {MESH_DIM_NAMES + tuple(FLAT_MESHES)}"
            )
        if name in FLAT_MESHES:
            self.world_mesh  # noqa: B018 - raises a clear error before setup
            return self._flat_meshes[name]
        return self.world_mesh[name]

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: 1-D ``dp_shard_cp`` (the flattened mesh kept at build time: slicing a
        flattened dim from the root mesh is deprecated), or 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP."""
        if self.dp_replicate > 1:
            # torch 2.11-2.13 has no other way to a 2-D mesh whose second dim is flattened AND that shares the root
            # of the tp mesh (FSDP2 x TP needs one root; ``DeviceMesh.from_group`` makes a new root): the slice warns
            # of a deprecation, so it is silenced here, in this one place
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return self.world_mesh["dp_replicate", "dp_shard_cp"]
        return self.mesh("dp_shard_cp")

    def expert_mesh(self) -> DeviceMesh:
        """The experts' mesh (:data:`EXPERT_MESH_DIM_NAMES`), built with the world mesh when ``ep > 1``."""
        if self._expert_mesh is None:
            raise RuntimeError(f"ParallelDims: there is no experts' mesh in the layout {self} (ep=1), or the mesh is "
                               f"not built yet (the strategy's setup builds it).")
        return self._expert_mesh

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards experts over: ``efsdp`` (the data/context ranks outside the expert group), 2-D
        ``(dp_replicate, efsdp)`` with replicas. A size-1 mesh still matters: FSDP divides the experts' gradients."""
        mesh = self.expert_mesh()
        return mesh["dp_replicate", "efsdp"] if self.dp_replicate > 1 else mesh["efsdp"]

    def lightning_mesh(self) -> DeviceMesh:
        """Lightning's ``ModelParallelStrategy`` mesh: 2-D ``("data_parallel", "tensor_parallel")``, the data
        dimension being this layout's ``dp`` (replicas x shards). Built from the groups that already exist
        (``DeviceMesh.from_group``: no new process group), for layouts without pipeline or context parallelism."""
        if self.pp > 1 or self.cp > 1:
            raise ValueError(f"Lightning's 2-D (data_parallel, tensor_parallel) mesh cannot describe the layout {self}"
                             f": it has no pipeline or context dimension. Use lightning_par's mesh names instead.")
        coords = self.world_mesh.get_coordinate()
        assert coords is not None
        ranks = self.world_mesh.mesh[coords[0], :, :, coords[3], :].reshape(self.dp_size, self.tp)
        return DeviceMesh.from_group([self.mesh("dp").get_group(), self.mesh("tp").get_group()],
                                     self.world_mesh.device_type, mesh=ranks,
                                     mesh_dim_names=("data_parallel", "tensor_parallel"))

    def coordinates(self) -> dict[str, int]:
        """This rank's index along every base and flattened dimension."""
        return {name: self.mesh(name).get_local_rank() for name in MESH_DIM_NAMES + tuple(FLAT_MESHES)}

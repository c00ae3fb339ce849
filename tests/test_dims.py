"""ParallelDims: validation (no processes) and the mesh it builds (4 processes)."""

import pytest
from launch import launch

from lightning_par import ParallelDims


def test_fill_from_world_size():
    assert ParallelDims(dp_shard=-1, tp=2).resolve(8).sizes() == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2)
    assert ParallelDims(dp_replicate=-1, dp_shard=2).resolve(8).dp_replicate == 4
    assert ParallelDims(dp_replicate=2, dp_shard=2).resolve(4).dp_size == 4


@pytest.mark.parametrize(
    "kwargs, world, match",
    [
        (dict(dp_shard=3), 4, r"multiplies to 3 processes, but the world size is 4"),
        (dict(dp_shard=-1, tp=3), 4, r"cannot fill `dp_shard=-1`.*tp=3"),
        (dict(dp_shard=-1, tp=-1), 4, r"only one dimension may be -1.*\['dp_shard', 'tp'\]"),
        (dict(dp_shard=0), 4, r"`dp_shard=0` is not a valid size"),
        (dict(tp=-2), 4, r"`tp=-2` is not a valid size"),
    ],
)
def test_bad_layouts_are_refused(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs).resolve(world)


def test_non_int_size_is_refused():
    with pytest.raises(TypeError, match=r"`cp` must be an int, got '2'"):
        ParallelDims(cp="2")


def test_mesh_needs_resolve_and_setup():
    with pytest.raises(RuntimeError, match="resolve"):
        _ = ParallelDims().dp_size
    with pytest.raises(RuntimeError, match="not available yet"):
        _ = ParallelDims(dp_shard=1).resolve(1).world_mesh


def _mesh_worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dims = ParallelDims(dp_replicate=2, dp_shard=2).resolve(4)
    dims.build_mesh("cpu")
    return {
        "coords": dims.coordinates(),
        "dp_ranks": dims.mesh("dp").mesh.tolist(),
        "fsdp_mesh": dims.fsdp_mesh().mesh.tolist(),
        "shard_ranks": dims.mesh("dp_shard").mesh.tolist(),
    }


def test_mesh_groups_world4():
    results = launch(4, _mesh_worker)
    for rank, r in enumerate(results):
        assert r["coords"]["dp_replicate"] == rank // 2 and r["coords"]["dp_shard"] == rank % 2
        assert r["coords"]["dp"] == rank  # batch sharded over all 4 ranks
        assert r["dp_ranks"] == [0, 1, 2, 3]
        assert r["fsdp_mesh"] == [[0, 1], [2, 3]]  # HSDP: replicate over rows, shard within a row
        assert r["shard_ranks"] == ([0, 1] if rank < 2 else [2, 3])

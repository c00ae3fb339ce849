"""Lightning users switch in one line: Lightning's own ModelParallelStrategy examples (its Llama 3 tensor-parallel
example and the 2-D example of its docs, shrunk for CPU, in ``tests/lightning_examples``) give Lightning's losses
under ``lightning_par.ModelParallelStrategy`` at every step, and checkpoints resume in both directions.

Tolerance 1e-5 (fp32); the runs are in fact equal to the last bit: the same ops in the same order, seeded alike."""

from __future__ import annotations

import re

import pytest
from launch import launch
from migration_workers import migration_world2, migration_world4

import lightning_par

TOL = 1e-5


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return launch(2, migration_world2, str(tmp_path_factory.mktemp("migration2")), timeout=600)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return launch(4, migration_world4, str(tmp_path_factory.mktemp("migration4")), timeout=600)


def _assert_close(diffs: dict[str, float], steps: int | None = None) -> None:
    assert diffs["loss"] <= TOL, diffs
    assert diffs.get("weights", 0.0) <= TOL, diffs
    if steps is not None:
        assert diffs["steps"] == steps, diffs


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_lightning_llama_example_gives_lightnings_losses(world2, layout):
    for rank in world2:
        result = rank[layout]
        _assert_close(result["ours_vs_theirs"], steps=4)
        assert len(set(result["theirs_losses"])) == 4  # it trains: four different losses


def test_lightning_llama_example_2d_gives_lightnings_losses(world4):
    for rank in world4:
        _assert_close(rank["dp2xtp2"]["ours_vs_theirs"], steps=4)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_checkpoints_resume_in_both_directions(world2, layout):
    """Lightning's sharded checkpoint (nested optimizer state, no COMPLETE marker) resumes under lightning_par, and
    lightning_par.ModelParallelStrategy's resumes under Lightning: steps 3-4 equal the uninterrupted run."""
    for rank in world2:
        _assert_close(rank[layout]["ours_resume_theirs"], steps=2)
        _assert_close(rank[layout]["theirs_resume_ours"], steps=2)


def test_checkpoints_resume_in_both_directions_2d(world4):
    for rank in world4:
        _assert_close(rank["dp2xtp2"]["ours_resume_theirs"], steps=2)
        _assert_close(rank["dp2xtp2"]["theirs_resume_ours"], steps=2)


def test_lightning_checkpoint_resumes_resharded(world2, world4):
    """Lightning's dp2 checkpoint restored under tp2, its dp2 x tp2 one under dp4: the weights it holds."""
    assert world2[0]["dp2"]["resharded_weights"] <= TOL
    assert world4[0]["dp2xtp2"]["resharded_weights"] <= TOL


def test_single_file_checkpoints_both_ways(world2):
    for rank in world2:
        result = rank["file_tp2"]
        assert result["is_file"]
        for case in ("ours_vs_theirs", "ours_resume_theirs", "theirs_resume_ours"):
            _assert_close(result[case])


def test_lightning_par_checkpoint_converted_for_lightning(world2):
    """FSDP2Strategy's own layout, through to_lightning_checkpoint, resumed by Lightning's strategy."""
    for rank in world2:
        _assert_close(rank["converted"]["fresh"], steps=4)  # the engine's FSDP2 trains the docs model alike
        _assert_close(rank["converted"]["theirs_resume_converted"], steps=2)


def test_docs_2d_example(world4):
    for rank in world4:
        _assert_close(rank["docs_2d"], steps=4)


def test_summary_says_what_configure_model_applied(world2, world4):
    described = world2[0]["tp2"]["describe"]
    assert described.startswith("parallelized in configure_model"), described
    assert "(S(0)) over tensor_parallel=2" in described and "(R) over tensor_parallel=2" in described, described
    docs = world4[0]["docs_describe"]
    assert "fully_shard on 4 modules" in docs and "data_parallel=2 x tensor_parallel=2" in docs, docs


def test_migration_errors_name_the_fix(world2):
    for rank in world2:
        errors = rank["errors"]
        assert re.search(r"KeyError: .*data_parallel.*lightning_par\.ModelParallelStrategy",
                         errors["lightning_names_on_fsdp2"] or ""), errors
        assert re.search(r"shape '\[.*\]' is invalid.*tp=2.*model\.layers\.0\.attention\.n_heads=4.*reshape with -1",
                         errors["hard_coded_heads"] or "", re.S), errors
        assert re.search(r"foreach=True over DTensor and plain parameters.*'model\.w2\.weight'.*foreach=False",
                         errors["foreach_mixed"] or ""), errors


def test_model_without_block_list_trains_under_fsdp(world2):
    """The docs model has no list of blocks: FSDP2Strategy shards it as one unit instead of refusing it."""
    for rank in world2:
        assert len(rank["no_blocks_losses"]) == 4


def test_a_plan_replaces_the_hand_written_parallelization(world2):
    """The docs model left to the engine with its plan as data trains like Lightning's hand-parallelized run."""
    for rank in world2:
        _assert_close(rank["plan_instead_of_configure_model"], steps=4)


def test_no_mesh_slicing_deprecation_from_our_own_code(world2):
    """lightning_par keeps its flattened meshes instead of slicing them from the root mesh (deprecated in torch)."""
    for rank in world2:
        assert not [w for w in rank["fsdp_warnings"] if "Slicing a flattened dim" in w], rank["fsdp_warnings"]


def test_constructor_takes_lightnings_arguments():
    from lightning.pytorch import Trainer

    strategy = lightning_par.ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size="auto",
                                                   save_distributed_checkpoint=False)
    Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert (strategy.dims.dp_shard, strategy.dims.tp) == (1, 2)  # Lightning's rule: tp within the node
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (1, 2)  # resolved, as Lightning's
    strategy = lightning_par.ModelParallelStrategy(data_parallel_size=2)
    Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert (strategy.dims.dp_shard, strategy.dims.tp) == (2, 1)  # "auto" takes what the other leaves
    trainer = Trainer(accelerator="cpu", devices=2, strategy="model_parallel", logger=False)
    assert isinstance(trainer.strategy, lightning_par.ModelParallelStrategy)
    with pytest.raises(ValueError, match=r"data_parallel_size=0 must be a positive number of processes or 'auto'"):
        lightning_par.ModelParallelStrategy(data_parallel_size=0)
    with pytest.raises(TypeError, match=r"save_distributed_checkpoint='yes' must be True or False"):
        lightning_par.ModelParallelStrategy(save_distributed_checkpoint="yes")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.0 must be a positive number"):
        lightning_par.ModelParallelStrategy(tensor_parallel_size=2.0)
    with pytest.raises(TypeError, match=r"not \['pp'\]: for pipeline.*use NDParallelStrategy"):
        lightning_par.ModelParallelStrategy(pp=2)
    with pytest.raises(ValueError, match=r"layout dp_shard=3 multiplies to 3 processes, but the world size is 2"):
        Trainer(accelerator="cpu", devices=2, logger=False,
                strategy=lightning_par.ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=1))

"""Sharded checkpoints: save, resume in a new process group, consolidate; bad checkpoint paths are refused.

Epochs are 5 steps long (40 samples, global batch 8); checkpoints every 3 steps fall mid-epoch (steps 3, 6, 9) and
one more is taken at each epoch's end (steps 5, 10). Lightning alone would replay a mid-epoch checkpoint's epoch from
its first batch; the strategy skips the batches already trained on, so every resume continues exactly.
"""

import shutil
from pathlib import Path

import pytest
import torch
from launch import launch
from workers import assert_raised_on_every_rank, error_of, fit, fit_reference, max_loss_diff, max_weight_diff

from example_projects.gpt.lit import GPTModule
from lightning_par import FSDP2Strategy, consolidate_checkpoint

SAMPLES = 40  # 5 steps per epoch
RESUME_POINTS = {"step=3.ckpt": 3, "epoch_end-step=5.ckpt": 5, "step=6.ckpt": 6}


def _train_with_checkpoints(ckpt_dir: str) -> dict:
    return fit(FSDP2Strategy(), devices=2, dp_size=2, max_steps=10, ckpt_dir=ckpt_dir, ckpt_every_n_steps=3,
               num_samples=SAMPLES)


def _resume_and_bad_paths(ckpt_dir: str) -> dict:
    """In a new process group: every bad path first (each must fail on every rank, before any collective, leaving
    the group usable), then the real resume."""
    ckpt = Path(ckpt_dir)
    errors = {}
    bad = {
        "missing": (str(ckpt / "nope.ckpt"), {}),
        "incomplete": (str(ckpt / "broken.ckpt"), {}),
        "other_depth": (str(ckpt / "step=3.ckpt"), {"n_layer": 2}),
        "other_width": (str(ckpt / "step=3.ckpt"), {"vocab_size": 40}),
    }
    for name, (path, overrides) in bad.items():
        errors[name] = error_of(lambda p=path, o=overrides: fit(
            FSDP2Strategy(), devices=2, dp_size=2, max_steps=10, resume_from=p, num_samples=SAMPLES, **o))
    resumed = {
        name: fit(FSDP2Strategy(), devices=2, dp_size=2, max_steps=10, resume_from=str(ckpt / name),
                  num_samples=SAMPLES)
        for name in RESUME_POINTS
    }
    return {"errors": errors, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    full = launch(2, _train_with_checkpoints, str(ckpt_dir))[0]
    # a checkpoint whose save was interrupted: shards present, no COMPLETE marker
    shutil.copytree(ckpt_dir / "step=3.ckpt", ckpt_dir / "broken.ckpt")
    (ckpt_dir / "broken.ckpt" / "COMPLETE").unlink()
    resumed = launch(2, _resume_and_bad_paths, str(ckpt_dir))
    return {"dir": ckpt_dir, "full": full, "resumed": resumed[0], "resumed_rank1": resumed[1]}


def test_checkpoint_layout(runs):
    names = sorted(p.name for p in runs["dir"].iterdir())
    assert names == ["broken.ckpt", "epoch_end-step=10.ckpt", "epoch_end-step=5.ckpt", "last.ckpt", "step=3.ckpt",
                     "step=6.ckpt", "step=9.ckpt"]  # and no .partial directory left behind
    files = {p.name for p in (runs["dir"] / "step=3.ckpt").iterdir()}
    assert {".metadata", "meta.pt", "COMPLETE", "__0_0.distcp", "__1_0.distcp"} <= files


@pytest.mark.parametrize("name", list(RESUME_POINTS))
def test_resume_continues_like_an_uninterrupted_run(runs, name):
    full, resumed, step = runs["full"], runs["resumed"]["resumed"][name], RESUME_POINTS[name]
    assert resumed["global_step"] == 10
    assert len(resumed["losses"]) == 10 - step
    assert max_loss_diff(resumed["losses"], full["losses"][step:]) <= 1e-6
    assert max_weight_diff(resumed["weights"], full["weights"]) <= 1e-6


def test_consolidated_checkpoint_equals_single_process_model(runs, tmp_path):
    reference = fit_reference(max_steps=10, num_samples=SAMPLES)
    out = tmp_path / "full.ckpt"
    consolidated = consolidate_checkpoint(runs["dir"] / "epoch_end-step=10.ckpt", out)
    assert consolidated["global_step"] == 10
    assert max_weight_diff(consolidated["state_dict"], reference["weights"]) <= 1e-5
    # and it is a Lightning checkpoint: the module loads it for inference
    module = GPTModule.load_from_checkpoint(out)
    loaded = {k: v for k, v in module.state_dict().items()}
    assert max_weight_diff(loaded, reference["weights"]) <= 1e-5


@pytest.mark.parametrize(
    "case, error",
    [
        ("missing", r"FileNotFoundError: ckpt_path='.*nope.ckpt' does not exist"),
        ("incomplete",
         r"ValueError: ckpt_path='.*broken.ckpt' holds no complete checkpoint \(missing \['COMPLETE'\]\)"),
        ("other_depth", r"ValueError: .* was saved from a different model: missing \[\], unexpected \['model.blocks.2"),
        ("other_width", r"shape mismatch \['model.head.weight: checkpoint \(32, 32\) vs model \(40, 32\)'"),
    ],
)
def test_bad_checkpoint_paths_are_refused_on_every_rank(runs, case, error):
    assert_raised_on_every_rank([runs["resumed"]["errors"], runs["resumed_rank1"]["errors"]], case, error)


def test_consolidate_refuses_an_incomplete_checkpoint(runs):
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        consolidate_checkpoint(runs["dir"] / "broken.ckpt")
    assert torch.load(runs["dir"] / "step=3.ckpt" / "meta.pt", weights_only=False)["global_step"] == 3

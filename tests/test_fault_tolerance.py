"""Fault-tolerant replica groups (torchft): a group dies mid-training and rejoins while the other trains on.

Two replica groups of two processes each (FSDP inside a group), each its own ``torchrun`` job as in production,
meeting at a Lighthouse run by the test. Group 1 loses a process to SIGKILL, its torchrun ends the group, and the
test starts it again (as a scheduler would): it rejoins and recovers its state from group 0 over the network.
Parity: a single process replaying the same steps with the same live groups per step (read from the run's own
records) gives every loss and the final weights within 1e-5 (fp32; the groups average gradients in a different
order than the replay sums them).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import free_port
from torch.utils.data import DistributedSampler

torchft = pytest.importorskip("torchft", reason="needs the ft extra (torchft)")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ft_group  # noqa: E402

from lightning_par import FaultTolerance  # noqa: E402

KILL_AT, WAIT_FOR_REJOIN = 4, 9
TOLERANCE = 1e-5


_lighthouse = ft_group.start_lighthouse


def _group(out: Path, group: int, lighthouse: str, restart: int = 0, processes: int = 2,
           **extra: str) -> subprocess.Popen:
    options = {"FT_KILL_AT": str(KILL_AT), "FT_WAIT_FOR_REJOIN": str(WAIT_FOR_REJOIN), "FT_SYNC_START": "1", **extra}
    return ft_group.start_group(out, group, lighthouse, restart, processes, **options)


@pytest.fixture(scope="module")
def killed_and_rejoined(tmp_path_factory):
    out = tmp_path_factory.mktemp("ft")
    lighthouse = _lighthouse()
    try:
        timeout = int(os.environ.get("FT_TEST_TIMEOUT", 240))
        survivor, killed = _group(out, 0, lighthouse.address()), _group(out, 1, lighthouse.address())
        jobs = [survivor, killed]
        try:
            killed.wait(timeout=timeout)
            assert killed.returncode != 0, (out / "group1_0.log").read_text()[-4000:]
            jobs.append(_group(out, 1, lighthouse.address(), restart=1))
            for job in jobs:
                job.wait(timeout=timeout)
        finally:
            for job in jobs:
                job.kill()
        logs = {name: (out / f"{name}.log").read_text() for name in ("group0_0", "group1_1")}
        for job, name in zip((survivor, jobs[-1]), logs):
            assert job.returncode == 0, logs[name][-6000:]
    finally:
        lighthouse.shutdown()
    return out, logs


def _records(out: Path, group: int, rank: int, restart: int) -> list[dict]:
    return json.loads((out / f"record_g{group}_r{rank}_{restart}.json").read_text())


def _replay(steps: list[dict], data_ranks: int = 2) -> tuple[dict[tuple[int, int, int], float],
                                                            dict[str, torch.Tensor]]:
    """One process: per step, the mean gradient over the live groups' batches (each group's ``data_ranks`` data
    ranks' batches). Returns every (group, data rank, step)'s loss and the final weights."""
    data = ft_group.dataset()
    model = ft_group.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    samplers = [DistributedSampler(data, num_replicas=2 * data_ranks, rank=k, shuffle=True, seed=0)
                for k in range(2 * data_ranks)]
    per_epoch = len(samplers[0]) // ft_group.BATCH
    losses = {}
    for entry in steps:
        step, live = entry["step"], entry["live"]
        epoch, index = divmod(step, per_epoch)
        optimizer.zero_grad()
        total = 0.0
        for group in (0, 1):
            for rank in range(data_ranks):
                sampler = samplers[group * data_ranks + rank]
                sampler.set_epoch(epoch)
                idx = list(sampler)[index * ft_group.BATCH:(index + 1) * ft_group.BATCH]
                x, y = data[idx]
                loss = F.mse_loss(ft_group.run(model, x), y)
                losses[(group, rank, step)] = loss.item()
                if entry["committed"] and group in live:
                    total = total + loss / (data_ranks * len(live))
        if entry["committed"]:
            total.backward()
            optimizer.step()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


RECORDS = [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 1)]  # (group, rank, restart)


def _schedule(out: Path, records: list[tuple[int, int, int]] = RECORDS, count: int = ft_group.STEPS) -> list[dict]:
    """What each step was, from the records of every group's rank 0: which groups trained it and whether it was
    committed (all of them must agree; on a committed step, with the number of groups torchft counted)."""
    by_step: dict[int, list[tuple[int, dict]]] = {}
    for group, rank, restart in records:
        if rank == 0:
            for r in _records(out, group, rank, restart):
                if "committed_steps" in r:  # finished (a step cut short by the kill has no outcome)
                    by_step.setdefault(r["step"], []).append((group, r))
    steps = []
    for step in range(count):
        entries = by_step[step]
        outcomes = {r["committed_steps"] > r["committed_before"] for _, r in entries}
        assert len(outcomes) == 1, entries
        committed = outcomes.pop()
        assert not committed or {r["participants"] for _, r in entries} == {len(entries)}, entries
        steps.append({"step": step, "committed": committed, "live": tuple(sorted(g for g, _ in entries))})
    return steps


def test_killed_group_rejoins_and_matches_a_replay(killed_and_rejoined):
    out, _ = killed_and_rejoined
    survivor = [r["step"] for r in _records(out, 0, 0, 0)]
    assert survivor == list(range(survivor[0], ft_group.STEPS)) and survivor[0] <= 1, "group 0 never restarted"
    steps = _schedule(out)
    alone = [s["step"] for s in steps if s["live"] == (0,) and s["step"] > KILL_AT]
    assert alone and max(alone) < ft_group.STEPS - 1, steps  # group 0 trained alone, then with group 1 again
    skipped = [s["step"] for s in steps if not s["committed"]]
    assert len(skipped) == 1 and KILL_AT <= skipped[0] < WAIT_FOR_REJOIN, steps  # the step the kill cut short
    losses, weights = _replay(steps)
    for group, rank, restart in RECORDS:
        for r in _records(out, group, rank, restart):
            assert abs(r["loss"] - losses[(group, rank, r["step"])]) <= TOLERANCE, (group, rank, restart, r)
    rejoined = _records(out, 1, 0, 1)
    assert rejoined[0]["step"] > KILL_AT and rejoined[-1]["step"] == ft_group.STEPS - 1, "it rejoined mid-run"
    for group in (0, 1):
        final = torch.load(out / f"weights_g{group}.pt")
        for name, value in weights.items():
            key = f"blocks.{name}"
            torch.testing.assert_close(final[key], value, atol=TOLERANCE, rtol=0, msg=f"group {group} {key}")


def test_a_dying_process_ends_its_group_and_the_survivors_pause_about_the_heartbeat_timeout(killed_and_rejoined):
    """One process of group 1 is killed (SIGKILL) in a step; its torchrun ends the group's other process, whatever it
    was waiting in, so the group stops heartbeating, and group 0 trains on alone once the Lighthouse stops hearing it:
    from the kill to group 0's next committed step takes the heartbeat timeout (1 s here) plus about a step. Bounded
    at 6 s on this shared 2-core machine; a group whose other process went on heartbeating would hold the survivors
    in the cross-group all-reduce until its timeout (60 s)."""
    out, _ = killed_and_rejoined
    killed = float((out / "killed_at").read_text())
    after = [r for r in _records(out, 0, 0, 0)
             if r.get("time", 0.0) > killed and r["committed_steps"] > r["committed_before"]]
    assert after, "group 0 committed no step after the kill"
    pause = after[0]["time"] - killed
    print(f"from the kill to the survivors' next committed step: {pause:.2f} s (heartbeat timeout 1 s)")
    assert pause < 6.0, pause


def test_checkpoints_and_logs_come_from_one_group(killed_and_rejoined):
    """The live group of lowest index writes every checkpoint (complete, with torchft's committed step); the
    loggers and the monitors' logging run on group 0's rank 0 only: one log with every step, however the groups came
    and went."""
    from lightning_par import consolidate_checkpoint

    out, _ = killed_and_rejoined
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [f"epoch={e}-step={s}.ckpt" for e, s in ((0, 6), (1, 12), (2, 18), (3, 24))], names
    last = consolidate_checkpoint(out / "checkpoints" / names[-1])
    assert last["global_step"] == ft_group.STEPS and last["fault_tolerance"]["step"] == ft_group.STEPS - 1
    final = torch.load(out / "weights_g0.pt")
    for key, value in final.items():
        torch.testing.assert_close(last["state_dict"][key], value, atol=0, rtol=0)
    versions = list((out / "logs").iterdir())
    assert [v.name for v in versions] == ["version_0"], versions
    rows = list(csv.DictReader((versions[0] / "metrics.csv").open()))
    trained = len(_records(out, 0, 0, 0))  # every step group 0 trained (from step 0 or 1)
    assert len([r for r in rows if r["loss"]]) == trained, rows
    memory = [float(r["mem/rss_bytes/max"]) for r in rows if r["mem/rss_bytes/max"]]  # group 0's ranks, summarized
    assert len(memory) == trained and min(memory) > 0, rows


def test_a_group_with_another_layout_is_refused_and_the_others_train_on(tmp_path):
    """Group 0 shards its model with FSDP over its 2 processes and trains; group 1 joins later with its model cut
    into 2 pipeline stages. It refuses the state it receives, naming both layouts, and group 0 trains to the end.
    (At a common start both groups receive state, spread over the peers rank by rank, and both refuse.)"""
    lighthouse = _lighthouse()
    try:
        options = {"FT_STEPS": "8", "FT_KILL_AT": "-1", "FT_SYNC_START": "", "FT_STEP_SLEEP": "0.05"}
        jobs = [_group(tmp_path, 0, lighthouse.address(), FT_WAIT_FOR_LATE_GROUP="2", **options)]
        deadline = time.monotonic() + 60
        while not (tmp_path / "started_g0_0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        jobs.append(_group(tmp_path, 1, lighthouse.address(), FT_PP="2", **options))
        ft_group.wait_all(jobs)
    finally:
        lighthouse.shutdown()
    logs = [(tmp_path / f"group{g}_0.log").read_text() for g in (0, 1)]
    assert jobs[0].returncode == 0 and jobs[1].returncode != 0, [log[-3000:] for log in logs]
    assert ("FaultTolerance: replica group 1 has the layout {'strategy': \"pipeline (1f1b, 2 micro-batches, 2 stages"
            in logs[1] and "but the live groups have {'strategy': 'FSDP2 (ZeRO-3)', 'processes': 2}" in logs[1]), \
        logs[1][-3000:]
    assert [r["step"] for r in _records(tmp_path, 0, 0, 0)] == list(range(8))  # group 0 trained every step


def test_a_peer_state_of_another_model_is_refused_with_the_shapes():
    from torch import nn

    from lightning_par.parallel.fault_tolerance import load_module_state, module_state

    with pytest.raises(ValueError, match=r"tensors of other shapes \(\['weight: \(32, 16\) there, \(48, 16\) here', "
                                         r"'bias: \(32,\) there, \(48,\) here'\]\)"):
        load_module_state(nn.Linear(16, 48), module_state(nn.Linear(16, 32)))
    with pytest.raises(ValueError, match=r"lacks \['bias'\]: the groups run different models"):
        load_module_state(nn.Linear(16, 32), module_state(nn.Linear(16, 32, bias=False)))


def _fit_without_lighthouse(port: int) -> None:
    import lightning.pytorch as pl

    from lightning_par import FaultTolerance, NDParallelStrategy

    strategy = NDParallelStrategy(dp_replicate=2, fault_tolerance=FaultTolerance(
        replica_id=0, lighthouse=f"http://127.0.0.1:{port}", timeout=1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    module = ft_group.Regression(Path("."), 0, 0)
    trainer.fit(module, torch.utils.data.DataLoader(ft_group.dataset(), batch_size=4))


def test_an_unreachable_lighthouse_is_a_clear_error_not_a_hang():
    from launch import WorkerError, launch

    with pytest.raises(WorkerError, match=r"could not reach the Lighthouse at lighthouse='http://127.0.0.1:\d+' "
                                          r"within timeout=1 s"):
        launch(1, _fit_without_lighthouse, free_port(), timeout=60)


@pytest.mark.parametrize("make, match", [
    (lambda: FaultTolerance(replica_id=2, lighthouse="http://h:1"),
     r"replica_id=2 must be an int in \[0, dp_replicate=2\)"),
    (lambda: FaultTolerance(replica_id=0), r"lighthouse is not set and neither is TORCHFT_LIGHTHOUSE"),
    (lambda: FaultTolerance(replica_id=0, lighthouse="h:29510"), r"lighthouse='h:29510' must be an address like"),
    (lambda: FaultTolerance(replica_id=0, lighthouse="http://h:1", min_replicas=3), r"min_replicas=3 exceeds"),
    (lambda: FaultTolerance(lighthouse="http://h:1"), r"replica_id is not set and neither is the REPLICA_GROUP_ID"),
    (lambda: FaultTolerance(replica_id=0, lighthouse="http://h:1", timeout=0), r"timeout=0 must be a positive"),
])
def test_bad_options_are_refused_at_construction(make, match, monkeypatch):
    from lightning_par import NDParallelStrategy

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ValueError, match=match):
        NDParallelStrategy(dp_replicate=2, fault_tolerance=make())


def test_bad_strategy_arguments_are_refused():
    from lightning_par import NDParallelStrategy

    with pytest.raises(ValueError, match=r"dp_replicate=-1 with fault_tolerance: dp_replicate is the number"):
        NDParallelStrategy(dp_replicate=-1, fault_tolerance=FaultTolerance(replica_id=0, lighthouse="http://h:1"))
    with pytest.raises(TypeError, match=r"fault_tolerance=\{'replica_id': 0\} must be a lightning_par.FaultTolerance"):
        NDParallelStrategy(dp_replicate=2, fault_tolerance={"replica_id": 0})


def test_the_environment_fills_in_the_group_and_the_lighthouse(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    resolved = FaultTolerance().resolve(2)
    assert (resolved.replica_id, resolved.lighthouse) == (1, "http://lighthouse:29510")


def test_lightning_cli_sets_it_from_a_dict():
    """LightningCLI's parser (jsonargparse) builds the FaultTolerance from a flag's JSON, as the docs show."""
    from jsonargparse import ArgumentParser

    from lightning_par import NDParallelStrategy

    parser = ArgumentParser()
    parser.add_class_arguments(NDParallelStrategy, "strategy")
    config = parser.parse_args(["--strategy.dp_replicate=2", '--strategy.fault_tolerance={"replica_id": 1, '
                                '"lighthouse": "http://h:29510", "min_replicas": 2}'])
    strategy = parser.instantiate(config).strategy
    assert strategy.fault_tolerant.options == FaultTolerance(1, "http://h:29510", 2, 60.0, 60.0)
    assert strategy.fault_tolerant.num_groups == 2 and strategy.dims.dp_replicate == 1


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    from lightning_par.parallel.fault_tolerance import import_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # what `import torchft` meets where it is not installed
    with pytest.raises(ImportError, match=r"needs torchft, which is not installed. Install the extra: pip install "
                                          r"'lightning_par\[ft\]'"):
        import_torchft()


def test_pipeline_stages_inside_groups_match_a_replay(tmp_path):
    """Each group's 2 processes are 2 pipeline stages (1F1B, 2 micro-batches): the gradients averaged across groups
    live in the stages' own parameters. No failure here; every loss and the final weights match the replay."""
    lighthouse = _lighthouse()
    try:
        options = {"FT_PP": "2", "FT_STEPS": "8", "FT_KILL_AT": "-1", "FT_STEP_SLEEP": "0"}
        jobs = [_group(tmp_path, g, lighthouse.address(), **options) for g in (0, 1)]
        ft_group.wait_all(jobs)
    finally:
        lighthouse.shutdown()
    for g, job in enumerate(jobs):
        assert job.returncode == 0, (tmp_path / f"group{g}_0.log").read_text()[-4000:]
    steps = _schedule(tmp_path, [(0, 0, 0), (1, 0, 0)], count=8)
    assert all(s["committed"] for s in steps) and steps[-1]["live"] == (0, 1), steps
    losses, weights = _replay(steps, data_ranks=1)
    for group in (0, 1):
        for rank in (0, 1):  # both stages report the group's mean loss
            for r in _records(tmp_path, group, rank, 0):
                assert abs(r["loss"] - losses[(group, 0, r["step"])]) <= TOLERANCE, (group, rank, r)
        final = torch.load(tmp_path / f"weights_g{group}.pt")
        for name, value in weights.items():
            torch.testing.assert_close(final[f"blocks.{name}"], value, atol=TOLERANCE, rtol=0)

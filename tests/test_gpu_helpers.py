"""The harness of tests/test_gpu.py, checked on the CPU: when a GPU test fails, the GPU path is at fault, not this.

- The hand-written loop (tests/gpu_workers.py) does exactly what Lightning does under a strategy at world size 1:
  same batches, optimizer, LR schedule and precision contexts; in fp32, bf16-mixed and bf16-true the two agree to
  the last bit here (gloo, one process).
- The context-parallel emulation (cp ranks' blocks in one process) gives exact attention with the math path, within
  the tolerances the GPU test uses.
"""

from __future__ import annotations

import gpu_workers as G
import pytest
import torch
from launch import launch
from test_gpu import CP_TOL, EAGER_CASES

#: ``CP_CASES`` at a quarter of the sequence length: the same block plans, a CPU-sized fp64 reference
SMALL_CP_CASES = [(*case[:5], case[5] // 4, *(window // 4 for window in case[6:])) for case in G.CP_CASES]


@pytest.fixture(scope="module")
def cpu_parity():
    return launch(1, G.run_parity, EAGER_CASES, "cpu", timeout=300)[0]


@pytest.mark.parametrize("name", list(EAGER_CASES))
def test_hand_written_loop_is_what_lightning_runs(cpu_parity, name):
    precision = EAGER_CASES[name][2]
    run, hand = cpu_parity[name]["run"], cpu_parity[name]["hand"]
    assert run["devices"] == ["cpu"] and len(run["losses"]) == G.STEPS
    assert max(abs(a - b) for a, b in zip(run["losses"], hand["losses"])) <= 1e-6
    assert G.max_abs_diff(run["weights"], hand["weights"]) <= 1e-6
    assert {v.dtype for v in run["weights"].values()} == {G.WEIGHT_DTYPES[precision]}
    assert run["logits_dtypes"] == {"torch.float32" if precision == "32-true" else "torch.bfloat16"}


def test_bf16_true_differs_from_fp32_by_more_than_the_gpu_tolerance(cpu_parity):
    """The GPU test's bf16 tolerance would catch a run that silently trained in fp32 instead of bf16-true."""
    from test_gpu import BF16_LOSS_TOL, BF16_WEIGHT_TOL

    result = cpu_parity["bf16-true"]
    run, fp32 = result["run"], result["hand_fp32"]
    assert max(abs(a - b) for a, b in zip(run["losses"], fp32["losses"])) > BF16_LOSS_TOL
    assert G.max_abs_diff(G._fp32(run["weights"]), fp32["weights"]) > BF16_WEIGHT_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cp_emulation_with_the_math_path_is_exact_attention(dtype):
    errors = G.cp_kernel_errors(False, "cpu", (dtype,), SMALL_CP_CASES)
    assert len(errors) == len(SMALL_CP_CASES)
    for case, err in errors.items():
        assert err <= CP_TOL[case.split("/")[0]], (case, err)


def test_cp_emulation_catches_a_wrong_merge(monkeypatch):
    """The emulation really goes through context/context.py's merge: keep only each row's first block and every
    case with more than one rank is far off (cp = 1 has one block: still exact)."""
    from lightning_par.techniques.context import context as ctx

    real_merge = ctx._merge

    def first_block_only(out, lse, rows, blk_out, blk_lse):
        if torch.isneginf(lse[:, :, rows]).all():
            real_merge(out, lse, rows, blk_out, blk_lse)

    monkeypatch.setattr(ctx, "_merge", first_block_only)
    errors = G.cp_kernel_errors(False, "cpu", (torch.float32,), SMALL_CP_CASES)
    assert all(err > 0.05 for case, err in errors.items() if "/cp1/" not in case), errors
    assert all(err <= CP_TOL["float32"] for case, err in errors.items() if "/cp1/" in case), errors

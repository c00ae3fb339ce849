"""Fit the GPU time model's three shares on the fitting half of the published set only: ``devices.MATMUL_STEP_SHARE``
(a step's matmuls against the rate one large matmul reaches), ``devices.BANDWIDTH_SHARE`` (the non-matmul ops'
bytes against the datasheet's memory bandwidth) and ``devices.FUSED_TRAFFIC`` (the share of those bytes that
software fusing them moves: the cases whose ``fused_kernels`` is set, torch.compile, Megatron's kernels, Transformer
Engine).

The fitting half (benchmarks/published/README.md, "The split", written before anything was fitted): the rows of
``collected_runs.yaml`` from mosaicml/llm-foundry and pytorch/torchtitan, and the earlier published cases from those
repositories and the others the planner had been checked against (tests/test_planner_published.py's ``CASES``,
benchmarks/planner_heldout.py's ``CASES``: Megatron-LM 2021, Megatron-Core's README, torchtitan, NeMo AutoModel,
Llama 3, BLOOM, LLM Foundry). No test-half row is read.

Each case is planned once (as ``plan_case`` plans it) to find the variants of its published layout; then, for every
set of shares on a grid, those variants are predicted again on the device table's hardware with those shares, the
best ranked one (fitting first, then the fastest) is the published layout's prediction, and its tokens/s per GPU are
compared with the published figure. The set that puts the most cases within 25 % wins, the median distance from
1 (in log ratio) breaking ties. The old rule (one share of the matmuls' rate for all the step's work,
``devices.STEP_SHARE``) is scored on the same cases for comparison.

Usage: python benchmarks/fit_time_model.py [--limit N] [--out JSON]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "tests")):  # the published cases' harness lives with the tests
    if _path not in sys.path:
        sys.path.insert(0, _path)

import test_planner_published as published  # noqa: E402

from benchmarks.common import run_metadata, write_json  # noqa: E402
from benchmarks.planner_heldout import CASES as HELDOUT  # noqa: E402
from benchmarks.published.cases import convert, half_of, load_rows  # noqa: E402
from lightning_par.devices import STEP_SHARE, lookup_device  # noqa: E402
from lightning_par.planner.predict import predict  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "fit_time_model.json"
#: the coarse grid (then 0.0125, 0.025 and 0.025 steps around its best)
MATMUL_GRID = [round(0.50 + 0.05 * i, 2) for i in range(9)]  # 0.50 .. 0.90
BANDWIDTH_GRID = [round(0.10 + 0.1 * i, 1) for i in range(10)]  # 0.10 .. 1.00
FUSION_GRID = [0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]
VARIANTS = 6  # the published layout's best-ranked variants kept per case


def fitting_cases() -> list[Any]:
    rows = [case for row, case in convert(load_rows()) if half_of(row) == "fit" and not isinstance(case, str)]
    return rows + list(published.CASES) + list(HELDOUT)


def hardware_for(case: Any, matmul_share: float | None, bandwidth_share: float | None,
                 fused_traffic: float = 1.0) -> Any:
    """The case's hardware (``case_hardware``, as ``plan`` builds it) with the time model's shares (and, where the
    case's software fused its non-matmul ops, its share of their bytes); None: the old rule, one share of the
    matmuls' rate for the whole step (no memory term, so nothing to fuse)."""
    spec = lookup_device(case.device)
    if matmul_share is None:
        return published.case_hardware(case, efficiency=STEP_SHARE * spec.matmul_efficiency)
    return published.case_hardware(case, efficiency=matmul_share * spec.matmul_efficiency,
                                   memory_efficiency=bandwidth_share, fused_traffic=fused_traffic)


def variants_of(case: Any) -> tuple[Any, list[Any], float]:
    """The case's profile, its published layout's best-ranked variants, and the published tokens/s per GPU."""
    # only the published mesh is planned (its variants are what the fit compares): fast at thousands of GPUs
    result = published.plan(replace(case, restrict={
        **(case.restrict or {}), **{k: [v] for k, v in zip(published.RESTRICTABLE, published.published_sizes(case))}}))
    if case.excluded is not None:
        result = replace(result, predictions=[p for p in result.predictions if not case.excluded(p.layout)])
    variants = [p.layout for p in published.published_variants(case, result.predictions)][:VARIANTS]
    return result.profile, variants, published.published_tokens(case, result.profile)


def ratio(case: Any, profile: Any, layouts: list[Any], published_tokens: float, hw: Any) -> float:
    predictions = [predict(layout, profile, hw, case.global_batch // layout.dp, case.seq_len, case.precision,
                           published.case_budget(case)) for layout in layouts]
    best = min(predictions, key=lambda p: (not p.fits, -p.tokens_per_s))
    return best.tokens_per_s / published_tokens


def score(ratios: list[float]) -> dict[str, Any]:
    return {"within_25_percent": sum(0.75 <= r <= 1.25 for r in ratios),
            "median_ratio": statistics.median(ratios),
            "median_abs_log_ratio": statistics.median(abs(math.log(r)) for r in ratios), "cases": len(ratios)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=None, help="plan only the first N fitting cases (a quick look)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    cases = fitting_cases()[:args.limit]
    start = time.perf_counter()
    planned = []
    for i, case in enumerate(cases):
        profile, layouts, tokens = variants_of(case)
        planned.append((case, profile, layouts, tokens))
        print(f"[{i + 1}/{len(cases)}] {case.name}: {len(layouts)} variants ({time.perf_counter() - start:.0f} s)",
              flush=True)
    old = [ratio(c, prof, lay, tok, hardware_for(c, None, None)) for c, prof, lay, tok in planned]
    grid: list[dict[str, Any]] = []

    def search(matmul: list[float], bandwidth: list[float], fusion: list[float]) -> dict[str, Any]:
        for m in matmul:
            for b in bandwidth:
                for f in fusion:
                    if 0 < m <= 1 and 0 < b <= 1 and 0 < f <= 1:
                        ratios = [ratio(c, prof, lay, tok, hardware_for(c, m, b, f))
                                  for c, prof, lay, tok in planned]
                        grid.append({"matmul_step_share": m, "bandwidth_share": b, "fused_traffic": f,
                                     **score(ratios), "ratios": ratios})
        return max(grid, key=lambda g: (g["within_25_percent"], -g["median_abs_log_ratio"]))

    coarse = search(MATMUL_GRID, BANDWIDTH_GRID, FUSION_GRID)
    best = search([round(coarse["matmul_step_share"] + 0.0125 * i, 4) for i in (-2, -1, 0, 1, 2)],
                  [round(coarse["bandwidth_share"] + 0.025 * i, 4) for i in (-2, -1, 0, 1, 2)],
                  [round(coarse["fused_traffic"] + 0.025 * i, 4) for i in (-2, -1, 0, 1, 2)])
    names = [c.name for c, *_ in planned]
    print(f"old rule (one share, {STEP_SHARE:g} of the matmuls' rate): {score(old)}")
    print(f"best: MATMUL_STEP_SHARE {best['matmul_step_share']}, BANDWIDTH_SHARE {best['bandwidth_share']}, "
          f"FUSED_TRAFFIC {best['fused_traffic']}: "
          f"{ {k: v for k, v in best.items() if k != 'ratios'} }")
    for name, before, after in zip(names, old, best["ratios"]):
        print(f"  {before:5.2f} -> {after:5.2f}  {name}")
    write_json(args.out, {**run_metadata(), "fitting_cases": names, "old_rule": {**score(old), "ratios": old},
                          "best": best, "grid": [{k: v for k, v in g.items() if k != "ratios"} for g in grid],
                          "seconds": time.perf_counter() - start})


if __name__ == "__main__":
    main()

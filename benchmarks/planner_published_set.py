"""The planner on the published-run set of benchmarks/published/ (366 rows collected 2026-11-28): each row converted
into a published case (benchmarks/published/cases.py's ``to_case``) and planned exactly as
tests/test_planner_published.py plans its cases (its ``PublishedCase`` and ``plan_case``: the device table, no
probe, the run's world, global batch, sequence and precision, among the layouts its software could run), and
reported the same way: the predicted tokens/s per GPU of the published layout against the published figure, and
where that layout ranks.

The rows and the split (benchmarks/published/README.md, written before anything was fitted to them): the fitting
half is the repositories the planner was already checked against, mosaicml/llm-foundry (MPT throughput tables,
pure FSDP) and pytorch/torchtitan (benchmarks/*.md); the test half is NVIDIA/dgxc-benchmarking (NeMo/Megatron-Core
weak-scaling tables, whole-job tokens/s), NVIDIA-NeMo/Megatron-Bridge (performance-summary archive, tokens/s per GPU),
NVIDIA/NeMo (24.07 summary and long-sequence tables) and allenai/OLMo-core. Calibration is fitted on the fitting half
only; accuracy is reported on the test half.

A row is left out only for a reason that follows from the row (the README's; ``to_case`` returns it): a precision
with no peak in the device table (FP8, MXFP8), software outside PyTorch (MaxText, Paxml), a device the table lacks
(GB300, B300), a source the collector marked ``DOUBT``, an incomplete shape or layout; and, beyond the README, a
model or layout the planner cannot build (``unmappable``: Llama 4; expert parallelism wider than ``dp_shard x cp``).
The counts of each are printed before anything is planned.

How rows become cases (architectures, units, layouts, software options) is described in cases.py's docstring, and
what the rows leave unsaid is in its ``ASSUMED`` (printed at the end). In short: whole-job tokens/s are divided by
the GPUs; Megatron-Core's data parallelism with the distributed optimizer is planned as the ZeRO-1-like FSDP variant
(planner_heldout's ``MEGATRON_CORE_2024`` options); llm-foundry's and torchtitan's FSDP as ``dp_shard``; Nemotron-4
as transformers' Apertus block with a squared-ReLU MLP, GPT-3 as GPT-NeoX, MPT as the example GPT, Grok-1 as
Mixtral.

Usage: python benchmarks/planner_published_set.py [--half fit|test|all] [--source SUBSTR] [--name SUBSTR]
       [--limit N] [--convert-only] [--out JSON]
A whole half plans ~70 (test) to ~200 (fit) cases at 5-60 s each: run it on a machine with the time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "tests")):  # the published cases' harness lives with the tests
    if _path not in sys.path:
        sys.path.insert(0, _path)

from test_planner_published import plan_case  # noqa: E402

from benchmarks.common import run_metadata, write_json  # noqa: E402
from benchmarks.published.cases import ASSUMED, ROWS, convert, half_of, load_rows, repository  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "planner_published_set.json"


def conversion_summary(converted: list[tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    """Per half: rows, cases, and the reasons for the others (counted by category and by reason)."""
    summary: dict[str, Any] = {}
    for half in ("fit", "test"):
        rows = [(row, case) for row, case in converted if half_of(row) == half]
        reasons = [case for _, case in rows if isinstance(case, str)]
        summary[half] = {
            "rows": len(rows),
            "cases": len(rows) - len(reasons),
            "left_out": len(reasons),
            "by_category": dict(collections.Counter(r.split(":", 1)[0] for r in reasons).most_common()),
            "by_reason": dict(collections.Counter(reasons).most_common()),
            "cases_by_repository": dict(collections.Counter(
                repository(row) for row, case in rows if not isinstance(case, str)).most_common()),
        }
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    for half, s in summary.items():
        print(f"{half} half: {s['rows']} rows, {s['cases']} cases, {s['left_out']} left out "
              f"({', '.join(f'{k} {v}' for k, v in s['by_category'].items()) or 'none'}); cases by repository: "
              f"{', '.join(f'{k} {v}' for k, v in s['cases_by_repository'].items())}")
        for reason, count in s["by_reason"].items():
            print(f"  {count:3d} x {reason}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=("fit", "test", "all"), default="all")
    parser.add_argument("--source", default="", help="plan only rows whose source contains this (case-insensitive)")
    parser.add_argument("--name", default="", help="plan only rows whose name contains this (case-insensitive)")
    parser.add_argument("--limit", type=int, default=None, help="plan at most this many cases (after the filters)")
    parser.add_argument("--convert-only", action="store_true", help="print the conversion counts, plan nothing")
    parser.add_argument("--rows", default=str(ROWS), help="the collected rows (YAML)")
    parser.add_argument("--out", default=None,
                        help=f"JSON results (default {DEFAULT_OUT.relative_to(ROOT)} when nothing is filtered; "
                             f"a filtered run writes JSON only where --out is given)")
    args = parser.parse_args(argv)

    converted = convert(load_rows(args.rows))
    summary = conversion_summary(converted)
    print_summary(summary)
    if args.convert_only:
        return

    selected = [(row, case) for row, case in converted if not isinstance(case, str)
                and args.half in ("all", half_of(row)) and args.source.lower() in row["source"].lower()
                and args.name.lower() in row["name"].lower()]
    if args.limit is not None:
        selected = selected[:args.limit]
    filtered = bool(args.source or args.name or args.limit is not None)
    out = args.out or (None if filtered else str(DEFAULT_OUT))
    print(f"\nplanning {len(selected)} case(s)")

    start, records = time.perf_counter(), []
    for row, case in selected:
        began = time.perf_counter()
        record: dict[str, Any] = {"row": row["index"], "half": half_of(row), "repository": repository(row),
                                  "name": case.name}
        try:
            record.update(plan_case(case))
        except Exception as error:  # noqa: BLE001  (one case's failure is reported, the others still planned)
            record["error"] = f"{type(error).__name__}: {error}"
        record["seconds"] = time.perf_counter() - began
        records.append(record)
        if "error" in record:
            print(f"[{row['index']}] {case.name}: ERROR {record['error']} ({record['seconds']:.0f} s)")
        else:
            print(f"[{row['index']}] {case.name}: published {record['published_tokens_per_s']:,.0f} tok/s/GPU, "
                  f"predicted {record['predicted_tokens_per_s']:,.0f}, ratio {record['ratio']:.3f}, rank "
                  f"{record['published_rank']} of {record['layouts']} layouts{'' if record['fits'] else ' (no fit)'}"
                  f"; first {record['best']} ({record['best_tokens_per_s']:,.0f}); {record['seconds']:.0f} s")

    planned = [r for r in records if "error" not in r]
    ratios = [r["ratio"] for r in planned]
    result: dict[str, Any] = {
        "planned": len(planned), "errors": len(records) - len(planned),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "within_25_percent": sum(0.75 <= x <= 1.25 for x in ratios),
        "top_three": sum(r["published_rank"] <= 3 for r in planned),
        "fits": sum(bool(r["fits"]) for r in planned),
    }
    by_half = {half: [r for r in planned if r["half"] == half] for half in ("fit", "test")}
    for half, rs in by_half.items():
        if rs:
            result[half] = {"planned": len(rs), "median_ratio": statistics.median(r["ratio"] for r in rs),
                            "within_25_percent": sum(0.75 <= r["ratio"] <= 1.25 for r in rs),
                            "top_three": sum(r["published_rank"] <= 3 for r in rs)}
    median = "-" if result["median_ratio"] is None else f"{result['median_ratio']:.3f}"
    print(f"\n{len(planned)} planned ({result['errors']} errors): median ratio predicted/published {median}, within "
          f"25 %: {result['within_25_percent']} of {len(planned)}, published layout in the top three: "
          f"{result['top_three']} of {len(planned)}, listed as fitting: {result['fits']}; "
          f"{time.perf_counter() - start:.0f} s")
    for half in ("fit", "test"):
        if half in result:
            h = result[half]
            print(f"  {half} half: {h['planned']} planned, median ratio {h['median_ratio']:.3f}, within 25 %: "
                  f"{h['within_25_percent']}, top three: {h['top_three']}")
    print(f"Assumed: {ASSUMED}")
    if out is None:
        print("(filtered run: no JSON written; give --out to keep it)")
        return
    import torch

    metadata = run_metadata()
    path = write_json(out, {
        "date": metadata["time_utc"], "torch": torch.__version__, "machine": metadata,
        "arguments": vars(args), "conversion": summary, "summary": result, "cases": records, "assumed": ASSUMED})
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()

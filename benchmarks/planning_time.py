"""How long the planner takes on its largest published case, Llama 3 405B on 8,192 H100 (issue #25 asks under 10 s):
the meta trace of the model once, then the search of every layout, repeated (the search starts from a fresh profile
each time, so no memo carries over; the shortest run is reported, this machine's CPU speed varies by 10-20 % from
run to run).

Usage: python benchmarks/planning_time.py [--repeats 3] [--out benchmarks/results/planning_time.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "tests")):  # the published cases' harness lives with the tests
    if _path not in sys.path:
        sys.path.insert(0, _path)

from test_planner_published import CASES, build  # noqa: E402

from benchmarks.common import write_json  # noqa: E402
from lightning_par.costs.profile import profile_model  # noqa: E402
from lightning_par.devices import known_hardware  # noqa: E402
from lightning_par.planner.search import plan_layouts  # noqa: E402

CASE = next(c for c in CASES if c.world == 8192)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planning_time.json"))
    args = parser.parse_args(argv)
    module, batch = build(CASE)
    hardware = known_hardware(CASE.device, precision="bf16", gpus_per_node=8, inter_link=CASE.inter_link)
    traces, searches, layouts = [], [], 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        profile = profile_model(module, batch)
        traces.append(time.perf_counter() - start)
        start = time.perf_counter()
        plan = plan_layouts(profile, batch, CASE.world, hardware, precision=CASE.precision, restrict=CASE.restrict,
                            activation_checkpointing=CASE.checkpointing)
        searches.append(time.perf_counter() - start)
        layouts = len(plan.predictions)
    total = min(traces) + min(searches)
    print(f"{CASE.name}: {layouts:,} layouts; meta trace {min(traces):.2f} s + search {min(searches):.2f} s = "
          f"{total:.2f} s (shortest of {args.repeats}; searches {', '.join(f'{s:.2f}' for s in searches)} s)")
    path = write_json(args.out, {"case": CASE.name, "layouts": layouts, "trace_s": traces, "search_s": searches,
                                 "total_s": total})
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()

"""Wall-clock seconds of one ``editkit bench`` with and without ``--ray auto``, from empty banks each time.

The engine's cost on a small machine (Ray's start, one scenario build per unit instead of one in all) against what
it wins (units side by side); on a machine of many cores, the speed-up of a repeated bench. Both runs train the same
streams and strategies: the plain one with ``--threads`` equal to ``--unit-cpus``, so they compute the same rows
(checked here), each in a process of its own, one after the other. Prints the seconds and the ratio, and writes them
as JSON.

    python benchmarks/bench_cluster.py [--scenario split-mnist] [--strategies naive,ewc,lwf,si,replay,agem,joint]
        [--seeds 1] [--steps N] [--unit-cpus 1] [--json runs/bench_cluster.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bench(root: Path, name: str, args: argparse.Namespace, *extra: str) -> tuple[float, dict]:
    """(seconds, report) of one bench into ``root/name`` from empty banks."""
    argv = [sys.executable, "-m", "editkit", "bench", "--scenario", args.scenario, "--seeds", str(args.seeds),
            "--bank-root", str(root / name / "banks"), "--run-dir", str(root / name / "run"), *extra]
    if args.strategies:
        argv += ["--strategies", args.strategies]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    return seconds, json.loads((root / name / "run" / "report.json").read_text())


def rows(report: dict) -> list:
    return report["addition"]["rows"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="split-mnist")
    parser.add_argument("--strategies", default="naive,ewc,lwf,si,replay,agem,joint")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="steps a task (default: the scenario's)")
    parser.add_argument("--unit-cpus", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("runs/bench_cluster.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="editkit-bench-cluster-") as scratch:
        root = Path(scratch)
        plain, one = bench(root, "plain", args, "--threads", str(args.unit_cpus))
        ray, other = bench(root, "ray", args, "--ray", "auto", "--unit-cpus", str(args.unit_cpus))
    result = {"scenario": args.scenario, "strategies": args.strategies, "seeds": args.seeds, "steps": args.steps,
              "unit_cpus": args.unit_cpus, "plain_seconds": plain, "ray_seconds": ray, "ray_over_plain": ray / plain,
              "same_rows": rows(one) == rows(other)}
    print(json.dumps(result, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

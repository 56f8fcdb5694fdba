"""Where a stream's training step spends its time, per mode: the streams users run, timed part by part.

Runs the scenario's whole stream once per mode through ``editkit.runs.stream.run_scenario`` (fresh banks in
a temporary directory; the modes share one built scenario, as ``editkit bench`` does): its sources, reg-batch
sampling, cyclic schedule and scoring are the stream's own. Inside :func:`editkit.train.timing.profiled`
every fine-tuning run splits its time into setup (before the first step: encoding the data its steps will
read, the task model, the optimizer), warm-up (the first steps) and steady steps, and each steady step into
task batch, reg batch, forward / jvp, backward, optimizer and host work. Prints per mode the seconds per
steady step (each task's median, weighted by its steps, as the bench's cost table), its ratio to the
linear stream, setup seconds and each part's milliseconds per step; writes them as JSON.

    python benchmarks/stream_steps.py [--scenario offline-vision] [--modes linear,taujp] [--steps 100]
                                      [--json runs/stream_steps.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from editkit.runs.stream import run_scenario
from editkit.scenario.build import build_scenario
from editkit.scenario.spec import load_scenario
from editkit.train.timing import PARTS, StepTimes, profiled
from editkit.util.memory import keep_freed_memory


def summary(runs: list[StepTimes]) -> dict:
    """One stream's runs summed up: steady s/step weighted by steps, setup + warm-up seconds, ms per part."""
    steps = sum(len(run.steps) for run in runs)
    steady_steps = sum(len(run.steady) for run in runs)
    return {
        "steady_seconds_per_step": sum(run.steady_per_step * len(run.steps) for run in runs) / steps,
        "setup_seconds": sum(run.setup + run.warmup for run in runs),
        "train_seconds_per_step": sum(sum(run.steps) for run in runs) / steps,
        "part_ms_per_step": {part: 1000 * sum(run.parts.get(part, 0.0) for run in runs) / steady_steps
                             for part in PARTS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="offline-vision")
    parser.add_argument("--modes", default="linear,taujp")
    parser.add_argument("--steps", type=int, default=100, help="steps per task")
    parser.add_argument("--json", type=Path, default=Path("runs/stream_steps.json"))
    args = parser.parse_args()
    keep_freed_memory()
    built = build_scenario(load_scenario(args.scenario))
    modes: dict[str, dict] = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="editkit-stream-steps-") as scratch, profiled() as runs:
            run_scenario(args.scenario, bank=Path(scratch) / "bank", run_dir=Path(scratch) / "run", built=built,
                         mode=mode, steps=args.steps)
        modes[mode] = summary(runs)
    linear = modes.get("linear", {}).get("steady_seconds_per_step")
    print(f"{'mode':>16} {'steady s/step':>13} {'vs linear':>9} {'setup s':>8}  " + " ".join(f"{p:>10}" for p in PARTS))
    for mode, result in modes.items():
        result["over_linear"] = result["steady_seconds_per_step"] / linear if linear else None
        ratio = f"{result['over_linear']:.2f}" if linear else "—"
        print(f"{mode:>16} {result['steady_seconds_per_step']:13.3f} {ratio:>9} {result['setup_seconds']:8.1f}  "
              + " ".join(f"{result['part_ms_per_step'][p]:10.1f}" for p in PARTS))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"scenario": args.scenario, "steps": args.steps, "modes": modes}, indent=2) + "\n")
    print(f"written {args.json} (parts in ms per steady step)")


if __name__ == "__main__":
    main()

"""Where ``editkit negate toxic`` spends its seconds, part by part: the run a user starts, timed from inside.

Runs :func:`editkit.runs.negate_lm.negate_scenario` (what the command runs) into a bank of its own (a fresh one in a
temporary directory unless ``--bank`` names one, so the vector is fine-tuned as on a first run), inside
:func:`editkit.train.timing.profiled`, and prints the seconds of each part:

- loading: building the scenario (the model read from the cache, the corpora tokenized);
- fine-tuning: the stream, split into the run's setup (the prefix states of the text its steps read), its steps
  (with the steady seconds per step and each part of a step in milliseconds, as ``stream_steps.py`` splits them) and
  the rest (the stream scoring its vector, banking it);
- validation and test perplexities, and sampling per scored model (theta_0, theta_0 + tau, the chosen negation);
- the rest of the negation (the toxicity scorer, the checks), and the whole wall time of the process.

theta_0's continuations come from the sample cache when it holds them: ``--cold-samples`` empties it first
(``<derived cache>/samples``), as on a machine that never sampled them.

    python benchmarks/negate_parts.py [--scenario toxic] [--bank DIR] [--steps N] [--cold-samples]
                                      [--precision bf16|fp32] [--json runs/negate_parts.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # before torch and editkit are imported: a user's wall clock includes them

from editkit.eval import sample_cache  # noqa: E402
from editkit.runs.negate_lm import negate_scenario  # noqa: E402
from editkit.scenario.spec import load_scenario  # noqa: E402
from editkit.settings import derived_cache_dir  # noqa: E402
from editkit.train.runtime import default_runtime  # noqa: E402
from editkit.train.timing import PARTS, profiled  # noqa: E402
from editkit.util.memory import keep_freed_memory  # noqa: E402


def fine_tuning_parts(runs: list, seconds: float) -> dict:
    """The stream's seconds split into the runs' setup, their steps and the rest; a steady step's parts in ms."""
    steps = sum(len(run.steps) for run in runs)
    steady = sum(len(run.steady) for run in runs)
    setup = sum(run.setup for run in runs)
    stepping = sum(sum(run.steps) for run in runs)
    return {"seconds": seconds, "setup": setup, "steps": stepping, "rest": seconds - setup - stepping,
            "step_count": steps,
            "steady_seconds_per_step": sum(run.steady_per_step * len(run.steps) for run in runs) / max(1, steps),
            "part_ms_per_step": {part: 1000 * sum(run.parts.get(part, 0.0) for run in runs) / max(1, steady)
                                 for part in PARTS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="toxic")
    parser.add_argument("--bank", type=Path, help="bank to use (default: a fresh one, so the vector is fine-tuned)")
    parser.add_argument("--steps", type=int, help="fine-tuning steps (default: the scenario's)")
    parser.add_argument("--cold-samples", action="store_true", help="theta_0's continuations sampled anew")
    parser.add_argument("--precision", choices=("bf16", "fp32"), help="the passes' precision (default: the "
                        "scenario's own, as the command's)")
    parser.add_argument("--json", type=Path, default=Path("runs/negate_parts.json"))
    args = parser.parse_args()
    keep_freed_memory()
    spec = load_scenario(args.scenario)
    with tempfile.TemporaryDirectory(prefix="editkit-negate-parts-") as scratch:
        if args.cold_samples:
            shutil.rmtree(derived_cache_dir() / sample_cache.FOLDER, ignore_errors=True)
        with profiled() as runs:
            report = negate_scenario(spec, spec.task_names[0], args.bank or Path(scratch) / "bank",
                                     runtime=default_runtime(precision=args.precision or spec.precision),
                                     steps=args.steps)
    seconds = report["seconds"]
    parts = {"loading": seconds.get("loading", 0.0)}
    if "fine-tuning" in seconds:
        parts["fine-tuning"] = fine_tuning_parts(runs, seconds["fine-tuning"])
    parts.update(seconds["parts"])
    timed = sum(v if isinstance(v, float) else v["seconds"] for v in parts.values())
    total = time.perf_counter() - STARTED
    parts["rest"] = total - timed
    print(f"{'part':<28} {'seconds':>8}")
    for part, value in parts.items():
        if isinstance(value, dict):
            print(f"{part:<28} {value['seconds']:8.1f}")
            print(f"{'  setup (prefix states)':<28} {value['setup']:8.1f}")
            print(f"{'  ' + str(value['step_count']) + ' steps':<28} {value['steps']:8.1f}   "
                  f"steady {value['steady_seconds_per_step']:.3f} s/step: "
                  + ", ".join(f"{p} {ms:.0f} ms" for p, ms in value["part_ms_per_step"].items()))
            print(f"{'  scoring, banking':<28} {value['rest']:8.1f}")
        else:
            print(f"{part:<28} {value:8.1f}")
    print(f"{'total (process wall)':<28} {total:8.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"scenario": spec.name, "parts": parts, "total": total,
                                     "alpha": report["alpha"], "rows": report["rows"]}, indent=2, default=str) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()

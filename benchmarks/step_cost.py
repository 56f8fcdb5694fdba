"""Cost of one training step per mode, measured in one process on the offline-vision backbone.

Runs ``editkit.train.loop.fine_tune`` for nonlinear, linear, taujp (cyclic) and taujp
(strict) on the same task, batch and sources; times every step through the
``on_step`` callback (median after warm-up) and samples the process's resident
memory while each mode runs. Prints ratios against the plain (non-linear) step
and writes them as JSON.

    python benchmarks/step_cost.py [--steps 12] [--warmup 3] [--json runs/step_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from editkit.util.memory import PeakRSS
from editkit.train.recipe import Recipe
from editkit.scenario.spec import load_scenario
from editkit.scenario.build import build_scenario
from editkit.core.taujp import Regularizer, UnlabeledSource, unlabeled_source
from editkit.train.loop import fine_tune

MODES = {  # label -> (mode, schedule)
    "nonlinear": ("nonlinear", "cyclic"),
    "linear": ("linear", "cyclic"),
    "taujp": ("taujp", "cyclic"),
    "taujp_strict": ("taujp", "strict"),
}


def measure(built, recipe: Recipe, sources: list[UnlabeledSource], warmup: int) -> dict[str, float]:
    task = built.tasks[0]
    regularizer = Regularizer(sources, lam=recipe.lam, schedule=recipe.schedule, batch_size=recipe.reg_batch_size)
    stamps: list[float] = []
    with PeakRSS(interval=0.001) as rss:
        start = time.perf_counter()
        fine_tune(built.backbone.module, built.heads[task.name], task.train, recipe, regularizer,
                  on_step=lambda step, record: stamps.append(time.perf_counter()))
        peak = rss.window()
    durations = [b - a for a, b in zip([start] + stamps[:-1], stamps)][warmup:]
    return {"seconds_per_step": statistics.median(durations), "steps_timed": len(durations), "peak_rss_mb": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="offline-vision")
    parser.add_argument("--steps", type=int, default=12, help="steps per mode, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("runs/step_cost.json"))
    args = parser.parse_args()
    if args.steps - args.warmup < 5:
        parser.error("need at least 5 timed steps (steps - warmup >= 5)")

    spec = load_scenario(args.scenario)
    built = build_scenario(spec)
    sources = [unlabeled_source(t.name, t.train) for t in built.tasks[1:]]
    if built.generic is not None:
        sources.append(built.generic)
    # One untimed pass first: the process's first training steps pay one-off costs (allocator, kernels'
    # first calls) that the per-mode warm-up alone does not absorb.
    measure(built, spec.recipe.with_overrides(mode="taujp", steps=args.warmup + 1), sources, args.warmup)
    results = {}
    for label, (mode, schedule) in MODES.items():
        recipe = spec.recipe.with_overrides(mode=mode, schedule=schedule, steps=args.steps)
        results[label] = measure(built, recipe, sources, args.warmup)
        print(f"{label:>13}: {results[label]['seconds_per_step']:.3f} s/step  peak RSS {results[label]['peak_rss_mb']:.0f} MB")

    sec = {k: v["seconds_per_step"] for k, v in results.items()}
    mem = {k: v["peak_rss_mb"] for k, v in results.items()}
    report = {
        "scenario": spec.name,
        "batch_size": spec.recipe.batch_size,
        "reg_batch": spec.recipe.reg_batch_size,
        "n_sources_strict": len(sources),
        "torch_threads": torch.get_num_threads(),
        "seconds_per_step": sec,
        "linear_over_nonlinear": sec["linear"] / sec["nonlinear"],
        "taujp_over_linear": sec["taujp"] / sec["linear"],
        "strict_over_linear": sec["taujp_strict"] / sec["linear"],
        "peak_rss_mb": mem,
        "memory_over_nonlinear": {k: v / mem["nonlinear"] for k, v in mem.items()},
    }
    print(json.dumps({k: report[k] for k in ("linear_over_nonlinear", "taujp_over_linear", "strict_over_linear")}, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()

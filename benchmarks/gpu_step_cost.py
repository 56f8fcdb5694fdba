"""Cost of one training step on a GPU, in the paper's setting: CLIP ViT-B-32, batch 128, bf16 autocast.

The paper reports for its cyclic tauJp on this model 0.361 -> 0.374 s per iteration over linearized
fine-tuning (+3.6%) and +3.2% memory. This script measures the same ratios with editkit's own step
(``editkit.train.loop.fine_tune``) on a machine that has no model hub: the image tower is built by
``editkit.models.clip.build_clip`` with random weights (the cost of a step does not depend on the
values), the data are generated images, and the recipe is vision8's (batch 128, reg batch 16, one other
task's batch per step in turn, lr 1e-5, AdamW). One process runs every mode in turn, ``--rounds`` times,
so the ratios compare steps measured minutes apart at most.

Per mode: the median steady step (each step's own duration, taken from the run: a step's statistics are
read back once the next step is queued, so in steady state a step's wall time is the device's) and the
peak CUDA memory allocated during the run (``torch.cuda.max_memory_allocated``, reset per run). With
``--parts`` a further run per mode synchronises the device at each part of the step and reports where the
time goes (slower: for reading, not for the ratios). ``--data host`` keeps the images in CPU memory, so
the steps include the input pipeline (workers, pinned memory, the copy); the default holds them on the GPU,
so the ratios are the steps' own.

    python benchmarks/gpu_step_cost.py [--model ViT-B-32] [--steps 40] [--warmup 10] [--rounds 2]
                                       [--precision bf16] [--parts] [--json runs/gpu_step_cost.json]

On a CPU it runs too (``--device cpu --model editkit-tiny-clip --batch 8``: what the tests do), which is only a check
that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import time

import torch

from editkit.core.curvature import Curvature, source_curvature
from editkit.core.taujp import UnlabeledSource
from editkit.data.tasks import TensorTaskDataset
from editkit.models.clip import TINY_MODEL_NAME, build_clip
from editkit.models.heads import ZeroShotHead
from editkit.scenario.spec import load_scenario
from editkit.train.loop import FineTuneResult, fine_tune
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime, setup

#: label -> the recipe fields its runs override
MODES = {
    "nonlinear": {"mode": "nonlinear"},
    "linear": {"mode": "linear"},
    "taujp": {"mode": "taujp"},
    "taujp_strict": {"mode": "taujp", "schedule": "strict"},
    "taujp_nonlinear": {"mode": "taujp-nonlinear"},
    # the data-free penalty: the other tasks' curvature (computed once, before the timed runs), no reg rows
    "taujp_kfac": {"mode": "taujp", "penalty": "kfac"},
    "taujp_kfac_apart": {"mode": "taujp", "penalty": "kfac", "curvature_combine": "apart"},
}
#: ratio name -> (label over label)
RATIOS = {
    "linear_over_nonlinear": ("linear", "nonlinear"),
    "taujp_over_linear": ("taujp", "linear"),
    "strict_over_linear": ("taujp_strict", "linear"),
    "taujp_nonlinear_over_nonlinear": ("taujp_nonlinear", "nonlinear"),
    "kfac_over_linear": ("taujp_kfac", "linear"),
    "kfac_apart_over_linear": ("taujp_kfac_apart", "linear"),
}
#: vision8's number of tasks: the first is trained, the other seven are the penalty's sources
TASKS = 8
CLASSES = 10
PAPER = {"linear_s": 0.361, "taujp_s": 0.374, "taujp_over_linear": 0.374 / 0.361, "memory_taujp_over_linear": 1.032}


def generated_tasks(count: int, examples: int, image_size: int, classes: int,
                    device: torch.device) -> list[TensorTaskDataset]:
    """``count`` tasks of random images (normalised-pixel scale) and labels, seeded, held on ``device``."""
    generator = torch.Generator().manual_seed(0)
    return [TensorTaskDataset(torch.randn(examples, 3, image_size, image_size, generator=generator).to(device),
                              torch.randint(classes, (examples,), generator=generator).to(device))
            for _ in range(count)]


@dataclass
class Setting:
    """What every run of the benchmark shares: the tower at theta_0, its head, the tasks, the recipe, the device."""

    backbone: Any
    head: ZeroShotHead
    tasks: list[TensorTaskDataset]
    recipe: Recipe
    runtime: Runtime
    curvatures: list[Curvature] | None = None
    curvature_seconds: float = 0.0

    def run(self, label: str, steps: int, *, parts: bool = False) -> FineTuneResult:
        """One fine-tune of the first task in mode ``label``, the other tasks as the penalty's sources (built
        anew, so every run draws the same reg batches), or their curvature for the data-free penalty."""
        recipe = self.recipe.with_overrides(**{"schedule": "cyclic", **MODES[label]}, steps=steps)
        sources = [UnlabeledSource(f"task{i}", task.inputs) for i, task in enumerate(self.tasks[1:], start=1)]
        penalty = (recipe.curvature_regularizer(self.task_curvatures(recipe)) if recipe.penalty == "kfac"
                   else recipe.regularizer(sources))
        return fine_tune(self.backbone.module, self.head, self.tasks[0], recipe, penalty,
                         runtime=self.runtime, time_parts=parts)

    def task_curvatures(self, recipe: Recipe) -> list[Curvature]:
        """The other tasks' curvature at theta_0, each on ``recipe.curvature_examples`` of its images (once)."""
        if self.curvatures is None:
            start = time.perf_counter()
            self.curvatures = [source_curvature(self.backbone.module, UnlabeledSource(f"task{i}", task.inputs),
                                                examples=recipe.curvature_examples, seed=i, device=self.runtime.device)
                               for i, task in enumerate(self.tasks[1:], start=1)]
            self.curvature_seconds = (time.perf_counter() - start) / len(self.curvatures)
            print(f"curvature: {self.curvature_seconds:.1f} s a task, {self.curvatures[0].nbytes / 2**20:.1f} MiB "
                  f"({self.curvatures[0].describe()})", flush=True)
        return self.curvatures


def build_setting(args: argparse.Namespace) -> Setting:
    runtime = setup(args.device, args.precision)
    recipe = load_scenario("vision8").recipe
    if args.batch:
        recipe = recipe.with_overrides(batch_size=args.batch, reg_batch=max(1, args.batch // 8))
    backbone = build_clip(args.model, pretrained=None, allow_download=False)
    size = backbone.module.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    generator = torch.Generator().manual_seed(1)
    head = ZeroShotHead(torch.nn.functional.normalize(torch.randn(CLASSES, backbone.feature_dim, generator=generator),
                                                      dim=-1), logit_scale=100.0)
    where = runtime.device if args.data == "device" else torch.device("cpu")
    return Setting(backbone, head, generated_tasks(TASKS, 2 * recipe.batch_size, size, CLASSES, where), recipe, runtime)


def timed_rounds(setting: Setting, labels: list[str], steps: int, warmup: int,
                 rounds: int) -> tuple[list[dict[str, float]], dict[str, list[float]], dict[str, int]]:
    """Every mode in turn, ``rounds`` times, after one untimed round of ``warmup`` steps each (the process's
    one-off costs: kernels chosen, the allocator's growth). Returns each round's median step per mode, every
    timed step per mode, and each mode's largest peak of CUDA memory (empty on a CPU)."""
    for label in labels:
        setting.run(label, warmup)
    medians: list[dict[str, float]] = []
    durations: dict[str, list[float]] = {label: [] for label in labels}
    peaks: dict[str, int] = {}
    for r in range(1, rounds + 1):
        medians.append({})
        for label in labels:
            result = setting.run(label, steps)
            timed = result.times.steps[warmup:]
            medians[-1][label] = statistics.median(timed)
            durations[label] += timed
            if result.peak_gpu_bytes is not None:
                peaks[label] = max(peaks.get(label, 0), result.peak_gpu_bytes)
            print(f"round {r} {label:>16}: {medians[-1][label]:.4f} s/step"
                  + (f"  peak {result.peak_gpu_bytes / 2**30:.2f} GiB" if result.peak_gpu_bytes else ""), flush=True)
    return medians, durations, peaks


def ratios(medians: list[dict[str, float]], peaks: dict[str, int]) -> dict[str, Any]:
    """Each ratio of :data:`RATIOS` whose two modes ran (median over rounds of the round's ratio), and the
    memory ratios when CUDA memory was measured."""
    out: dict[str, Any] = {name: statistics.median(r[top] / r[bottom] for r in medians)
                           for name, (top, bottom) in RATIOS.items() if top in medians[0] and bottom in medians[0]}
    if peaks:
        out["peak_gpu_gib"] = {label: value / 2**30 for label, value in peaks.items()}
        if "nonlinear" in peaks:
            out["memory_over_nonlinear"] = {label: value / peaks["nonlinear"] for label, value in peaks.items()}
        if "taujp" in peaks and "linear" in peaks:
            out["memory_taujp_over_linear"] = peaks["taujp"] / peaks["linear"]
    return out


def parts_ms(setting: Setting, labels: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Per mode, the mean milliseconds of each part of a steady step (the device synchronised at each part)."""
    out = {}
    for label in labels:
        result = setting.run(label, steps, parts=True)
        out[label] = {part: 1e3 * s for part, s in result.times.parts_per_step().items()}
        print(f"parts {label:>16}: " + ", ".join(f"{p} {v:.1f}" for p, v in out[label].items()) + " ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32", help=f"an open_clip name ({TINY_MODEL_NAME!r}: a tiny one)")
    parser.add_argument("--batch", type=int, default=None, help="default: vision8's (128)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--device", default=None)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--data", choices=("device", "host"), default="device",
                        help="where the generated images lie: device = on the GPU, batches gathered there (the "
                             "step alone); host = in CPU memory, batches through DataLoader workers and pinned "
                             "memory (the step plus the input pipeline)")
    parser.add_argument("--parts", action="store_true", help="also one run per mode timing the step's parts")
    parser.add_argument("--json", type=Path, default=Path("runs/gpu_step_cost.json"))
    args = parser.parse_args()
    labels = args.modes.split(",")
    if unknown := sorted(set(labels) - set(MODES)):
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if args.steps - args.warmup < 5:
        parser.error("need at least 5 timed steps (steps - warmup >= 5)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    setting = build_setting(args)
    medians, durations, peaks = timed_rounds(setting, labels, args.steps, args.warmup, args.rounds)
    report = {
        "device": torch.cuda.get_device_name(setting.runtime.device) if setting.runtime.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "runtime": setting.runtime.describe(),
        "model": args.model,
        "weights": "random",
        "data": args.data,
        "batch_size": setting.recipe.batch_size,
        "reg_batch": setting.recipe.reg_batch_size,
        "penalty_sources": TASKS - 1,
        "steps_timed_per_run": args.steps - args.warmup,
        "rounds": args.rounds,
        "seconds_per_step": {label: statistics.median(durations[label]) for label in labels},
        "seconds_per_step_rounds": medians,
        "paper": PAPER,
        **ratios(medians, peaks),
    }
    if setting.curvatures is not None:
        report["curvature"] = {"seconds_per_task": setting.curvature_seconds, **setting.curvatures[0].describe()}
    if args.parts:
        report["parts_ms"] = parts_ms(setting, labels, args.steps)
    print(json.dumps({k: v for k, v in report.items() if k not in ("seconds_per_step_rounds", "parts_ms")}, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()

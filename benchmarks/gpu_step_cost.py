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

On a CPU it runs too (``--device cpu --model tiny --batch 8``: what the tests do), which is only a check
that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from editkit.core.taujp import UnlabeledSource
from editkit.data.tasks import TensorTaskDataset
from editkit.models.clip import TINY_MODEL_NAME, build_clip
from editkit.models.heads import ZeroShotHead
from editkit.scenario.spec import load_scenario
from editkit.train.loop import FineTuneResult, fine_tune
from editkit.train.runtime import Runtime, setup

#: label -> (mode, schedule)
MODES = {
    "nonlinear": ("nonlinear", "cyclic"),
    "linear": ("linear", "cyclic"),
    "taujp": ("taujp", "cyclic"),
    "taujp_strict": ("taujp", "strict"),
    "taujp_nonlinear": ("taujp-nonlinear", "cyclic"),
}
#: ratio name -> (label over label)
RATIOS = {
    "linear_over_nonlinear": ("linear", "nonlinear"),
    "taujp_over_linear": ("taujp", "linear"),
    "strict_over_linear": ("taujp_strict", "linear"),
    "taujp_nonlinear_over_nonlinear": ("taujp_nonlinear", "nonlinear"),
}
PAPER = {"linear_s": 0.361, "taujp_s": 0.374, "taujp_over_linear": 0.374 / 0.361, "memory_taujp_over_linear": 1.032}


def generated_tasks(count: int, examples: int, image_size: int, classes: int,
                    device: torch.device) -> list[TensorTaskDataset]:
    """``count`` tasks of random images (normalised-pixel scale) and labels, seeded, held on ``device``."""
    generator = torch.Generator().manual_seed(0)
    return [TensorTaskDataset(torch.randn(examples, 3, image_size, image_size, generator=generator).to(device),
                              torch.randint(classes, (examples,), generator=generator).to(device))
            for _ in range(count)]


def run_mode(backbone, head, tasks, recipe, runtime: Runtime, *, parts: bool = False) -> FineTuneResult:
    """One fine-tune of the first task, the other tasks as the penalty's sources (restarted: same draws)."""
    sources = [UnlabeledSource(f"task{i}", task.inputs) for i, task in enumerate(tasks[1:], start=1)]
    return fine_tune(backbone.module, head, tasks[0], recipe, recipe.regularizer(sources), runtime=runtime,
                     time_parts=parts)


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

    runtime = setup(args.device, args.precision)
    base = load_scenario("vision8").recipe
    if args.batch:
        base = base.with_overrides(batch_size=args.batch, reg_batch=max(1, args.batch // 8))
    backbone = build_clip(args.model, pretrained=None, allow_download=False)
    size = backbone.module.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    classes = 10
    generator = torch.Generator().manual_seed(1)
    head = ZeroShotHead(torch.nn.functional.normalize(torch.randn(classes, backbone.feature_dim, generator=generator),
                                                      dim=-1), logit_scale=100.0)
    n_tasks = 8  # vision8's count: the first is trained, the other seven are the penalty's sources
    tasks = generated_tasks(n_tasks, 2 * base.batch_size, size, classes,
                            runtime.device if args.data == "device" else torch.device("cpu"))

    rounds: list[dict[str, float]] = []
    steps: dict[str, list[float]] = {label: [] for label in labels}
    peaks: dict[str, list[int]] = {label: [] for label in labels}
    for r in range(args.rounds + 1):  # round 0: untimed, the process's one-off costs (kernels, allocator)
        timed = r > 0
        rounds.append({}) if timed else None
        for label in labels:
            mode, schedule = MODES[label]
            recipe = base.with_overrides(mode=mode, schedule=schedule,
                                         steps=args.steps if timed else args.warmup)
            result = run_mode(backbone, head, tasks, recipe, runtime)
            if not timed:
                continue
            durations = result.times.steps[args.warmup:]
            rounds[-1][label] = statistics.median(durations)
            steps[label] += durations
            if result.peak_gpu_bytes is not None:
                peaks[label].append(result.peak_gpu_bytes)
            print(f"round {r} {label:>16}: {rounds[-1][label]:.4f} s/step"
                  + (f"  peak {result.peak_gpu_bytes / 2**30:.2f} GiB" if result.peak_gpu_bytes else ""), flush=True)

    report = {
        "device": torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "runtime": runtime.describe(),
        "model": args.model,
        "weights": "random",
        "data": args.data,
        "batch_size": base.batch_size,
        "reg_batch": base.reg_batch_size,
        "penalty_sources": n_tasks - 1,
        "steps_timed_per_run": args.steps - args.warmup,
        "rounds": args.rounds,
        "seconds_per_step": {label: statistics.median(steps[label]) for label in labels},
        "seconds_per_step_rounds": rounds,
        "paper": PAPER,
    }
    for name, (top, bottom) in RATIOS.items():
        if top in labels and bottom in labels:
            report[name] = statistics.median(rnd[top] / rnd[bottom] for rnd in rounds)
    if all(peaks.values()):
        peak = {label: max(values) for label, values in peaks.items()}
        report["peak_gpu_gib"] = {label: value / 2**30 for label, value in peak.items()}
        report["memory_over_nonlinear"] = {label: value / peak[labels[0]] for label, value in peak.items()}
        if "taujp" in peak and "linear" in peak:
            report["memory_taujp_over_linear"] = peak["taujp"] / peak["linear"]
    if args.parts:
        report["parts_ms"] = {}
        for label in labels:
            mode, schedule = MODES[label]
            result = run_mode(backbone, head, tasks, base.with_overrides(mode=mode, schedule=schedule, steps=args.steps),
                              runtime, parts=True)
            report["parts_ms"][label] = {part: 1e3 * s for part, s in result.times.parts_per_step().items()}
            print(f"parts {label:>16}: " + ", ".join(f"{p} {v:.1f}" for p, v in report["parts_ms"][label].items())
                  + " ms", flush=True)
    print(json.dumps({k: v for k, v in report.items() if k not in ("seconds_per_step_rounds", "parts_ms")}, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {args.json}")


if __name__ == "__main__":
    main()

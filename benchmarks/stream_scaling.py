"""How a stream's cost grows with its length: training and evaluation seconds per task for T tasks.

After experience t a stream scores the merged model on all t + 1 tasks seen so far, so
evaluation per experience grows with t (a whole stream's with T^2), while fine-tuning
costs the same per task whatever T. This measures both on the ``offline-vision``
scenario, built once, for streams of T = 2, 4, 8, 16 tasks (``--tasks``) in each mode
(``--modes``): the four packaged tasks first, then label-permuted copies (copy k of task
X, ``X-pk``: X's inputs, its labels mapped through a seeded permutation of its classes,
with its own few-shot probe head fitted on them) until the stream is long enough. The
copies cost what their originals cost to train and score; their accuracies mean
nothing (a copy contradicts its original) and are not reported.

Each (mode, T) stream runs through ``editkit.runs.stream.run_stream`` into a fresh
temporary bank with the scenario's recipe at ``--steps`` steps (a step costs the same
whatever T, so few steps keep the run short). The ``on_step`` callback timestamps each
finished experience; its evaluation seconds are its wall time less its fine-tuning
(``record.cost.train_seconds``): scoring its vector alone, theta_0 and the merged model,
plus what the runner does around them (building the task model, the bank's writes and
the merge's reads). Peak RSS is sampled over each whole stream. An untimed one-task,
one-step stream per mode runs first, so the first timed stream does not pay the
process's one-off costs.

Per (mode, T) it reports the mean training seconds per task, the mean evaluation
seconds per experience, the last experience's, the evaluation seconds per task scored
(experience t counted as scoring t + 1 tasks) and the peak RSS; prints them as a table
and writes them as JSON, with a PNG of each experience's evaluation seconds and of the
per-T means.

    python benchmarks/stream_scaling.py [--tasks 2,4,8,16] [--modes nonlinear,taujp] [--steps 20]
        [--json runs/stream_scaling.json] [--png runs/stream_scaling.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.table import Table
from torch import nn

from editkit.data.tasks import TaskData, TensorTaskDataset
from editkit.errors import ConfigError
from editkit.integrations.avalanche.benchmark import Experience, task_experiences
from editkit.models.heads import probe_head
from editkit.runs.bench.plots import MODE_COLORS
from editkit.runs.records import StepRecord
from editkit.runs.report import pyplot
from editkit.runs.stream import process_runtime, run_stream
from editkit.scenario.build import BuiltScenario, build_scenario
from editkit.scenario.spec import load_scenario
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime
from editkit.util.memory import PeakRSS

SCENARIO = "offline-vision"


def permuted_copy(task: TaskData, copy: int, rng: np.random.Generator) -> TaskData:
    """Copy ``copy`` of ``task``: the same input tensors (shared, not copied), each label ``y`` replaced by
    ``mapping[y]`` for a permutation drawn from ``rng``, so the copy is a new task of the same size and cost."""
    mapping = torch.from_numpy(rng.permutation(task.num_classes))

    def relabel(split: TensorTaskDataset) -> TensorTaskDataset:
        return TensorTaskDataset(split.inputs, mapping[split.targets])

    classes = [task.classes[c] for c in torch.argsort(mapping).tolist()]  # new class mapping[c] is old class c
    return TaskData(f"{task.name}-p{copy}", classes, relabel(task.train), relabel(task.val), relabel(task.test))


def stream_tasks(built: BuiltScenario, length: int, seed: int) -> tuple[list[TaskData], dict[str, nn.Module]]:
    """The longest stream's tasks and heads: the scenario's tasks, then round k adds copy k of each of them,
    with a probe head fitted as the scenario fits its own (same shots, same seed). Every shorter stream is a
    prefix, so each head is fitted once."""
    tasks, heads = list(built.tasks[:length]), dict(built.heads)
    copy = 0
    while len(tasks) < length:
        copy += 1
        for index, original in enumerate(built.tasks[: length - len(tasks)]):
            task = permuted_copy(original, copy, np.random.default_rng([seed, copy, index]))
            heads[task.name] = probe_head(built.backbone, task, shots=built.spec.heads["shots"], seed=seed)
            tasks.append(task)
    return tasks, heads


def measure(exps: list[Experience], built: BuiltScenario, heads: dict[str, nn.Module], recipe: Recipe,
            runtime: Runtime, label: str) -> tuple[list[float], list[float], int]:
    """(training seconds, evaluation seconds) of each experience of one stream run into a fresh bank, and the
    run's peak RSS in bytes. The generic source restarts from its seed, so every run samples the same batches."""
    stamps: list[float] = []
    train: list[float] = []

    def on_step(record: StepRecord) -> None:
        stamps.append(time.perf_counter())
        train.append(record.cost.train_seconds)
        seconds = stamps[-1] - (stamps[-2] if len(stamps) > 1 else start)
        print(f"{label} [{record.step + 1:>2}/{len(exps)}] {record.task:>12}: "
              f"train {record.cost.train_seconds:6.2f} s, evaluation {seconds - record.cost.train_seconds:6.2f} s",
              flush=True)

    if built.generic is not None:
        built.generic.restart()
    with PeakRSS() as rss, tempfile.TemporaryDirectory(prefix="stream-scaling-") as bank:
        start = time.perf_counter()
        run_stream(exps, built.backbone, heads, recipe, bank, scenario=built.spec.name, generic=built.generic,
                   runtime=runtime, on_step=on_step)
        peak = rss.window()
    walls = np.diff([start, *stamps])
    return train, [float(w - t) for w, t in zip(walls, train)], peak


def summary(mode: str, train: list[float], evals: list[float], peak: int) -> dict:
    """One (mode, T) row: the per-task means the table shows, and the per-experience seconds the plot draws."""
    scored = sum(t + 1 for t in range(len(evals)))  # experience t scores the merged model on t + 1 tasks
    return {
        "mode": mode,
        "tasks": len(evals),
        "train_seconds_per_task": statistics.mean(train),
        "eval_seconds_per_task": statistics.mean(evals),
        "eval_seconds_last": evals[-1],
        "eval_seconds_per_task_scored": sum(evals) / scored,
        "peak_rss_mb": peak / 2**20,
        "train_seconds": train,
        "eval_seconds": evals,
    }


def table(report: dict) -> Table:
    """The report's rows as a rich table (every number read from the report, so terminal and JSON agree)."""
    out = Table(title=f"stream scaling — {report['scenario']}, {report['steps']} steps per task, "
                      f"{report['runtime']} (seconds)", title_justify="left")
    out.caption = ("train/task, eval/task: means over the T experiences; eval last: the last experience's; "
                   "eval/scored: evaluation seconds over the tasks scored (experience t scores t + 1)")
    out.caption_justify = "left"
    for column in ("mode", "T", "train/task", "eval/task", "eval last", "eval/scored", "RSS MB"):
        out.add_column(column, justify="left" if column == "mode" else "right")
    previous = None
    for row in report["runs"]:
        if previous is not None and row["mode"] != previous:
            out.add_section()
        previous = row["mode"]
        out.add_row(row["mode"], str(row["tasks"]), f"{row['train_seconds_per_task']:.2f}",
                    f"{row['eval_seconds_per_task']:.2f}", f"{row['eval_seconds_last']:.2f}",
                    f"{row['eval_seconds_per_task_scored']:.3f}", f"{row['peak_rss_mb']:.0f}")
    return out


def plot(report: dict, path: Path) -> Path:
    """Left: evaluation seconds of each experience against its index (= tasks the merged model scores), one
    line per (mode, T); streams of one mode share their prefix, so their lines should lie on each other.
    Right, per mode against T: evaluation seconds per task scored (solid), the cost that can stay flat (each
    experience must show its new vector to every seen task), and training seconds per task (dashed)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = report["tasks"]
    styles = dict(zip(lengths, ("-", "--", "-.", ":") * len(lengths)))
    for row in report["runs"]:
        color = MODE_COLORS.get(row["mode"], "tab:gray")
        left.plot(range(1, row["tasks"] + 1), row["eval_seconds"], styles[row["tasks"]], color=color, marker="o",
                  markersize=3, label=f"{row['mode']} T={row['tasks']}")
    left.set(xlabel="experience (tasks scored by the merged model)", ylabel="evaluation seconds",
             title="evaluation seconds per experience")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.legend(fontsize=8)
    for mode in report["modes"]:
        rows = [r for r in report["runs"] if r["mode"] == mode]
        color = MODE_COLORS.get(mode, "tab:gray")
        right.plot([r["tasks"] for r in rows], [r["eval_seconds_per_task_scored"] for r in rows], "-o",
                   color=color, label=f"{mode} evaluation per task scored")
        right.plot([r["tasks"] for r in rows], [r["train_seconds_per_task"] for r in rows], "--s", color=color,
                   label=f"{mode} training")
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [str(n) for n in lengths])
    right.set(xlabel="tasks in the stream (T)", ylabel="seconds", title="per task, against the stream's length")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ints(value: str) -> list[int]:
    lengths = sorted({int(v) for v in value.split(",")})
    if lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"stream lengths must be >= 1, got {value}")
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=_ints, default=[2, 4, 8, 16], help="stream lengths T, comma-separated")
    parser.add_argument("--modes", default="nonlinear,taujp", help="recipe modes, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per task")
    parser.add_argument("--json", type=Path, default=Path("runs/stream_scaling.json"))
    parser.add_argument("--png", type=Path, default=Path("runs/stream_scaling.png"))
    args = parser.parse_args()

    spec = load_scenario(SCENARIO)
    try:
        recipes = {mode: spec.recipe.with_overrides(mode=mode, steps=args.steps) for mode in args.modes.split(",")}
    except ConfigError as error:
        parser.error(str(error))
    with process_runtime() as runtime:  # as ``editkit stream`` runs: on a CPU, freed memory kept for reuse
        built = build_scenario(spec, seed=spec.recipe.seed, device=str(runtime.device),
                               precision=runtime.precision)
        tasks, heads = stream_tasks(built, max(args.tasks), spec.recipe.seed)
        built.backbone.module.to(runtime.device)
        exps = task_experiences(tasks)
        for mode, recipe in recipes.items():
            measure(exps[:1], built, heads, recipe.with_overrides(steps=1), runtime, f"warm-up {mode}")
        runs = [summary(mode, *measure(exps[:length], built, heads, recipe, runtime, f"{mode} T={length}"))
                for mode, recipe in recipes.items() for length in args.tasks]
    report = {"scenario": spec.name, "steps": args.steps, "modes": list(recipes), "tasks": args.tasks,
              "stream": [t.name for t in tasks], "runtime": runtime.describe(),
              "torch_threads": torch.get_num_threads(), "runs": runs}
    Console().print(table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {args.json} and {plot(report, args.png)}")


if __name__ == "__main__":
    main()

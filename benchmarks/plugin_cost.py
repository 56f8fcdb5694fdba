"""Seconds per step of tauJp inside a stock Avalanche ``Naive`` strategy against editkit's own loop.

Streams the same two packaged tasks (mnist, digits on EfficientNet-Lite0 with few-shot
probe heads) twice in one process, with the same recipe, seed and generic source:
once through ``editkit.runs.stream.run_benchmark`` and once through ``Naive`` with
``TauJpPlugin``; prints each task's seconds per step (as the banks record them), their
ratio, and the largest difference between the two banks' vectors (0 when the plugin
runs exactly editkit's step). Writes the numbers as JSON.

    python benchmarks/plugin_cost.py [--steps 25] [--train-size 1000] [--json runs/plugin_cost.json]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import torch

from editkit.bank.store import Bank
from editkit.core.taujp import UnlabeledSource
from editkit.data.packaged import packaged_task
from editkit.integrations.avalanche.benchmark import benchmark_from_tasks, experiences
from editkit.integrations.avalanche.multitask import MultiHeadTaskModel
from editkit.integrations.avalanche.plugin import TauJpPlugin
from editkit.models import efficientnet
from editkit.runs.stream import probe_heads, run_benchmark
from editkit.train.recipe import Recipe
from editkit.util.memory import keep_freed_memory

from avalanche.logging import TextLogger  # noqa: E402  (after editkit: torchvision next to the CPU torch)
from avalanche.training import Naive  # noqa: E402
from avalanche.training.plugins import EvaluationPlugin  # noqa: E402

NAMES = ["mnist", "digits"]


def plugin_stream(benchmark, backbone, heads, recipe: Recipe, bank: Path, generic: UnlabeledSource) -> None:
    """The stock script: Naive, the plugin line, train then evaluate each experience."""
    model = MultiHeadTaskModel(backbone, [heads[n] for n in NAMES])
    strategy = Naive(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                     criterion=torch.nn.CrossEntropyLoss(), eval_mb_size=256, device="cpu",
                     evaluator=EvaluationPlugin(loggers=[TextLogger(io.StringIO())]),
                     plugins=[TauJpPlugin(recipe, bank=bank, names=NAMES, generic=generic)])
    for t, experience in enumerate(benchmark.train_stream):
        strategy.train(experience)
        strategy.eval(benchmark.test_stream[: t + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per task")
    parser.add_argument("--train-size", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=Path("runs/plugin_cost.json"))
    args = parser.parse_args()
    keep_freed_memory()  # as editkit commands run on a CPU

    backbone = efficientnet.build(image_size=32)
    benchmark = benchmark_from_tasks([packaged_task(n, n, backbone, args.train_size, 200) for n in NAMES])
    heads = probe_heads(backbone, experiences(benchmark, NAMES), seed=0)
    recipe = Recipe(steps=args.steps)  # taujp, the offline-vision batch (32) and reg batch (4)
    crops = torch.randn(200, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with tempfile.TemporaryDirectory() as tmp:  # the two banks: only their numbers are kept
        root = Path(tmp)
        run_benchmark(benchmark, backbone, recipe, root / "editkit", names=NAMES, heads=heads,
                      generic=UnlabeledSource("generic", crops, seed=9))
        plugin_stream(benchmark, backbone, heads, recipe, root / "plugin", UnlabeledSource("generic", crops, seed=9))

        ours, theirs = Bank(root / "plugin"), Bank(root / "editkit")
        report = {"steps": args.steps, "train_size": args.train_size, "tasks": {}}
        for name in NAMES:
            plugin, loop = ours.get(name).metrics["seconds_per_step"], theirs.get(name).metrics["seconds_per_step"]
            a, b = ours.load(name), theirs.load(name)
            gap = max((a[k] - b[k]).abs().max().item() for k in a)
            report["tasks"][name] = {"editkit_s_per_step": loop, "plugin_s_per_step": plugin,
                                     "plugin_over_editkit": plugin / loop, "max_abs_tau_difference": gap}
            print(f"{name:>7}: editkit {loop:.3f} s/step, plugin {plugin:.3f} s/step "
                  f"(x{plugin / loop:.2f}), max |tau difference| {gap:.1e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"written {args.json}")


if __name__ == "__main__":
    main()

"""A scripted incremental-learning run through the Python API, on datasets of your choice.

Builds an Avalanche benchmark from three packaged datasets (any torch datasets
work the same way), then fine-tunes each with tauJp, banks the vectors and
scores the merged model after every step.

    python examples/custom_stream.py
"""

import torch

from editkit.integrations.avalanche.benchmark import benchmark_from_tasks
from editkit.models import efficientnet
from editkit.data.packaged import load_packaged
from editkit.train.recipe import Recipe
from editkit.runs.stream import run_benchmark
from editkit.data.tasks import tensor_task

backbone = efficientnet.build(image_size=32)
tasks = []
for name in ["digits", "mnist", "fashion-mnist"]:
    data = load_packaged(name)
    tasks.append(tensor_task(name, data.classes,
                             backbone.preprocess_arrays(data.train.images[:1000]), torch.from_numpy(data.train.labels[:1000]),
                             backbone.preprocess_arrays(data.test.images[:300]), torch.from_numpy(data.test.labels[:300])))

recipe = Recipe(mode="taujp", steps=40, batch_size=32, lr=1e-4, reg_batch=4, lam=0.1, scope="seen")
result = run_benchmark(benchmark_from_tasks(tasks), backbone, recipe, bank="banks/example-custom",
                       names=[t.name for t in tasks], scenario="example-custom", resume=True,
                       on_step=lambda s: print(f"after {s.task}: merged absolute {s.merged['absolute']:.3f}"))
print("final:", {k: round(v, 3) for k, v in result.final["per_task"].items()},
      "normalized", round(result.final["normalized"], 3))

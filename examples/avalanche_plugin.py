"""An ordinary Avalanche ``Naive`` script on two packaged tasks, with editkit's tauJp plugin added in one line.

The model is theta_0's EfficientNet-Lite0 with a few-shot probe head per task
(``MultiHeadTaskModel``); the plugin fine-tunes each experience as a linearized model with
the tauJp penalty, banks its task vector and adds the merged-model metrics (theta_0 + every
banked vector, alpha = 1) to the evaluator, so the text logger prints them next to
Avalanche's accuracy. Runs offline from the packaged datasets (``$EDITKIT_CACHE``).

    python examples/avalanche_plugin.py                              # 100 steps per task
    python examples/avalanche_plugin.py --steps 10 --train-size 300 --test-size 100 --mode linear
"""

import argparse
import sys

import torch
from editkit.bank.store import Bank
from editkit.core.modes import Mode
from editkit.data.packaged import packaged_task
from editkit.integrations.avalanche.benchmark import benchmark_from_tasks
from editkit.integrations.avalanche.multitask import MultiHeadTaskModel
from editkit.integrations.avalanche.plugin import TauJpPlugin
from editkit.models import efficientnet
from editkit.models.heads import probe_head

# after editkit, which makes torchvision (imported by avalanche) load next to the CPU build of torch
from avalanche.evaluation.metrics import accuracy_metrics  # noqa: E402
from avalanche.logging import TextLogger  # noqa: E402
from avalanche.training import Naive  # noqa: E402
from avalanche.training.plugins import EvaluationPlugin  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=100, help="optimizer steps per task")
parser.add_argument("--train-size", type=int, default=1000, help="train images per task")
parser.add_argument("--test-size", type=int, default=300, help="test images per task")
parser.add_argument("--mode", default="taujp", choices=[str(mode) for mode in Mode])
parser.add_argument("--bank", default=None, help="a new bank directory (default: banks/avalanche-plugin-<mode>)")
args = parser.parse_args()
bank = args.bank or f"banks/avalanche-plugin-{args.mode}"
if len(Bank(bank)):
    sys.exit(f"{bank} already holds vectors; pass another --bank")

backbone = efficientnet.build(image_size=32)
tasks = [packaged_task(name, name, backbone, args.train_size, args.test_size) for name in ["mnist", "digits"]]
benchmark = benchmark_from_tasks(tasks)

model = MultiHeadTaskModel(backbone, [probe_head(backbone, t, shots=5, seed=0) for t in tasks])
strategy = Naive(
    model=model,
    optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
    criterion=torch.nn.CrossEntropyLoss(),
    train_mb_size=32,
    eval_mb_size=256,
    evaluator=EvaluationPlugin(accuracy_metrics(experience=True, stream=True), loggers=[TextLogger(sys.stdout)]),
    plugins=[TauJpPlugin(bank=bank, names=[t.name for t in tasks], mode=args.mode, steps=args.steps)],  # the line
)
for t, experience in enumerate(benchmark.train_stream):
    strategy.train(experience)
    results = strategy.eval(benchmark.test_stream[: t + 1])
print(f"merged model (alpha = 1): absolute {results['MergedAcc_Stream/eval_phase/test_stream']:.3f}, "
      f"normalized {results['MergedNormAcc_Stream/eval_phase/test_stream']:.3f}; vectors in {bank}")

"""Which scorer a task's fixed head calls for: accuracy for classifiers, perplexity for language models."""

from __future__ import annotations

from torch import nn
from torch.utils.data import Dataset

from editkit.core.batching import Batching
from editkit.eval.accuracy import ClassificationScorer, SplitScorer
from editkit.eval.language import PerplexityScorer


def task_scorer(name: str, head: nn.Module, dataset: Dataset, batching: Batching) -> SplitScorer:
    """Perplexity for a head whose objective is language modelling, else accuracy."""
    if getattr(head, "objective", None) == "language-modeling":
        return PerplexityScorer(name, head, dataset, batching)
    return ClassificationScorer(name, head, dataset, batching)

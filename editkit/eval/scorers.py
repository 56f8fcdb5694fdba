"""Which scorer a task's fixed head calls for: accuracy for classifiers, perplexity for language models,
teacher-forced label accuracy for text-to-text tasks."""

from __future__ import annotations

from torch import nn
from torch.utils.data import Dataset

from editkit.core.batching import Batching
from editkit.eval.accuracy import ClassificationScorer, SplitScorer, TeacherForcedScorer
from editkit.eval.language import PerplexityScorer
from editkit.models.seq2seq import TEXT_TO_TEXT


def task_scorer(name: str, head: nn.Module, dataset: Dataset, batching: Batching) -> SplitScorer:
    """Perplexity for a head whose objective is language modelling, teacher-forced accuracy for a
    text-to-text head, else accuracy."""
    objective = getattr(head, "objective", None)
    if objective == "language-modeling":
        return PerplexityScorer(name, head, dataset, batching)
    if objective == TEXT_TO_TEXT:
        return TeacherForcedScorer(name, head, dataset, batching)
    return ClassificationScorer(name, head, dataset, batching)

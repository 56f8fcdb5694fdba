"""One task's data as editkit uses it: preprocessed inputs, labels, fixed splits.

Split rule (the paper's): validation = 10% of the train split (at most 5000
examples, seed 0), train = the rest; the dataset's own test split is for reporting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


class TensorTaskDataset(TensorDataset):
    """(input, label) pairs held as two tensors.

    ``inputs`` lets the tauJp regularizer take the inputs without the labels;
    ``targets`` is what Avalanche reads to build classification datasets.
    """

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__(inputs, labels.long())
        self.inputs = inputs
        self.targets = labels.long()


@dataclass(frozen=True)
class LabelledTexts:
    """One split of a text-classification dataset: ``texts[i]`` has class ``labels[i]``, an index into ``classes``
    (every split of a dataset lists the same classes, in the same order)."""

    texts: list[str]
    labels: list[int]
    classes: list[str]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise ValueError(f"{len(self.texts)} texts but {len(self.labels)} labels")


@dataclass
class TaskData:
    """A task: its name, class names and the three splits (items are (x, y))."""

    name: str
    classes: list[str]
    train: Dataset
    val: Dataset
    test: Dataset

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def validation_indices(n: int, *, fraction: float = 0.1, max_size: int = 5000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, val_idx): a seeded random 10% (<= 5000) of ``n`` train examples held out."""
    size = min(max_size, int(round(n * fraction)))
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[size:]), np.sort(order[:size])


def tensor_task(name: str, classes: list[str], train_x, train_y, test_x, test_y) -> TaskData:
    """TaskData from preprocessed tensors, carving validation out of train."""
    train_idx, val_idx = validation_indices(len(train_y))
    train_idx_t, val_idx_t = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    return TaskData(
        name=name,
        classes=list(classes),
        train=TensorTaskDataset(train_x[train_idx_t], train_y[train_idx_t]),
        val=TensorTaskDataset(train_x[val_idx_t], train_y[val_idx_t]),
        test=TensorTaskDataset(test_x, test_y),
    )

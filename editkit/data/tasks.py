"""One task's data as editkit uses it: preprocessed inputs, labels, fixed splits.

Split rule (the paper's): validation = 10% of the train split (at most 5000
examples, seed 0), train = the rest; the dataset's own test split is for reporting.

A user's data names its splits as it likes (``train`` / ``val`` / ``validation`` / ``test``...):
:func:`split_roles` maps them to editkit's, and data without a test split has one held out,
stratified and seeded (:func:`stratified_holdout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from editkit.errors import ConfigError


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


#: A user's split names -> editkit's split roles.
SPLIT_ALIASES = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val",
                 "dev": "val", "test": "test", "testing": "test"}


def split_roles(names: Iterable[str]) -> dict[str, str]:
    """A user's split names by the role they play: ``train``; ``test`` (the test split, else the validation
    split); ``val`` (the validation split, only when a test split is given too: otherwise validation is
    carved out of train). Names of no role are left out; the caller refuses data without ``train``."""
    by_role: dict[str, str] = {}
    for name in names:
        role = SPLIT_ALIASES.get(str(name).strip().lower())
        if role is not None:
            by_role.setdefault(role, name)
    if "test" not in by_role and "val" in by_role:
        by_role["test"] = by_role.pop("val")
    return by_role


def stratified_holdout(labels: Sequence[int], fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held), both sorted: of each class's ``n`` examples, ``round(fraction * n)`` held out (at least one
    when the class has two or more, never all), drawn with ``seed``. Per class, so a small class keeps its
    share on both sides; the same labels and seed always hold out the same examples."""
    if not 0 < fraction < 1:
        raise ConfigError(f"test_fraction must be between 0 and 1, got {fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    held: list[np.ndarray] = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = min(len(members) - 1, max(1, round(fraction * len(members)))) if len(members) > 1 else 0
        held.append(rng.permutation(members)[:count])
    held_idx = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    return np.setdiff1d(np.arange(len(labels)), held_idx), held_idx


def tensor_task(name: str, classes: list[str], train_x, train_y, test_x, test_y, *, val=None) -> TaskData:
    """TaskData from preprocessed tensors, carving validation out of train unless ``val`` = (inputs, labels)
    gives it."""
    if val is not None:
        return TaskData(name, list(classes), TensorTaskDataset(train_x, train_y), TensorTaskDataset(*val),
                        TensorTaskDataset(test_x, test_y))
    train_idx, val_idx = validation_indices(len(train_y))
    train_idx_t, val_idx_t = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    return TaskData(
        name=name,
        classes=list(classes),
        train=TensorTaskDataset(train_x[train_idx_t], train_y[train_idx_t]),
        val=TensorTaskDataset(train_x[val_idx_t], train_y[val_idx_t]),
        test=TensorTaskDataset(test_x, test_y),
    )

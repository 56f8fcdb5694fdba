"""Avalanche interop: editkit tasks as an Avalanche benchmark, and back.

Streams are Avalanche benchmarks, so any Avalanche benchmark can be fed to
``editkit.runs.stream`` and editkit scenarios can be used by Avalanche strategies.
Avalanche is imported here only (it takes seconds to import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset

from editkit._compat import quiet_avalanche_import
from editkit.core.batching import Batching, TensorBatching
from editkit.data.tasks import TaskData


def import_avalanche():
    """The avalanche functions editkit uses: (benchmark_from_datasets, with_task_labels, make_dataset).

    Imported on first use (seconds), or early under torchrun.
    """
    with quiet_avalanche_import():
        from avalanche.benchmarks.scenarios.dataset_scenario import benchmark_from_datasets
        from avalanche.benchmarks.scenarios.task_aware import with_task_labels
        from avalanche.benchmarks.utils.classification_dataset import _make_taskaware_classification_dataset
    return benchmark_from_datasets, with_task_labels, _make_taskaware_classification_dataset


def benchmark_from_tasks(tasks: Sequence[TaskData], batching: Batching | None = None, *,
                         class_incremental: bool = False):
    """train / valid / test streams with one experience per task; task label = index.

    ``batching`` (a backbone's; images' by default) collates the batches Avalanche's own loaders draw, so its
    strategies and plugins (Replay's buffer, A-GEM's memory) take texts of different lengths as they take images.
    ``class_incremental``: the stream as the class-incremental protocol has it: no task id (every experience's
    task label 0), each task's labels offset by the classes of the tasks before it (:func:`class_offsets`, in
    every split), and each experience told its classes (Avalanche's classes timeline, by which its
    ``IncrementalClassifier`` grows).
    """
    benchmark_from_datasets, with_task_labels, make_dataset = import_avalanche()
    collate = avalanche_collate(batching or TensorBatching())
    offsets = class_offsets(tasks)

    def wrap(split: str) -> list:
        if class_incremental:
            return [make_dataset(GlobalLabels(getattr(t, split), offset), task_labels=0, collate_fn=collate)
                    for t, offset in zip(tasks, offsets)]
        return [make_dataset(getattr(t, split), task_labels=i, collate_fn=collate) for i, t in enumerate(tasks)]

    benchmark = with_task_labels(benchmark_from_datasets(train=wrap("train"), valid=wrap("val"), test=wrap("test")))
    if not class_incremental:
        return benchmark
    with quiet_avalanche_import():
        from avalanche.benchmarks.scenarios.supervised import with_classes_timeline
    return with_classes_timeline(benchmark)


def class_offsets(tasks: Sequence[TaskData]) -> list[int]:
    """Each task's first global label: the classes of the tasks before it in stream order."""
    return [sum(t.num_classes for t in tasks[:i]) for i in range(len(tasks))]


class GlobalLabels(Dataset):
    """A task's split with its labels made global: each item ``(input, label + offset)``; ``targets`` (what
    Avalanche reads a classification dataset's classes from) offset alike."""

    def __init__(self, dataset: Dataset, offset: int) -> None:
        self.dataset = dataset
        self.offset = offset
        self.targets = [int(y) + offset for y in dataset.targets]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        x, y = self.dataset[index]
        return x, int(y) + self.offset


def avalanche_collate(batching: Batching) -> Callable[[Sequence[tuple[Any, Any, int]]], list[Any]]:
    """Avalanche's minibatch ``[inputs, labels, task labels]`` from its ``(x, y, t)`` items, the inputs and labels
    collated by ``batching``."""
    def collate(items: Sequence[tuple[Any, Any, int]]) -> list[Any]:
        return [batching.collate([item[0] for item in items]), batching.collate_labels([item[1] for item in items]),
                torch.as_tensor([int(item[-1]) for item in items])]
    return collate


@dataclass
class Experience:
    """What the stream runner needs from one Avalanche experience."""

    index: int
    name: str
    task_label: int
    train: Dataset
    test: Dataset
    val: Dataset | None
    num_classes: int


def experiences(benchmark, names: Sequence[str] | None = None) -> list[Experience]:
    """Read a benchmark's train/test (and valid, if any) streams into ``Experience`` records."""
    train, test = list(benchmark.train_stream), list(benchmark.test_stream)
    if len(train) != len(test):
        raise ValueError(f"train_stream has {len(train)} experiences but test_stream has {len(test)}")
    valid = list(getattr(benchmark, "valid_stream", [])) or [None] * len(train)
    names = list(names) if names is not None else [f"task{i}" for i in range(len(train))]
    out = []
    for i, (tr, te, va) in enumerate(zip(train, test, valid)):
        targets = list(tr.dataset.targets) + list(te.dataset.targets)
        out.append(
            Experience(
                index=i,
                name=names[i],
                task_label=getattr(tr, "task_label", i),
                train=tr.dataset,
                test=te.dataset,
                val=va.dataset if va is not None else None,
                num_classes=int(max(targets)) + 1,
            )
        )
    return out


def task_experiences(tasks: Sequence[TaskData]) -> list[Experience]:
    """The stream of ``tasks`` in order (task label = index), read from editkit's own task data.

    What :func:`benchmark_from_tasks` followed by :func:`experiences` gives, without wrapping
    every split in an Avalanche classification dataset: language-modelling tasks have no
    classes to wrap, and the wrapper's per-item cost would slow image loaders.
    """
    return [Experience(index=i, name=t.name, task_label=i, train=t.train, test=t.test, val=t.val,
                       num_classes=t.num_classes) for i, t in enumerate(tasks)]

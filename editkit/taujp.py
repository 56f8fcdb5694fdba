"""The tauJp regularizer: keep a task vector silent on other tasks' inputs.

penalty(tau) = mean over unlabeled x_o of || J_theta0 f(x_o) . tau ||  (backbone features)

Sources are *unlabeled* views of other tasks' train splits: ``UnlabeledSource``
holds an inputs tensor only, so the penalty path has no way to read a label.
Schedules (paper Eq. 10/11): ``cyclic`` draws one batch from source
``step % n_sources`` per step; ``strict`` draws one batch from every source and
averages their penalties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.utils.data import Dataset


class UnlabeledSource:
    """Inputs of one source, sampled in seeded random order without replacement."""

    def __init__(self, name: str, inputs: torch.Tensor, *, seed: int = 0) -> None:
        if len(inputs) == 0:
            raise ValueError(f"unlabeled source {name!r} is empty")
        self.name = name
        self.inputs = inputs
        self._generator = torch.Generator().manual_seed(seed)
        self._order: list[int] = []

    @classmethod
    def from_dataset(cls, name: str, dataset: Dataset, *, seed: int = 0) -> "UnlabeledSource":
        """Keep only the inputs of a labelled dataset (element 0 of each item)."""
        inputs = getattr(dataset, "inputs", None)
        if inputs is None:
            inputs = torch.stack([dataset[i][0] for i in range(len(dataset))])
        return cls(name, inputs, seed=seed)

    def __len__(self) -> int:
        return len(self.inputs)

    def next_batch(self, size: int) -> torch.Tensor:
        index = []
        while len(index) < size:
            if not self._order:
                self._order = torch.randperm(len(self.inputs), generator=self._generator).tolist()
            index.append(self._order.pop())
        return self.inputs[index]


def penalty(tangent: torch.Tensor, *, squared: bool = False) -> torch.Tensor:
    """Mean over the batch of the per-example L2 norm (or squared norm) of J.tau."""
    norms = torch.linalg.vector_norm(tangent.flatten(1), dim=1)
    return (norms.square() if squared else norms).mean()


@dataclass
class Regularizer:
    """Which unlabeled batches to penalise at each step, and how to score them."""

    sources: Sequence[UnlabeledSource]
    lam: float = 0.1
    schedule: str = "cyclic"
    batch_size: int = 4
    squared: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in ("cyclic", "strict"):
            raise ValueError(f"unknown schedule {self.schedule!r}")

    @property
    def active(self) -> bool:
        return self.lam > 0 and len(self.sources) > 0

    def batches(self, step: int) -> list[torch.Tensor]:
        """The reg batches of one step (empty when inactive)."""
        if not self.active:
            return []
        if self.schedule == "cyclic":
            return [self.sources[step % len(self.sources)].next_batch(self.batch_size)]
        return [source.next_batch(self.batch_size) for source in self.sources]

    def loss(self, tangents: Sequence[torch.Tensor]) -> torch.Tensor:
        """lam * mean over the step's sources of their penalties."""
        values = [penalty(t, squared=self.squared) for t in tangents]
        return self.lam * torch.stack(values).mean()


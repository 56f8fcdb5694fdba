"""How examples become one batch and one batch becomes the module's arguments, per modality.

Training and evaluation never assume images: they collate, concatenate, call and
split through a :class:`Batching` that the backbone carries
(:attr:`editkit.models.backbone.Backbone.batching`). The protocol lives here, below
both ``train`` and ``models``, because the train loop runs it and may not import
the models layer.

- :class:`TensorBatching` (images, any fixed-shape input): a batch is one tensor;
  this is exactly what the loop did before the protocol existed (``default_collate``,
  ``torch.cat``, ``torch.split``), so image runs bank the same vectors.
- :class:`SequenceBatching` (token sequences of different lengths): a batch is a
  :class:`SequenceBatch` of right-padded ``input_ids`` plus ``attention_mask``; the
  mask is passed to the module as a keyword argument and, for backbones whose
  outputs are per token, tells the tauJp penalty which positions are padding.

A batch of either kind has ``len`` (examples) and ``.to(device, non_blocking=...)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch.utils.data import default_collate


class Batching(Protocol):
    """What the train loop and the scorers need to know about a backbone's inputs."""

    def collate(self, items: Sequence[Any]) -> Any:
        """One batch from the inputs of single examples (what a dataset returns as element 0)."""

    def concat(self, task_batch: Any, reg_batches: Sequence[Any]) -> Any:
        """The task batch followed by the reg batches, as one batch (one jvp serves all of them)."""

    def split(self, output: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Undo :meth:`concat` on a module output (or on a mask): pieces of ``sizes`` examples, in order."""

    def output_mask(self, batch: Any) -> torch.Tensor | None:
        """Which output positions are real, shaped like the output's leading dimensions; None when all are."""

    def arguments(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` that call the module on ``batch``: ``module(*args, **kwargs)``."""


class TensorBatching:
    """Fixed-shape inputs (images): a batch is a tensor whose first dimension is the example."""

    def collate(self, items: Sequence[torch.Tensor]) -> torch.Tensor:
        return default_collate(list(items))  # stacks into shared memory inside DataLoader workers

    def concat(self, task_batch: torch.Tensor, reg_batches: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([task_batch, *reg_batches])

    def split(self, output: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        return list(torch.split(output, list(sizes)))

    def output_mask(self, batch: torch.Tensor) -> None:
        return None

    def arguments(self, batch: torch.Tensor) -> tuple[tuple[torch.Tensor], dict[str, Any]]:
        return (batch,), {}


@dataclass
class SequenceBatch:
    """Right-padded token ids ``(N, T)`` and their attention mask ``(N, T)`` (1 = token, 0 = padding)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: Any) -> "SequenceBatch":
        """Examples at ``index`` (slice, list or tensor of indices): how sources and chunked loops select rows."""
        return SequenceBatch(self.input_ids[index], self.attention_mask[index])

    def to(self, *args: Any, **kwargs: Any) -> "SequenceBatch":
        return SequenceBatch(self.input_ids.to(*args, **kwargs), self.attention_mask.to(*args, **kwargs))

    def pin_memory(self) -> "SequenceBatch":
        """Called by a DataLoader with ``pin_memory=True``."""
        return SequenceBatch(self.input_ids.pin_memory(), self.attention_mask.pin_memory())


class SequenceBatching:
    """Token sequences of any length, padded on the right with ``pad_id`` to the longest in the batch.

    per_token: the module returns one output per position ``(N, T, ...)`` (a language
        model's hidden states), so padded positions must be masked out of the penalty;
        False when the module pools over real tokens itself and returns ``(N, D)``.
    """

    def __init__(self, pad_id: int = 0, *, per_token: bool = False) -> None:
        self.pad_id = pad_id
        self.per_token = per_token

    def collate(self, items: Sequence[torch.Tensor]) -> SequenceBatch:
        """Items are 1-d token id tensors of any lengths."""
        length = max(len(ids) for ids in items)
        input_ids = torch.full((len(items), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, ids in enumerate(items):
            input_ids[row, : len(ids)] = torch.as_tensor(ids)
            attention_mask[row, : len(ids)] = 1
        return SequenceBatch(input_ids, attention_mask)

    def concat(self, task_batch: SequenceBatch, reg_batches: Sequence[SequenceBatch]) -> SequenceBatch:
        batches = [task_batch, *reg_batches]
        length = max(b.input_ids.shape[1] for b in batches)
        return SequenceBatch(torch.cat([self._pad(b.input_ids, length, self.pad_id) for b in batches]),
                             torch.cat([self._pad(b.attention_mask, length, 0) for b in batches]))

    @staticmethod
    def _pad(rows: torch.Tensor, length: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(rows, (0, length - rows.shape[1]), value=value)

    # along examples only, as for tensors: pieces keep the common length (their masks say where padding is)
    split = TensorBatching.split

    def output_mask(self, batch: SequenceBatch) -> torch.Tensor | None:
        return batch.attention_mask.bool() if self.per_token else None

    def arguments(self, batch: SequenceBatch) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
        return (batch.input_ids,), {"attention_mask": batch.attention_mask}


def labelled_collate(batching: Batching) -> functools.partial:
    """A DataLoader ``collate_fn`` for ``(input, label, ...)`` items: ``(batching.collate(inputs), labels)``.

    Extra item fields (task labels) are dropped. A partial of a module-level function,
    so DataLoader workers can pickle it.
    """
    return functools.partial(_collate_labelled, batching)


def _collate_labelled(batching: Batching, items: Sequence[Sequence[Any]]) -> tuple[Any, torch.Tensor]:
    return batching.collate([item[0] for item in items]), default_collate([item[1] for item in items])

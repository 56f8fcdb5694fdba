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
  :class:`SequenceBatch` of right-padded ``inputs`` (token ids, or the hidden states
  a frozen prefix of a language model computed) plus ``attention_mask``; the mask is
  passed to the module as a keyword argument and, for backbones whose outputs are per
  token, tells the tauJp penalty which positions are padding. Labels that are
  sequences too (a language model's next tokens) are padded with ``IGNORE_INDEX``.
- :class:`Seq2SeqBatching` (encoder-decoder models): a batch is a :class:`Seq2SeqBatch`
  of right-padded encoder ids and decoder input ids, each with its mask. An example's
  input is the pair (encoder ids, decoder input ids): with teacher forcing the decoder
  reads the label shifted right, and an unlabeled example (a tauJp source) reads the
  start token alone. Outputs are one row of logits per decoder position, so the
  decoder mask is the output mask.

A batch of either kind has ``len`` (examples) and ``.to(device, non_blocking=...)``.
"""

from __future__ import annotations

import dataclasses
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

    def collate_labels(self, labels: Sequence[Any]) -> torch.Tensor:
        """One tensor from the labels of single examples (class ids; or token ids of different lengths)."""

    def worth_concatenating(self, batches: Sequence[Any]) -> bool:
        """Whether one call over the batches concatenated costs less than one call each."""


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

    def collate_labels(self, labels: Sequence[Any]) -> torch.Tensor:
        return default_collate(list(labels))

    def worth_concatenating(self, batches: Sequence[torch.Tensor]) -> bool:
        """Always: fixed-shape examples add no padding, and one call saves a pass of per-call overhead."""
        return True


#: The label of a padded position: ``torch.nn.functional.cross_entropy`` skips it.
IGNORE_INDEX = -100


@dataclass
class SequenceBatch:
    """Right-padded inputs ``(N, T, ...)`` and their attention mask ``(N, T)`` (1 = real position, 0 = padding).

    inputs: token ids ``(N, T)``, or per-position features ``(N, T, D)`` (the cached
        hidden states of a language model's frozen prefix).
    """

    inputs: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: Any) -> "SequenceBatch":
        """Examples at ``index`` (slice, list or tensor of indices): how sources and chunked loops select rows."""
        return SequenceBatch(self.inputs[index], self.attention_mask[index])

    def to(self, *args: Any, **kwargs: Any) -> "SequenceBatch":
        return SequenceBatch(self.inputs.to(*args, **kwargs), self.attention_mask.to(*args, **kwargs))

    def pin_memory(self) -> "SequenceBatch":
        """Called by a DataLoader with ``pin_memory=True``."""
        return SequenceBatch(self.inputs.pin_memory(), self.attention_mask.pin_memory())


#: How many times the positions of separate calls one concatenated call of sequence batches may compute.
CONCAT_SLACK = 1.25


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
        """Items are ``(T_i, ...)`` tensors (token ids, or per-position features) of any lengths ``T_i``.

        Token ids are padded with ``pad_id``, features with zeros."""
        first = torch.as_tensor(items[0])
        pad = self.pad_id if not first.is_floating_point() else 0
        inputs = _pad_rows(items, pad, first.dtype)
        attention_mask = torch.zeros(inputs.shape[:2], dtype=torch.long)
        for row, item in enumerate(items):
            attention_mask[row, : len(item)] = 1
        return SequenceBatch(inputs, attention_mask)

    def collate_labels(self, labels: Sequence[Any]) -> torch.Tensor:
        """Token-id label sequences padded with ``IGNORE_INDEX``; class ids stacked as for tensors."""
        if torch.as_tensor(labels[0]).dim() == 0:
            return default_collate(list(labels))
        return _pad_rows(labels, IGNORE_INDEX, torch.long)

    def concat(self, task_batch: SequenceBatch, reg_batches: Sequence[SequenceBatch]) -> SequenceBatch:
        batches = [task_batch, *reg_batches]
        length = max(b.inputs.shape[1] for b in batches)
        pad = self.pad_id if not task_batch.inputs.is_floating_point() else 0
        return SequenceBatch(torch.cat([_pad_positions(b.inputs, length, pad) for b in batches]),
                             torch.cat([_pad_positions(b.attention_mask, length, 0) for b in batches]))

    # along examples only, as for tensors: pieces keep the common length (their masks say where padding is)
    split = TensorBatching.split

    def worth_concatenating(self, batches: Sequence[SequenceBatch]) -> bool:
        """Whether padding every batch to the longest one adds at most :data:`CONCAT_SLACK` of the positions
        computed: a batch of short reviews concatenated with reg batches of long news sentences would
        otherwise run mostly padding through every block."""
        lengths = [b.inputs.shape[1] for b in batches]
        apart = sum(len(b) * t for b, t in zip(batches, lengths))
        return sum(len(b) for b in batches) * max(lengths) <= CONCAT_SLACK * apart

    def output_mask(self, batch: SequenceBatch) -> torch.Tensor | None:
        return batch.attention_mask.bool() if self.per_token else None

    def arguments(self, batch: SequenceBatch) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
        return (batch.inputs,), {"attention_mask": batch.attention_mask}


@dataclass
class Seq2SeqBatch:
    """Right-padded encoder ids ``(N, S)`` and decoder input ids ``(N, L)``, each with its mask (1 = real)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    decoder_input_ids: torch.Tensor
    decoder_attention_mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)

    def _map(self, fn: Any) -> "Seq2SeqBatch":
        return Seq2SeqBatch(*(fn(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def __getitem__(self, index: Any) -> "Seq2SeqBatch":
        return self._map(lambda t: t[index])

    def to(self, *args: Any, **kwargs: Any) -> "Seq2SeqBatch":
        return self._map(lambda t: t.to(*args, **kwargs))

    def pin_memory(self) -> "Seq2SeqBatch":
        return self._map(torch.Tensor.pin_memory)


class Seq2SeqBatching:
    """Inputs ``(encoder ids, decoder input ids)`` of an encoder-decoder model, both padded with ``pad_id``.

    The module is called with the four tensors as keyword arguments and returns logits
    ``(N, L, V)``, one row per decoder position; padded decoder positions are masked out
    of the tauJp penalty (:meth:`output_mask`) and labelled ``IGNORE_INDEX``.
    """

    def __init__(self, pad_id: int = 0) -> None:
        self.pad_id = pad_id

    def collate(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Seq2SeqBatch:
        encoder, decoder = zip(*items)
        return Seq2SeqBatch(_pad_rows(encoder, self.pad_id, torch.long), _real(encoder),
                            _pad_rows(decoder, self.pad_id, torch.long), _real(decoder))

    def collate_labels(self, labels: Sequence[Any]) -> torch.Tensor:
        """Label token ids padded with ``IGNORE_INDEX``."""
        return _pad_rows(labels, IGNORE_INDEX, torch.long)

    def concat(self, task_batch: Seq2SeqBatch, reg_batches: Sequence[Seq2SeqBatch]) -> Seq2SeqBatch:
        batches = [task_batch, *reg_batches]
        columns = []
        for f in dataclasses.fields(Seq2SeqBatch):
            rows = [getattr(b, f.name) for b in batches]
            length = max(r.shape[1] for r in rows)
            pad = self.pad_id if f.name.endswith("input_ids") else 0
            columns.append(torch.cat([_pad_positions(r, length, pad) for r in rows]))
        return Seq2SeqBatch(*columns)

    split = TensorBatching.split
    # One call: the reg rows' decoder input is a single token, and the prompts' lengths are alike.
    worth_concatenating = TensorBatching.worth_concatenating

    def output_mask(self, batch: Seq2SeqBatch) -> torch.Tensor:
        return batch.decoder_attention_mask.bool()

    def arguments(self, batch: Seq2SeqBatch) -> tuple[tuple[()], dict[str, torch.Tensor]]:
        return (), {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def _real(items: Sequence[Any]) -> torch.Tensor:
    """The ``(N, max T_i)`` mask of right-padded rows of lengths ``T_i``."""
    lengths = torch.tensor([len(item) for item in items])
    return (torch.arange(int(lengths.max())) < lengths[:, None]).long()


def _pad_rows(items: Sequence[Any], value: float, dtype: torch.dtype) -> torch.Tensor:
    """``(N, max T_i, ...)`` from ``(T_i, ...)`` items, right-padded with ``value``."""
    rows = [torch.as_tensor(item, dtype=dtype) for item in items]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def _pad_positions(rows: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """``rows`` ``(N, T, ...)`` right-padded along T to ``length``."""
    if rows.shape[1] == length:
        return rows
    pad = rows.new_full((rows.shape[0], length - rows.shape[1], *rows.shape[2:]), value)
    return torch.cat([rows, pad], dim=1)


def labelled_collate(batching: Batching) -> functools.partial:
    """A DataLoader ``collate_fn`` for ``(input, label, ...)`` items: ``(batching.collate(inputs), labels)``.

    Extra item fields (task labels) are dropped. A partial of a module-level function,
    so DataLoader workers can pickle it.
    """
    return functools.partial(_collate_labelled, batching)


def _collate_labelled(batching: Batching, items: Sequence[Sequence[Any]]) -> tuple[Any, torch.Tensor]:
    return batching.collate([item[0] for item in items]), batching.collate_labels([item[1] for item in items])

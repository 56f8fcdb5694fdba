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
  token, tells the tauJp penalty which positions are padding. On a CPU a batch runs
  as a few calls over rows of similar lengths (:func:`length_bands`), so padding costs
  little arithmetic. Labels that are sequences too (a language model's next tokens)
  are padded with ``IGNORE_INDEX``.
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
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

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

    def run(self, fn: Callable[..., Any], batch: Any) -> Any:
        """``fn`` called on the batch's :meth:`arguments`: its output (a tensor, or a tuple of tensors), row for row
        what one call over the whole batch gives. A batching may compute it in several calls over groups of
        rows when that is cheaper (sequences of very different lengths)."""


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

    def run(self, fn: Callable[..., Any], batch: Any) -> Any:
        """One call: fixed-shape examples add no padding."""
        return call_on(self, fn, batch)


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

    def lengths(self) -> torch.Tensor:
        """Real positions per row ``(N,)``."""
        return self.attention_mask.sum(dim=1)

    def trimmed(self) -> "SequenceBatch":
        """The batch without the trailing positions that are padding in every row."""
        length = int(self.lengths().max())
        return SequenceBatch(self.inputs[:, :length], self.attention_mask[:, :length])


#: What one more call of the module costs on a CPU, in padded positions: a batch of sequences is split into
#: calls over rows of similar lengths only where that saves more positions than the calls add. A call has a
#: fixed cost of weight-sized memory traffic (tau = theta - theta_0, the jvp reading theta_0 and tau, the
#: backward writing gradients); measured on MiniLM's last 3 blocks it is that of ~50 positions in a training
#: step (jvp and backward) and ~90 in evaluation (jvp alone).
CALL_COST = 64


def length_bands(lengths: torch.Tensor, call_cost: float = CALL_COST) -> list[torch.Tensor]:
    """Row indices in groups ("bands") of similar lengths that minimise the cost of one call per band:
    sum over bands of (rows x the band's longest length + ``call_cost``).

    Rows are sorted longest first; an optimal split into bands is then contiguous in that order,
    found exactly by dynamic programming over the cut points (quadratic in the rows of one batch).
    """
    order = torch.argsort(lengths, descending=True, stable=True)
    ordered = lengths[order].tolist()
    if ordered[0] == ordered[-1]:  # no padding to save (a language model's packed blocks): skip the search
        return [order]
    n = len(ordered)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):  # the band ordered[start:end], padded to ordered[start]
            cost = best[start] + (end - start) * ordered[start] + call_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    bands, end = [], n
    while end > 0:
        bands.append(order[cut[end] : end])
        end = cut[end]
    return bands[::-1]


class SequenceBatching:
    """Token sequences of any length, padded on the right with ``pad_id`` to the longest in the batch.

    per_token: the module returns one output per position ``(N, T, ...)`` (a language
        model's hidden states), so padded positions must be masked out of the penalty;
        False when the module pools over real tokens itself and returns ``(N, D)``.
    packs: the module packs the sequences of a padded batch itself (padding costs it
        nothing), so :meth:`run` makes one call.
    """

    def __init__(self, pad_id: int = 0, *, per_token: bool = False, packs: bool = False) -> None:
        self.pad_id = pad_id
        self.per_token = per_token
        self.packs = packs

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

    def run(self, fn: Callable[..., Any], batch: SequenceBatch) -> Any:
        """On a CPU, one call per band of rows of similar lengths (:func:`length_bands`), each trimmed to its
        longest row, and the outputs put back in the batch's row order (per-token outputs padded with zeros
        to the batch's length). Every row's output is the same as in one call (rows never interact; padding
        is masked), but short reviews batched with long news sentences no longer run mostly padding through
        every block. On a GPU one call: padded positions cost little there next to a call."""
        bands = length_bands(batch.lengths()) if batch.inputs.device.type == "cpu" and not self.packs else []
        if len(bands) <= 1:
            return call_on(self, fn, batch)
        pieces = [call_on(self, fn, batch[rows].trimmed()) for rows in bands]
        order = torch.cat(bands)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        length = batch.inputs.shape[1] if self.per_token else None
        if isinstance(pieces[0], tuple):
            return tuple(_rejoin([p[i] for p in pieces], inverse, length) for i in range(len(pieces[0])))
        return _rejoin(pieces, inverse, length)

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
    run = TensorBatching.run

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


def call_on(batching: Batching, fn: Callable[..., Any], batch: Any) -> Any:
    """``fn`` called once on the batch's arguments."""
    args, kwargs = batching.arguments(batch)
    return fn(*args, **kwargs)


def _rejoin(pieces: Sequence[torch.Tensor], inverse: torch.Tensor, length: int | None) -> torch.Tensor:
    """Outputs of bands of rows as one tensor in the batch's row order (``inverse``: each row's place in the
    bands' concatenation); per-token pieces (``length`` given) are first padded with zeros to ``length``."""
    if length is not None:
        pieces = [_pad_positions(p, length, 0) for p in pieces]
    return torch.cat(list(pieces))[inverse.to(pieces[0].device)]


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

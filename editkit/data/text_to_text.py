"""Text-to-text task data for a sequence-to-sequence backbone (:mod:`editkit.models.seq2seq`).

A classification dataset becomes text-to-text by writing each example as a prompt and
its class as a target text (class ``c`` -> ``targets[c]``, e.g. "acceptable"). Both are
tokenized once, with the backbone's tokenizer, when the task is built.

An item is ``((encoder ids, decoder input ids), label ids)``: the decoder input is the
label shifted right behind the start token (teacher forcing), so the batching can build
the model's four inputs from the item's input alone. :meth:`TextToTextExamples.input`
is the unlabeled view a tauJp source reads: the encoder ids and the start token only, so
the penalty never sees a label, not even shifted into the decoder input.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch.utils.data import Dataset

from editkit.data.tasks import TaskData
from editkit.data.text import tokenize

#: editkit's splits, in the order a task holds them.
SPLITS = ("train", "val", "test")


class TextToTextExamples(Dataset):
    """Tokenized prompts and their targets; ``targets`` holds each example's class id (what Avalanche reads)."""

    def __init__(self, encoder_ids: Sequence[torch.Tensor], classes: Sequence[int],
                 class_labels: Sequence[torch.Tensor], backbone: Any) -> None:
        if len(encoder_ids) != len(classes):
            raise ValueError(f"{len(encoder_ids)} prompts but {len(classes)} classes")
        self.encoder_ids = list(encoder_ids)
        self.targets = torch.as_tensor(list(classes), dtype=torch.long)
        self._labels = list(class_labels)
        self._decoder = [backbone.teacher_forcing(label) for label in self._labels]
        self._start = backbone.first_step()

    def __len__(self) -> int:
        return len(self.encoder_ids)

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        c = int(self.targets[index])
        return (self.encoder_ids[index], self._decoder[c]), self._labels[c]

    def input(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Example ``index`` unlabeled: its prompt and the decoder's start token."""
        return self.encoder_ids[index], self._start


def text_to_text_task(name: str, targets: Sequence[str], backbone: Any,
                      splits: Mapping[str, tuple[Sequence[str], Sequence[int]]], *,
                      max_length: int | None = None) -> TaskData:
    """A :class:`TaskData` from ``splits`` = {split: (prompts, class ids)}, class ``c`` written as ``targets[c]``;
    prompts are cut to ``max_length`` tokens (None: kept whole), targets never."""
    labels = tokenize(backbone.tokenizer, targets)
    data = {split: TextToTextExamples(tokenize(backbone.tokenizer, splits[split][0], max_length), splits[split][1], labels,
                                      backbone) for split in SPLITS}
    return TaskData(name, list(targets), data["train"], data["val"], data["test"])

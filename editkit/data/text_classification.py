"""Text classification as a text encoder reads it: labelled texts -> (prefix hidden states, class id).

Registered here:

- task source ``labelled-text`` (``source = "labelled-text:<dataset>"``): one split of a dataset of
  ``LABELLED_TEXTS`` per split of the task, each text tokenized by the backbone's tokenizer (with its
  special tokens, cut at ``max_length``) and read by the frozen prefix once
  (:class:`~editkit.data.text.TokenSequences`). ``train_size`` / ``eval_size`` (and ``val_size``, the
  validation split alone) keep a seeded random subset, every class in proportion, so a run's cost does
  not grow with the dataset;
- generic source ``text-sentences`` (``[generic] kind = "text-sentences"``): the sentences of a text
  corpus's train split as unlabeled inputs for the tauJp penalty (the role natural-image crops play for
  images). Sentences, not whole articles: a news article cut at ``max_length`` tokens would be its
  first lines only, and task texts are a sentence or a paragraph long.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import torch

from editkit.core.registry import Record
from editkit.core.taujp import LazyUnlabeledSource
from editkit.data import GENERIC_SOURCES, LABELLED_TEXTS, TASK_SOURCES
from editkit.data.tasks import LabelledTexts, TaskData
from editkit.data.text import (SPLITS, TokenSequences, corpus_split, generic_check, require_prefix, sentences,
                               tokenize)
from editkit.errors import ConfigError

#: Sentences shorter than this many words carry little text (headings, "Yes.").
MIN_WORDS = 4


def stratified_choice(labels: Sequence[int], size: int | None, seed: int) -> list[int]:
    """Indices of at most ``size`` examples drawn with ``seed``, each class keeping its share (rounded, at least
    one example of every class present), in their original order. ``None`` keeps everything."""
    if size is None or size >= len(labels):
        return list(range(len(labels)))
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    rng = random.Random(seed)
    chosen: list[int] = []
    for label in sorted(by_class):
        members = by_class[label]
        quota = max(1, round(size * len(members) / len(labels)))
        chosen += rng.sample(members, min(quota, len(members)))
    return sorted(chosen)


def stratified_subset(data: LabelledTexts, size: int | None, seed: int) -> LabelledTexts:
    """:func:`stratified_choice` of a split's examples."""
    if size is None or size >= len(data.texts):
        return data
    chosen = stratified_choice(data.labels, size, seed)
    return LabelledTexts([data.texts[i] for i in chosen], [data.labels[i] for i in chosen], data.classes)


def labelled_split(dataset: str, split: str, seed: int = 0) -> LabelledTexts:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}: expected {', '.join(SPLITS)}")
    return LABELLED_TEXTS[dataset].build(split, seed=seed)


def labelled_task(name: str, splits: Mapping[str, LabelledTexts], backbone: Any, max_length: int = 64,
                  sizes: Mapping[str, int | None] | None = None) -> TaskData:
    """The task of ``splits`` (``train`` / ``val`` / ``test``): each split cut to its size (classes in proportion,
    seed 0), tokenized by the backbone's tokenizer and read by its frozen prefix when first used."""
    require_prefix(backbone)
    built, classes = {}, []
    for split in SPLITS:
        data = stratified_subset(splits[split], (sizes or {}).get(split), seed=0)
        if not data.texts:
            raise ConfigError(f"task {name!r}: its {split} split is empty")
        classes = data.classes
        ids = tokenize(backbone.tokenizer, data.texts, max_length)
        built[split] = TokenSequences(ids, backbone, labels=torch.tensor(data.labels, dtype=torch.long),
                                      texts=data.texts, max_length=max_length)
    return TaskData(name, list(classes), built["train"], built["val"], built["test"])


def eval_sizes(train_size: int | None, eval_size: int | None, val_size: int | None) -> dict[str, int | None]:
    """Each split's size limit from the ``train_size`` / ``eval_size`` / ``val_size`` options."""
    return {"train": train_size, "val": val_size if val_size is not None else eval_size, "test": eval_size}


def _task_source(name: str, dataset: str, backbone: Any, max_length: int = 64, train_size: int | None = None,
                 eval_size: int | None = None, val_size: int | None = None) -> TaskData:
    require_prefix(backbone)
    splits = {split: labelled_split(dataset, split) for split in SPLITS}
    return labelled_task(name, splits, backbone, max_length, eval_sizes(train_size, eval_size, val_size))


def _task_check(name: str, dataset: str, max_length: int = 64, train_size: int | None = None,
                eval_size: int | None = None, val_size: int | None = None) -> list[str]:
    check = LABELLED_TEXTS[dataset].check
    return check() if check is not None else []


def _generic_source(backbone: Any, seed: int, corpus: str = "", max_length: int = 64,
                    size: int | None = None) -> LazyUnlabeledSource:
    require_prefix(backbone)
    found = [s for text in corpus_split(corpus, "train", seed) for s in sentences(text) if len(s.split()) >= MIN_WORDS]
    if size is not None and size < len(found):
        found = random.Random(seed).sample(found, size)
    if not found:
        raise ConfigError(f"the corpus {corpus!r} has no sentence of {MIN_WORDS} words or more in its train split")
    data = TokenSequences(tokenize(backbone.tokenizer, found, max_length), backbone)
    return LazyUnlabeledSource(f"{corpus} sentences", data, seed=seed, collate=backbone.batching.collate)


#: The labelled-text options' help, shared by every source of labelled texts (a user's tables too).
SIZE_HELP = {
    "max_length": "tokens per text (special tokens included); longer texts are cut",
    "train_size": "at most this many train examples, classes in proportion (default: all)",
    "eval_size": "at most this many validation / test examples each, classes in proportion (default: all)",
    "val_size": "at most this many validation examples (default: eval_size); what the bench tunes coefficients "
                "on, and a non-linear sweep runs the model over it once per grid point"}
TASK_SOURCES.register("labelled-text", Record.of(_task_source, check=_task_check, help=SIZE_HELP))
GENERIC_SOURCES.register("text-sentences", Record.of(_generic_source, check=generic_check, help={
    "corpus": "the text corpus whose train split's sentences are the source",
    "max_length": "tokens per sentence (special tokens included)",
    "size": "at most this many sentences, drawn with the seed (default: all)"}))

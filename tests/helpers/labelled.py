"""The tiny text-classification scenario of the text tests: a random two-block BERT with a word-level tokenizer
saved as a checkpoint directory, two labelled-text datasets and a news corpus registered for the duration of a
block, so the whole text path (prefix states, probe heads, tauJp, bank, exports) runs in seconds."""

from __future__ import annotations

import contextlib
from pathlib import Path

from editkit.core.registry import Record
from editkit.data import LABELLED_TEXTS
from editkit.data.tasks import LabelledTexts
from helpers import models
from helpers.scenarios import write_toml
from helpers.text import registered_corpora

GOOD, BAD = ["a fine warm film", "great fun and heart", "lovely and clever work"], ["a dull tired mess", "boring and flat", "weak plot and bad acting"]
SPORT, MONEY = ["the team won the match", "a late goal for the side"], ["the bank raised its rates", "stocks fell on monday"]
DATASETS = {
    "tiny-sentiment": {split: LabelledTexts(GOOD + BAD, [1, 1, 1, 0, 0, 0], ["bad", "good"]) for split in ("train", "val", "test")},
    "tiny-topic": {split: LabelledTexts(SPORT + MONEY, [0, 0, 1, 1], ["sport", "money"]) for split in ("train", "val", "test")},
}
NEWS = {"train": ["The council met on Monday. It discussed the budget for the year. Rain is expected later."],
        "val": ["A museum opened."], "test": ["A bridge opened."]}


@contextlib.contextmanager
def registered_datasets():
    """:data:`DATASETS` as labelled-text datasets and :data:`NEWS` as the corpus ``tiny-news``, inside the block."""
    for name, splits in DATASETS.items():
        LABELLED_TEXTS.register(name, Record.of(lambda split, seed=0, splits=splits: splits[split]))
    try:
        with registered_corpora({"tiny-news": NEWS}):
            yield
    finally:
        for name in DATASETS:
            LABELLED_TEXTS.unregister(name)


def word_tokenizer(directory: Path):
    """A BERT WordPiece tokenizer whose vocabulary is the special tokens and every word of the test's texts."""
    from transformers import BertTokenizerFast

    texts = [t for splits in DATASETS.values() for t in splits["train"].texts] + NEWS["train"]
    words = sorted({w for t in texts for w in t.lower().replace(".", " .").split()})
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def scenario_file(root: Path) -> Path:
    """``root/tiny-text.toml``: the tiny BERT saved in ``root/tiny-bert``, tasks ``sentiment`` and ``topic``."""
    model_dir = root / "tiny-bert"
    model_dir.mkdir()
    tokenizer = word_tokenizer(root)
    models.bert(vocab_size=len(tokenizer), num_hidden_layers=2, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return write_toml({"name": "tiny-text",
                       "backbone": {"family": "text-encoder", "model": str(model_dir), "trainable_blocks": 1},
                       "heads": {"kind": "probe", "shots": 2}, "data": {"max_length": 12},
                       "generic": {"kind": "text-sentences", "corpus": "tiny-news"},
                       "recipe": {"mode": "taujp", "steps": 4, "batch_size": 4, "lr": 1e-2, "reg_batch": 2},
                       "tasks": [{"name": "sentiment", "source": "labelled-text:tiny-sentiment"},
                                 {"name": "topic", "source": "labelled-text:tiny-topic"}]},
                      root / "tiny-text.toml")

"""Labelled texts as a text encoder reads them: subsets, tokens, prefix states, the generic sentences."""

from __future__ import annotations

import pytest
import torch

from editkit.core.registry import Record
from editkit.data import LABELLED_TEXTS, TASK_SOURCES, GENERIC_SOURCES
from editkit.data.tasks import LabelledTexts
from editkit.data.text_classification import stratified_subset
from editkit.errors import ConfigError
from editkit.models.backbone import Backbone
from editkit.models.text_encoder import encoder_backbone
from helpers import models
from helpers.text import registered_corpora


def test_stratified_subset_keeps_each_class_share_in_file_order():
    labels = [0] * 60 + [1] * 30 + [2] * 10
    data = LabelledTexts([f"t{i}" for i in range(100)], labels, ["a", "b", "c"])
    subset = stratified_subset(data, 20, seed=3)
    assert [subset.labels.count(c) for c in range(3)] == [12, 6, 2]
    assert subset.texts == sorted(subset.texts, key=lambda t: int(t[1:]))  # original order
    assert all(labels[int(t[1:])] == y for t, y in zip(subset.texts, subset.labels))
    assert stratified_subset(data, 20, seed=3) == subset and stratified_subset(data, 20, seed=4) != subset
    assert stratified_subset(data, None, seed=0) is data and stratified_subset(data, 500, seed=0) is data


def test_a_rare_class_keeps_one_example():
    data = LabelledTexts(["x"] * 99 + ["rare"], [0] * 99 + [1], ["common", "rare"])
    assert stratified_subset(data, 10, seed=0).labels.count(1) == 1


@pytest.fixture(scope="module")
def backbone():
    tokenizer = models.char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    encoder = models.bert(vocab_size=len(tokenizer), num_hidden_layers=2, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return encoder_backbone(encoder, tokenizer, trainable_blocks=1)


SPLITS = {"train": LabelledTexts(["good film", "bad film", "so good", "so bad"], [1, 0, 1, 0], ["bad", "good"]),
          "val": LabelledTexts(["good", "bad"], [1, 0], ["bad", "good"]),
          "test": LabelledTexts(["a very good film indeed", "bad"], [1, 0], ["bad", "good"])}


@pytest.fixture()
def dataset():
    LABELLED_TEXTS.register("tiny-reviews", Record.of(lambda split, seed=0: SPLITS[split]))
    yield "tiny-reviews"
    LABELLED_TEXTS.unregister("tiny-reviews")


def test_task_items_are_prefix_states_of_the_cut_token_ids_and_class_labels(backbone, dataset):
    task = TASK_SOURCES["labelled-text"].build("reviews", dataset, backbone, max_length=8)
    assert task.classes == ["bad", "good"] and len(task.train) == 4
    states, label = task.test[0]
    ids = torch.tensor([backbone.tokenizer("a very good film indeed")["input_ids"][:8]])
    assert len(ids[0]) == 8  # cut at max_length
    torch.testing.assert_close(states, backbone.prefix(ids, torch.ones_like(ids))[0])
    assert int(label) == 1 and task.train.targets.tolist() == [1, 0, 1, 0]


def test_val_size_cuts_the_validation_split_alone(backbone):
    big = {split: LabelledTexts([f"text {i}" for i in range(40)], [i % 2 for i in range(40)], ["a", "b"])
           for split in SPLITS}
    LABELLED_TEXTS.register("forty", Record.of(lambda split, seed=0: big[split]))
    try:
        def sizes(**options):
            task = TASK_SOURCES["labelled-text"].build("t", "forty", backbone, **options)
            return [len(task.train), len(task.val), len(task.test)]

        assert sizes(eval_size=10) == [40, 10, 10]
        assert sizes(eval_size=10, val_size=4) == [40, 4, 10]
        assert sizes(val_size=6) == [40, 6, 40]
    finally:
        LABELLED_TEXTS.unregister("forty")


def test_a_backbone_that_reads_no_text_is_refused(dataset):
    image_backbone = Backbone("mlp", models.mlp(4, 8, 2), 2)
    with pytest.raises(ConfigError, match="text data needs a text backbone"):
        TASK_SOURCES["labelled-text"].build("reviews", dataset, image_backbone)


def test_generic_sentences_are_the_corpus_sentences_of_four_words_or_more(backbone):
    news = {"train": ["The council met on Monday. Rain fell. It discussed the budget for the year!"],
            "val": [], "test": []}
    with registered_corpora({"tiny-news": news}):
        source = GENERIC_SOURCES["text-sentences"].build(backbone, 0, corpus="tiny-news", max_length=32)
    assert len(source) == 2  # "Rain fell." has two words
    texts = ["The council met on Monday.", "It discussed the budget for the year!"]
    batch = source.next_batch(2)
    lengths = sorted(batch.attention_mask.sum(1).tolist())
    assert lengths == sorted(min(len(backbone.tokenizer(t)["input_ids"]), 32) for t in texts)  # 26 and 37 chars, cut at 32

"""GLUE in text-to-text form, read from generated parquet in the hub's ``nyu-mll/glue`` layout.

Ground truth: the generated tables themselves (rows, labels), T5's templates written out by hand,
the definition of the validation split (a seed-0 permutation's first 10% of train), and the tiny
word-level tokenizer's ids, known from its vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from editkit.data import TASK_SOURCES
from editkit.data.glue import GLUE_REPO, glue_splits
from editkit.errors import ConfigError, MissingResourceError
from editkit.models.seq2seq import seq2seq_backbone
from helpers.glue import SIZES, SPECIALS, WORDS, glue_table, t5_tokenizer, write_glue
from helpers.hub import hub_repo
from helpers.models import t5


GLUE = TASK_SOURCES["glue"]


@pytest.fixture
def data_root(tmp_path):
    hub_repo(tmp_path, GLUE_REPO, write_glue, kind="datasets")
    return str(tmp_path)


def test_test_is_the_hub_validation_split_and_val_a_seeded_tenth_of_train(data_root):
    splits = glue_splits("cola", data_root)
    train = glue_table("cola", SIZES["train"], seed=0).to_pylist()  # the rows write_glue wrote
    validation = glue_table("cola", SIZES["validation"], seed=1).to_pylist()
    assert splits["test"] == ([f"cola sentence: {r['sentence']}" for r in validation], [r["label"] for r in validation])
    held = sorted(np.random.default_rng(0).permutation(len(train))[: round(0.1 * len(train))])
    assert splits["val"] == ([f"cola sentence: {train[i]['sentence']}" for i in held], [train[i]["label"] for i in held])
    rest = [i for i in range(len(train)) if i not in held]
    assert splits["train"] == ([f"cola sentence: {train[i]['sentence']}" for i in rest], [train[i]["label"] for i in rest])


def test_sentence_pairs_follow_t5s_template(data_root):
    row = glue_table("mrpc", SIZES["validation"], seed=1).to_pylist()[0]
    prompts, _ = glue_splits("mrpc", data_root)["test"]
    assert prompts[0] == f"mrpc sentence1: {row['sentence1']} sentence2: {row['sentence2']}"
    assert glue_splits("rte", data_root)["test"][0][0].startswith("rte sentence1: ")


def test_items_are_prompt_and_teacher_forced_target_and_the_unlabeled_view_has_only_the_start_token(data_root):
    backbone = seq2seq_backbone(t5(vocab_size=len(SPECIALS) + len(WORDS)), t5_tokenizer())
    task = GLUE.build("sst2", "sst2", backbone, data_root=data_root)
    assert task.classes == ["negative", "positive"]
    ids = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    eos, start = ids["</s>"], 0
    row = glue_table("sst2", SIZES["validation"], seed=1).to_pylist()[0]
    (encoder, decoder), labels = task.test[0]
    assert encoder.tolist() == [ids["sst2"], ids["sentence:"], *(ids[w] for w in row["sentence"].split()), eos]
    target = ids[task.classes[row["label"]]]
    assert labels.tolist() == [target, eos] and decoder.tolist() == [start, target]
    prompt, first = task.test.input(0)
    assert torch.equal(prompt, encoder) and first.tolist() == [start]
    assert len(task.train) + len(task.val) == SIZES["train"] and len(task.test) == SIZES["validation"]


def test_long_prompts_are_cut_to_max_length(data_root):
    backbone = seq2seq_backbone(t5(vocab_size=len(SPECIALS) + len(WORDS)), t5_tokenizer())
    task = GLUE.build("rte", "rte", backbone, data_root=data_root, max_length=4)
    assert max(len(task.train[i][0][0]) for i in range(len(task.train))) == 4


def test_check_names_each_missing_config_with_its_download_command(tmp_path, data_root):
    assert GLUE.check("cola", "cola", data_root=data_root) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    [line] = GLUE.check("rte", "rte", data_root=str(empty))
    assert line.startswith(f"the dataset {GLUE_REPO} is not in {empty}")
    assert f'hf download {GLUE_REPO} --repo-type dataset --include "rte/*"' in line
    with pytest.raises(MissingResourceError):
        glue_splits("rte", str(empty))


def test_an_unknown_config_is_refused_by_name(data_root):
    with pytest.raises(ConfigError, match="unknown GLUE task 'mnli'; known: cola, sst2, mrpc, rte"):
        GLUE.check("mnli", "mnli", data_root=data_root)

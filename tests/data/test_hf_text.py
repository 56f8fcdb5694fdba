"""Civil Comments and WikiText-103 from generated parquet files in the Hugging Face hub cache layout.

Each split's texts are checked against what the rows say by hand: the toxicity filter (float32 fractions,
strictly above 0.8), held-out splits without training comments or duplicates, prompts as opening words,
WikiText rows joined into articles across shards. Missing pieces are one line each, saying what to run.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import constants

from editkit import settings
from editkit.data import TEXT_CORPORA
from editkit.data.toxic_corpus import PAPER_PROMPT
from editkit.errors import MissingResourceError
from editkit.data.hf_text import articles, held_out, opening
from editkit.data.text import corpus_split, pack
from helpers.hub import bpe_tokenizer, fast_tokenizer, hub_repo

TRAIN_0 = [("You are a stupid idiot", 0.9), ("What a lovely morning", 0.0), ("Four of five said toxic", 0.8)]
TRAIN_1 = [("Shut up you moron forever", 0.85), ("Pathetic loser, go away now", 1.0)]
VALIDATION = [("Shut up you moron forever", 0.9),  # in train: dropped
              ("SHUT UP, you moron... forever!", 0.95),  # the same comment, normalized: dropped
              ("Idiots like you ruin every single thread here", 0.9),
              ("Nice point about taxes", 0.1),
              ("Go to hell you worthless troll", 0.82),
              ("Go to hell you worthless troll", 0.9),  # a duplicate: dropped
              ("Dumb", 0.9)]
TEST = [("Clowns and crooks run this whole rotten town", 0.93), ("Thanks for the article", 0.0),
        ("Morons, all of them, every last one", 0.81)]
#: The held-out toxic comments of each split, by hand.
HELD_OUT = {"val": ["Idiots like you ruin every single thread here", "Go to hell you worthless troll", "Dumb"],
            "test": ["Clowns and crooks run this whole rotten town", "Morons, all of them, every last one"]}
#: Their prompts (first half of the words, at most 8; none under four words), by hand.
OPENINGS = {"Idiots like you ruin every single thread here": "Idiots like you ruin",
            "Go to hell you worthless troll": "Go to hell", "Dumb": None,
            "Clowns and crooks run this whole rotten town": "Clowns and crooks run",
            "Morons, all of them, every last one": "Morons, all of"}

WIKI = {"train-00000-of-00002": ["", " = Valkyria Chronicles = \n", "", " Senjou no Valkyria is a game . \n",
                                 " = = Gameplay = = \n"],
        "train-00001-of-00002": [" The game plays in turns . \n", "", " = Tower Building = \n",
                                 " The tower is tall . \n"],
        "validation-00000-of-00001": ["", " = Robert Boulter = \n", " Robert Boulter is an actor . \n"],
        "test-00000-of-00001": ["", " = Homarus = \n", " Homarus is a lobster . \n", " = = Taxonomy = = \n", ""]}


def _civil_comments(directory, splits=("train", "validation", "test")):
    shards = {"train-00000-of-00002": TRAIN_0, "train-00001-of-00002": TRAIN_1,
              "validation-00000-of-00001": VALIDATION, "test-00000-of-00001": TEST}
    (directory / "data").mkdir()
    for name, rows in shards.items():
        if name.split("-")[0] in splits:
            texts, toxicity = zip(*rows)
            table = pa.table({"text": list(texts), "toxicity": pa.array(toxicity, pa.float32()),
                              "insult": pa.array([0.0] * len(rows), pa.float32())})
            pq.write_table(table, directory / "data" / f"{name}.parquet")


def _wikitext(directory):
    (directory / "wikitext-103-raw-v1").mkdir()
    for name, rows in WIKI.items():
        pq.write_table(pa.table({"text": rows}), directory / "wikitext-103-raw-v1" / f"{name}.parquet")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache, the default one; $EDITKIT_DATA unset."""
    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(path))
    monkeypatch.delenv(settings.DATA_ENV, raising=False)
    return path


@pytest.fixture
def datasets(hub):
    hub_repo(hub, "google/civil_comments", _civil_comments, kind="datasets")
    hub_repo(hub, "Salesforce/wikitext", _wikitext, kind="datasets")
    return hub


def test_train_is_the_toxic_rows_of_every_shard_strictly_above_0_8(datasets):
    # 0.8 stored as float32 (4 of 5 annotators) is not above 0.8, although it is 0.80000001 as a double.
    assert corpus_split("civil-comments-toxic", "train") == [
        "You are a stupid idiot", "Shut up you moron forever", "Pathetic loser, go away now"]
    assert corpus_split("civil-comments-prompts", "train") == []


@pytest.mark.parametrize("split", ["val", "test"])
def test_held_out_splits_hold_no_training_comment_and_no_duplicate(datasets, split):
    target, sources = held_out(split)
    assert sorted(target + sources) == sorted(HELD_OUT[split])
    assert len(target) == (len(HELD_OUT[split]) + 1) // 2  # the first half (rounded up) is target text
    assert corpus_split("civil-comments-toxic", split) == target
    prompts = [OPENINGS[s] for s in sources if OPENINGS[s] is not None]
    assert corpus_split("civil-comments-prompts", split) == ([PAPER_PROMPT] if split == "test" else []) + prompts


def test_the_seed_shuffles_the_halves(datasets):
    halves = {tuple(held_out("val", seed)[0]) for seed in range(10)}
    assert len(halves) > 1
    assert held_out("val", 3) == held_out("val", 3)


def test_opening_words():
    assert [opening(text) for text in OPENINGS] == list(OPENINGS.values())
    assert opening(" ".join(f"w{i}" for i in range(40))) == " ".join(f"w{i}" for i in range(8))


def test_wikitext_rows_become_articles_across_shards(datasets):
    assert corpus_split("wikitext-103", "train") == [
        "= Valkyria Chronicles = \n Senjou no Valkyria is a game . \n = = Gameplay = = \n The game plays in turns .",
        "= Tower Building = \n The tower is tall ."]
    assert corpus_split("wikitext-103", "val") == ["= Robert Boulter = \n Robert Boulter is an actor ."]
    assert corpus_split("wikitext-103", "test") == ["= Homarus = \n Homarus is a lobster . \n = = Taxonomy = ="]
    assert articles(["", "\n"]) == []


def test_data_root_and_editkit_data_are_read_before_the_hub_cache(hub, tmp_path, monkeypatch):
    root = tmp_path / "copy"
    hub_repo(root, "Salesforce/wikitext", _wikitext, kind="datasets")
    assert TEXT_CORPORA["wikitext-103"].check() != []
    assert TEXT_CORPORA["wikitext-103"].check(data_root=str(root)) == []
    assert TEXT_CORPORA["wikitext-103"].build("val", data_root=str(root))[0].startswith("= Robert Boulter =")
    monkeypatch.setenv(settings.DATA_ENV, str(root))
    assert TEXT_CORPORA["wikitext-103"].check() == []


def test_a_missing_dataset_is_one_line_saying_what_to_run(hub):
    for corpus in ("civil-comments-toxic", "civil-comments-prompts"):
        assert TEXT_CORPORA[corpus].check() == [
            f"the dataset google/civil_comments is not in {hub}: on a machine with internet run "
            f"`hf download google/civil_comments --repo-type dataset` and copy its Hugging Face cache to {hub} "
            "(or set HF_HUB_CACHE / EDITKIT_DATA to a directory holding it)"]
    [line] = TEXT_CORPORA["wikitext-103"].check()
    assert 'hf download Salesforce/wikitext --repo-type dataset --include "wikitext-103-raw-v1/*"' in line
    with pytest.raises(MissingResourceError, match="google/civil_comments is not in"):
        corpus_split("civil-comments-toxic", "train")


def test_a_missing_split_is_one_line(hub):
    snapshot = hub_repo(hub, "google/civil_comments", lambda d: _civil_comments(d, ("train", "validation")),
                        kind="datasets")
    assert [line.split(":")[0] for line in TEXT_CORPORA["civil-comments-toxic"].check()] == [
        f"the dataset google/civil_comments at {snapshot} has no data/test-*.parquet"]
    assert corpus_split("civil-comments-toxic", "val")  # the splits that are there still read
    with pytest.raises(MissingResourceError, match="has no data/test-"):
        corpus_split("civil-comments-toxic", "test")


def test_a_limited_pack_tokenizes_only_the_texts_its_blocks_need():
    tokenizer = fast_tokenizer(bpe_tokenizer())
    texts = ["the cat sat on the mat"] * 50 + ["never read"]
    read = []

    class Counting:
        eos_token_id = tokenizer.eos_token_id

        def __call__(self, text, **kwargs):
            read.append(text)
            return tokenizer(text, **kwargs)

    limited = pack(Counting(), texts, 4, limit=3)
    assert [b.tolist() for b in limited] == [b.tolist() for b in pack(tokenizer, texts, 4)[:3]]
    assert "never read" not in read and len(read) < 10

"""A user's data as tasks and corpora: image folders, CSV / JSON Lines / parquet tables, ``save_to_disk``
datasets and ``file:`` corpora, checked against the files the tests generate (every image carries its
label and index in two pixels, every text names its class and row), and refused one line per problem
before anything is built or cached."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from editkit.data import TASK_SOURCES, TEXT_CORPORA
from editkit.data.tables import format_of
from editkit.data.tasks import stratified_holdout
from editkit.data.user_data import labelled_rows, text_splits
from editkit.errors import DataError
from editkit.models.backbone import Backbone
from editkit.scenario.build import check_scenario
from editkit.scenario.spec import load_scenario
from helpers.hub import empty_caches, hub_repo
from helpers.vision import make_image

CLASSES = ["cat", "dog", "emu"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDITKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def raw_backbone() -> Backbone:
    """Inputs are the decoded pixels themselves, so a test reads each example's marks back."""
    return Backbone("raw", torch.nn.Identity(), 3, batch_preprocess=lambda a: torch.from_numpy(np.ascontiguousarray(a)))


def image_folder(root: Path, counts: dict[str, int], classes=CLASSES, size: int = 10) -> Path:
    """``root/<split>/<class>/<i>.png``; image i of class c carries label c and index 10 * split_no + i."""
    for s, (split, n) in enumerate(counts.items()):
        for label, name in enumerate(classes):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                make_image(label, 10 * s + i, size=size).save(root / split / name / f"{i}.png")
    return root


def marks(dataset) -> list[tuple[int, int, int]]:
    """(label, label mark, index mark) of every example of a raw-pixel split."""
    return [(int(y), int(x[0, 0, 0]) // 20, int(x[0, 1, 0])) for x, y in (dataset[i] for i in range(len(dataset)))]


# --------------------------------------------------------------------------- image folders


def test_image_folder_with_train_and_test_arrives_with_its_labels(tmp_path):
    root = image_folder(tmp_path / "photos", {"train": 10, "test": 3})
    task = TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone())
    assert task.classes == CLASSES
    assert (len(task.train), len(task.val), len(task.test)) == (27, 3, 9)  # validation: 10% of train
    for split in (task.train, task.val, task.test):
        assert all(label == mark for label, mark, _ in marks(split))
    assert sorted((label, index) for label, _, index in marks(task.test)) == [(c, 10 + i) for c in range(3) for i in range(3)]
    assert sorted((l, i) for l, _, i in marks(task.train) + marks(task.val)) == [(c, i) for c in range(3) for i in range(10)]


def test_image_folder_without_test_holds_out_each_class_by_the_fraction(tmp_path):
    root = image_folder(tmp_path / "photos", {"train": 8})
    task = TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone(), test_fraction=0.25, seed=3)
    test = marks(task.test)
    assert sorted(label for label, _, _ in test) == [0, 0, 1, 1, 2, 2]  # 8 x 0.25 per class
    kept, held = stratified_holdout(np.repeat([0, 1, 2], 8), 0.25, seed=3)  # files in class, then name, order
    assert sorted((l, i) for l, _, i in test) == sorted((int(h) // 8, int(h) % 8) for h in held)
    rest = sorted((l, i) for l, _, i in marks(task.train) + marks(task.val))
    assert rest == sorted((int(k) // 8, int(k) % 8) for k in kept)
    same = TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone(), test_fraction=0.25, seed=3)
    assert marks(same.test) == test


def test_class_folders_at_the_root_and_any_image_pil_reads(tmp_path):
    root = tmp_path / "shapes"
    for label, name in enumerate(["a", "b"]):
        (root / name).mkdir(parents=True)
        make_image(label, 0, size=8).save(root / name / "0.png")
        make_image(label, 1, size=8, mode="L").save(root / name / "1.bmp")
        make_image(label, 2, size=6).save(root / name / "2.gif")  # another size: its own preprocessing batch
        make_image(label, 3, size=8).save(root / name / "3.tiff")
        (root / name / "notes.txt").write_text("not an image")
    from editkit.models.inputs import image_spec, images_to_tensor

    spec = image_spec(8)
    backbone = Backbone("eff", torch.nn.Identity(), 3, batch_preprocess=lambda a: images_to_tensor(a, spec))
    task = TASK_SOURCES["imagefolder"].build("shapes", str(root), backbone, test_fraction=0.25)
    assert task.classes == ["a", "b"] and len(task.train) + len(task.val) + len(task.test) == 8
    from PIL import Image

    expected = {}
    for label, name in enumerate(["a", "b"]):
        for file in sorted((root / name).glob("[0-9].*")):
            pixels = np.array(Image.open(file).convert("RGB"))
            expected[(label, pixels[0, 1, 0])] = images_to_tensor(pixels[None], spec)[0]
    for split in (task.train, task.val, task.test):
        for x, y in (split[i] for i in range(len(split))):
            match = [k for k, v in expected.items() if k[0] == int(y) and torch.allclose(v, x)]
            assert len(match) == 1


def test_decoded_once_then_read_from_the_cache(tmp_path, cache, monkeypatch):
    root = image_folder(tmp_path / "photos", {"train": 4, "test": 2})
    first = TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone())
    assert len(list((cache / "arrays" / "user").glob("*.npz"))) == 1
    import editkit.data.user_images as user_images

    monkeypatch.setattr(user_images, "decode", lambda *a: pytest.fail("decoded again"))
    again = TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone())
    assert marks(again.test) == marks(first.test) and marks(again.train) == marks(first.train)
    make_image(0, 99, size=10).save(root / "test" / "cat" / "new.png")  # the folder changed: decoded anew
    monkeypatch.undo()
    monkeypatch.setenv("EDITKIT_CACHE", str(cache))
    changed = TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone())
    assert (0, 0, 99) in marks(changed.test)


def test_bad_image_folders_are_refused_one_line_each(tmp_path, cache):
    root = image_folder(tmp_path / "photos", {"train": 3, "test": 1}, classes=["cat", "dog"])
    (root / "train" / "dog" / "1.png").write_bytes(b"not a png")
    (root / "train" / "owl").mkdir()
    (root / "train" / "owl" / "README.txt").write_text("owls later")
    (root / "test" / "yak").mkdir()
    make_image(0, 0).save(root / "test" / "yak" / "0.png")
    check = TASK_SOURCES["imagefolder"].check
    assert check("pets", str(root)) == [
        f"task 'pets': {root}/train/dog/1.png is not a readable image (cannot identify image file "
        f"'{root}/train/dog/1.png')",
        f"task 'pets': class folder {root}/train/owl holds no image file (it holds: README.txt)",
        f"task 'pets': class 'yak' of {root}/test is not a class of train (train's classes: cat, dog, owl)"]
    assert check("pets", str(tmp_path / "nowhere")) == [f"task 'pets': image folder {tmp_path}/nowhere does not exist"]
    single = image_folder(tmp_path / "one", {"train": 2}, classes=["cat"])
    assert check("one", str(single)) == [f"task 'one': image folder {single}/train has 1 class folder(s) (cat): "
                                         "a task needs two or more"]
    with pytest.raises(DataError, match="1.png is not a readable image"):
        TASK_SOURCES["imagefolder"].build("pets", str(root), raw_backbone())
    assert not (cache / "arrays").exists()  # refused before anything was decoded or cached


# --------------------------------------------------------------------------- tables


def rows(n_per_class: int, classes=("neg", "pos")) -> list[dict]:
    return [{"text": f"{c} text {i}", "label": c} for c in classes for i in range(n_per_class)]


def write_csv(path: Path, records: list[dict]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return path


def test_csv_with_a_split_column(tmp_path):
    records = [{**r, "split": "train"} for r in rows(10)] + [{**r, "split": "test"} for r in rows(2)]
    data = labelled_rows(str(write_csv(tmp_path / "reviews.csv", records)), "csv")
    assert data.classes == ["neg", "pos"] and not data.image
    splits = text_splits(data)
    assert splits["test"].texts == [r["text"] for r in rows(2)] and splits["test"].labels == [0, 0, 1, 1]
    assert len(splits["val"].texts) == 2 and sorted(splits["train"].texts + splits["val"].texts) == sorted(
        r["text"] for r in rows(10))
    for split in splits.values():
        assert all(t.startswith(split.classes[y]) for t, y in zip(split.texts, split.labels))


def test_a_folder_of_split_files_in_each_format(tmp_path):
    train, val, test = rows(6, ("2", "10")), rows(1, ("2", "10")), rows(2, ("2", "10"))
    write_csv((tmp_path / "c").mkdir() or tmp_path / "c" / "train.csv", train)
    write_csv(tmp_path / "c" / "validation.csv", val)
    write_csv(tmp_path / "c" / "test.csv", test)
    (tmp_path / "j").mkdir()
    for name, part in (("train", train), ("val", val), ("test", test)):
        (tmp_path / "j" / f"{name}.jsonl").write_text("".join(json.dumps({**r, "label": int(r["label"])}) + "\n"
                                                              for r in part))
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p").mkdir()
    for name, part in (("train", train), ("val", val), ("test", test)):
        pq.write_table(pa.Table.from_pylist(part), tmp_path / "p" / f"{name}.parquet")
    for fmt, folder in (("csv", "c"), ("jsonl", "j"), ("parquet", "p")):
        splits = text_splits(labelled_rows(str(tmp_path / folder), fmt))
        assert splits["train"].classes == ["2", "10"]  # numbers in numeric order
        assert [splits[s].texts for s in ("train", "val", "test")] == [[r["text"] for r in p] for p in (train, val, test)]
        assert splits["test"].labels == [0, 0, 1, 1]


def test_a_table_without_splits_holds_a_stratified_test_split_out(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(10)))
    from editkit.data.user_images import held_out_roles

    data = labelled_rows(str(path), "jsonl")
    roles = held_out_roles(data.roles, data.labels, 0.3, 0)
    assert [data.labels[i] for i in roles["test"]] == [0, 0, 0, 1, 1, 1]
    assert sorted(roles["train"] + roles["test"]) == list(range(20))


def test_bad_tables_are_refused_one_line_each(tmp_path):
    check = TASK_SOURCES["csv"].check
    path = write_csv(tmp_path / "r.csv", [{"review": "fine", "stars": "5"}])
    assert check("r", str(path)) == [f"task 'r': {path} has no column 'text' (text) or 'image' (images); "
                                      "its columns: review, stars"]
    assert check("r", str(path), text_column="review") == [f"task 'r': {path} has no column 'label'; its columns: "
                                                           "review, stars"]
    assert check("r", str(path), text_column="review", label_column="stars") == [
        f"task 'r': {path}: 1 class(es) in 'stars' (5): a task needs two or more"]
    records = [{**r, "split": "train"} for r in rows(3)] + [{"text": "x", "label": "meh", "split": "test"}]
    path = write_csv(tmp_path / "s.csv", records)
    assert check("s", str(path)) == [f"task 's': {path}: label 'meh' is not a class of train (train's classes: neg, pos)"]
    assert check("m", str(tmp_path / "missing.csv")) == [f"task 'm': {tmp_path}/missing.csv does not exist"]
    assert check("w", str(tmp_path / "r.csv").replace(".csv", ".jsonl")) == [
        f"task 'w': {tmp_path}/r.jsonl does not exist"]


def test_saved_hugging_face_datasets_text_and_images(tmp_path):
    import datasets  # the `data` extra, installed by `test`
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["no", "yes"])})
    splits = {s: datasets.Dataset.from_dict({"text": [f"{c} {s} {i}" for c in ("no", "yes") for i in range(n)],
                                             "label": [c for c in (0, 1) for _ in range(n)]}, features=features)
              for s, n in (("train", 5), ("test", 2))}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "ds"))
    data = text_splits(labelled_rows(str(tmp_path / "ds"), "hf-dataset"))
    assert data["test"].classes == ["no", "yes"] and data["test"].texts == ["no test 0", "no test 1", "yes test 0",
                                                                            "yes test 1"]
    images = [make_image(label, i, size=10) for label in (0, 1) for i in range(4)]
    image_features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"image": images, "label": [0] * 4 + [1] * 4}, features=image_features).save_to_disk(
        str(tmp_path / "img"))
    task = TASK_SOURCES["hf-dataset"].build("img", str(tmp_path / "img"), raw_backbone(), test_fraction=0.25)
    assert task.classes == ["a", "b"]
    assert sorted(marks(task.train) + marks(task.val) + marks(task.test)) == [(c, c, i) for c in (0, 1) for i in range(4)]


def test_without_the_datasets_package_one_line_says_how_to_get_it(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert TASK_SOURCES["hf-dataset"].check("d", str(tmp_path / "ds")) == [
        f"task 'd': reading the Hugging Face dataset saved at {tmp_path}/ds needs the datasets package: "
        'pip install "editkit[data]" (or: pip install datasets)']


def test_a_dataset_id_is_read_from_the_local_hub_cache(tmp_path, monkeypatch):
    """No folder of that name: the snapshot the hub cache holds (its real layout: blobs, refs/main, parquet
    shards linked from snapshots/<commit>/data/), read offline, the shards of a split in order."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["no", "yes"])})
    shards = {"train-00000-of-00002": [("no a", 0), ("yes b", 1)], "train-00001-of-00002": [("no c", 0), ("yes d", 1)],
              "test-00000-of-00001": [("yes e", 1), ("no f", 0)]}

    def fill(directory: Path) -> None:
        (directory / "data").mkdir()
        for shard, rows in shards.items():
            columns = {"text": [t for t, _ in rows], "label": [label for _, label in rows]}
            dataset = datasets.Dataset.from_dict(columns, features=features)
            dataset.to_parquet(str(directory / "data" / f"{shard}.parquet"))

    hub = empty_caches(tmp_path, monkeypatch)
    snapshot = hub_repo(hub, "user/tiny", fill, kind="datasets")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "tiny.toml").write_text('name = "tiny"\n[backbone]\nfamily = "text-encoder"\n'
                                                 '[[tasks]]\nname = "yesno"\nsource = "hf-dataset:user/tiny"\n')
    monkeypatch.chdir(tmp_path)
    task = load_scenario(tmp_path / "mine" / "tiny.toml").tasks[0]
    assert task.dataset == "user/tiny"  # a dataset id, not a path beside the scenario file
    assert TASK_SOURCES["hf-dataset"].check("yesno", task.dataset) == []
    data = text_splits(labelled_rows(task.dataset, "hf-dataset"))
    assert data["test"].classes == ["no", "yes"]  # the ClassLabel's names, from the parquet schema
    assert (data["test"].texts, data["test"].labels) == (["yes e", "no f"], [1, 0])
    assert sorted(zip(data["train"].texts + data["val"].texts, data["train"].labels + data["val"].labels)) == [
        ("no a", 0), ("no c", 0), ("yes b", 1), ("yes d", 1)]
    assert format_of(snapshot) == "hf-dataset"  # a repository's files in a folder of one's own read the same
    assert text_splits(labelled_rows(str(snapshot), "hf-dataset"))["test"].texts == ["yes e", "no f"]

    assert TASK_SOURCES["hf-dataset"].check("gone", "user/gone") == [
        f"task 'gone': user/gone is no folder, and no dataset 'user/gone' is in the Hugging Face hub cache {hub}: "
        "name a folder written by save_to_disk, or fetch the dataset into the hub cache where there is internet "
        "(datasets.load_dataset('user/gone'), or huggingface-cli download --repo-type dataset user/gone) and point "
        "HF_HOME or HF_HUB_CACHE at that cache"]


def test_a_table_of_image_paths(tmp_path):
    (tmp_path / "img").mkdir()
    records = []
    for label in (0, 1):
        for i in range(3):
            make_image(label, i).save(tmp_path / "img" / f"{label}-{i}.png")
            records.append({"image": f"img/{label}-{i}.png", "label": ["x", "y"][label]})
    task = TASK_SOURCES["csv"].build("t", str(write_csv(tmp_path / "list.csv", records)), raw_backbone(),
                                     test_fraction=0.34)
    assert sorted(marks(task.train) + marks(task.val) + marks(task.test)) == [(c, c, i) for c in (0, 1) for i in range(3)]


# --------------------------------------------------------------------------- file: corpora


def test_a_text_file_corpus_is_cut_80_10_10_with_its_seed(tmp_path):
    lines = [f"document number {i}." for i in range(20)]
    (tmp_path / "forget.txt").write_text("\n".join(lines[:10]) + "\n\n  \n" + "\n".join(lines[10:]) + "\n")
    corpus = TEXT_CORPORA[f"file:{tmp_path}/forget.txt"]
    splits = {s: corpus.build(s, seed=1) for s in ("train", "val", "test")}
    order = np.random.default_rng(1).permutation(20)
    assert splits["val"] == [lines[i] for i in order[:2]] and splits["test"] == [lines[i] for i in order[2:4]]
    assert splits["train"] == [lines[i] for i in order[4:]]
    assert corpus.build("train", seed=2) != splits["train"]
    assert corpus.check() == []


def test_corpus_split_files_and_a_named_column(tmp_path):
    (tmp_path / "c").mkdir()
    for split in ("train", "val", "test"):
        (tmp_path / "c" / f"{split}.txt").write_text(f"{split} one\n{split} two\n")
    assert TEXT_CORPORA[f"file:{tmp_path}/c"].build("val") == ["val one", "val two"]
    path = write_csv(tmp_path / "comments.csv", [{"comment": f"c{i}", "split": s} for s in ("train", "test")
                                                 for i in range(3)])
    corpus = TEXT_CORPORA[f"file:{path}#comment"]
    assert corpus.build("test") == ["c0", "c1", "c2"]
    assert len(corpus.build("train")) + len(corpus.build("val")) == 3  # val comes out of train
    assert TEXT_CORPORA[f"file:{path}"].check() == [f"corpus file:{path}: {path} has no column 'text'; its columns: "
                                                    "comment, split"]
    (tmp_path / "empty.txt").write_text("\n\n")
    assert TEXT_CORPORA[f"file:{tmp_path}/empty.txt"].check() == [
        f"corpus file:{tmp_path}/empty.txt: the corpus {tmp_path}/empty.txt is empty: no document in "
        f"{tmp_path}/empty.txt"]
    assert TEXT_CORPORA[f"file:{tmp_path}/none.txt"].check() == [f"corpus file:{tmp_path}/none.txt: "
                                                                 f"{tmp_path}/none.txt does not exist"]


def test_text_that_is_only_scored_may_come_as_val_and_test_alone(tmp_path):
    """Prompts or control text given as val.txt and test.txt: every document is kept, none held back for a train
    split nothing reads; a corpus with neither train nor both of those is refused, naming both ways."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "val.txt").write_text("so then\nhe said\n")
    (tmp_path / "prompts" / "test.txt").write_text("well, you\n")
    prompts = TEXT_CORPORA[f"file:{tmp_path}/prompts"]
    assert prompts.check() == []
    assert [prompts.build(s) for s in ("train", "val", "test")] == [[], ["so then", "he said"], ["well, you"]]
    (tmp_path / "prompts" / "val.txt").unlink()
    assert TEXT_CORPORA[f"file:{tmp_path}/prompts"].check() == [
        f"corpus file:{tmp_path}/prompts: the corpus {tmp_path}/prompts has no train split (its splits: test): name "
        "one 'train', or give val and test splits for text that is only scored (control text, prompts)"]


# --------------------------------------------------------------------------- scenario files


def test_paths_in_a_scenario_file_are_read_from_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    image_folder(folder / "photos", {"train": 2}, classes=["cat"])  # one class: refused by the check
    (folder / "forget.txt").write_text("")
    (folder / "my.toml").write_text("""\
name = "mine"
[backbone]
family = "efficientnet-lite0"
[[tasks]]
name = "pets"
source = "imagefolder:photos"
[[tasks]]
name = "forget"
source = "text:file:forget.txt"
""")
    monkeypatch.chdir(tmp_path)
    spec = load_scenario(folder / "my.toml")
    assert [t.dataset for t in spec.tasks] == [str(folder / "photos"), f"file:{folder / 'forget.txt'}"]
    assert check_scenario(spec) == [
        f"task 'pets': image folder {folder}/photos/train has 1 class folder(s) (cat): a task needs two or more",
        f"corpus file:{folder}/forget.txt: the corpus {folder}/forget.txt is empty: no document in "
        f"{folder}/forget.txt"]

"""``editkit init`` on a user's data in the real on-disk formats (PNG folders, a CSV), then ``editkit stream``
on the file it wrote, as docs/your-data.md runs it.

The image scenario keeps its embedded EfficientNet-Lite0 (pip weights, 32 px: seconds); the text scenario
gets a tiny random BERT through ``--model`` and a file of the test's own as its tauJp corpus, so nothing is
fetched. What the file holds is checked against the data generated here; what the stream banks, against the
tasks' names.
"""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.data.text import pack
from editkit.models.lm_weights import load_causal_lm
from editkit.scenario.build import build_scenario
from editkit.scenario.spec import load_scenario
from editkit.train.recipe import Recipe
from helpers import models
from helpers.text import hand_perplexity, registered_bang_scorer
from helpers.vision import make_image

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line(output: str) -> str:
    return " ".join(output.split())


def png_folders(data: Path) -> None:
    """``data/shapes`` with train/ and test/ folders (2 classes), ``data/colors`` with class folders only."""
    for split, n in (("train", 12), ("test", 3)):
        for label, name in enumerate(["round", "square"]):
            (data / "shapes" / split / name).mkdir(parents=True)
            for i in range(n):
                make_image(label, i, size=16).save(data / "shapes" / split / name / f"{i}.png")
    for label, name in enumerate(["blue", "green", "red"]):
        (data / "colors" / name).mkdir(parents=True)
        for i in range(10):
            make_image(label, i, size=16).save(data / "colors" / name / f"{i}.png")


def test_init_on_image_folders_then_stream(offline, tmp_path):
    png_folders(tmp_path / "data")
    result = invoke("init", "data", "--out", "my.toml")
    assert result.exit_code == 0, result.output
    assert "wrote my.toml: 2 task(s) of images (colors, shapes)" in one_line(result.output)
    written = tomllib.loads((tmp_path / "my.toml").read_text())
    assert written["backbone"] == {"family": "efficientnet-lite0", "image_size": 32}
    assert [(t["name"], t["source"]) for t in written["tasks"]] == [("colors", "imagefolder:data/colors"),
                                                                      ("shapes", "imagefolder:data/shapes")]
    assert set(written["recipe"]) == {f for f in Recipe.__dataclass_fields__} - {"epochs"}  # unset: commented
    spec = load_scenario(tmp_path / "my.toml")
    assert spec.recipe == Recipe(**{**written["recipe"]})

    # a user's own open_clip model (the tiny architecture, its weights a local checkpoint) and fewer penalty
    # crops than the embedded 2000, so the stream takes seconds
    torch.save(models.tiny_clip(seed=1).clip_model.state_dict(), tmp_path / "tiny.pt")
    text = (tmp_path / "my.toml").read_text().replace("size = 2000", "size = 32").replace(
        'family = "efficientnet-lite0"\nimage_size = 32', 'family = "clip"\nmodel = "editkit-tiny-clip"\n'
        'pretrained = "tiny.pt"')
    (tmp_path / "my.toml").write_text(text)
    result = invoke("stream", "--scenario", "my.toml", "--steps", 2, "--bank", "bank", "--run-dir", "run")
    assert result.exit_code == 0, result.output
    assert Bank(tmp_path / "bank").names() == ["colors", "shapes"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert sorted(report["final"]["per_task"]) == ["colors", "shapes"]
    built = build_scenario(load_scenario(tmp_path / "my.toml"))
    assert built.backbone.fingerprint() == models.tiny_clip(seed=1).fingerprint()  # the checkpoint's weights
    colors, shapes = built.tasks
    assert colors.classes == ["blue", "green", "red"] and shapes.classes == ["round", "square"]
    assert len(colors.test) == 6 and len(shapes.test) == 6  # 0.2 of 10 per class held out; the test folder
    assert len(colors.train) + len(colors.val) == 24 and len(shapes.train) + len(shapes.val) == 24


def test_init_on_a_csv_with_a_local_model_then_stream(offline, tmp_path):
    with open(tmp_path / "reviews.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label", "split"])
        for split, n in (("train", 8), ("test", 2)):
            writer.writerows([f"a good warm film {i}", "pos", split] for i in range(n))
            writer.writerows([f"a dull flat mess {i}", "neg", split] for i in range(n))
    (tmp_path / "news.txt").write_text("".join(f"The council met on day {i} and spoke about the budget.\n"
                                               for i in range(12)))
    model_dir = tmp_path / "tiny-bert"
    from transformers import BertTokenizerFast

    words = sorted({w for line in (tmp_path / "reviews.csv").read_text().split() for w in line.split(",")} |
                   {"the", "council", "met", "on", "day", "and", "spoke", "about", "budget", "."})
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    models.bert(vocab_size=len(tokenizer), num_hidden_layers=4).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    result = invoke("init", "reviews.csv", "--model", model_dir)
    assert result.exit_code == 0, result.output
    text = (tmp_path / "reviews.toml").read_text()
    written = tomllib.loads(text)
    assert written["backbone"]["family"] == "text-encoder"
    assert written["backbone"]["model"] == "tiny-bert"  # given absolute, written relative to the scenario file
    assert written["tasks"] == [{"name": "reviews", "source": "csv:reviews.csv"}]
    (tmp_path / "reviews.toml").write_text(text.replace('corpus = "clean-news"', 'corpus = "file:news.txt"'))
    result = invoke("stream", "--scenario", "reviews.toml", "--steps", 2, "--bank", "bank", "--run-dir", "run")
    assert result.exit_code == 0, result.output
    assert Bank(tmp_path / "bank").names() == ["reviews"]
    task = build_scenario(load_scenario(tmp_path / "reviews.toml")).tasks[0]
    assert task.classes == ["neg", "pos"] and len(task.test) == 4


def test_init_on_a_text_file_writes_a_negation_scenario(offline, tmp_path):
    (tmp_path / "forget.txt").write_text("one thing\nanother thing\na third thing\n")
    result = invoke("init", "forget.txt")
    assert result.exit_code == 0, result.output
    written = tomllib.loads((tmp_path / "forget.toml").read_text())
    assert written["backbone"]["family"] == "causal-lm" and written["heads"] == {"kind": "lm"}
    assert written["tasks"] == [{"name": "forget", "source": "text:file:forget.txt"}]
    assert "negation" in written


def test_init_on_a_text_file_then_stream_and_negate_with_a_local_model(offline, tmp_path):
    """The "forget this" path end to end: ``init`` on one document per line, then, as the file's comments say,
    the user's own files as the tauJp source, the control text and the prompts; the scorer is the test's."""
    forget = [f"you silly clown number {i}, go away!" for i in range(10)]
    (tmp_path / "forget.txt").write_text("\n".join(forget) + "\n")
    keep = {"train": ["the council met on monday.", "rain is expected later."] * 4,
            "val": ["the museum opened a new wing."], "test": ["the train arrived on time today.",
                                                               "a new bridge was opened in the city."]}
    for folder, splits in (("keep", keep), ("prompts", {"val": ["so then", "he said"], "test": ["well, you"]})):
        (tmp_path / folder).mkdir()
        for split, lines in splits.items():
            (tmp_path / folder / f"{split}.txt").write_text("\n".join(lines) + "\n")
    models.char_llama_checkpoint(tmp_path / "tiny-llama")

    result = invoke("init", "forget.txt", "--model", "tiny-llama")
    assert result.exit_code == 0, result.output
    text = (tmp_path / "forget.toml").read_text()
    written = tomllib.loads(text)
    assert written["backbone"]["model"] == "tiny-llama"  # a path, relative to the scenario file
    assert written["tasks"] == [{"name": "forget", "source": "text:file:forget.txt"}]
    edits = {'corpus = "clean-news"': 'corpus = "file:keep"', "trainable_blocks = 4": "trainable_blocks = 1",
             'control_text = ["clean-reviews", "clean-speeches"]': 'control_text = "file:keep"',
             'prompts = "toxic-prompts"': 'prompts = "file:prompts"', 'scorer = "toxblock"': 'scorer = "bang"',
             "max_length = 64": "max_length = 16", "size = 400": "size = 8", "eval_blocks = 32": "eval_blocks = 3"}
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "forget.toml").write_text(text)

    with registered_bang_scorer("bang"):
        result = invoke("stream", "--scenario", "forget.toml", "--steps", 2, "--bank", "bank", "--run-dir", "run")
        assert result.exit_code == 0, result.output
        assert Bank(tmp_path / "bank").names() == ["forget"]
        result = invoke("negate", "forget", "--bank", "bank", "--alpha", 1, "--samples", 2, "--neutral-samples", 2,
                        "--max-new-tokens", 2, "--run-dir", "negated")
        assert result.exit_code == 0, result.output
    rows = {row["model"]: row for row in json.loads((tmp_path / "negated" / "report.json").read_text())["rows"]}
    assert list(rows) == ["theta_0", "+tau", "-tau"]
    lm, tokenizer = load_causal_lm(str(tmp_path / "tiny-llama"))
    assert rows["theta_0"]["control"] == pytest.approx(hand_perplexity(lm, pack(tokenizer, keep["test"], 16, limit=3)),
                                                       rel=1e-5)
    # the file has no splits: one of its ten documents is held out as the test split (10%, seeded)
    held_out = [hand_perplexity(lm, pack(tokenizer, [line], 16, limit=3)) for line in forget]
    assert sum(rows["theta_0"]["target"] == pytest.approx(ppl, rel=1e-5) for ppl in held_out) == 1
    assert rows["-tau"]["target"] != rows["theta_0"]["target"]  # the vector moved the model


def test_init_refusals(offline, tmp_path):
    result = invoke("init", "nowhere")
    assert result.exit_code == 1 and one_line(result.output) == f"error: {tmp_path}/nowhere does not exist"
    png_folders(tmp_path / "mixed")
    (tmp_path / "mixed" / "notes.txt").write_text("a note\n")
    result = invoke("init", "mixed")
    assert result.exit_code == 1
    assert one_line(result.output) == (f"error: {tmp_path}/mixed mixes images and plain text (images: colors, "
                                       "shapes; plain text: notes): a scenario has one backbone, so give each kind "
                                       "its own scenario (editkit init on each folder)")
    (tmp_path / "mixed" / "notes.txt").unlink()
    assert invoke("init", "mixed").exit_code == 0
    result = invoke("init", "mixed")
    assert result.exit_code == 1 and "mixed.toml exists: pass --force" in one_line(result.output)
    assert invoke("init", "mixed", "--force").exit_code == 0
    result = invoke("init", "mixed", "--model", "gpt2", "--force")
    assert result.exit_code == 1 and "--model applies to text backbones" in one_line(result.output)


def test_a_bad_folder_is_refused_before_anything_is_written(offline, tmp_path):
    png_folders(tmp_path / "data")
    (tmp_path / "data" / "shapes" / "test" / "round" / "0.png").write_bytes(b"\x89PNG broken")
    assert invoke("init", "data", "--out", "my.toml").exit_code == 0
    result = invoke("stream", "--scenario", "my.toml", "--bank", "bank", "--run-dir", "run")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == ("error: scenario 'data' cannot start: 1 missing piece (nothing was trained, no bank was "
                        "written)")
    assert one_line(" ".join(lines[1:])).startswith(
        f"- task 'shapes': {tmp_path}/data/shapes/test/round/0.png is not a readable image")
    assert not (tmp_path / "bank").exists() and not (tmp_path / "run").exists()

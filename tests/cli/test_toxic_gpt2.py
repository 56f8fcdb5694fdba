"""The paper's GPT-2 path, ``scenarios/toxic-gpt2.toml``, through the ``editkit`` command.

Offline with nothing local, ``stream --check`` and ``negate toxic-gpt2`` list every missing piece (model,
both datasets, the scorer's checkpoint and tokenizer), one line each, and train nothing. With a tiny
random GPT-2 saved as the hub id ``gpt2``, generated Civil Comments / WikiText-103 parquet and a tiny
Detoxify checkpoint and BERT tokenizer, all in generated Hugging Face cache layouts, a copy of the
scenario with small sizes passes ``--check`` and streams two steps into a bank.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from editkit import settings
from editkit.bank.store import Bank
from editkit.cli import app
from editkit.eval.toxicity import DETOXIFY_URL, detoxify_checkpoint
from helpers.scenarios import assert_refused_before_work, write_toml
from helpers.hub import bpe_tokenizer, fast_tokenizer, hub_repo
from helpers.models import gpt2

#: The scenario files of this checkout (the installed package may point elsewhere).
SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
TOXIC = ["You are a stupid idiot and a clown", "Shut up you moron, nobody asked", "Pathetic loser, go away now",
         "What a dumb and worthless troll you are", "Idiots like you ruin every single thread here"]
CLEAN = [" = Valkyria Chronicles = \n", " The game is played in turns on a map . \n",
         " = Tower Building = \n", " The tower is tall and was built in 1900 . \n"]
runner = CliRunner()


def _civil_comments(directory: Path) -> None:
    (directory / "data").mkdir()
    splits = {"train": TOXIC * 3 + ["A lovely morning"], "validation": TOXIC[::-1] + ["Ugly stupid liars"],
              "test": ["Clowns and crooks run this whole rotten town", "Morons, all of them, every one"]}
    for split, rows in splits.items():
        toxicity = pa.array([0.1 if "lovely" in r else 0.9 for r in rows], pa.float32())
        table = pa.table({"text": rows, "toxicity": toxicity})
        pq.write_table(table, directory / "data" / f"{split}-00000-of-00001.parquet")


def _wikitext(directory: Path) -> None:
    (directory / "wikitext-103-raw-v1").mkdir()
    for split in ("train", "validation", "test"):
        path = directory / "wikitext-103-raw-v1" / f"{split}-00000-of-00001.parquet"
        pq.write_table(pa.table({"text": CLEAN * 4}), path)


def _bert(directory: Path) -> None:
    import transformers

    transformers.BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8, num_labels=6).save_pretrained(directory)
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])}
                               ).save_pretrained(directory)


def _gpt2(directory: Path) -> None:
    bpe = bpe_tokenizer(TOXIC + CLEAN)
    gpt2(vocab_size=bpe.get_vocab_size(), n_positions=64, n_layer=2).save_pretrained(directory)
    fast_tokenizer(bpe).save_pretrained(directory)


@pytest.mark.parametrize("command", [["stream", "--scenario", "toxic-gpt2", "--check"], ["negate", "toxic-gpt2"]])
def test_offline_every_missing_piece_is_one_line_before_any_work(offline, tmp_path, command):
    result = runner.invoke(app, command)
    assert result.exit_code == 1
    hub = offline
    expected = [
        f"gpt2 is not in the Hugging Face cache at {hub}: on a machine with internet run `hf download gpt2`",
        f"the dataset google/civil_comments is not in {hub}: on a machine with internet run "
        "`hf download google/civil_comments --repo-type dataset`",
        f"the dataset Salesforce/wikitext is not in {hub}: on a machine with internet run "
        '`hf download Salesforce/wikitext --repo-type dataset --include "wikitext-103-raw-v1/*"`',
        f"the Detoxify checkpoint {detoxify_checkpoint()} does not exist: on a machine with internet download "
        f"{DETOXIFY_URL}",
        f"the Detoxify config and tokenizer bert-base-uncased are neither a directory nor in the Hugging Face "
        f"cache at {hub}: on a machine with internet run `hf download bert-base-uncased "]
    assert_refused_before_work(result.output, "toxic-gpt2", expected, tmp_path)


def _small_copy(directory: Path, hub: Path) -> Path:
    """toxic-gpt2 with the model looked up in ``hub`` and sizes fit for a tiny model (recipe kept)."""
    data = tomllib.loads((SCENARIOS / "toxic-gpt2.toml").read_text())
    data["backbone"]["hub_cache"] = str(hub)
    data["data"].update(max_length=16, eval_blocks=4)
    data["generic"].update(max_length=16, size=8)
    data["recipe"].update(batch_size=2, reg_batch=2)
    return write_toml(data, directory / "toxic-gpt2.toml")


@pytest.mark.slow
def test_tiny_gpt2_streams_two_steps_from_local_copies(offline, tmp_path, monkeypatch):
    hub, data = offline, tmp_path / "data"
    hub_repo(hub, "gpt2", _gpt2)
    hub_repo(hub, "bert-base-uncased", _bert)
    hub_repo(data, "google/civil_comments", _civil_comments, kind="datasets")
    hub_repo(data, "Salesforce/wikitext", _wikitext, kind="datasets")
    monkeypatch.setenv(settings.DATA_ENV, str(data))  # the datasets are read from $EDITKIT_DATA, not the hub cache
    checkpoint = detoxify_checkpoint()
    checkpoint.parent.mkdir(parents=True)
    torch.save({"state_dict": {}, "config": {}}, checkpoint)  # --check looks for the file; the stream never scores
    scenario = _small_copy(tmp_path, hub)

    check = runner.invoke(app, ["stream", "--scenario", str(scenario), "--check"])
    assert check.exit_code == 0 and "ok" in check.output, check.output
    result = runner.invoke(app, ["stream", "--scenario", str(scenario), "--steps", "2",
                                 "--bank", str(tmp_path / "bank"), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["scenario"] == "toxic-gpt2" and report["mode"] == "taujp"
    assert report["recipe"]["steps"] == 2 and report["recipe"]["penalty_on"] == "logits"
    assert report["recipe"]["lr"] == 1e-5 and report["recipe"]["weight_decay"] == 0.1
    bank = Bank(tmp_path / "bank")
    assert bank.names() == ["toxic-gpt2"] and bank.verify() == []
    tau = bank.load("toxic-gpt2")
    assert {name.split(".")[1] for name in tau if name.startswith("layers.")} == {"0", "1"}  # every block is theta
    assert any(value.abs().sum() > 0 for value in tau.values())

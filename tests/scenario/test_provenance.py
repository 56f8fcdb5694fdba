"""Provenance answered once: the base-model refusal and the stale-vector line, whoever asks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.errors import BankError, IncompatibleVectorsError
from editkit.models.backbone import Backbone
from editkit.scenario.provenance import check_base, refuse_stale, staleness


def _bank(tmp_path, base: str) -> Bank:
    bank = Bank(tmp_path / "bank")
    bank.append("a", {"w": torch.zeros(2)}, task="a", mode="linear", base=base, scenario="s",
                recipe={"mode": "linear", "lr": 0.01, "steps": 5}, provenance={"precision": "fp32"})
    return bank


def test_a_bank_of_another_base_is_refused_in_one_wording_naming_both(tmp_path):
    backbone = Backbone(name="tiny", module=nn.Linear(2, 2), feature_dim=2)
    bank = _bank(tmp_path, "sha256:" + "0" * 64)
    fingerprint = backbone.fingerprint()
    messages = []
    for args in ((bank, backbone), (bank, "tiny", fingerprint), (bank.base, backbone)):
        with pytest.raises(IncompatibleVectorsError) as refused:
            check_base(*args)
        messages.append(str(refused.value))
    assert all("was built on another base model than tiny" in m and fingerprint[:19] in m and "sha256:000000" in m
               for m in messages)
    assert str(bank.root) in messages[0] and messages[0] == messages[1]
    check_base(_bank(tmp_path / "same", fingerprint), backbone)  # its own base: nothing to refuse
    check_base(Bank(tmp_path / "empty"), backbone)  # a bank without vectors fits any model


def test_staleness_names_each_field_banked_and_now(tmp_path):
    bank = _bank(tmp_path, "sha256:" + "1" * 64)
    entry = bank.get("a")
    assert staleness(entry, entry.recipe, scenario="s", precision="fp32") == ""
    assert staleness(entry, entry.recipe, scenario="other") == "scenario 's' banked, 'other' now"
    line = staleness(entry, {**entry.recipe, "lr": 0.02}, scenario="s", precision="bf16")
    assert line == "lr 0.01 banked, 0.02 now, precision fp32 banked, bf16 now"
    with pytest.raises(BankError, match=r"holds 'a', fine-tuned with another recipe or data than this run's "
                                        r"\(lr 0.01 banked, 0.02 now, precision .*\): remove it"):
        refuse_stale(bank, entry, line, "remove it")
    refuse_stale(bank, entry, "", "remove it")  # nothing differs: nothing refused

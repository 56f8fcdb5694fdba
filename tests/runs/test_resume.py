"""A resumed stream banks what an uninterrupted one banks.

Ground truth: the same stream run without interruption. The penalty's unlabeled sources are shared by
all of a stream's experiences, so a later task's reg batches depend on what earlier tasks drew; a resume
that restarted the sources would bank different vectors for every task after the interruption.
"""

from __future__ import annotations

import pytest
import torch

from editkit.bank.store import Bank
from editkit.errors import BankError

from helpers.streams import NAMES, stream


def vectors(root) -> dict[str, dict[str, torch.Tensor]]:
    bank = Bank(root)
    return {name: bank.load(name) for name in bank.names()}


def bit_equal(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


def test_a_resumed_stream_banks_the_vectors_of_an_uninterrupted_one(tmp_path):
    fresh = stream(tmp_path / "fresh")
    stream(tmp_path / "resumed", names=NAMES[:2])
    resumed = stream(tmp_path / "resumed", resume=True)
    assert [r.resumed for r in resumed.steps] == [True, True, False, False]
    assert bit_equal(vectors(tmp_path / "resumed"), vectors(tmp_path / "fresh"))
    assert [(r.single_task, r.merged) for r in resumed.steps] == [(r.single_task, r.merged) for r in fresh.steps]


def test_the_reg_batches_matter_to_the_vectors(tmp_path, monkeypatch):
    """The test above can fail: restarting the sources at the resume changes the later vectors."""
    stream(tmp_path / "fresh")
    stream(tmp_path / "restarted", names=NAMES[:2])
    monkeypatch.setattr("editkit.runs.stream.StreamRunner.skip_draws", lambda self, t: None)
    stream(tmp_path / "restarted", resume=True)
    fresh, restarted = vectors(tmp_path / "fresh"), vectors(tmp_path / "restarted")
    assert bit_equal({n: fresh[n] for n in NAMES[:2]}, {n: restarted[n] for n in NAMES[:2]})
    assert not bit_equal({n: fresh[n] for n in NAMES[2:]}, {n: restarted[n] for n in NAMES[2:]})


def test_a_resume_with_another_recipe_is_refused_by_field_and_changes_nothing(tmp_path):
    stream(tmp_path / "bank", names=NAMES[:2])
    before = vectors(tmp_path / "bank")
    with pytest.raises(BankError, match=r"holds 'a', fine-tuned with another recipe or data than this run's "
                                        r"\(lam 0\.1 banked, 0\.5 now, lr 0\.05 banked, 0\.01 now\)"):
        stream(tmp_path / "bank", resume=True, recipe_fields={"lam": 0.5, "lr": 1e-2})
    assert bit_equal(vectors(tmp_path / "bank"), before)

"""Banks that say when they are stale, and a bank another run is writing.

A language scenario's vector is reused by ``negate`` / ``generate`` only if it is what a stream of the scenario
would fine-tune now: after the scenario file changes one recipe field, one task option and the precision, the refusal
names each, banked and now, says how to proceed, and writes nothing. A second stream on a bank that another process holds is
refused before it trains anything, naming the other run; a refusal names the command that mends it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from editkit.bank.store import Bank
from editkit.errors import BankError
from editkit.runs.negate_lm import ensure_vector
from editkit.scenario.spec import load_scenario
from editkit.train import runtime as runtime_module
from helpers.cli import invoke, one_line_refusal
from helpers.exports import rude_scenario

pytestmark = pytest.mark.slow  # a short stream of a tiny language model


def test_a_bank_from_before_the_scenario_changed_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime_module, "native_bf16", lambda device: True)  # bf16 stays bf16 on any CPU
    with rude_scenario(tmp_path, "stale") as (scenario, _):
        bank_dir = tmp_path / "bank"
        result = invoke("stream", "--scenario", scenario, "--bank", bank_dir, "--run-dir", tmp_path / "stream")
        assert result.exit_code == 0, result.output
        assert ensure_vector(load_scenario(scenario), "rude", bank_dir).names() == ["rude"]  # current: reused
        manifest = (bank_dir / "manifest.json").read_bytes()

        text = scenario.read_text()
        changed = text.replace("lr = 0.01", "lr = 0.02").replace("max_length = 16", "max_length = 12")
        scenario.write_text(changed.replace("\n[", '\nprecision = "bf16"\n\n[', 1))  # a top-level key
        assert load_scenario(scenario).precision == "bf16"
        with pytest.raises(BankError) as refused:
            ensure_vector(load_scenario(scenario), "rude", bank_dir)
        message = str(refused.value)
        assert "lr 0.01 banked, 0.02 now" in message and "task option max_length 16 banked, 12 now" in message
        assert "precision fp32 banked, bf16 now" in message
        assert f"editkit bank remove rude --bank {bank_dir}" in message and "pass --bank DIR" in message
        assert (bank_dir / "manifest.json").read_bytes() == manifest  # nothing written
        assert sorted(p.name for p in bank_dir.iterdir() if not p.name.startswith(".")) == [
            "manifest.json", "rude.safetensors"]


HOLDER = textwrap.dedent("""
    import sys, time
    from editkit.bank.store import Bank
    with Bank(sys.argv[1]).writer("editkit stream --scenario elsewhere"):
        print("held", flush=True)
        time.sleep(120)
""")


def test_a_stream_on_a_bank_another_run_is_writing_is_refused_before_it_trains(tmp_path):
    with rude_scenario(tmp_path, "held") as (scenario, _):
        bank_dir = tmp_path / "bank"
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(bank_dir)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            result = invoke("stream", "--scenario", scenario, "--bank", bank_dir, "--run-dir", tmp_path / "run")
        finally:
            holder.kill()
            holder.wait()
        one_line_refusal(result, f"bank {bank_dir} is being written by another run (`editkit stream --scenario "
                                 "elsewhere`, process")
        assert "pass another --bank directory" in " ".join(result.stderr.split())
        assert Bank(bank_dir).names() == []  # nothing trained, nothing banked
        result = invoke("stream", "--scenario", scenario, "--bank", bank_dir, "--run-dir", tmp_path / "run")
        assert result.exit_code == 0, result.output  # the hold went with its process


def test_a_vector_name_taken_is_refused_with_the_command_that_frees_it(tmp_path):
    import torch

    bank = Bank(tmp_path / "bank")
    bank.append("a", {"w": torch.zeros(2)}, task="a", mode="nonlinear", base="sha256:" + "0" * 64)
    with pytest.raises(BankError, match=rf"remove it first \(editkit bank remove a --bank {tmp_path / 'bank'}\)"):
        bank.append("a", {"w": torch.ones(2)}, task="a", mode="nonlinear", base="sha256:" + "0" * 64)

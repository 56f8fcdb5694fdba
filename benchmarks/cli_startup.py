"""Seconds until ``editkit --help``, ``editkit scenarios`` and ``editkit bank list`` answer, beside ``python -c pass``.

None of the three needs torch, which alone takes seconds to import; each should answer within half a
second. Beside the bare interpreter, a one-command Typer app is timed too: what any Typer command costs
(Typer parses options through pydantic), so what is editkit's own shows. Each command runs as a new
process, the commands in turn ``--rounds`` times (so a slow spell of a shared machine falls on all of
them alike); prints each one's median wall-clock seconds and its ratio to the bare interpreter's, and
writes them as JSON.

    python benchmarks/cli_startup.py [--rounds 5] [--json runs/cli_startup.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from editkit.bank.store import Bank

#: What each editkit command answers within, in seconds.
TARGET_SECONDS = 0.5
BARE = "python -c pass"
#: The least a Typer command costs: one command with one option, run.
TYPER_APP = "import typer\napp = typer.Typer()\n@app.command()\ndef run(flag: bool = False):\n    pass\napp()"


def commands(bank: Path) -> dict[str, list[str]]:
    editkit = [sys.executable, "-m", "editkit"]
    return {BARE: [sys.executable, "-c", "pass"], "a Typer command": [sys.executable, "-c", TYPER_APP],
            "editkit --help": [*editkit, "--help"], "editkit scenarios": [*editkit, "scenarios"],
            "editkit bank list": [*editkit, "bank", "list", "--bank", str(bank)]}


def seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def small_bank(root: Path) -> Path:
    """A bank of two tiny vectors: ``bank list`` reads a real manifest."""
    bank = Bank(root / "bank")
    for name in ("a", "b"):
        bank.append(name, {"w": torch.ones(4)}, task=name, mode="nonlinear", base="sha256:0")
    return bank.root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (the median is reported)")
    parser.add_argument("--json", type=Path, default=Path("runs/cli_startup.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        argvs = commands(small_bank(Path(tmp)))
        times: dict[str, list[float]] = {name: [] for name in argvs}
        for _ in range(args.rounds):
            for name, argv in argvs.items():
                times[name].append(seconds(argv))
    median = {name: statistics.median(values) for name, values in times.items()}
    bare = median[BARE]
    editkit = {name: value for name, value in median.items() if name.startswith("editkit")}
    report = {"rounds": args.rounds, "target_seconds": TARGET_SECONDS, "seconds": median,
              "over_python": {name: value / bare for name, value in median.items() if name != BARE},
              "all_seconds": times, "met": all(value <= TARGET_SECONDS for value in editkit.values())}
    for name, value in median.items():
        ratio = "" if name == BARE else f"  ({value / bare:.1f} x {BARE})"
        print(f"{name:>18}: {value:.3f} s{ratio}")
    print(f"target {TARGET_SECONDS} s: {'met' if report['met'] else 'NOT met'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"written {args.json}")


if __name__ == "__main__":
    main()

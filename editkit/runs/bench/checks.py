"""What the bench refuses before it trains anything: a bank it cannot reuse or extend, heads it cannot sweep.

Every check runs on the built scenario and the banks' headers only (no vector is read), so a bench that would fail
on its second stream fails before its first.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch import nn

from editkit.bank.store import Bank
from editkit.errors import BankError, ConfigError, IncompatibleVectorsError
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import check_base, refuse_stale, staleness
from editkit.scenario.spec import ScenarioSpec


def check_bank(bank: Bank, *, scenario: str, tasks: Sequence[str], mode: str, recipes: Mapping[str, Mapping[str, Any]],
               base: str, backbone: str, shapes: Mapping[str, tuple[int, ...]] | None = None,
               spec: ScenarioSpec | None = None, build: BuildOptions | None = None) -> None:
    """Refuse a bank this bench cannot reuse or extend: other base, tasks, mode, scenario or recipe
    (``recipes``: each task's resolved recipe, as the stream records it), other task options than ``spec``'s with
    ``build`` (where the bank recorded them), or (given the backbone's parameter ``shapes``) vectors whose tensors
    do not fit the backbone."""
    if not bank.exists() or not len(bank):
        return
    check_base(bank, backbone, base)
    for entry in bank.entries():
        where = f"bank {bank.root} holds vector {entry.name!r}"
        if entry.name not in tasks or entry.task != entry.name:
            raise BankError(f"{where} for task {entry.task!r}, which is not a task of scenario {scenario!r} "
                            f"({', '.join(tasks)}); pass another --bank-root or remove it")
        if entry.mode != mode:
            raise BankError(f"{where} of mode {entry.mode!r}, expected {mode!r}; pass another --bank-root")
        refuse_stale(bank, entry, staleness(entry, recipes[entry.name], scenario=spec or scenario, build=build),
                     f"use the same recipe options (--steps, --seed...), another --bank-root, or remove it (editkit "
                     f"bank remove {entry.name} --bank {bank.root})")
        if shapes is not None:
            _check_layout(bank, entry, shapes, backbone)


def _check_layout(bank: Bank, entry, shapes: Mapping[str, tuple[int, ...]], backbone: str) -> None:
    """The vector's tensor names and shapes (read from the file header only) fit the backbone."""
    stored = bank.shapes(entry.name)
    unknown = sorted(set(stored) - set(shapes))
    wrong = sorted(k for k in set(stored) & set(shapes) if stored[k] != tuple(shapes[k]))
    if unknown or wrong:
        detail = (f"parameters the backbone lacks: {unknown[:3]}" if unknown else
                  f"shape of {wrong[0]!r} is {stored[wrong[0]]}, the backbone's {tuple(shapes[wrong[0]])}")
        raise IncompatibleVectorsError(f"bank {bank.root}: vector {entry.name!r} does not fit {backbone} ({detail})")


def refuse_unswept_heads(scenario: str, heads: Mapping[str, nn.Module]) -> None:
    """The coefficient sweeps score a class head's argmax over features; a head with an objective of its own
    (text-to-text) is scored by running the model, which ``editkit stream`` and ``editkit add`` do."""
    other = sorted({h.objective for h in heads.values() if getattr(h, "objective", None) is not None})
    if other:
        raise ConfigError(f"editkit bench sweeps classification heads; the heads of {scenario!r} are {', '.join(other)}: "
                          f"score its vectors with editkit stream and editkit add")

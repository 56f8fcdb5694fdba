"""What a strategy did, kept under the bank root: a selection trial's score and a finished run's result.

A mode's stream leaves a bank that a re-run reuses; a strategy leaves nothing, so a bench re-run (more seeds, one
more merge method, a driver that died, a run refused after its trials) trained every strategy again: on split-mnist
with seven strategies, half an hour. Each strategy run is therefore recorded beside the banks, with everything it
depended on (:func:`strategy_key`), and read back only when a re-run asks for exactly that: the rule of the machine's
keyed cache (:func:`~editkit.core.derived_cache.cached_at`: read when whole and made for the key, else computed
and written whole). The scenario enters by its file's content, not its path, so nodes of a cluster that installed
editkit at different paths read each other's records.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from editkit.core.derived_cache import cached_at
from editkit.train.recipe import plain_training

T = TypeVar("T")


@dataclass(frozen=True)
class StrategyRecord:
    """Where one strategy run's outcome is kept, and what of the scenario it ran on (its file's content, build
    options, every task's source options)."""

    path: Path
    scenario: Mapping[str, Any]

    @classmethod
    def trial(cls, config, spec, name: str, index: int) -> "StrategyRecord":
        """A selection trial's score: ``<bank-root>/tune/trial-<i>/<scenario>-<strategy>.json``, beside the
        streams' trial banks."""
        return cls._at(config, spec, Path("tune") / f"trial-{index}" / f"{spec.name}-{name}.json")

    @classmethod
    def run(cls, config, spec, name: str, protocol: str) -> "StrategyRecord":
        """A finished run's result: ``<bank-root>/strategies/<scenario>-<strategy>-<protocol>.json``, beside the
        streams' banks of the same seed, order and selection."""
        return cls._at(config, spec, Path("strategies") / f"{spec.name}-{name}-{protocol}.json")

    @classmethod
    def _at(cls, config, spec, where: Path) -> "StrategyRecord":
        from editkit.scenario.provenance import scenario_identity

        return cls(Path(config.bank_root) / where, scenario_identity(spec, config.build))


def strategy_key(record: StrategyRecord, name: str, built, recipes: Sequence, options: Mapping[str, Any],
                 protocols: Sequence[str], runtime, **more: Any) -> dict[str, Any]:
    """Everything a strategy run's outcome depends on: the strategy, its options, every task's recipe as a plain
    network's training reads it (:func:`~editkit.train.recipe.plain_training`: a bench whose tauJp rows run another
    lambda or ``--from-sum`` reads the strategies' records back) and the stream's order, the protocols, theta_0,
    the scenario, and the numerics (threads, device, precision, layout, the torch and Avalanche releases: a row
    moves with the thread count); ``more``: what else the caller's run depends on."""
    return json.loads(json.dumps({
        "strategy": name, "options": dict(options), "recipes": [plain_training(r) for r in recipes],
        "tasks": [t.name for t in built.tasks], "protocols": list(protocols), "base": built.backbone.fingerprint(),
        "scenario": record.scenario, "threads": torch.get_num_threads(), "device": runtime.device.type,
        "precision": runtime.precision, "channels_last": runtime.channels_last,
        "releases": {"torch": torch.__version__, "avalanche": version("avalanche-lib")}, **more,
    }, default=str))


def recorded(record: StrategyRecord, key: dict[str, Any], compute: Callable[[], T], *,
             encode: Callable[[T], Any], decode: Callable[[Any], T]) -> tuple[T, bool]:
    """(the outcome recorded under ``key``, True) when ``record`` holds it, else (``compute()``'s, False), then
    recorded. ``encode`` / ``decode``: the outcome to and from JSON."""
    ran = []

    def run() -> T:
        ran.append(True)
        return compute()

    def load(path: Path, wanted: dict[str, Any]) -> T | None:
        stored = json.loads(path.read_text())
        return decode(stored["value"]) if stored["key"] == wanted else None

    def save(path: Path, stored_key: dict[str, Any], value: T) -> None:
        path.write_text(json.dumps({"key": stored_key, "value": encode(value)}, indent=1, sort_keys=True))

    value = cached_at(record.path, key, run, load=load, save=save)
    return value, not ran


def recorded_run(record: StrategyRecord, key: dict[str, Any], compute: Callable[[], Any]) -> tuple[Any, bool]:
    """A strategy's :class:`~editkit.integrations.avalanche.strategies.StrategyResult`, recorded (its seconds
    and peak memory are the run's that made it)."""
    from editkit.integrations.avalanche.strategies import StrategyResult

    return recorded(record, key, compute, encode=dataclasses.asdict, decode=lambda v: StrategyResult(**v))

"""editkit: continual-learning model editing with linearized fine-tuning and tauJp.

The names in ``__all__`` are the stable API: import them from ``editkit``
(``from editkit import Bank, run_scenario``), not from the module that defines them
today, so a script survives the packages being reorganised. Each is imported on
first use (PEP 562), because ``import editkit`` must stay cheap: the command line
imports it to answer ``--help``, and most names pull in torch and more.

A public name that is renamed keeps its old name in ``_MOVED`` for one release: it
still works, with a ``DeprecationWarning`` naming the new one.

``import editkit`` also arranges for torchvision to import next to the CPU build of
torch, when something first imports it (see ``_compat``), so open_clip and avalanche
work on a fresh CPU machine.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from editkit._compat import install_torchvision_shim

install_torchvision_shim()

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_PUBLIC: dict[str, str] = {
    # the task-vector bank and the vectors in it
    "Bank": "editkit.bank.store",
    "VectorEntry": "editkit.bank.store",
    "TaskVector": "editkit.merge.arithmetic",
    # running a stream
    "run_scenario": "editkit.runs.stream",
    "run_benchmark": "editkit.runs.stream",
    "StreamResult": "editkit.runs.records",
    "Recipe": "editkit.train.recipe",
    "Runtime": "editkit.train.runtime",
    # editing with banked vectors
    "add": "editkit.runs.edit",
    "negate": "editkit.runs.edit",
    "EditResult": "editkit.runs.edit",
    "negate_language": "editkit.runs.negate_lm",
    "export_vectors": "editkit.runs.export",
    "export_edit": "editkit.runs.export",
    "predict": "editkit.runs.predict",
    "read_export": "editkit.io.read",
    "import_peft_adapter": "editkit.io.peft",
    # scenario files
    "load_scenario": "editkit.scenario.spec",
    "known_scenarios": "editkit.scenario.spec",
    "ScenarioSpec": "editkit.scenario.spec",
    "check_scenario": "editkit.scenario.build",
    "build_scenario": "editkit.scenario.build",
    "BuiltScenario": "editkit.scenario.build",
    "BuildOptions": "editkit.scenario.options",
    # extensions: the registries, what they hold, what builders return
    "Registry": "editkit.core.registry",
    "Record": "editkit.core.registry",
    "Option": "editkit.core.registry",
    "BACKBONES": "editkit.models",
    "HEADS": "editkit.models",
    "TASK_SOURCES": "editkit.data",
    "GENERIC_SOURCES": "editkit.data",
    "TEXT_CORPORA": "editkit.data",
    "LABELLED_TEXTS": "editkit.data",
    "MERGE_METHODS": "editkit.merge",
    "TOXICITY_SCORERS": "editkit.eval.toxicity",
    "LOGGERS": "editkit.runs.loggers",
    "STRATEGIES": "editkit.integrations.avalanche.strategies",
    "Backbone": "editkit.models.backbone",
    "NativeWeights": "editkit.models.backbone",
    "TaskData": "editkit.data.tasks",
    # inside an Avalanche script
    "TauJpPlugin": "editkit.integrations.avalanche.plugin",
    "MultiHeadTaskModel": "editkit.integrations.avalanche.multitask",
    "MergedAccuracy": "editkit.integrations.avalanche.metrics",
    "StepBudget": "editkit.integrations.avalanche.plugin",
    "run_strategy": "editkit.integrations.avalanche.strategies",
    # errors
    "EditkitError": "editkit.errors",
    "ConfigError": "editkit.errors",
    "MissingResourceError": "editkit.errors",
    "DataError": "editkit.errors",
    "BankError": "editkit.errors",
    "IncompatibleVectorsError": "editkit.errors",
    "CorruptVectorError": "editkit.errors",
}

#: Renamed public name -> its new name; kept for one release after the rename.
_MOVED: dict[str, str] = {}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        new = _MOVED[name]
        warnings.warn(f"editkit.{name} is now editkit.{new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return __getattr__(new)
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'editkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

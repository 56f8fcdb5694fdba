"""What each row of the bench keeps of earlier tasks, in items and bytes.

A continual method's accuracy is bought with memory of the past: Replay keeps labelled examples, LwF a copy of the
model, EWC and SI importances, and editkit's streams keep their own. Counted here for the streams (the strategies
count theirs from Avalanche's objects, :mod:`editkit.integrations.avalanche.strategies`), after the last task,
of the tasks before it:

- **vectors**: every stream banks one vector per task (the bank's files). Task arithmetic at alpha = 1 needs only
  their running sum, one model's worth; a tuned coefficient and every other merge method read each vector.
- **unlabeled inputs**: the tauJp penalty (``penalty = "inputs"``) draws each step from every earlier task's
  unlabeled inputs, so it keeps them all (their bytes as the data source gives them, counted on up to
  :data:`SAMPLED` examples and scaled to the split).
- **curvature**: the data-free penalty (``penalty = "kfac"``) keeps each earlier task's Kronecker factors instead.
- **generic inputs**: the scenario's generic source, no task's data, a part of its own for either penalty: the
  inputs penalty draws from it, the data-free one computes its curvature from it at the start of each stream.
- **class statistics**: under the class-incremental protocol, each earlier task's class prototypes, one fp32
  vector of features per class, and its within-class scatter, one fp32 features x features matrix (the set the
  row classifies with: a stream's merged-model ones; theta_0's row its own). The head needs only the scatters'
  sum, so a stream could keep one matrix; the bank keeps one per task, which is what is counted.

Each row's entry is ``{"what", "items", "bytes", "mib", "parts": [...]}``, the parts' sums in the first four.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from editkit.core.taujp import input_accessor
from editkit.util.memory import nbytes

#: Examples of a data source whose bytes are counted; the rest are taken to be as large on average.
SAMPLED = 64


def part(what: str, items: int, size: int) -> dict[str, Any]:
    return {"what": what, "items": int(items), "bytes": int(size)}


def total(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A row's entry: its parts and their sums, bytes also in MiB as tables show them (nothing kept: items and
    bytes 0, ``what`` "nothing")."""
    kept = [p for p in parts if p["items"]]
    size = sum(p["bytes"] for p in kept)
    return {"what": "; ".join(p["what"] for p in kept) or "nothing",
            "items": sum(p["items"] for p in kept), "bytes": size, "mib": size / 2**20, "parts": kept}


def inputs_bytes(count: int, read: Callable[[int], Any]) -> int:
    """The bytes of ``count`` inputs, ``read(i)`` giving input ``i``: counted on up to :data:`SAMPLED` of them
    evenly spread and scaled to ``count`` (texts differ in length; images do not)."""
    if not count:
        return 0
    sizes = [nbytes(read(i)) for i in range(0, count, max(1, count // SAMPLED))]
    return round(sum(sizes) / len(sizes) * count)


def _files(bank, names: Iterable[str], field: str) -> tuple[int, int]:
    """(how many of ``names``' entries have a file under ``field``, their bytes on disk)."""
    found = [entry for entry in bank.entries() if entry.name in set(names)]
    paths = [Path(bank.root) / (entry.file if field == "file" else getattr(entry, field).get("file", ""))
             for entry in found if field == "file" or getattr(entry, field).get("file")]
    return len(paths), sum(p.stat().st_size for p in paths if p.is_file())


def stream_kept(state, built, tasks: Sequence[str], protocols: Sequence[str]) -> dict[str, Any]:
    """What a stream (a :class:`~editkit.runs.bench.report.ModeState` over ``built``) keeps of the tasks before
    its last one (see the module docstring)."""
    earlier, recipe = list(tasks[:-1]), state.recipe
    parts = [part("vectors", *_files(state.bank, earlier, "file"))]
    if recipe.regularized and recipe.penalty == "inputs":
        sources = [built.task(t).train for t in earlier]
        parts.append(part("unlabeled inputs of every earlier task", sum(map(len, sources)),
                          sum(inputs_bytes(len(s), input_accessor(s)) for s in sources)))
    if recipe.regularized and recipe.penalty == "kfac":
        parts.append(part("curvature of every earlier task", *_files(state.bank, earlier, "curvature")))
    if recipe.regularized and recipe.generic and built.generic is not None:
        generic = built.generic
        parts.append(part("generic unlabeled inputs", len(generic),
                          inputs_bytes(len(generic), lambda i: generic.load([i]))))
    if "class" in protocols:
        parts.append(prototypes_part(state.bank, earlier))
    return total(parts)


def prototypes_part(bank, names: Iterable[str]) -> dict[str, Any]:
    """One set of class statistics of each of ``names``' entries: a class per item, an fp32 feature vector each,
    and one fp32 scatter matrix a task (what :meth:`~editkit.core.prototypes.Prototypes.describe` recorded in the
    manifest)."""
    described = [entry.prototypes for entry in bank.entries() if entry.name in set(names) and entry.prototypes]
    return part("class statistics", sum(d["classes"] for d in described),
                sum(4 * (d["classes"] + d["features"]) * d["features"] for d in described))


def pretrained_kept(states: Mapping[str, Any], tasks: Sequence[str], protocols: Sequence[str]) -> dict[str, Any]:
    """theta_0's row: nothing under the task protocol (its heads are the scenario's), its own class statistics of
    the earlier tasks under the class protocol (any stream's bank holds them: theta_0 is every stream's)."""
    if "class" not in protocols:
        return total([])
    return total([prototypes_part(next(iter(states.values())).bank, tasks[:-1])])

"""Edited models to take away, and model formats in and out: what ``--out DIR`` writes.

``editkit add --out DIR`` and ``editkit negate --out DIR`` write a directory that needs nothing of editkit:

- ``model.pt2``: the model that was scored, heads included, as a ``torch.export`` program
  (:mod:`~editkit.runs.export.program`): f_lin for linearized vectors, f at theta_0 + delta otherwise; checked
  against editkit's own logits before the directory is kept;
- the family's own format of the weights theta_0 + delta and ``heads.safetensors``
  (:mod:`~editkit.runs.export.native`); for a LoRA vector, its PEFT adapter in ``adapter/``
  (:mod:`~editkit.runs.export.peft_io`);
- ``editkit.json`` and ``README.md`` (:mod:`~editkit.runs.export.card`): inputs, tasks, provenance and numbers.

A causal language model's take-away model is its Hugging Face directory (generation needs it): no program is
written for it, the directory is the model, as before.

Before anything is written (the CLI checks before any heavy work): ``--out`` that is a file, or a non-empty
directory without ``force``, is refused; a model whose fingerprint is not the vectors' base is refused. Everything
is written into a hidden temporary sibling and renamed into place in one step
(:func:`editkit.util.atomic.atomic_dir`): a crash or a refused program leaves nothing half-written, and with
``force`` the old content stays until the new is whole.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from editkit.bank.store import Bank
from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.merge.arithmetic import TaskVector, combine, negation_coefficients
from editkit.models.backbone import Backbone
from editkit.runs.edit import EditResult, find_scenario, recorded_build
from editkit.runs.export.card import CARD_FILE, MANIFEST_FILE, SCORE_KEYS, computes, model_card, provenance_of
from editkit.runs.export.native import (AUTO_CLASSES, HEADS_FILE, head_kind, loads, native_format, write_heads,
                                        write_weights)
from editkit.runs.export.peft_io import ADAPTER_SUBDIR, Adapter, adapter_factors, write_adapter
from editkit.runs.export.program import PROGRAM_FILE, quiet_export, trace, verify
from editkit.scenario.build import BuiltScenario, build_backbone, build_scenario
from editkit.scenario.options import BuildOptions
from editkit.train.recipe import attach_adapter
from editkit.util.atomic import atomic_dir

log = logging.getLogger(__name__)

__all__ = ["AUTO_CLASSES", "CARD_FILE", "MANIFEST_FILE", "PROGRAM_FILE", "bank_backbone", "check_target",
           "export_edit", "export_negation", "export_vectors", "write_export"]


# --------------------------------------------------------------------------- checks (cheap, before any work)


def check_target(out: Path | str, *, force: bool = False) -> Path:
    """Refuse ``out`` before any work: a file, always; a non-empty directory unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: --out names the directory the model is written into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} is a directory that is not empty: pass --force to replace it, or name a "
                          "new directory")
    return out


def check_base(backbone: Backbone, base: str | None) -> None:
    """Refuse writing ``backbone`` edited by vectors whose base fingerprint is not the backbone's own."""
    fingerprint = backbone.fingerprint()
    if base != fingerprint:
        raise IncompatibleVectorsError(
            f"the vectors were fine-tuned from base {str(base)[:19]}…, not from {backbone.name} "
            f"({fingerprint[:19]}…): the model written would be theta_0 of another model plus their tau")


# --------------------------------------------------------------------------- the directory


def _tasks(built: BuiltScenario, names: list[str]) -> list[dict[str, Any]]:
    """The program's tasks in output order: class names, head kind, the length their texts were cut at."""
    tasks = []
    for name in names:
        task = built.task(name)
        entry = {"name": name, "classes": list(task.classes), "head": head_kind(built.heads[name])}
        max_length = getattr(task.test, "max_length", None)
        if max_length is not None:
            entry["max_length"] = max_length
        tasks.append(entry)
    return tasks


def _write_program(tmp: Path, built: BuiltScenario, vector: TaskVector, names: list[str]) -> dict[str, Any] | None:
    """``model.pt2`` of the scored model with the heads of ``names``, checked on their test splits; the manifest's
    ``program``, ``input`` and ``tasks`` (None: the family's own directory is the model)."""
    backbone = built.backbone
    heads = {name: built.heads[name] for name in names}
    probe = backbone.program_inputs()
    if probe is None:
        return None
    for module in (probe.module, backbone.module, *heads.values()):  # a program a CPU loads: traced on the CPU
        module.to("cpu")
    program, inputs = trace(backbone, vector, heads)
    with quiet_export():
        torch.export.save(program, tmp / PROGRAM_FILE)
        loaded = torch.export.load(tmp / PROGRAM_FILE).module()
    checked = verify(loaded, backbone, vector, heads, {name: built.task(name).test for name in names})
    tasks = _tasks(built, names)
    spec = dict(inputs.spec)
    lengths = {t["max_length"] for t in tasks if "max_length" in t}
    if lengths:
        spec["max_length"] = max(lengths)
    return {"program": {"file": PROGRAM_FILE, "inputs": spec.get("names"),
                        "outputs": "a dict: each task's name -> its logits (batch, classes), in the order of tasks",
                        "verified": checked},
            "input": spec, "tasks": tasks}


def write_export(built: BuiltScenario, vector: TaskVector, out: Path | str, *, base: str | None,
                 provenance: Mapping[str, Any], tasks: list[str], force: bool = False,
                 adapter: Adapter | None = None) -> Path:
    """Write the export directory of ``built``'s backbone (theta_0) edited by ``vector`` (see the module docstring).

    base: the fingerprint the vectors were fine-tuned from (the bank's ``base``): it must be the backbone's.
    provenance: what the manifest and card state of its making (:func:`~editkit.runs.export.card.provenance_of`).
    tasks: the tasks whose heads the program carries, in its output order.
    adapter: the same edit as a PEFT adapter (:func:`editkit.runs.export.peft_io.adapter_factors`), written to
        ``DIR/adapter``.
    """
    out = check_target(out, force=force)
    backbone = built.backbone
    check_base(backbone, base)
    names = [t for t in tasks if t in built.heads]
    manifest = dict(provenance)
    with atomic_dir(out, replace=force) as tmp:
        written = _write_program(tmp, built, vector, names)
        if written is not None:
            manifest.update(written)
            manifest["program"]["computes"] = computes(manifest)
        fmt = native_format(backbone)
        files = write_weights(backbone, vector.tensors, tmp, provenance)
        manifest["weights"] = {"format": fmt, "files": files, "model": manifest["edit"], "loads": loads(backbone, fmt)}
        if names and written is not None:
            write_heads({name: built.heads[name] for name in names}, tmp / HEADS_FILE)
            manifest["weights"]["heads"] = HEADS_FILE
        if adapter is not None:
            write_adapter(tmp / ADAPTER_SUBDIR, backbone, *adapter)
            manifest["weights"]["adapter"] = ADAPTER_SUBDIR
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str) + "\n", encoding="utf-8")
        (tmp / CARD_FILE).write_text(model_card(manifest), encoding="utf-8")
    log.info("wrote the edited model to %s", out)
    return out


# --------------------------------------------------------------------------- from the bank


def bank_backbone(bank: Bank, name: str, build: BuildOptions | None = None) -> Backbone:
    """The backbone vector ``name`` was fine-tuned on, built alone (no task data) with the options its stream
    recorded (``build`` laid over them), checked against the bank's base."""
    entry = bank.get(name)
    spec = find_scenario(entry.scenario, entry.provenance.get("scenario_file"))
    backbone = build_backbone(spec, recorded_build(bank, name, build))
    attach_adapter(backbone.module, [entry.recipe])
    check_base(backbone, bank.base)
    return backbone


def bank_scenario(bank: Bank, name: str, build: BuildOptions | None = None) -> BuiltScenario:
    """The scenario vector ``name`` was fine-tuned in, built (data and heads: the program carries the heads, and
    it is checked on the test splits) with the options its stream recorded, its backbone checked against the bank."""
    entry = bank.get(name)
    spec = find_scenario(entry.scenario, entry.provenance.get("scenario_file"))
    built = build_scenario(spec, seed=int(entry.recipe.get("seed", 0)), build=recorded_build(bank, name, build))
    attach_adapter(built.backbone.module, [entry.recipe])
    check_base(built.backbone, bank.base)
    return built


def negation_scores(report: Mapping[str, Any], alpha: float) -> dict[str, Any]:
    """What a language negation's card states: its test rows (the one at ``alpha``, the exported model,
    marked) and scorer."""
    rows = []
    for row in report.get("rows", []):
        keep = {k: row[k] for k in ("model", "alpha", "control", "target", "control_flin", "target_flin",
                                    "toxic_fraction", "toxic_fraction_stderr", "mean_score") if k in row}
        keep["exported"] = row.get("alpha") == alpha
        rows.append(keep)
    tuning = report.get("tuning")
    chosen = (f"chosen on validation by the {tuning['rule']} rule (control perplexity <= {tuning['bound']:.4g}"
              f"{'' if tuning['met'] else ', met by no alpha tried: the best one'})" if tuning else "given")
    return {"rows": rows, "scorer": (report.get("settings") or {}).get("scorer"), "alpha_choice": chosen}


def export_negation(bank: Bank, name: str, out: Path | str, *, alpha: float, report: Mapping[str, Any] | None = None,
                    force: bool = False, build: BuildOptions | None = None) -> Path:
    """Write theta_0 - alpha tau of the language vector ``name`` (``editkit negate NAME --out DIR``): its Hugging
    Face directory is the model. ``report``: the negation's report (``editkit.runs.negate_lm.negate_language``),
    whose test rows (perplexities of these weights and, for linearized vectors, f_lin's; toxicity) go into the card."""
    check_target(out, force=force)
    coefficients = negation_coefficients(name, alpha)
    vector = combine(bank, coefficients)
    backbone = bank_backbone(bank, name, build)
    provenance = provenance_of(bank, coefficients, operation="negate", mode=vector.mode, build=build, alpha=alpha,
                               scores=negation_scores(report, alpha) if report else None)
    entry = bank.get(name)
    built = BuiltScenario(find_scenario(entry.scenario, entry.provenance.get("scenario_file")), backbone, [], {})
    return write_export(built, vector, out, base=bank.base, provenance=provenance, tasks=[], force=force,
                        adapter=adapter_factors(bank, coefficients, "task-arithmetic", vector.tensors, backbone))


def export_edit(result: EditResult, bank: Bank, out: Path | str, *, method: str = "task-arithmetic",
                force: bool = False, build: BuildOptions | None = None) -> Path:
    """Write the model ``editkit add`` or ``editkit negate`` scored (an :class:`~editkit.runs.edit.EditResult`, whose
    scenario holds theta_0, the data and the heads), the heads of the tasks it scored, its report's numbers (the
    weights' own beside the program's for linearized vectors) in the manifest and card."""
    report = result.report
    operation = report["operation"]
    alpha = -next(iter(result.coefficients.values())) if operation == "negate" else None  # theta_0 - alpha tau
    provenance = provenance_of(bank, result.coefficients, operation=operation, mode=result.mode, build=build,
                               method=method, options=report.get("options"), alpha=alpha,
                               scores={k: report[k] for k in SCORE_KEYS if k in report})
    adapter = adapter_factors(bank, result.coefficients, method, result.vector.tensors, result.backbone)
    return write_export(result.built, result.vector, out, base=bank.base, provenance=provenance,
                        tasks=list(report["per_task"]), force=force, adapter=adapter)


def export_vectors(bank: Bank, coefficients: Mapping[str, float], out: Path | str, *, force: bool = False,
                   build: BuildOptions | None = None, scores: Mapping[str, Any] | None = None) -> Path:
    """For scripts: theta_0 + sum alpha_i tau_i of the named bank vectors (``{name: alpha}``; negative for a
    negation), with the heads of their tasks, written without scoring anything (``scores``: numbers of your own
    for the card)."""
    check_target(out, force=force)
    vector: TaskVector = combine(bank, dict(coefficients))
    first = next(iter(coefficients))
    built = bank_scenario(bank, first, build)
    provenance = provenance_of(bank, coefficients, operation="add", mode=vector.mode, build=build, scores=scores)
    return write_export(built, vector, out, base=bank.base, provenance=provenance,
                        tasks=[bank.get(n).task for n in coefficients], force=force,
                        adapter=adapter_factors(bank, coefficients, "task-arithmetic", vector.tensors, built.backbone))

"""The export directory ``--out DIR`` writes: whole, or not at all.

``editkit add --out DIR`` and ``editkit negate --out DIR`` write a directory that needs nothing of editkit:

- ``model.pt2``: the model that was scored, heads included, as a ``torch.export`` program (:mod:`editkit.io.program`):
  f_lin for linearized vectors, f at theta_0 + delta otherwise; checked against editkit's own logits before the
  directory is kept;
- ``model.onnx``: the same program for ONNX Runtime (:mod:`editkit.io.onnx`), checked against the same logits; one
  that cannot be converted, differs, or lacks the optional packages is not written, and the manifest's ``onnx``
  says why in one line;
- the family's own format of the weights theta_0 + delta and ``heads.safetensors`` (:mod:`editkit.io.native`); for
  a LoRA vector, its PEFT adapter in ``adapter/`` (:mod:`editkit.io.peft`);
- ``editkit.json`` and ``README.md`` (:mod:`editkit.io.card`): inputs, tasks, provenance and numbers.

A causal language model's take-away model is its Hugging Face directory (generation needs it): no program is
written for it, the directory is the model.

Before anything is written (the CLI checks before any heavy work, :func:`check_target`, as every writer of a path
the user names does): ``--out`` that is a file, or a non-empty directory without ``force``, is refused; a model
whose fingerprint is not the vectors' base is refused. Everything is written into a hidden temporary sibling and
renamed into place in one step (:func:`editkit.util.atomic.atomic_dir`): a crash or a refused program leaves nothing
half-written, and with ``force`` the old content stays until the new is whole.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from editkit.io.card import computes, model_card
from editkit.io.layout import ADAPTER_SUBDIR, CARD_FILE, HEADS_FILE, MANIFEST_FILE, PROGRAM_FILE, quiet_export
from editkit.io.onnx import write_onnx
from editkit.io.native import head_kind, write_heads, write_weights
from editkit.io.peft import Adapter, write_adapter
from editkit.io.program import expected_logits, trace, verify
from editkit.merge.arithmetic import TaskVector
from editkit.scenario.build import BuiltScenario
from editkit.scenario.provenance import check_base
from editkit.io.targets import check_target
from editkit.util.atomic import atomic_dir
from editkit.util.progress import NullProgress, Progress, ProgressTask

log = logging.getLogger(__name__)


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


def _write_program(tmp: Path, built: BuiltScenario, vector: TaskVector, names: list[str],
                   bar: ProgressTask) -> dict[str, Any] | None:
    """``model.pt2`` of the scored model with the heads of ``names``, checked on their test splits, and
    ``model.onnx`` beside it where it converts and reproduces the same logits; the manifest's ``program``, ``onnx``,
    ``input`` and ``tasks`` (None: the family's own directory is the model)."""
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
    bar.advance(1)
    expected = expected_logits(backbone, vector, heads, {name: built.task(name).test for name in names})
    checked = verify(loaded, backbone, expected)
    bar.advance(1)
    onnx = write_onnx(program, inputs.spec["names"], names, tmp, inputs.dynamic, expected)
    bar.advance(1)
    tasks = _tasks(built, names)
    spec = dict(inputs.spec)
    lengths = {t["max_length"] for t in tasks if "max_length" in t}
    if lengths:
        spec["max_length"] = max(lengths)
    return {"program": {"file": PROGRAM_FILE, "inputs": spec.get("names"),
                        "outputs": "a dict: each task's name -> its logits (batch, classes), in the order of tasks",
                        "verified": checked},
            "onnx": onnx, "input": spec, "tasks": tasks}


def write_export(built: BuiltScenario, vector: TaskVector, out: Path | str, *, base: str | None,
                 provenance: Mapping[str, Any], tasks: list[str], force: bool = False,
                 adapter: Adapter | None = None, progress: Progress | None = None) -> Path:
    """Write the export directory of ``built``'s backbone (theta_0) edited by ``vector`` (see the module docstring).

    base: the fingerprint the vectors were fine-tuned from (the bank's ``base``): it must be the backbone's.
    provenance: what the manifest and card state of its making (:func:`~editkit.io.card.provenance_of`).
    tasks: the tasks whose heads the program carries, in its output order.
    adapter: the same edit as a PEFT adapter (:func:`editkit.io.peft.adapter_factors`), written to
        ``DIR/adapter``.
    progress: one bar over the program (traced, checked), ``model.onnx`` (converted, checked) and the weights.
    """
    out = check_target(out, force=force)
    backbone = built.backbone
    check_base(base, backbone)
    names = [t for t in tasks if t in built.heads]
    manifest = dict(provenance)
    with atomic_dir(out, replace=force) as tmp, (progress or NullProgress()).task(
            f"writing the edited model to {out}", total=4) as bar:
        written = _write_program(tmp, built, vector, names, bar)
        if written is not None:
            manifest.update(written)
            manifest["program"]["computes"] = computes(manifest)
        manifest["weights"] = {**write_weights(backbone, vector.tensors, tmp, provenance), "model": manifest["edit"]}
        bar.advance(1 if written is not None else 4)
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

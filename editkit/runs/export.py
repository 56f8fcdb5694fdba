"""Edited models to take away: what ``--out`` writes for ``editkit add`` and ``editkit negate``.

The edited model is theta_0 + delta, delta being the vectors as the command combined them
(``sum alpha_i tau_i``, merged by a method, or ``-alpha tau`` for a negation), written in the
format its family is read with elsewhere, so nothing of editkit is needed to load it:

- **transformers** backbones (causal LMs, text encoders, seq2seq LMs): a Hugging Face model
  directory, the *whole* model (prefix, tail and head, not only the fine-tuned blocks) written by
  ``save_pretrained`` (config, safetensors weights, generation config where the model has one), its
  tokenizer, a ``README.md`` model card stating the provenance and the measured numbers, and the
  same provenance as ``editkit.json``. ``AutoModelForCausalLM`` / ``AutoModel`` /
  ``AutoModelForSeq2SeqLM.from_pretrained(DIR)`` loads it (:data:`AUTO_CLASSES`);
- **open_clip** backbones: one checkpoint file of the whole CLIP model (both towers, the image tower
  edited), which ``open_clip.create_model_and_transforms(arch, pretrained=PATH)`` loads: safetensors
  (provenance in its header) when the path ends in ``.safetensors``, else a torch file
  ``{"state_dict": ..., "editkit": <provenance>}``;
- **torchvision** backbones: the state dict of the whole torchvision model (the edited feature layers and
  the classification layer as it came), which ``torchvision.models.get_model(arch).load_state_dict``
  loads as it is: safetensors (provenance in its header) when the path ends in ``.safetensors``, else
  a torch file of the plain state dict with the provenance beside it in ``<PATH>.editkit.json``.

For vectors of **linearized** models (``linear``, ``taujp``) the written model is the ordinary
network at the weights theta_0 + delta, the same weights ``editkit negate`` samples continuations
from; it is not the linearized model f_lin the vectors were trained and scored as. The caller puts
the weights' own scores beside f_lin's (``editkit add`` and the accuracy-scored ``editkit negate``:
``report["weights"]``; a language negation's rows: ``control`` / ``target`` beside ``control_flin`` /
``target_flin``) and the card states both.

Before anything is written (and the CLI checks before any heavy work): a target that is a non-empty
directory or an existing file is refused unless ``force``; a model whose fingerprint is not the
vectors' base is refused. The files are written into a hidden temporary sibling and
renamed into place in one step (:func:`editkit.util.atomic.atomic_dir` / ``atomic_path``), so a
crash leaves nothing half-written and, with ``force``, the old content stays until the new is whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

import editkit
from editkit.bank.store import Bank
from editkit.core.adapters import attached, without_adapter
from editkit.core.modes import Mode
from editkit.errors import BankError, ConfigError, IncompatibleVectorsError
from editkit.merge.arithmetic import TaskVector, combine, negation_coefficients
from editkit.models.backbone import Backbone
from editkit.models.blocks import whole_model
from editkit.models.torchvision_models import TorchvisionBackbone, torchvision_state
from editkit.runs.edit import find_scenario, recorded_build
from editkit.runs.peft_io import ADAPTER_SUBDIR, Adapter, adapter_factors, write_adapter
from editkit.scenario.build import backbone_options, build_backbone
from editkit.scenario.options import BuildOptions
from editkit.train.recipe import attach_adapter
from editkit.util.atomic import atomic_dir, atomic_path, atomic_write_text

log = logging.getLogger(__name__)

TRANSFORMERS, OPEN_CLIP, TORCHVISION = "transformers", "open_clip", "torchvision"
#: Backbone family -> export format; a family not named here has none (``add --out`` then writes the
#: backbone module's state dict, :func:`editkit.runs.checkpoints.write_model`).
FAMILY_FORMATS = {"causal-lm": TRANSFORMERS, "text-encoder": TRANSFORMERS, "seq2seq-lm": TRANSFORMERS,
                  "clip": OPEN_CLIP, "torchvision": TORCHVISION}
#: Backbone family -> the transformers auto class that reads its export.
AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "text-encoder": "AutoModel",
                "seq2seq-lm": "AutoModelForSeq2SeqLM"}
PROVENANCE_FILE = "editkit.json"
#: The numbers of an addition's or an accuracy-scored negation's report its export records.
SCORE_KEYS = ("per_task", "pretrained", "absolute", "normalized", "target", "target_pretrained", "control",
              "control_pretrained", "weights")
#: Those its model card sums up in one line (an addition's, or a negation's).
SUMMARY_KEYS = ("absolute", "normalized", "target", "control")
#: A torchvision torch-file export's provenance sits beside it, in ``<file><suffix>``.
PROVENANCE_SUFFIX = ".editkit.json"
CARD_FILE = "README.md"


# --------------------------------------------------------------------------- checks (cheap, before any work)


def check_target(out: Path | str, *, force: bool = False, directory: bool = True) -> Path:
    """Refuse ``out`` before any work: a non-empty directory or an existing file unless ``force``; a directory
    where a file is to be written, always."""
    out = Path(out)
    if out.is_dir() and not directory:
        raise ConfigError(f"--out {out} is a directory: name the checkpoint file to write")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} is a directory that is not empty: pass --force to replace it, or name a "
                          "new directory")
    if out.exists() and not out.is_dir() and not force:
        raise ConfigError(f"--out {out} is a file: pass --force to replace it"
                          + (" by the model directory, or name a new directory" if directory else
                             ", or name a new file"))
    return out


def family_of(bank: Bank, names: list[str] | tuple[str, ...]) -> str:
    """The backbone family of the scenario vector ``names[0]`` was fine-tuned in (read from the scenario file;
    nothing is built)."""
    entry = bank.get(names[0])
    spec = find_scenario(entry.scenario, entry.provenance.get("scenario_file"))
    return str(spec.backbone.get("family"))


def export_format(bank: Bank, names: list[str] | tuple[str, ...]) -> str | None:
    """:data:`TRANSFORMERS`, :data:`OPEN_CLIP` or None (no standard format) for these vectors' backbone."""
    return FAMILY_FORMATS.get(family_of(bank, names))


def check_base(backbone: Backbone, base: str | None) -> None:
    """Refuse writing ``backbone`` edited by vectors whose base fingerprint is not the backbone's own."""
    fingerprint = backbone.fingerprint()
    if base != fingerprint:
        raise IncompatibleVectorsError(
            f"the vectors were fine-tuned from base {str(base)[:19]}…, not from {backbone.name} "
            f"({fingerprint[:19]}…): the model written would be theta_0 of another model plus their tau")


# --------------------------------------------------------------------------- the whole model, edited


@contextlib.contextmanager
def edited(module: nn.Module, delta: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters (shared with the whole model) at theta_0 + delta inside the block, restored
    exactly afterwards. The sum is the one :class:`~editkit.core.linearize.NonLinearModel` computes."""
    params = dict(module.named_parameters(remove_duplicate=False))
    unknown = [key for key in delta if key not in params]
    if unknown:
        raise BankError(f"the vector has parameters the backbone lacks: {', '.join(unknown[:5])}")
    saved: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for key, value in delta.items():
                saved[key] = params[key].detach().clone()
                params[key].add_(value.to(params[key]))
        yield
    finally:
        with torch.no_grad():
            for key, value in saved.items():
                params[key].copy_(value)


def plain_state(backbone: Backbone, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as the model without editkit's LoRA adapter holds it (each adapted weight W + s B A under its own
    name), or as it is when the backbone carries none: what is written is a plain model of its family."""
    state = {key: value.detach().to("cpu").clone().contiguous() for key, value in state.items()}
    return without_adapter(backbone.module, state)


def _write_transformers(backbone: Backbone, delta: Mapping[str, torch.Tensor], out: Path,
                        provenance: Mapping[str, Any], force: bool, adapter: Adapter | None) -> None:
    model = whole_model(backbone)
    with atomic_dir(out, replace=force) as tmp:
        with edited(backbone.module, delta):
            state = plain_state(backbone, model.state_dict()) if attached(backbone.module) is not None else None
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        if adapter is not None:
            write_adapter(tmp / ADAPTER_SUBDIR, backbone, *adapter)
        tokenizer = getattr(backbone, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=str) + "\n", encoding="utf-8")
        (tmp / CARD_FILE).write_text(model_card(provenance), encoding="utf-8")


def _write_open_clip(backbone: Backbone, delta: Mapping[str, torch.Tensor], out: Path,
                     provenance: Mapping[str, Any]) -> None:
    model = whole_model(backbone)
    with edited(backbone.module, delta):
        state = plain_state(backbone, model.state_dict())
    with atomic_path(out) as tmp:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata={"format": "pt", "editkit": json.dumps(provenance, default=str)})
        else:
            torch.save({"state_dict": state, "editkit": json.loads(json.dumps(provenance, default=str))}, tmp)


def _write_torchvision(backbone: Backbone, delta: Mapping[str, torch.Tensor], out: Path,
                       provenance: Mapping[str, Any]) -> None:
    with edited(backbone.module, delta):
        state = plain_state(backbone, backbone.module.state_dict())
    state = torchvision_state(backbone, state)
    text = json.dumps(provenance, default=str)
    with atomic_path(out) as tmp:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp), metadata={"format": "pt", "editkit": text})
        else:
            torch.save(state, tmp)
    if out.suffix != ".safetensors":
        atomic_write_text(out.with_name(out.name + PROVENANCE_SUFFIX), text + "\n")


def backbone_format(backbone: Backbone) -> str:
    """The format a built backbone's edited model is written in."""
    if hasattr(backbone, "clip_model"):
        return OPEN_CLIP
    return TORCHVISION if isinstance(backbone, TorchvisionBackbone) else TRANSFORMERS


def export_model(backbone: Backbone, delta: Mapping[str, torch.Tensor], out: Path | str, *, base: str | None,
                 provenance: Mapping[str, Any], force: bool = False, adapter: Adapter | None = None) -> Path:
    """Write ``backbone``'s whole model at theta_0 + ``delta`` to ``out`` (see the module docstring).

    base: the fingerprint the vectors were fine-tuned from (the bank's ``base``): it must be the backbone's.
    provenance: what the card and ``editkit.json`` state (:func:`provenance_of` builds it).
    force: replace what is at ``out``.
    adapter: the same edit as a PEFT adapter (:func:`editkit.runs.peft_io.adapter_factors`), written beside the
        model: ``DIR/adapter`` in a model directory, ``<file>.adapter`` beside a checkpoint file.
    """
    out = Path(out)
    fmt = backbone_format(backbone)
    if fmt == TRANSFORMERS:
        whole_model(backbone)  # refuses a backbone without one before anything is hashed or written
    check_target(out, force=force, directory=fmt == TRANSFORMERS)
    check_base(backbone, base)
    provenance = {**provenance, "format": fmt}
    if fmt == TRANSFORMERS:
        _write_transformers(backbone, delta, out, provenance, force, adapter)
    else:
        (_write_torchvision if fmt == TORCHVISION else _write_open_clip)(backbone, delta, out, provenance)
        if adapter is not None:
            write_adapter(out.with_name(out.name + "." + ADAPTER_SUBDIR), backbone, *adapter, force=force)
    log.info("wrote the edited model to %s", out)
    return out


# --------------------------------------------------------------------------- provenance and card


def provenance_of(bank: Bank, coefficients: Mapping[str, float], *, operation: str, mode: str,
                  build: BuildOptions | None = None, method: str = "task-arithmetic",
                  options: Mapping[str, Any] | None = None, alpha: float | None = None,
                  scores: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What an export records: base model (as the scenario names it, its fingerprint as the bank records
    it), the vectors and their coefficients, the operation, mode, method, alpha, measured numbers, version."""
    first = next(iter(coefficients))
    entry = bank.get(first)
    spec = find_scenario(entry.scenario, entry.provenance.get("scenario_file"))
    family, backbone_opts = backbone_options(spec, recorded_build(bank, first, build))
    vectors = {name: {"coefficient": float(c), "task": bank.get(name).task, "mode": bank.get(name).mode,
                      "checksum": bank.get(name).checksum} for name, c in coefficients.items()}
    return {
        "editkit_version": editkit.__version__,
        "operation": operation,
        "scenario": spec.name,
        "scenario_file": entry.provenance.get("scenario_file"),
        "family": family,
        "auto_class": AUTO_CLASSES.get(family),
        "base_model": {"model": backbone_opts.get("model"), "options": {k: v for k, v in backbone_opts.items()
                                                                        if isinstance(v, (str, int, float, bool))},
                       "fingerprint": bank.base},
        "vectors": vectors,
        "mode": mode,
        "linearized": Mode(mode).linearized,
        "method": method,
        "options": dict(options or {}),
        "alpha": alpha,
        "weights": "theta_0" + "".join(f" {'-' if c < 0 else '+'} {abs(c):g} * tau[{n}]"
                                       for n, c in coefficients.items())
                   + ("" if method == "task-arithmetic" else f", merged by {method}"),
        "scores": dict(scores or {}),
    }


def _number(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _score_lines(provenance: Mapping[str, Any]) -> list[str]:
    scores = provenance.get("scores") or {}
    lines: list[str] = []
    if "rows" in scores:  # a language negation: test rows of the report
        lines += ["Test split, as `editkit negate` measured it (perplexities: lower is better for the control "
                  "text, higher for the negated task's text; toxic: fraction of sampled continuations flagged by "
                  f"the `{scores.get('scorer', '?')}` scorer):", "",
                  "| model | alpha | control ppl | target ppl | f_lin control ppl | f_lin target ppl | toxic ± s.e. |",
                  "|---|---|---|---|---|---|---|"]
        for row in scores["rows"]:
            mark = " **(this model)**" if row.get("exported") else ""
            toxic = (f"{row['toxic_fraction']:.3f} ± {row['toxic_fraction_stderr']:.3f}"
                     if "toxic_fraction" in row else "–")
            lines.append(f"| {row['model']}{mark} | {_number(row.get('alpha'))} | {_number(row.get('control'))} | "
                         f"{_number(row.get('target'))} | {_number(row.get('control_flin'))} | "
                         f"{_number(row.get('target_flin'))} | {toxic} |")
        if provenance.get("linearized"):
            lines += ["", "The perplexities in the control / target columns are those of these weights (this "
                      "model); the f_lin columns are the linearized model's, which the vector was trained as and "
                      "which no set of weights reproduces: their gap is what the export loses."]
        return lines
    if "per_task" in scores:  # an addition, or a negation scored by accuracy
        return _accuracy_lines(provenance, scores)
    return ["No scores were recorded with this export."]


def _accuracy_lines(provenance: Mapping[str, Any], scores: Mapping[str, Any]) -> list[str]:
    """Per-task accuracies of an addition or a negation (theta_0's beside them where measured), its summary, and
    for a linearized vector the weights' own beside f_lin's."""
    weights, pretrained = scores.get("weights"), scores.get("pretrained")
    columns = (["theta_0"] if pretrained else []) + (["linearized model (f_lin)", "these weights"] if weights
                                                     else ["score"])
    lines = [f"Test accuracy per task, as `editkit {provenance['operation']}` measured it:", "",
             "| task | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for task, value in scores["per_task"].items():
        cells = ([pretrained.get(task)] if pretrained else []) + [value] + (
            [weights["per_task"].get(task)] if weights else [])
        lines.append(f"| {task} | " + " | ".join(map(_number, cells)) + " |")
    summary = [key for key in SUMMARY_KEYS if key in scores]
    line = ", ".join(f"{key} {_number(scores[key])}" for key in summary)
    if weights:
        line += " (f_lin); these weights: " + ", ".join(f"{key} {_number(weights.get(key))}" for key in summary)
    lines += ["", line]
    if weights:
        lines += ["", f"The vectors are of a linearized model: these weights are the ordinary network at "
                  f"{provenance['weights']}, not the f_lin the scores above it were measured on."]
    return lines


def _load_lines(provenance: Mapping[str, Any]) -> list[str]:
    if provenance.get("format") == OPEN_CLIP:
        arch = provenance["base_model"].get("model")
        return ["```python", "import open_clip", "",
                f"model, _, preprocess = open_clip.create_model_and_transforms({arch!r}, pretrained=PATH)", "```",
                "", "(with the base model's QuickGELU setting: `force_quick_gelu=True` for OpenAI weights)."]
    auto = provenance.get("auto_class") or "AutoModel"
    lines = ["```python", f"from transformers import {auto}, AutoTokenizer", "",
             f"model = {auto}.from_pretrained(DIR)", "tokenizer = AutoTokenizer.from_pretrained(DIR)", "```"]
    return lines


def model_card(provenance: Mapping[str, Any]) -> str:
    """The ``README.md`` of an export: what the weights are, where they come from, what was measured."""
    base = provenance["base_model"]
    vectors = provenance["vectors"]
    lines = [f"# {provenance['scenario']}: {provenance['operation']} "
             f"{', '.join(vectors)} (editkit {provenance['editkit_version']})", "",
             f"Weights: **{provenance['weights']}**, written by `editkit {provenance['operation']}` "
             f"(editkit {provenance['editkit_version']}).", "",
             "## Provenance", "",
             f"- base model: `{base.get('model')}` (family `{provenance['family']}`), fingerprint "
             f"`{base['fingerprint']}` as the bank records it",
             f"- mode: `{provenance['mode']}`" + (" (linearized: see the scores)" if provenance["linearized"] else ""),
             f"- method: `{provenance['method']}`" + (f", options `{json.dumps(provenance['options'])}`"
                                                       if provenance["options"] else ""),
             ]
    if provenance.get("alpha") is not None:
        choice = (provenance.get("scores") or {}).get("alpha_choice")
        lines.append(f"- alpha: {provenance['alpha']:g}" + (f", {choice}" if choice else ""))
    lines += ["- vectors:", ""]
    lines += [f"  - `{name}` (task `{v['task']}`, mode `{v['mode']}`): coefficient {v['coefficient']:g}, "
              f"checksum `{v['checksum']}`" for name, v in vectors.items()]
    lines += ["", "## Measured", "", *_score_lines(provenance), "", "## Loading", "",
              "Nothing of editkit is needed:", "", *_load_lines(provenance), "",
              f"`{PROVENANCE_FILE}` holds this provenance as JSON.", ""]
    return "\n".join(lines)


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
    """Write theta_0 - alpha tau of vector ``name`` (what ``editkit negate NAME --out DIR`` writes for a language
    vector). ``report``: the negation's report (``editkit.runs.negate_lm.negate_language``), whose test rows
    (perplexities of these weights and, for linearized vectors, f_lin's; toxicity) go into the card."""
    out = Path(out)
    check_target(out, force=force)
    coefficients = negation_coefficients(name, alpha)
    vector = combine(bank, coefficients)
    backbone = bank_backbone(bank, name, build)
    provenance = provenance_of(bank, coefficients, operation="negate", mode=vector.mode, build=build, alpha=alpha,
                               scores=negation_scores(report, alpha) if report else None)
    return export_model(backbone, vector.tensors, out, base=bank.base, provenance=provenance, force=force,
                        adapter=adapter_factors(bank, coefficients, "task-arithmetic", vector.tensors, backbone))


def export_edit(result: Any, bank: Bank, out: Path | str, *, method: str = "task-arithmetic",
                force: bool = False, build: BuildOptions | None = None) -> Path:
    """Write the model ``editkit add`` or ``editkit negate`` scored (an ``editkit.runs.edit.EditResult`` of
    :func:`editkit.runs.edit.add` / :func:`~editkit.runs.edit.negate`, whose backbone holds theta_0), with its
    report's numbers (``weights`` beside f_lin's) in the provenance and card."""
    report = result.report
    operation = report["operation"]
    alpha = -next(iter(result.coefficients.values())) if operation == "negate" else None  # theta_0 - alpha tau
    provenance = provenance_of(bank, result.coefficients, operation=operation, mode=result.mode, build=build,
                               method=method, options=report.get("options"), alpha=alpha,
                               scores={k: report[k] for k in SCORE_KEYS if k in report})
    adapter = adapter_factors(bank, result.coefficients, method, result.vector.tensors, result.backbone)
    return export_model(result.backbone, result.vector.tensors, out, base=bank.base, provenance=provenance,
                        force=force, adapter=adapter)


def export_vectors(bank: Bank, coefficients: Mapping[str, float], out: Path | str, *, force: bool = False,
                   build: BuildOptions | None = None, scores: Mapping[str, Any] | None = None) -> Path:
    """For scripts: theta_0 + sum alpha_i tau_i of the named bank vectors (``{name: alpha}``; negative for a
    negation), written without scoring anything (``scores``: numbers of your own for the card)."""
    out = Path(out)
    check_target(out, force=force, directory=export_format(bank, list(coefficients)) == TRANSFORMERS)
    vector: TaskVector = combine(bank, dict(coefficients))
    backbone = bank_backbone(bank, next(iter(coefficients)), build)
    provenance = provenance_of(bank, coefficients, operation="add", mode=vector.mode, build=build, scores=scores)
    return export_model(backbone, vector.tensors, out, base=bank.base, provenance=provenance, force=force,
                        adapter=adapter_factors(bank, coefficients, "task-arithmetic", vector.tensors, backbone))

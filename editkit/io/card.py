"""What an export says about itself: ``editkit.json`` (the manifest a program reads) and ``README.md`` (its card).

The manifest holds everything needed to use the directory without editkit and to know where it came from:

- ``program``: the file, what it computes (f_lin or f), its inputs and outputs, and how closely it reproduced
  editkit's own logits when written;
- ``input``: how to make the inputs, as data (:mod:`editkit.models.inputs`);
- ``tasks``: in the program's output order, each with its class names and head;
- ``weights``: the family's own format beside the program (:mod:`editkit.io.native`) and the heads file;
- the provenance: base model and fingerprint, vectors, coefficients, mode, method, alpha, editkit version;
- ``scores``: the accuracies measured by the command that wrote it (the program's and the weights' own).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import editkit
from editkit.bank.store import Bank
from editkit.core.modes import Mode
from editkit.io.layout import EXPORT_FORMAT, FORMAT_VERSION, MANIFEST_FILE, PROGRAM_FILE
from editkit.io.native import OPEN_CLIP, TRANSFORMERS
from editkit.scenario.build import backbone_options
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import recorded_build, recorded_scenario

#: The numbers of an addition's or an accuracy-scored negation's report its export records.
SCORE_KEYS = ("per_task", "pretrained", "absolute", "normalized", "target", "target_pretrained", "control",
              "control_pretrained", "weights")
#: Those its model card sums up in one line (an addition's, or a negation's).
SUMMARY_KEYS = ("absolute", "normalized", "target", "control")


def formulas(coefficients: Mapping[str, float], method: str) -> dict[str, str]:
    """``delta`` (``0.5 * tau[a] - 1 * tau[b]``) and ``edit`` (theta_0 and delta: ``theta_0 + 0.5 * tau[a] ...``),
    naming a merge method other than the sum."""
    combination = " ".join(f"{'-' if c < 0 else '+'} {abs(c):g} * tau[{n}]" for n, c in coefficients.items())
    merged = "" if method == "task-arithmetic" else f", merged by {method}"
    delta = combination[2:] if combination.startswith("+") else "-" + combination[2:]
    return {"delta": delta + merged, "edit": f"theta_0 {combination}{merged}"}


def provenance_of(bank: Bank, coefficients: Mapping[str, float], *, operation: str, mode: str,
                  build: BuildOptions | None = None, method: str = "task-arithmetic",
                  options: Mapping[str, Any] | None = None, alpha: float | None = None,
                  scores: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What an export records of its making: base model (as the scenario names it, its fingerprint as the bank
    records it), the vectors and their coefficients, the operation, mode, method, alpha, measured numbers, version."""
    first = next(iter(coefficients))
    entry = bank.get(first)
    spec = recorded_scenario(entry)
    family, backbone_opts = backbone_options(spec, recorded_build(bank, first, build))
    vectors = {name: {"coefficient": float(c), "task": bank.get(name).task, "mode": bank.get(name).mode,
                      "checksum": bank.get(name).checksum} for name, c in coefficients.items()}
    return {
        "format": EXPORT_FORMAT,
        "format_version": FORMAT_VERSION,
        "editkit_version": editkit.__version__,
        "operation": operation,
        "scenario": spec.name,
        "scenario_file": entry.provenance.get("scenario_file"),
        "family": family,
        "base_model": {"model": backbone_opts.get("model"), "options": {k: v for k, v in backbone_opts.items()
                                                                        if isinstance(v, (str, int, float, bool))},
                       "fingerprint": bank.base},
        "vectors": vectors,
        "mode": mode,
        "linearized": Mode(mode).linearized,
        "method": method,
        "options": dict(options or {}),
        "alpha": alpha,
        **formulas(coefficients, method),
        "scores": dict(scores or {}),
    }


def computes(manifest: Mapping[str, Any]) -> str:
    """What the program computes, in one formula."""
    if manifest["linearized"]:
        return f"f_lin(x) = f(x; theta_0) + J f(x; theta_0) . delta, delta = {manifest['delta']}"
    return f"f(x; {manifest['edit']})"


def _number(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _percent(value: Any) -> str:
    """An accuracy as the commands print it: percent, one decimal."""
    return "–" if value is None else f"{100 * value:.1f}"


def _language_lines(manifest: Mapping[str, Any], scores: Mapping[str, Any]) -> list[str]:
    """A language negation's test rows: perplexities of these weights (and f_lin's) and sampled toxicity."""
    lines = ["Test split, as `editkit negate` measured it (perplexities: lower is better for the control text, higher "
             "for the negated task's text; toxic: fraction of sampled continuations flagged by the "
             f"`{scores.get('scorer', '?')}` scorer):", "",
             "| model | alpha | control ppl | target ppl | f_lin control ppl | f_lin target ppl | toxic ± s.e. |",
             "|---|---|---|---|---|---|---|"]
    for row in scores["rows"]:
        mark = " **(this model)**" if row.get("exported") else ""
        toxic = (f"{row['toxic_fraction']:.3f} ± {row['toxic_fraction_stderr']:.3f}" if "toxic_fraction" in row
                 else "–")
        lines.append(f"| {row['model']}{mark} | {_number(row.get('alpha'))} | {_number(row.get('control'))} | "
                     f"{_number(row.get('target'))} | {_number(row.get('control_flin'))} | "
                     f"{_number(row.get('target_flin'))} | {toxic} |")
    if manifest.get("linearized"):
        lines += ["", "The perplexities in the control / target columns are those of these weights (this model); the "
                  "f_lin columns are the linearized model's, which the vector was trained as and which no set of "
                  "weights reproduces: their gap is what the export loses."]
    return lines


def _accuracy_lines(manifest: Mapping[str, Any], scores: Mapping[str, Any]) -> list[str]:
    """Per-task accuracies of an addition or a negation: the program's (the scored model), the weights' own for a
    linearized vector, theta_0's where measured; then the summary."""
    weights, pretrained = scores.get("weights"), scores.get("pretrained")
    scored = "model.pt2 (f_lin)" if manifest["linearized"] else "model.pt2 (these weights)"
    columns = (["theta_0"] if pretrained else []) + [scored] + (["the weights alone"] if weights else [])
    lines = [f"Test accuracy per task (%), as `editkit {manifest['operation']}` measured it:", "",
             "| task | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for task, value in scores["per_task"].items():
        cells = ([pretrained.get(task)] if pretrained else []) + [value] + (
            [weights["per_task"].get(task)] if weights else [])
        lines.append(f"| {task} | " + " | ".join(map(_percent, cells)) + " |")
    summary = [key for key in SUMMARY_KEYS if key in scores]
    line = ", ".join(f"{key} {_percent(scores[key])}" for key in summary)
    if weights:
        line += "; the weights alone: " + ", ".join(f"{key} {_percent(weights.get(key))}" for key in summary)
    lines += ["", line]
    if weights:
        lines += ["", f"The vectors are of a linearized model: the weights alone are the ordinary network at "
                  f"{manifest['edit']}, not the f_lin the program computes; the choice is yours."]
    return lines


def _score_lines(manifest: Mapping[str, Any]) -> list[str]:
    scores = manifest.get("scores") or {}
    if "rows" in scores:
        return _language_lines(manifest, scores)
    if "per_task" in scores:
        return _accuracy_lines(manifest, scores)
    return ["No scores were recorded with this export."]


def _program_lines(manifest: Mapping[str, Any]) -> list[str]:
    """How to run the program with torch alone, what it takes and returns."""
    program, spec = manifest.get("program"), manifest.get("input") or {}
    if not program:
        return []
    names = ", ".join(spec.get("names", []))
    tasks = ", ".join(f'"{t["name"]}"' for t in manifest.get("tasks", []))
    lines = ["## Use it without editkit", "", "```python", "import torch", "",
             f'model = torch.export.load("{PROGRAM_FILE}").module()',
             f"logits = model({names})  # {{{tasks}}}: logits (batch, classes) of each task", "```", ""]
    if spec.get("kind") == "image":
        size = "×".join(map(str, spec["size"]))
        how = (f"resized as a whole to {size} (bilinear, antialiased)" if spec.get("on") == "tensor" else
               f"resized by PIL ({spec.get('interpolation')}, shorter side) and centre-cropped to {size}")
        lines += [f"`pixels`: float32 `(batch, 3, {', '.join(map(str, spec['size']))})`, RGB / 255, {how}, then "
                  f"normalized by mean {spec['mean']} and std {spec['std']} (`editkit.json`'s `input`)."]
    else:
        lines += [f"`{names}`: int64 `(batch, length)`, from the tokenizer saved here "
                  f"(`AutoTokenizer.from_pretrained(DIR)`), padded on the right, texts cut at "
                  f"{spec.get('max_length')} tokens (`editkit.json`'s `input`)."]
        if spec.get("kind") == "text-to-text":
            lines += ["", f"The decoder reads its input by teacher forcing: the start token "
                      f"({spec.get('decoder_start_token_id')}), then the target's tokens but its last; the logits "
                      "`(batch, length, vocabulary)` score every target position."]
    verified = program.get("verified") or {}
    lines += ["", f"It computes {program['computes']}. Batch size{' and length' if spec.get('kind') != 'image' else ''} "
              f"may be anything; call it under `torch.no_grad()` or `torch.inference_mode()`. Written, it gave "
              f"editkit's own logits to {verified.get('max_abs_logit_difference', float('nan')):.2g} on "
              f"{verified.get('examples', 0)} test examples. With editkit: `editkit predict --model DIR INPUTS...`.", ""]
    return lines


def _onnx_lines(manifest: Mapping[str, Any]) -> list[str]:
    """How to run ``model.onnx`` with ONNX Runtime alone, or why there is none."""
    onnx = manifest.get("onnx")
    if not onnx:
        return []
    if "skipped" in onnx:
        return ["## ONNX", "", f"No ONNX model: {onnx['skipped']}.", ""]
    feeds = ", ".join(f'"{name}": {name}' for name in onnx["inputs"])
    verified = onnx["verified"]
    return ["## Use it with ONNX Runtime", "", "```python", "import onnxruntime", "",
            f'session = onnxruntime.InferenceSession("{onnx["file"]}")',
            f"logits = dict(zip({onnx['outputs']!r}, session.run(None, {{{feeds}}})))", "```", "",
            f"The same inputs as numpy arrays, the same program (opset {onnx['opset']}); written, it gave editkit's own "
            f"logits to {verified['max_abs_logit_difference']:.2g} on {verified['examples']} test examples "
            f"({verified['runtime']}).", ""]


def _weights_lines(manifest: Mapping[str, Any]) -> list[str]:
    weights = manifest.get("weights") or {}
    fmt = weights.get("format")
    if fmt == OPEN_CLIP:
        arch = manifest["base_model"].get("model")
        load = ["```python", "import open_clip", "",
                f"model, _, preprocess = open_clip.create_model_and_transforms({arch!r}, "
                f"pretrained=\"{weights['files'][0]}\")", "```", "",
                "(with the base model's QuickGELU setting: `force_quick_gelu=True` for OpenAI weights)."]
    elif fmt == TRANSFORMERS:
        auto = weights["loads"].split(".")[1]  # transformers.<its auto class>.from_pretrained
        load = ["```python", f"from transformers import {auto}, AutoTokenizer", "",
                f"model = {auto}.from_pretrained(DIR)", "tokenizer = AutoTokenizer.from_pretrained(DIR)", "```"]
    else:
        load = [f"`{weights['files'][0]}`: a safetensors state dict, which {weights['loads']} loads."]
    heads = weights.get("heads")
    return ["## The weights alone", "", f"{manifest['edit']} as the {fmt} format holds them:", "", *load, ""] + (
        [f"`{heads}`: each task's head (`<task>.weight`, `<task>.bias`; its header says each head's kind).", ""]
        if heads else [])


def model_card(manifest: Mapping[str, Any]) -> str:
    """The ``README.md`` of an export: what the model is and does, how to load it, where it comes from, what was
    measured."""
    base, vectors = manifest["base_model"], manifest["vectors"]
    tasks = manifest.get("tasks") or []
    lines = [f"# {manifest['scenario']}: {manifest['operation']} {', '.join(vectors)} "
             f"(editkit {manifest['editkit_version']})", ""]
    if manifest.get("program"):
        lines += [f"The edited model **{computes(manifest)}** (`{PROGRAM_FILE}`), with the head of every task it "
                  f"does: " + "; ".join(f"`{t['name']}` ({', '.join(map(str, t['classes']))})" for t in tasks) + ".", ""]
    else:
        lines += [f"Weights: **{manifest['edit']}**, written by `editkit {manifest['operation']}`.", ""]
    lines += _program_lines(manifest)
    lines += _onnx_lines(manifest)
    lines += ["## Measured", "", *_score_lines(manifest), ""]
    lines += _weights_lines(manifest)
    lines += ["## Provenance", "",
              f"- base model: `{base.get('model') or manifest['family']}` (family `{manifest['family']}`, options "
              f"`{json.dumps(base.get('options', {}))}`), fingerprint "
              f"`{base['fingerprint']}` as the bank records it",
              f"- mode: `{manifest['mode']}`" + (" (linearized)" if manifest["linearized"] else ""),
              f"- method: `{manifest['method']}`" + (f", options `{json.dumps(manifest['options'])}`"
                                                      if manifest["options"] else "")]
    if manifest.get("alpha") is not None:
        choice = (manifest.get("scores") or {}).get("alpha_choice")
        lines.append(f"- alpha: {manifest['alpha']:g}" + (f", {choice}" if choice else ""))
    lines += ["- vectors:", ""]
    lines += [f"  - `{name}` (task `{v['task']}`, mode `{v['mode']}`): coefficient {v['coefficient']:g}, "
              f"checksum `{v['checksum']}`" for name, v in vectors.items()]
    lines += ["", f"`{MANIFEST_FILE}` holds all of this as JSON.", ""]
    return "\n".join(lines)

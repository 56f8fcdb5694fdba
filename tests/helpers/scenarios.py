"""Scenario files for the end-to-end tests: reduced offline-vision (the real backbone, heads and packaged
datasets, small splits), a language task on a tiny random Llama, and any scenario dict written as TOML.

End-to-end tests of ``editkit stream`` / ``editkit bench`` / ``editkit negate`` run whole streams on them in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from helpers import models

#: Task name -> packaged dataset (``packaged:<dataset>``).
DATASETS = {"digits": "digits", "mnist": "mnist", "fashion": "fashion-mnist"}


def write_scenario(directory: Path, tasks: Sequence[str] = ("digits", "mnist"), name: str = "bench-mini", *,
                   train_size: int = 120, test_size: int = 50) -> Path:
    """``<directory>/<name>.toml``: ``tasks`` of offline-vision with ``train_size`` / ``test_size`` examples."""
    lines = [f'name = "{name}"', 'description = "reduced offline-vision for tests"',
             "[backbone]", 'family = "efficientnet-lite0"', "image_size = 32",
             "[heads]", 'kind = "probe"', "shots = 5", "[generic]", 'kind = "natural-crops"', "size = 64"]
    for task in tasks:
        lines += ["[[tasks]]", f'name = "{task}"', f'source = "packaged:{DATASETS[task]}"',
                  f"train_size = {train_size}", f"test_size = {test_size}"]
    lines += ["[recipe]", 'mode = "taujp"', "steps = 100", "batch_size = 16", "lr = 1e-4", "reg_batch = 4"]
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_toml(data: dict[str, Any], path: Path) -> Path:
    """A scenario dict (as ``tomllib`` reads it) written back as TOML: top-level values, tables, then
    ``[[tasks]]`` entries. Values are written as JSON, which TOML reads the same for strings, numbers,
    booleans and flat lists."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    for table, values in data.items():
        if isinstance(values, dict):
            lines += [f"[{table}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    for task in data.get("tasks", []):
        lines += ["[[tasks]]"] + [f"{k} = {json.dumps(v)}" for k, v in task.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_language_scenario(directory: Path, name: str, *, task_corpus: str, control: str | Sequence[str],
                            prompts: str, scorer: str, negation: Mapping[str, Any] | None = None,
                            max_length: int = 16, eval_blocks: int | None = None, generic_corpus: str | None = None,
                            steps: int, lr: float, seed: int = 0,
                            backbone: Mapping[str, Any] | None = None) -> tuple[Path, Path]:
    """A two-block random Llama with the character tokenizer saved as ``<directory>/tiny-llama-<seed>``, and
    ``<directory>/<name>.toml``: the causal-LM scenario that fine-tunes its last block (taujp, batch 4, reg
    batch 2, ``steps`` at ``lr``) on one task ``rude`` of the text corpus ``task_corpus``.

    Its ``[negation]`` table names the ``control`` text corpus (or corpora), the ``prompts`` corpus and the
    toxicity ``scorer``, then the options in ``negation``; ``negation=None`` leaves the table out. ``[data]``
    holds ``max_length`` and ``eval_blocks`` (when given); ``generic_corpus`` adds a ``[generic]`` table of
    that text corpus; ``backbone`` adds options to ``[backbone]``. Returns (scenario file, checkpoint directory).
    """
    model_dir = models.char_llama_checkpoint(directory / f"tiny-llama-{seed}", seed=seed)
    data: dict[str, Any] = {"name": name,
                            "backbone": {"family": "causal-lm", "model": str(model_dir), "trainable_blocks": 1,
                                         **(backbone or {})},
                            "heads": {"kind": "lm"}, "data": {"max_length": max_length}}
    if eval_blocks is not None:
        data["data"]["eval_blocks"] = eval_blocks
    if generic_corpus is not None:
        data["generic"] = {"kind": "text", "corpus": generic_corpus, "max_length": max_length}
    if negation is not None:
        data["negation"] = {"control_text": control if isinstance(control, str) else list(control),
                            "prompts": prompts, "scorer": scorer, **negation}
    data["recipe"] = {"mode": "taujp", "steps": steps, "batch_size": 4, "lr": lr, "reg_batch": 2}
    data["tasks"] = [{"name": "rude", "source": f"text:{task_corpus}"}]
    return write_toml(data, directory / f"{name}.toml"), model_dir


def assert_refused_before_work(output: str, scenario: str, starts: Sequence[str], workdir: Path) -> None:
    """``output`` is the offline refusal of ``scenario``: its header, then one line per missing piece, each
    starting with the matching entry of ``starts``; and ``workdir`` holds no bank or run directory."""
    header, *lines = output.splitlines()
    assert header == (f"error: scenario '{scenario}' cannot start: {len(starts)} missing pieces (nothing was trained, "
                      "no bank was written)")
    assert len(lines) == len(starts)
    for line, start in zip(lines, starts):
        assert line.startswith(f"  - {start}"), line
    assert not (workdir / "banks").exists() and not (workdir / "runs").exists()

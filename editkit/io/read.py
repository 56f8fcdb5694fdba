"""Reading an export directory back: its manifest checked, its model (the program, or ``model.onnx`` in ONNX Runtime)
and tokenizer loaded.

What ``editkit predict`` (and anything else that receives a directory ``--out`` wrote) starts from. It needs the
directory alone: no bank, no scenario. A directory that is not an export, or one of a newer format, is refused by
name before anything is loaded; so is ``--runtime onnx`` where no ``model.onnx`` was written (the manifest says why)
or ONNX Runtime is not installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from editkit.errors import ExportError, MissingResourceError
from editkit.io.layout import (EXPORT_FORMAT, FORMAT_VERSION, MANIFEST_FILE, ONNX_EXTRA, ONNX_FILE, PROGRAM_FILE,
                               quiet_export)

#: What ``editkit predict --runtime`` runs: the ``torch.export`` program, or ``model.onnx`` in ONNX Runtime.
RUNTIMES = ("torch", "onnx")


class OnnxModel:
    """``model.onnx`` in an ONNX Runtime session (CPU), called as the program is: the inputs as tensors, in the
    program's order; ``{task: logits}`` back as tensors."""

    def __init__(self, path: Path) -> None:
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, *inputs: Any) -> dict[str, Any]:
        import torch

        feeds = {name: value.numpy(force=True) for name, value in zip(self.inputs, inputs)}
        return {name: torch.from_numpy(logits)
                for name, logits in zip(self.outputs, self.session.run(self.outputs, feeds))}


@dataclass(frozen=True)
class Export:
    """An export directory and its manifest (``editkit.json``)."""

    directory: Path
    manifest: dict[str, Any]

    @property
    def tasks(self) -> list[dict[str, Any]]:
        """The program's tasks in output order (name, classes, head)."""
        return list(self.manifest.get("tasks") or [])

    @property
    def input(self) -> dict[str, Any]:
        """How the program's inputs are made (:mod:`editkit.models.inputs`)."""
        return dict(self.manifest.get("input") or {})

    def program(self) -> Any:
        """The program as a callable module (``torch.export.load(...).module()``)."""
        import torch

        with quiet_export():
            return torch.export.load(self.directory / PROGRAM_FILE).module()

    def model(self, runtime: str = "torch") -> Any:
        """The model as a callable of the program's inputs returning ``{task: logits}``: the program, or
        ``model.onnx`` in ONNX Runtime (``runtime="onnx"``), refused in one line where there is none."""
        if runtime == "torch":
            return self.program()
        if runtime != "onnx":
            raise ExportError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
        onnx = self.manifest.get("onnx") or {"skipped": f"it was written before editkit wrote {ONNX_FILE}"}
        if "skipped" in onnx:
            raise ExportError(f"{self.directory} has no {ONNX_FILE}: {onnx['skipped']}")
        if not (self.directory / onnx["file"]).is_file():
            raise ExportError(f"{self.directory} lacks {onnx['file']}, which its {MANIFEST_FILE} names")
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise MissingResourceError(f"--runtime onnx needs ONNX Runtime: {ONNX_EXTRA}") from None
        return OnnxModel(self.directory / onnx["file"])

    def tokenizer(self) -> Any:
        """The tokenizer saved beside a text program."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.directory / self.input.get("tokenizer", ".")))


def read_export(directory: Path | str) -> Export:
    """The export in ``directory``, refused by name when it is not one editkit can read (see the module docstring)."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise ExportError(f"--model {directory} is not a directory: name a directory that editkit add / negate "
                          "--out wrote")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise ExportError(f"{directory} has no {MANIFEST_FILE}: it is not a model written by editkit add / negate "
                          "--out")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is not readable JSON ({exc}): the export is damaged") from None
    if manifest.get("format") != EXPORT_FORMAT or not isinstance(manifest.get("format_version"), int):
        raise ExportError(f"{path} is not an editkit export manifest (format {manifest.get('format')!r})")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ExportError(f"{directory} was written in export format {manifest['format_version']}, newer than this "
                          f"editkit reads ({FORMAT_VERSION}): upgrade editkit")
    if not manifest.get("program"):
        raise ExportError(f"{directory} holds a {manifest.get('family')} model without a program (a language model's "
                          "Hugging Face directory): sample from it with editkit generate --model DIR")
    if not (directory / PROGRAM_FILE).is_file():
        raise ExportError(f"{directory} lacks {PROGRAM_FILE}, which its {MANIFEST_FILE} names")
    return Export(directory, manifest)

"""Reading an export directory back: its manifest checked, its program and tokenizer loaded.

What ``editkit predict`` (and anything else that receives a directory ``--out`` wrote) starts from. It needs the
directory alone: no bank, no scenario. A directory that is not an export, or one of a newer format, is refused by
name before anything is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from editkit.errors import ExportError
from editkit.io.layout import EXPORT_FORMAT, FORMAT_VERSION, MANIFEST_FILE, PROGRAM_FILE, quiet_export


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

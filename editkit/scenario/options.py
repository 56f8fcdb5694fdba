"""Build options: where a run's weights and data are, given from outside the scenario file.

The CLI's ``--model`` / ``--pretrained`` / ``--clip-cache`` / ``--data-root`` / ``--hub-cache``
and the Python API's ``build=`` are one value, :class:`BuildOptions`, whose unset
fields keep the scenario file's values. A stream records the options it was given in
each banked vector's provenance (paths made absolute, so they hold from any working
directory); ``add``, ``negate`` and ``bench`` rebuild the scenario a bank came from
with the options given now laid over the recorded ones (:meth:`BuildOptions.over`).

Each field says which builder option it sets (``metadata["sets"]``: the ``[backbone]``
table or every task's source options, and the key there); the recorded form keeps
that layout, ``{"backbone": {...}, "tasks": {...}}``, which is also how banks written
before provenance existed recorded them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from editkit.errors import ConfigError

TABLES = ("backbone", "tasks")


@dataclass(frozen=True)
class BuildOptions:
    """Backbone and data options laid over a scenario file's; ``None`` keeps the file's value."""

    model: str | None = field(default=None, metadata={
        "sets": ("backbone", "model"),
        "help": "Backbone model (CLIP: an open_clip name such as ViT-B-32, ViT-B-16, ViT-L-14, or a config .json; "
                "causal LMs: a packaged name, a local directory or .gguf file, or a hub id in the local cache; "
                "seq2seq LMs: a local directory or a hub id in the local cache)."})
    trainable_blocks: str | None = field(default=None, metadata={
        "sets": ("backbone", "trainable_blocks"),
        "help": "Causal and seq2seq LMs: the last K decoder blocks (plus the final norm) are fine-tuned, or 'all' "
                "(causal: every decoder block; seq2seq: every parameter)."})
    pretrained: str | None = field(default=None, metadata={
        "sets": ("backbone", "pretrained"), "path": True,
        "help": "Backbone weights (CLIP: an open_clip tag such as openai, a checkpoint file or directory, or "
                "'random')."})
    clip_cache: str | None = field(default=None, metadata={
        "sets": ("backbone", "cache_dir"), "path": True,
        "help": "Cache directory for CLIP weights (unset: $EDITKIT_CLIP_CACHE, else open_clip's / Hugging Face's)."})
    data_root: str | None = field(default=None, metadata={
        "sets": ("tasks", "data_root"), "path": True,
        "help": "Directory holding the datasets (unset: $EDITKIT_DATA); see docs/scenarios/vision8.md for the layouts."})
    hub_cache: str | None = field(default=None, metadata={
        "sets": ("tasks", "hub_cache_dir"), "path": True,
        "help": "Hugging Face hub cache to look for dataset copies in (unset: the hub's default)."})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # paths given as Path objects are kept as text, as the CLI gives them
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, f.name, os.fspath(value))

    def given(self) -> dict[str, str]:
        """The fields that are set, by field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def backbone(self) -> dict[str, str]:
        """The set options of the scenario's ``[backbone]`` table, keyed as its builder names them."""
        return self._table("backbone")

    def tasks(self) -> dict[str, str]:
        """The set options every task's source receives, keyed as the sources name them."""
        return self._table("tasks")

    def over(self, recorded: BuildOptions) -> BuildOptions:
        """These options where set, else the ``recorded`` ones."""
        return dataclasses.replace(recorded, **self.given())

    def to_json(self) -> dict[str, dict[str, str]]:
        """``{"backbone": {...}, "tasks": {...}}`` of the set options, for a bank's provenance.

        Paths that exist are made absolute, so a later ``negate`` run elsewhere finds them.
        """
        out: dict[str, dict[str, str]] = {table: {} for table in TABLES}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.metadata.get("path") and Path(value).expanduser().exists():
                value = str(Path(value).expanduser().resolve())
            table, key = f.metadata["sets"]
            out[table][key] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> BuildOptions:
        """Read :meth:`to_json`'s form back, refusing options this editkit does not know by name."""
        fields = {f.metadata["sets"]: f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for table, options in (data or {}).items():
            for key, value in (options or {}).items():
                if (table, key) not in fields:
                    known = ", ".join(f"{t}.{k}" for t, k in fields)
                    raise ConfigError(f"recorded build option {table}.{key} is unknown; known: {known}")
                values[fields[table, key]] = value
        return cls(**values)

    def _table(self, table: str) -> dict[str, str]:
        return {f.metadata["sets"][1]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata["sets"][0] == table and getattr(self, f.name) is not None}

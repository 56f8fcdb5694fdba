"""Named tensors kept in memory up to a byte budget, the rest in files on disk.

A stream's evaluation cache holds two vectors per test input of every task seen so
far; for most scenarios that is megabytes, for a long stream of large test splits it
is not. Tensors that would take the store past its budget are written to a directory
(one safetensors file each) and read back when asked for, so memory stays bounded by
the budget plus the one tensor in use.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class SpillingTensors:
    """A mapping from names to tensors: in memory while the budget allows, else in ``directory``.

    directory: where spilled tensors go (created on the first spill; removed by :meth:`close`).
        None: a fresh temporary directory, made only if something spills.
    """

    def __init__(self, budget_bytes: int, directory: str | Path | None = None) -> None:
        self.budget = budget_bytes
        self._directory = Path(directory) if directory is not None else None
        self._made: Path | None = None
        self._memory: dict[str, torch.Tensor] = {}
        self._files: dict[str, Path] = {}
        self._written = 0

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._memory.values())

    @property
    def spilled(self) -> list[str]:
        """Names whose tensors live on disk."""
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._memory or name in self._files

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._memory:
            return self._memory[name]
        return load_file(self._files[name])["tensor"]

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        """Store (or replace) ``name``: in memory if it fits beside what is held, else on disk."""
        self.pop(name)
        if self.held_bytes + tensor.numel() * tensor.element_size() <= self.budget:
            self._memory[name] = tensor
            return
        path = self._spill_dir() / f"{self._written}.safetensors"
        self._written += 1
        save_file({"tensor": tensor.contiguous()}, str(path))
        self._files[name] = path

    def pop(self, name: str) -> None:
        """Forget ``name`` (and its file); no error when absent."""
        self._memory.pop(name, None)
        path = self._files.pop(name, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def clear(self) -> None:
        for name in list(self._memory) + list(self._files):
            self.pop(name)

    def close(self) -> None:
        """Forget everything and remove the spill directory this store made."""
        self.clear()
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
            self._made = None

    def _spill_dir(self) -> Path:
        if self._made is None:
            if self._directory is not None:
                self._directory.mkdir(parents=True, exist_ok=True)
                self._made = Path(tempfile.mkdtemp(prefix="eval-cache-", dir=self._directory))
            else:
                self._made = Path(tempfile.mkdtemp(prefix="editkit-eval-cache-"))
        return self._made

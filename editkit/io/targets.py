"""Where a writer may write: the checks every path the user names for output (``--out``) goes through before any
work, so a run is never lost to a target refused after it, and nothing of the user's is overwritten unasked."""

from __future__ import annotations

from pathlib import Path

from editkit.errors import ConfigError


def check_target(out: Path | str, *, force: bool = False) -> Path:
    """A directory to write into: refuse a file, always; a non-empty directory unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: --out names the directory the model is written into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} is a directory that is not empty: pass --force to replace it, or name a "
                          "new directory")
    return out


def check_file_target(out: Path | str, *, force: bool = False) -> Path:
    """A file to write: refuse a directory, always; an existing file unless ``force``; a missing parent folder
    is made when the file is written."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: --out names the file to write")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} exists: pass --force to replace it, or name another file")
    return out

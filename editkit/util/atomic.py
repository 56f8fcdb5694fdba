"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Every file editkit writes for later reading (bank vectors and manifest, reports,
cached heads and arrays) goes through :func:`atomic_path`: the content is
written to a hidden temporary sibling (same directory, hence same filesystem),
flushed to disk, given the permissions a plain ``open()`` would have given it,
then renamed over the destination. A crash or an exception leaves the
destination untouched and removes the temporary file.

The permissions step matters because ``tempfile.mkstemp`` and safetensors'
``save_file`` both create files readable by their owner only (0600); a bank or
cache shared by a group would otherwise be unreadable to everyone else.

A cache entry made of several files (a converted model checkpoint) is built in a hidden
temporary directory by :func:`atomic_dir` and renamed into place in one step.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Iterator

TMP_MARKER = ".tmp-"  # in every temporary name, so leftovers of a killed process can be recognised


def temporary_sibling(path: Path) -> Path:
    """A hidden, unique name next to ``path``."""
    return path.parent / f".{path.name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's) content to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (not possible on every OS; best effort)."""
    with contextlib.suppress(OSError):
        fsync_path(path)


@contextlib.contextmanager
def atomic_path(path: Path | str, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write; on a clean exit it replaces ``path``.

    ``durable`` fsyncs the file and its directory (for banks: a power cut must not
    leave a manifest pointing at a vector whose bytes never reached the disk).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    # Created here (O_EXCL reserves the name) so the kernel applies the umask; writers that replace the
    # permissions (safetensors) get them back below. Reading the umask with os.umask would briefly set it
    # process-wide, which other threads could observe.
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        mode = stat.S_IMODE(os.stat(tmp).st_mode)
        yield tmp
        os.chmod(tmp, mode)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(path: Path | str, data: bytes, *, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: Path | str, text: str, *, durable: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def _plain_permissions(directory: Path) -> None:
    """Give every file below ``directory`` the permissions a plain ``open()`` gives (writers such as safetensors
    create files readable by their owner only), learnt from a probe file the kernel applies the umask to."""
    probe = directory / f".probe{TMP_MARKER}"
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    mode = stat.S_IMODE(os.stat(probe).st_mode)
    probe.unlink()
    for file in directory.rglob("*"):
        if file.is_file() and not file.is_symlink():
            os.chmod(file, mode)


@contextlib.contextmanager
def atomic_dir(path: Path | str, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory to fill; on a clean exit it is renamed to ``path`` in one step.

    For caches whose entry is several files: a reader sees the whole directory or none of it, so
    "the directory exists" means "it is complete". If another writer renamed its own copy into place
    first, that one is kept (both were built from the same input) and this one is discarded.

    ``replace``: what is at ``path`` (a directory with content, or a file) is replaced instead: it is
    moved to a temporary sibling, the new directory renamed into place, then the old one removed (put
    back if the rename fails). An exception inside the block leaves ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    tmp.mkdir()
    old: Path | None = None
    try:
        yield tmp
        _plain_permissions(tmp)
        if replace and (path.is_file() or path.is_symlink() or (path.is_dir() and any(path.iterdir()))):
            old = temporary_sibling(path)
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError:
            if old is not None:
                os.rename(old, path)
                old = None
                raise
            if not path.is_dir():
                raise
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

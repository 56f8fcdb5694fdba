"""The task-vector bank: a directory of task vectors any user can inspect.

Layout: one directory, one JSON manifest naming every vector, one safetensors file per vector::

    <root>/manifest.json          format version, base-model fingerprint, one entry per vector
    <root>/<name>.safetensors     tau = theta_ft - theta_0, tensors keyed by parameter name
    <root>/<name>.curvature.safetensors   the task's curvature at theta_0, where the data-free penalty banked it
    <root>/<name>.prototypes-2.safetensors  the task's class prototypes (format 2), where it has classes
    <root>/.lock                  file lock serialising writers
    <root>/.writer                who holds the bank for a whole run (a stream), beside its lock

Why it is built this way:

- *Crash safety.* Every file is written to a temporary file in the same
  directory, fsynced and renamed over its final name; the manifest is written
  last. A vector therefore exists exactly when the manifest names it: a crash
  at any point leaves the previous bank intact (at worst an orphan file the
  manifest does not mention, which is ignored and overwritten by a later
  append of the same name).
- *Concurrency.* Writers hold ``<root>/.lock`` and re-read the manifest inside
  it, so two processes appending at once both land. Readers take no lock: the
  manifest is only ever replaced atomically, and a referenced vector file is
  never rewritten. A run that appends several vectors (a stream) holds the bank
  for its whole length (:meth:`Bank.writer`), so a second run on it is refused at
  once, naming the first, not after fine-tuning a task it could not bank.
- *Trust.* Every load checks the sha256 recorded at append time and, when
  asked, the base-model fingerprint; merges refuse vectors of different bases
  or of different families (a non-linear tau and a linearized one live in
  different spaces and cannot be summed meaningfully).
- *Memory.* :meth:`Bank.merge` streams tensor by tensor through
  ``safetensors.safe_open``, so it needs about one model of memory however
  many vectors are combined.

Orphans (vector or temporary files the manifest does not reference) are not
errors: they are what an interrupted write leaves behind and never change what
the bank holds. :meth:`Bank.verify` logs them at INFO level and leaves them out
of its problem list; :meth:`Bank.orphans` lists them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from editkit.bank.entries import BESIDE_FILES, VectorEntry, check_mode, checked_fields, json_copy, short_fingerprint
from editkit.bank.summing import (VectorReader, check_bases, common_family, header_shapes, in_merge_space,
                                  sum_files)
from editkit.util.atomic import TMP_MARKER, atomic_path, atomic_write_bytes, fsync_dir
from editkit.core.adapters import LoraSpec
from editkit.core.artifacts import sha256_file
from editkit.core.modes import Family
from editkit.errors import BankError, ConfigError, CorruptVectorError, IncompatibleVectorsError

if TYPE_CHECKING:  # torch is imported where tensors are written or summed: reading the manifest needs none
    import torch

    from editkit.core.curvature import Curvature
    from editkit.core.prototypes import Prototypes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"
VECTOR_SUFFIX = ".safetensors"
CURVATURE_SUFFIX = ".curvature" + VECTOR_SUFFIX

# Filesystem-safe on every platform; the length cap keeps "<name>.safetensors" and
# its temporary sibling under the usual 255-byte filename limit.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_NAME_LEN = 200
_LOCK_TIMEOUT_S = 600.0
WRITER_NAME = ".writer"


# --------------------------------------------------------------------------- entries

@dataclass
class _Manifest:
    base: str | None = None
    vectors: list[VectorEntry] = field(default_factory=list)

    def find(self, name: str) -> VectorEntry | None:
        return next((e for e in self.vectors if e.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "base": self.base,
                "vectors": [e.to_json() for e in self.vectors]}


# --------------------------------------------------------------------------- files


def prototypes_file(name: str, prototypes: Prototypes) -> str:
    """The file a vector's class prototypes are banked in, named for their format: prototypes of a new format
    go to a new file, so a file a reader may be reading is never rewritten."""
    return f"{name}.{prototypes.describe()['format']}{VECTOR_SUFFIX}"


def _sha256_file(path: Path) -> str:
    return "sha256:" + sha256_file(path)


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that safetensors accepts.

    safetensors refuses tensors sharing storage (e.g. tied weights passed under two
    names); only those are cloned, so memory stays near one copy.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise BankError(f"tensor keys must be non-empty strings, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise BankError(f"value for {key!r} is a {type(value).__name__}, not a torch.Tensor")
        if value.layout != torch.strided:
            raise BankError(f"tensor {key!r} has layout {value.layout}; store dense tensors")
        tensor = value.detach().to("cpu").contiguous()
        ident = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if tensor.numel() and ident in seen:
            tensor = tensor.clone()
        seen.add(ident)
        out[key] = tensor
    return out


# --------------------------------------------------------------------------- the bank


class Bank:
    """A persistent, append-mostly collection of task vectors sharing one base model."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Bank({str(self.root)!r})"

    # ---- paths and locking

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def _path_of(self, entry: VectorEntry, file: str | None = None) -> Path:
        """Resolve an entry's file (or another ``file`` it names), refusing anything that would escape the bank
        directory."""
        file = entry.file if file is None else file
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise BankError(f"manifest entry {entry.name!r} names an unsafe file {file!r}")
        return self.root / file

    def _beside_paths(self, entry: VectorEntry) -> dict[str, Path]:
        """The files banked beside the entry's vector (curvature, prototypes), by record, where it has them."""
        return {kind: self._path_of(entry, getattr(entry, kind).get("file"))
                for kind in BESIDE_FILES if getattr(entry, kind)}

    @contextlib.contextmanager
    def _locked(self, *, create: bool = False) -> Iterator[None]:
        """Hold the writer lock. Only appends may create the bank directory."""
        import filelock  # writers only: readers take no lock, and bank list should not pay for it

        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise BankError(f"no bank at {self.root}")
        lock = filelock.FileLock(str(self.root / LOCK_NAME), timeout=_LOCK_TIMEOUT_S)
        try:
            lock.acquire()
        except filelock.Timeout as exc:
            raise BankError(
                f"bank {self.root} is locked by another process (waited {_LOCK_TIMEOUT_S:.0f} s); "
                f"if no editkit process is running, delete {self.root / LOCK_NAME}"
            ) from exc
        try:
            yield
        finally:
            lock.release()

    @contextlib.contextmanager
    def writer(self, command: str) -> Iterator[None]:
        """Hold the bank for one run that writes it (``command`` says which, to whoever is refused), from its
        checks to its last append; a second run is refused at once, naming this one. The hold is an OS file lock
        (it ends with the process: a crash never leaves the bank held); ``.writer`` says who holds it."""
        import filelock
        import os
        import socket

        created = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        lock_path = self.root / (WRITER_NAME + ".lock")
        lock = filelock.FileLock(str(lock_path), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise BankError(f"bank {self.root} is being written by another run ({self._writer()}): wait for it to "
                            "finish, or pass another --bank directory") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                  "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        atomic_write_bytes(self.root / WRITER_NAME, json.dumps(record).encode(), durable=False)
        try:
            yield
        finally:
            (self.root / WRITER_NAME).unlink(missing_ok=True)
            lock.release()
            if created and not self.manifest_path.exists():  # nothing was banked: leave no bank behind
                lock_path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.root.rmdir()

    def _writer(self) -> str:
        """Who holds the bank, as its ``.writer`` record says."""
        try:
            record = json.loads((self.root / WRITER_NAME).read_text())
            return f"`{record['command']}`, process {record['pid']} on {record['host']} since {record['since']}"
        except (OSError, ValueError, KeyError):
            return "a process that has not said which"

    # ---- manifest I/O

    def _read_manifest(self) -> _Manifest:
        """The manifest as it is on disk now; a missing manifest is an empty bank."""
        path = self.manifest_path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return _Manifest()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BankError(f"bank manifest {path} is not valid JSON ({exc}); restore it from a backup") from exc
        return self._parse_manifest(data, path)

    @staticmethod
    def _parse_manifest(data: Any, path: Path) -> _Manifest:
        if not isinstance(data, dict):
            raise BankError(f"bank manifest {path} is not a JSON object")
        version = data.get("format")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise BankError(
                f"bank manifest {path} has format {version!r}; this editkit reads format {FORMAT_VERSION} "
                "(a newer editkit may have written it)"
            )
        base, vectors = data.get("base"), data.get("vectors")
        if base is not None and not isinstance(base, str):
            raise BankError(f"bank manifest {path}: 'base' must be a string or null")
        if not isinstance(vectors, list):
            raise BankError(f"bank manifest {path}: 'vectors' must be a list")
        try:
            entries = [VectorEntry.from_json(item) for item in vectors]
        except BankError as exc:
            raise BankError(f"bank manifest {path}: {exc}") from exc
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise BankError(f"bank manifest {path} lists a vector name twice")
        return _Manifest(base=base, vectors=entries)

    def _write_manifest(self, manifest: _Manifest) -> None:
        atomic_write_bytes(self.manifest_path, (json.dumps(manifest.to_json(), indent=2) + "\n").encode())

    # ---- read-only queries

    def exists(self) -> bool:
        """True once a manifest has been written (the first append creates it)."""
        return self.manifest_path.is_file()

    def entries(self) -> list[VectorEntry]:
        """All entries, in append order."""
        return list(self._read_manifest().vectors)

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._read_manifest().find(name) is not None

    def __len__(self) -> int:
        return len(self._read_manifest().vectors)

    @property
    def base(self) -> str | None:
        """Fingerprint of theta_0 shared by every vector; None while the bank is empty."""
        return self._read_manifest().base

    def get(self, name: str) -> VectorEntry:
        return self._get(self._read_manifest(), name)

    def _get(self, manifest: _Manifest, name: str) -> VectorEntry:
        entry = manifest.find(name)
        if entry is None:
            known = ", ".join(e.name for e in manifest.vectors) or "none"
            raise BankError(f"no vector named {name!r} in bank {self.root} (known: {known})")
        return entry

    # ---- append

    def append(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        task: str,
        mode: str,
        base: str,
        **described: Any,
    ) -> VectorEntry:
        """Store a new vector atomically; the manifest is rewritten only after its file is durable.

        described: the entry's optional fields (``scenario``, ``step``, ``recipe``, ``metrics``,
            ``provenance``), declared once by :class:`VectorEntry` and checked as a manifest's are; and
            ``curvature``, the task's :class:`~editkit.core.curvature.Curvature`, and ``prototypes``, its
            :class:`~editkit.core.prototypes.Prototypes`, each written to a file of its own before the vector
            (the manifest, last, names all of them or none).
        """
        curvature, prototypes = described.pop("curvature", None), described.pop("prototypes", None)
        _check_name(name)
        check_mode(mode)
        if not isinstance(base, str) or not base:
            raise BankError("base must be the base model's fingerprint string")
        described = checked_fields(described, f"vector {name!r}")
        if not tensors:
            raise BankError(f"vector {name!r} has no tensors")
        cpu = _cpu_tensors(tensors)
        with self._locked(create=True):
            manifest = self._read_manifest()
            self._check_appendable(manifest, name, base, LoraSpec.from_fields(described["recipe"]))
            if curvature is not None:
                described["curvature"] = self._write_beside(name + CURVATURE_SUFFIX, curvature)
            if prototypes is not None:
                described["prototypes"] = self._write_beside(prototypes_file(name, prototypes), prototypes)
            file_name = name + VECTOR_SUFFIX
            checksum = self._write_vector(file_name, cpu, name=name, task=task, mode=mode, base=base)
            entry = VectorEntry(
                name=name, task=task, mode=mode, base=base, file=file_name, checksum=checksum,
                created=datetime.now(timezone.utc).isoformat(timespec="milliseconds"), **described,
            )
            manifest.base = base
            manifest.vectors.append(entry)
            self._write_manifest(manifest)
        logger.info("bank %s: appended %s (task=%s, mode=%s, %d tensors)", self.root, name, task, mode, len(cpu))
        return entry

    def _check_appendable(self, manifest: _Manifest, name: str, base: str, adapter: LoraSpec | None) -> None:
        if manifest.find(name) is not None:
            raise BankError(
                f"bank {self.root} already holds a vector named {name!r}; remove it first "
                f"(editkit bank remove {name} --bank {self.root}) or choose another name"
            )
        held = {e.adapter for e in manifest.vectors}
        if held and held != {adapter}:
            what = ", ".join(sorted(s.describe() if s else "full vectors" for s in held))
            raise IncompatibleVectorsError(
                f"vector {name!r} is {adapter.describe() if adapter else 'a full vector'} but bank {self.root} holds "
                f"{what}: adapter and full vectors, or adapters of other configurations, live in different spaces; "
                "use a separate bank")
        if manifest.base is not None and manifest.base != base:
            raise IncompatibleVectorsError(
                f"vector {name!r} was fine-tuned from base {short_fingerprint(base)} but bank {self.root} holds "
                f"vectors of base {short_fingerprint(manifest.base)}; use a separate bank per base model"
            )

    def _write_beside(self, file_name: str, content: Curvature | Prototypes) -> dict[str, Any]:
        """Write a task's curvature or prototypes durably beside its vector; returns the entry's record of them
        (file, checksum and what they say of themselves)."""
        from safetensors.torch import save_file

        with atomic_path(self.root / file_name) as tmp:
            save_file(_cpu_tensors(content.to_tensors()), str(tmp), metadata=content.header())
            checksum = _sha256_file(tmp)
        return {"file": file_name, "checksum": checksum, **content.describe()}

    def _write_vector(self, file_name: str, tensors: dict[str, torch.Tensor], **meta: str) -> str:
        """Write ``tensors`` durably under ``file_name``; returns the checksum of the bytes written."""
        from safetensors.torch import save_file

        with atomic_path(self.root / file_name) as tmp:
            save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
            checksum = _sha256_file(tmp)
        return checksum

    # ---- other writes

    def set_prototypes(self, name: str, prototypes: Prototypes) -> VectorEntry:
        """Bank the class prototypes of a vector banked without them (just appended, or written before they
        existed) or with an earlier format of them: the file first, then the manifest (atomic), then the earlier
        file is removed. An entry's files are never rewritten in place (readers take no lock: each format has a
        file name of its own), so prototypes of this format are refused."""
        self.get(name)  # refuse unknown names before touching the directory
        with self._locked():
            manifest = self._read_manifest()
            old = self._get(manifest, name)
            if old.prototypes.get("format") == prototypes.describe()["format"]:
                raise BankError(f"vector {name!r} of bank {self.root} already has its class prototypes")
            record = self._write_beside(prototypes_file(name, prototypes), prototypes)
            entry = VectorEntry(**{**old.to_json(), "prototypes": record})
            manifest.vectors[manifest.vectors.index(old)] = entry
            self._write_manifest(manifest)
            if old.prototypes and old.prototypes["file"] != record["file"]:
                (self.root / old.prototypes["file"]).unlink(missing_ok=True)
        logger.info("bank %s: added the class prototypes of %s", self.root, name)
        return entry

    def update_metrics(self, name: str, metrics: dict) -> VectorEntry:
        """Merge ``metrics`` into a vector's metrics (e.g. accuracies measured after training)."""
        new = json_copy(metrics, "metrics")
        self.get(name)  # refuse unknown names before touching the directory
        with self._locked():
            manifest = self._read_manifest()
            old = self._get(manifest, name)
            entry = VectorEntry(**{**old.to_json(), "metrics": {**old.metrics, **new}})
            manifest.vectors[manifest.vectors.index(old)] = entry
            self._write_manifest(manifest)
        logger.info("bank %s: updated metrics of %s (%s)", self.root, name, ", ".join(new))
        return entry

    def remove(self, name: str) -> None:
        """Forget a vector: the manifest first (atomic), then its file.

        A crash between the two leaves an orphan file, never a dangling entry. Removing
        the last vector resets the bank's base, so an empty bank accepts any model.
        """
        self.get(name)  # refuse unknown names before touching the directory
        with self._locked():
            manifest = self._read_manifest()
            entry = self._get(manifest, name)
            paths = [self._path_of(entry), *self._beside_paths(entry).values()]
            manifest.vectors.remove(entry)
            if not manifest.vectors:
                manifest.base = None
            self._write_manifest(manifest)
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            fsync_dir(self.root)
        logger.info("bank %s: removed %s", self.root, name)

    # ---- loading and checking

    def load(self, name: str, *, base: str | None = None) -> dict[str, torch.Tensor]:
        """The tensors of one vector, after checking its checksum (and base, when given)."""
        manifest = self._read_manifest()
        entry = self._get(manifest, name)
        check_bases([entry], base)
        path = self._verify_file(entry)
        try:
            with safe_open(str(path), framework="pt") as fh:
                return {key: fh.get_tensor(key) for key in fh.keys()}
        except Exception as exc:  # safetensors raises its own types
            raise CorruptVectorError(f"vector file {path} is truncated or unreadable") from exc

    def reader(self, name: str, *, base: str | None = None) -> VectorReader:
        """One vector whose tensors are read from its file one at a time, when asked for, after checking its
        checksum (and base, when given) once: what a merge that works layer by layer holds instead of the
        whole vector. A plain-LoRA vector reads as its weight updates (see :meth:`merge`)."""
        entry = self._get(self._read_manifest(), name)
        check_bases([entry], base)
        path = self._verify_file(entry)
        return in_merge_space(entry, VectorReader(path, header_shapes(path, name)))

    def shapes(self, name: str) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes of one vector, read from its file's header alone (cheap: no data, no
        checksum), for checking that a vector fits a backbone before anything is loaded."""
        return header_shapes(self._path_of(self.get(name)), name)

    def _verify_file(self, entry: VectorEntry, path: Path | None = None, checksum: str | None = None) -> Path:
        """Raise CorruptVectorError unless the entry's file (or ``path``, recorded with ``checksum``) exists and
        matches its checksum."""
        path, checksum = (self._path_of(entry), entry.checksum) if path is None else (path, checksum)
        try:
            actual = _sha256_file(path)
        except FileNotFoundError as exc:
            raise CorruptVectorError(f"vector file {path} of {entry.name!r} is missing") from exc
        except OSError as exc:
            raise CorruptVectorError(f"vector file {path} is truncated or unreadable") from exc
        if actual != checksum:
            raise CorruptVectorError(self._mismatch_message(path, checksum, actual))
        return path

    def curvature(self, name: str) -> Curvature | None:
        """Vector ``name``'s task curvature, after checking its checksum; None where none was banked."""
        from editkit.core.curvature import Curvature

        entry = self.get(name)
        if not entry.curvature:
            return None
        path, tensors, header = self._read_beside(entry, "curvature")
        try:
            return Curvature.from_tensors(tensors, header)
        except (ConfigError, KeyError, ValueError) as exc:  # its checksum holds: another editkit's format
            raise CorruptVectorError(f"curvature file {path} of {name!r} is not a curvature editkit wrote ({exc})") from exc

    def prototypes(self, name: str) -> Prototypes | None:
        """Vector ``name``'s class prototypes, after checking their checksum and that they are what the manifest
        says (classes, features, examples); None where none were banked, or only in an earlier format (a resumed
        stream computes them again)."""
        from editkit.core.prototypes import FORMAT, Prototypes

        entry = self.get(name)
        if entry.prototypes.get("format") != FORMAT:
            return None
        path, tensors, header = self._read_beside(entry, "prototypes")
        try:
            prototypes = Prototypes.from_tensors(tensors, header)
        except ConfigError as exc:
            raise CorruptVectorError(f"prototype file {path} of {name!r} is not what editkit wrote ({exc})") from exc
        recorded = {key: entry.prototypes.get(key) for key in prototypes.describe()}
        if prototypes.describe() != recorded:
            raise CorruptVectorError(f"prototype file {path} of {name!r} holds {prototypes.describe()}, its manifest "
                                     f"entry says {recorded}")
        return prototypes

    def _read_beside(self, entry: VectorEntry, kind: str) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
        """A file banked beside the entry's vector (``kind``: its record), checksummed: its path, tensors and
        header."""
        path = self._verify_file(entry, self._beside_paths(entry)[kind], getattr(entry, kind).get("checksum"))
        try:
            with safe_open(str(path), framework="pt") as fh:
                return path, {key: fh.get_tensor(key) for key in fh.keys()}, fh.metadata() or {}
        except Exception as exc:  # safetensors raises its own types
            raise CorruptVectorError(f"{kind} file {path} is truncated or unreadable") from exc

    @staticmethod
    def _mismatch_message(path: Path, checksum: str, actual: str) -> str:
        """Say whether the file no longer parses (truncated) or parses but changed."""
        try:
            with safe_open(str(path), framework="pt") as fh:
                fh.keys()
        except Exception:  # safetensors raises its own types
            return (f"vector file {path} is truncated or unreadable "
                    f"(checksum mismatch: manifest {short_fingerprint(checksum)}, file {short_fingerprint(actual)})")
        return (f"vector file {path}: checksum mismatch (manifest {short_fingerprint(checksum)}, "
                f"file {short_fingerprint(actual)}); the file was modified or damaged after it was stored")

    def verify(self) -> list[str]:
        """Problems that make the bank untrustworthy; an empty list means healthy.

        Checks the manifest parses, every entry's file exists, parses and matches its
        checksum, and every entry carries the bank's base. Orphan files are not
        problems (see the module docstring); they are logged at INFO level.
        """
        try:
            manifest = self._read_manifest()
        except BankError as exc:
            return [str(exc)]
        problems: list[str] = []
        for entry in manifest.vectors:
            if entry.base != manifest.base:
                problems.append(f"vector {entry.name!r} has base {short_fingerprint(entry.base)}, "
                                f"bank has {short_fingerprint(manifest.base)}")
            try:
                self._verify_file(entry)
                for kind, path in self._beside_paths(entry).items():
                    self._verify_file(entry, path, getattr(entry, kind).get("checksum"))
            except BankError as exc:
                problems.append(str(exc))
        for orphan in self._orphans(manifest):
            logger.info("bank %s: ignoring orphan file %s (left by an interrupted write?)", self.root, orphan.name)
        return problems

    def orphans(self) -> list[Path]:
        """Files in the bank directory that the manifest does not reference."""
        return self._orphans(self._read_manifest())

    def _orphans(self, manifest: _Manifest) -> list[Path]:
        if not self.root.is_dir():
            return []
        known = ({e.file for e in manifest.vectors} | {getattr(e, kind).get("file") for e in manifest.vectors
                                                      for kind in BESIDE_FILES} | {MANIFEST_NAME, LOCK_NAME})
        return sorted(p for p in self.root.iterdir()
                      if p.name not in known and (p.suffix == VECTOR_SUFFIX or TMP_MARKER in p.name))

    # ---- merging

    def check_combinable(self, names: list[str]) -> Family:
        """Refuse, by name, a selection whose vectors live in different spaces (families, adapters, bases)."""
        manifest = self._read_manifest()
        entries = [self._get(manifest, name) for name in names]
        family = common_family(entries)
        check_bases(entries, None)
        return family

    def merge(self, coefficients: Mapping[str, float], *, base: str | None = None) -> dict[str, torch.Tensor]:
        """Sum alpha_i * tau_i, streamed key by key (plain-LoRA vectors: their weight updates s * B_i A_i, whose
        factors do not add).

        Everything that could refuse (names, modes, bases, checksums, key sets, shapes)
        is checked before the first addition. Accumulation is in float32 (float64 if
        any input is float64 or not floating), and each result is cast back to the
        stored dtype (the promoted one if the vectors differ).
        """
        if not coefficients:
            raise BankError("merge needs at least one vector; the selection is empty")
        manifest = self._read_manifest()
        entries = [self._get(manifest, name) for name in coefficients]
        alphas = [float(coefficients[e.name]) for e in entries]
        common_family(entries)
        check_bases(entries, base)
        merged = sum_files(entries, [self._verify_file(e) for e in entries], alphas)
        logger.info("bank %s: merged %s", self.root,
                    ", ".join(f"{a:+g}*{e.name}" for a, e in zip(alphas, entries)))
        return merged


def open_bank(path: str | Path) -> Bank:
    """The bank at ``path``, refused (BankError) when it holds no vector: what every command that reads one
    starts with."""
    bank = Bank(path)
    if not bank.exists() or not len(bank):
        raise BankError(f"no task vectors in {Path(path)}: run `editkit stream` first or pass --bank DIR")
    return bank


# --------------------------------------------------------------------------- helpers


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > _MAX_NAME_LEN:
        raise BankError(
            f"invalid vector name {name!r}: use letters, digits, '.', '_' and '-', "
            f"starting with a letter or digit, at most {_MAX_NAME_LEN} characters"
        )



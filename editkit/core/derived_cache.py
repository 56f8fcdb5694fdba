"""What theta_0 computes, kept on disk: work whose inputs never change is done once per machine.

theta_0 is the same model in every run of a scenario, so what it alone computes (a frozen prefix's hidden states of
a text, its sampled continuations of a prompt set) is the same each time; yet each run computed it again. An entry is
``<folder>/<sha256 of its key><suffix>`` under :func:`~editkit.settings.derived_cache_dir`, and its file holds the
key itself. It is read only when that stored key equals the one asked for and the entry checks out (its own ``load``
says so); anything else (another key, a torn or edited file) is computed again and the entry rewritten whole
(written beside, then renamed), never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, TypeVar

from editkit.settings import derived_cache_dir
from editkit.util.atomic import atomic_path

log = logging.getLogger(__name__)

T = TypeVar("T")


def digest(value: Any) -> str:
    """sha256 of a JSON value (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def as_stored(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` as read back from a file (tuples as lists), so a stored key compares equal to a new one."""
    return json.loads(json.dumps(key))


def entry_path(folder: str, key: dict[str, Any], suffix: str) -> Path:
    return derived_cache_dir() / folder / f"{digest(key)}{suffix}"


def cached(folder: str, suffix: str, key: dict[str, Any], compute: Callable[[], T], *,
           load: Callable[[Path, dict[str, Any]], T | None], save: Callable[[Path, dict[str, Any], T], None]) -> T:
    """The value stored under ``key``, else ``compute()``'s, stored for the next call.

    load(path, key): the entry's value if it is whole and made for ``key``, else None; it may raise on a damaged
    file (read as a miss). save(path, key, value): writes the entry (to a temporary path, renamed when whole)."""
    key = as_stored(key)
    return cached_at(entry_path(folder, key, suffix), key, compute, load=load, save=save)


def cached_at(path: Path, key: dict[str, Any], compute: Callable[[], T], *,
              load: Callable[[Path, dict[str, Any]], T | None], save: Callable[[Path, dict[str, Any], T], None]) -> T:
    """:func:`cached` at a place the caller chooses (a bank root, beside what it records there) rather than the
    machine's cache: the same rule, an entry read only when whole and made for ``key``, else computed again."""
    key = as_stored(key)
    if path.is_file():
        try:
            found = load(path, key)
        except Exception as error:  # a torn or foreign file, whatever the reader raised: computed again
            log.warning("cache entry %s is unreadable (%s): computing it again", path, error)
            found = None
        else:
            if found is None:
                log.warning("cache entry %s was made for other inputs or does not check out: computing it again", path)
        if found is not None:
            return found
    value = compute()
    with atomic_path(path, durable=False) as scratch:
        save(scratch, key, value)
    return value

"""Extensions from other packages: the entry-point group ``editkit.extensions``.

A package adds backbone families, task sources, merge methods, strategies, scorers... without a line
inside editkit: its ``pyproject.toml`` names a module that registers them when imported::

    [project.entry-points."editkit.extensions"]
    my-resnet = "my_package.editkit_plugin"

Every such module is imported once, just before the first registry lookup of the process
(:meth:`editkit.core.registry.Registry.__getitem__` and friends call :func:`load`), so
``editkit --help``, the CLI's lists of choices and scenario validation all see what the
extensions register. Loading happens at lookup time rather than at ``import editkit``
because an extension imports editkit's registries itself: at import time they would be
half-built.

An extension that fails (an import error, a name another package registered already) is
named in one warning line and skipped, with whatever it registered before failing taken
back (the ``on_failure`` callback), so commands that do not need it still run. While a
module loads, :func:`current_package` names its distribution, which is how a duplicate
name is refused naming both packages.

Nothing here imports editkit: the registry module passes its callback in.
"""

from __future__ import annotations

import importlib
import logging
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Callable

log = logging.getLogger(__name__)

GROUP = "editkit.extensions"

_loaded = False
_loading = False
#: The distribution whose extension module is being imported (a stack: an extension may trigger another's load).
_current: list[str] = []
#: Extension modules imported, and by which package: what :func:`reset` forgets.
_modules: dict[str, str] = {}


def package_of(entry_point: EntryPoint) -> str:
    """The distribution that declares ``entry_point`` (its module path when unknown)."""
    dist = getattr(entry_point, "dist", None)
    return dist.name if dist is not None else entry_point.value.split(":")[0]


def current_package() -> str | None:
    """The package whose extension module is being imported now, or None (editkit itself, a script)."""
    return _current[-1] if _current else None


def load(on_failure: Callable[[str], None] = lambda package: None) -> None:
    """Import every extension module of the group, once per process; reentrant calls (an extension
    looking a name up while it loads) return at once."""
    global _loaded, _loading
    if _loaded or _loading:
        return
    _loading = True
    try:
        for entry_point in sorted(entry_points(group=GROUP), key=lambda ep: (package_of(ep), ep.name)):
            _load_one(entry_point, on_failure)
    finally:
        _loaded, _loading = True, False


def _load_one(entry_point: EntryPoint, on_failure: Callable[[str], None]) -> None:
    package, module = package_of(entry_point), entry_point.value.split(":")[0]
    _current.append(package)
    try:
        importlib.import_module(module)
        _modules[module] = package
    except Exception as exc:  # any failure of a third-party module: warn and go on without it
        sys.modules.pop(module, None)
        on_failure(package)
        reason = (str(exc).splitlines() or [""])[0]
        log.warning("editkit extension %r of package %s was not loaded (%s: %s)", entry_point.name, package,
                    type(exc).__name__, reason)
    finally:
        _current.pop()


def reset(on_reset: Callable[[str], None] = lambda package: None) -> None:
    """Forget the loaded extensions (``on_reset`` takes back each package's registrations) so the next
    lookup loads them again: for tests that put an extension on the path and take it away."""
    global _loaded
    for module, package in list(_modules.items()):
        on_reset(package)
        sys.modules.pop(module, None)
    _modules.clear()
    _loaded = False

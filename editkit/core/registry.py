"""Named extensions that announce themselves where they live.

Backbone families, task sources, head kinds, generic unlabeled sources and merge
methods are each a :class:`Registry` of :class:`Record` s. The module that
implements an extension registers it in one line, so the code that *uses*
extensions (the scenario builder, the bench) never names a family, source or
method, and adding one touches no other module. A record carries what a caller
needs besides building: an offline availability ``check`` (so a run stops before
training when weights or data are absent) and the ``options`` it accepts (so a
misspelt key in a scenario file is refused by name instead of silently running
with a default).

Each registry lives in the layer of what it holds (the backbone families in
``editkit.models``, task sources in ``editkit.data``, ...), so registering never
imports upward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Iterator, Mapping, TypeVar

from editkit.errors import ConfigError


@dataclass(frozen=True)
class Option:
    """One option a builder accepts: its name, its default and a line of help."""

    name: str
    default: Any
    help: str = ""


@dataclass(frozen=True)
class Record:
    """One extension: ``build`` makes the thing; ``check`` (optional) takes the same arguments and returns one
    line per missing piece, loading nothing large; ``options`` are the keyword options ``build`` accepts."""

    build: Callable[..., Any]
    check: Callable[..., list[str]] | None = None
    options: tuple[Option, ...] = ()
    label: str = ""  # how tables and listings name it; empty: its registered name

    @classmethod
    def of(cls, build: Callable[..., Any], *, check: Callable[..., list[str]] | None = None,
           help: Mapping[str, str] | None = None, label: str = "") -> "Record":
        """A record whose options are ``build``'s parameters that have a default.

        Parameters without a default are what the registry's caller always supplies
        (a task's name, the backbone, the seed...), so they are not options a user sets.
        """
        help = dict(help or {})
        options = tuple(Option(p.name, p.default, help.pop(p.name, ""))
                        for p in inspect.signature(build).parameters.values()
                        if p.default is not inspect.Parameter.empty)
        if help:
            raise ValueError(f"help given for {sorted(help)}, which {build.__qualname__} does not take as options")
        return cls(build, check, options, label)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def refuse_unknown(self, keys: Iterable[str], where: str) -> None:
        """Raise ``ConfigError`` naming every key in ``keys`` that is not one of the options."""
        unknown = sorted(set(keys) - set(self.option_names))
        if unknown:
            known = ", ".join(self.option_names) or "none"
            raise ConfigError(f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(repr, unknown))}; known: {known}")


R = TypeVar("R", bound=Record)


@dataclass
class Registry(Generic[R]):
    """Records by name; ``what`` names the kind of thing held, for messages ("backbone family")."""

    what: str
    _records: dict[str, R] = field(default_factory=dict, repr=False)

    def register(self, name: str, record: R) -> R:
        """Add ``record`` under ``name``; a second registration of a name is refused, never overwrites."""
        if name in self._records:
            raise ConfigError(f"{self.what} {name!r} is already registered ({self._records[name].build.__module__}); "
                              "pick another name")
        self._records[name] = record
        return record

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin being unloaded, a test's temporary extension)."""
        self[name]  # refuses an unknown name, listing the known ones
        del self._records[name]

    def __getitem__(self, name: str) -> R:
        try:
            return self._records[name]
        except (KeyError, TypeError):
            raise ConfigError(f"unknown {self.what} {name!r}; known: {', '.join(self.names()) or 'none'}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        return sorted(self._records)

    def label(self, name: str) -> str:
        return self[name].label or name

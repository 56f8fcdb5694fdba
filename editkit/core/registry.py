"""Named extensions that announce themselves where they live.

Backbone families, task sources, head kinds, generic unlabeled sources, merge methods,
continual-learning strategies, loggers... are each a :class:`Registry` of :class:`Record` s. The module that
implements an extension registers it in one line, so the code that *uses*
extensions (the scenario builder, the bench) never names a family, source or
method, and adding one touches no other module. A record carries what a caller
needs besides building: an offline availability ``check`` (so a run stops before
training when weights or data are absent) and the ``options`` it accepts (so a
misspelt key in a scenario file is refused by name instead of silently running
with a default).

Each registry lives in the layer of what it holds (the backbone families in
``editkit.models``, task sources in ``editkit.data``, ...), so registering never
imports upward. Facts a caller needs about a thing besides building it (a merge method's order dependence, a
strategy's rehearsal) are fields of its record: a registry whose records carry such facts holds a subclass of
:class:`Record` (its ``kind``), never a side table other modules fill in.

Other packages register through the entry-point group ``editkit.extensions``
(:mod:`editkit.core.extensions`): the first lookup in any registry imports them, and
each name remembers the package that registered it, so a clash names both.

Options are set in one grammar everywhere: ``key=value`` for one record (``editkit add --method dare --param
p=0.5``), ``NAME.key=value`` across a registry (``--strategy-params ewc.ewc_lambda=100``), each value typed by
its option's default and refused in one line when the key or the type is wrong (:meth:`Record.given`,
:meth:`Registry.parse_params`).

A registry may also hold a **family** of names: ``register_family("file", factory)`` makes
every ``"file:<rest>"`` a name whose record is ``factory(rest)`` (a user's text file as a
text corpus), accepted wherever a registered name is.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Iterator, Mapping, TypeVar

from editkit.core import extensions
from editkit.errors import ConfigError
from editkit.util.paths import PathRule


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
    #: ``build``'s parameters that may name a file or folder (a task source's ``dataset``, in ``source =
    #: "kind:dataset"``; a backbone's ``weights``), each with the rule that tells a path from a name: a scenario
    #: file's relative path is read from the scenario file's folder, not the working directory.
    paths: Mapping[str, PathRule] = field(default_factory=dict, hash=False)  # a record stays hashable
    #: Where it comes from (a method's paper), so a listing or a report can cite it.
    reference_url: str = ""

    @classmethod
    def of(cls, build: Callable[..., Any], *, check: Callable[..., list[str]] | None = None,
           help: Mapping[str, str] | None = None, label: str = "",
           paths: Mapping[str, PathRule] | None = None, **facts: Any) -> "Record":
        """A record whose options are ``build``'s parameters that have a default; ``facts`` are the record's
        other fields (``reference_url``, a subclass's own).

        Parameters without a default are what the registry's caller always supplies
        (a task's name, the backbone, the seed...), so they are not options a user sets.
        """
        help, paths = dict(help or {}), dict(paths or {})
        parameters = inspect.signature(build).parameters
        options = tuple(Option(p.name, p.default, help.pop(p.name, "")) for p in parameters.values()
                        if p.default is not inspect.Parameter.empty)
        if help:
            raise ValueError(f"help given for {sorted(help)}, which {build.__qualname__} does not take as options")
        if unknown := sorted(set(paths) - set(parameters)):
            raise ValueError(f"path rules given for {unknown}, which {build.__qualname__} does not take")
        return cls(build, check, options, label, paths, **facts)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options}

    def given(self, given: Mapping[str, Any] | Iterable[str], where: str,
              defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``given`` (``{key: value}``, or the command line's ``["key=value", ...]``) checked against the options:
        an unknown key is refused naming the known ones, and text takes the type of the option's default
        (``defaults``, where the caller's differ from the record's), so ``p=0.5`` is a float and ``seed=3`` an int.
        ``where`` names the record in messages."""
        pairs = dict(given) if isinstance(given, Mapping) else dict(_split(item, where) for item in given)
        self.refuse_unknown(pairs, where)
        defaults = {**self.defaults(), **(defaults or {})}
        return {key: _typed(value, defaults[key], f"{where}: {key}") for key, value in pairs.items()}

    def chosen(self, given: Mapping[str, Any] | Iterable[str], where: str,
               defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every option ``build`` gets: the defaults with :meth:`given` laid over them, so what was used is what a
        report records."""
        return {**self.defaults(), **(defaults or {}), **self.given(given, where, defaults)}

    def refuse_unknown(self, keys: Iterable[str], where: str) -> None:
        """Raise ``ConfigError`` naming every key in ``keys`` that is not one of the options."""
        unknown = sorted(set(keys) - set(self.option_names))
        if unknown:
            known = ", ".join(self.option_names) or "none"
            raise ConfigError(f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(repr, unknown))}; known: {known}")


def _split(item: str, where: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{where}: options are key=value, got {item!r}")
    return key.strip(), value.strip()


def _typed(value: Any, default: Any, what: str) -> Any:
    """``value`` as the type of ``default`` when it is text (a value from the command line)."""
    if not isinstance(value, str) or isinstance(default, str) or default is None:
        return value
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"{what} must be true or false, got {value!r}")
        return value.lower() == "true"
    try:
        return type(default)(value)
    except ValueError:
        raise ConfigError(f"{what} must be {'an integer' if isinstance(default, int) else 'a number'}, "
                          f"got {value!r}") from None


R = TypeVar("R", bound=Record)


#: Every registry made, so a failed extension's registrations can be taken back from all of them.
_REGISTRIES: list["Registry"] = []


def _forget_package(package: str) -> None:
    for registry in _REGISTRIES:
        registry.forget_package(package)


def load_extensions() -> None:
    """Import the ``editkit.extensions`` entry points (once; see :mod:`editkit.core.extensions`)."""
    extensions.load(on_failure=_forget_package)


def unload_extensions() -> None:
    """Take back every extension package's registrations; the next lookup loads the extensions again."""
    extensions.reset(on_reset=_forget_package)


def _origin(record: Record) -> str:
    """The package registering ``record``: the extension being loaded, else the top-level module of its builder."""
    return extensions.current_package() or record.build.__module__.split(".")[0]


@dataclass
class Registry(Generic[R]):
    """Records by name; ``what`` names the kind of thing held, for messages ("backbone family"); ``kind`` is the
    class of its records, where they carry facts of their own (a merge method's order dependence): a plain
    :class:`Record` registered here becomes one, those facts at their defaults."""

    what: str
    kind: type[R] = Record  # type: ignore[assignment]
    _records: dict[str, R] = field(default_factory=dict, repr=False)
    _origins: dict[str, str] = field(default_factory=dict, repr=False)
    _families: dict[str, tuple[Callable[[str], R], str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _REGISTRIES.append(self)

    def register(self, name: str, record: R) -> R:
        """Add ``record`` under ``name``; a second registration of a name is refused, never overwrites."""
        origin = _origin(record)
        if name in self._records:
            raise ConfigError(f"{self.what} {name!r} is already registered by package {self._origins[name]} "
                              f"({self._records[name].build.__module__}); package {origin} cannot register it "
                              "again: pick another name")
        if not isinstance(record, self.kind):
            record = self.kind(**{f.name: getattr(record, f.name) for f in dataclasses.fields(Record)})
        self._records[name] = record
        self._origins[name] = origin
        return record

    def register_family(self, prefix: str, factory: Callable[[str], R], *, form: str = "...") -> None:
        """Make every ``"<prefix>:<rest>"`` a name whose record is ``factory(rest)``; ``form`` says what
        ``rest`` is, for listings (``"PATH"``). A registered name of that form still wins."""
        if prefix in self._families:
            raise ConfigError(f"{self.what} family '{prefix}:' is already registered; pick another prefix")
        self._families[prefix] = (factory, form)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin being unloaded, a test's temporary extension)."""
        if name not in self._records:
            self[name]  # refuses an unknown name, listing the known ones
        del self._records[name]
        self._origins.pop(name, None)

    def forget_package(self, package: str) -> None:
        """Remove every name ``package`` registered (an extension that failed part-way, or is unloaded)."""
        for name in [n for n, origin in self._origins.items() if origin == package]:
            self.unregister(name)

    def origin(self, name: str) -> str:
        """The package that registered ``name`` (``editkit`` for the built-ins)."""
        self[name]
        return self._origins.get(name, "editkit")

    def __getitem__(self, name: str) -> R:
        load_extensions()
        try:
            return self._records[name]
        except (KeyError, TypeError):
            pass
        prefix, _, rest = name.partition(":") if isinstance(name, str) else ("", "", "")
        if rest and prefix in self._families:
            return self._families[prefix][0](rest)
        forms = [f"{p}:{form}" for p, (_, form) in sorted(self._families.items())]
        raise ConfigError(f"unknown {self.what} {name!r}; known: {', '.join(self.names() + forms) or 'none'}")

    def __contains__(self, name: object) -> bool:
        load_extensions()
        if name in self._records:
            return True
        return isinstance(name, str) and name.partition(":")[0] in self._families and bool(name.partition(":")[2])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        load_extensions()
        return sorted(self._records)

    def label(self, name: str) -> str:
        return self[name].label or name

    def options(self, name: str, given: Mapping[str, Any] | Iterable[str] = (),
                defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``name``'s options: its defaults with ``given`` over them (:meth:`Record.chosen`)."""
        return self[name].chosen(given, f"{self.what} {name!r}", defaults)

    def parse_params(self, values: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The command line's ``NAME.key=value`` items (``["ewc.ewc_lambda=100", "replay.mem_size=500"]``) ->
        ``{NAME: {key: value}}``, each name looked up here and each option checked and typed by its record
        (:meth:`Record.given`); only what was given, the defaults left to :meth:`options`."""
        items: dict[str, list[str]] = {}
        for value in values:
            name, dot, item = value.strip().partition(".")
            if not dot or "=" not in item:
                raise ConfigError(f"{self.what} option {value!r} is not {self.what.split()[-1].upper()}.OPTION=VALUE")
            self[name]  # refuses an unknown name, listing the known ones
            items.setdefault(name, []).append(item)
        return {name: self[name].given(given, f"{self.what} {name!r}") for name, given in items.items()}

"""Command options generated from dataclass fields, so each setting is declared once.

A field of :class:`~editkit.train.recipe.Recipe`, :class:`~editkit.runs.bench.config.BenchConfig`,
:class:`~editkit.scenario.options.BuildOptions` or :class:`~editkit.train.runtime.RuntimeOptions`
says what it means in ``metadata["help"]`` and, for a text field with a fixed set of
values, lists them in ``metadata["choices"]``. :func:`fields_as_options` turns such a field into a Typer
option: ``--field-name`` (booleans: ``--name/--no-name``), help from the metadata,
choices from the field. A command takes a group of generated options with
:func:`with_options`: its Python function declares one parameter per group (say
``recipe``), which receives ``{field name: value}``, and the signature Typer reads lists
the generated options in its place.

The ``--bank`` option the bank commands share is here too, with the bank it defaults to.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import typer

from editkit.settings import DEFAULT_SCENARIO, default_bank_dir
from editkit.train.recipe import Recipe


@dataclass(frozen=True)
class Fields:
    """Which fields of a dataclass become options, and with which defaults.

    names: the fields, in this order (default: every field not marked ``"cli": False``).
    exclude: fields left out.
    keep: ``True``: every option defaults to None, meaning "keep the value from below"
        (``keep_help`` says where that value comes from); ``False``: the field's own default.
    """

    cls: type
    names: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    keep: bool = False
    keep_help: str = ""

    def fields(self) -> list[dataclasses.Field]:
        by_name = {f.name: f for f in dataclasses.fields(self.cls)}
        chosen = [by_name[n] for n in self.names] if self.names is not None else [
            f for f in by_name.values() if f.metadata.get("cli", True)]
        return [f for f in chosen if f.name not in self.exclude]


def fields_as_options(spec: Fields) -> list[inspect.Parameter]:
    """One keyword parameter per field, its default a ``typer.Option`` (see the module docstring)."""
    hints = typing.get_type_hints(spec.cls)
    parameters = []
    for f in spec.fields():
        # Typer offers and checks a Literal's values; a field with choices may be an enum (Mode)
        kind = Literal[tuple(f.metadata["choices"])] if "choices" in f.metadata else _option_type(hints[f.name])
        default = None if spec.keep else _field_default(f)
        if isinstance(default, Sequence) and not isinstance(default, str):
            default = ",".join(map(str, default))  # sequences are given as comma-separated text
        declaration = f"--{f.name.replace('_', '-')}"
        if kind is bool:
            declaration += f"/--no-{f.name.replace('_', '-')}"
        text = f.metadata["help"] + (f" {spec.keep_help}" if spec.keep and spec.keep_help else "")
        option = typer.Option(default, declaration, help=text)
        annotation = Optional[kind] if default is None else kind
        parameters.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))
    return parameters


def with_options(**groups: Fields) -> Callable[[Callable], Callable]:
    """Give a command the options of each group; parameter ``<group>`` receives ``{field: value}``.

    The generated options take the place of the group parameters in the signature
    Typer reads; a name given twice (two groups, or a group and the command) is refused.
    """

    def decorate(fn: Callable) -> Callable:
        own = inspect.signature(fn, eval_str=True)
        kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.parameters.values() if p.name not in groups]
        generated = {group: fields_as_options(spec) for group, spec in groups.items()}
        parameters = kept + [p for group in generated.values() for p in group]
        names = [p.name for p in parameters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise TypeError(f"{fn.__name__}: option(s) {twice} declared twice")
        members = {group: [p.name for p in params] for group, params in generated.items()}

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for group, fields in members.items():
                kwargs[group] = {name: kwargs.pop(name) for name in fields}
            return fn(**kwargs)

        command.__signature__ = own.replace(parameters=parameters)
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        return command

    return decorate


def option_for(cls: type, name: str, keep_help: str | None = None) -> Any:
    """The ``typer.Option`` of one field, for a command that takes it alone: its own default, or with ``keep_help``
    None, meaning "keep the value from below" (``keep_help`` says where it comes from)."""
    spec = Fields(cls, names=(name,), keep=keep_help is not None, keep_help=keep_help or "")
    return fields_as_options(spec)[0].default


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _option_type(hint: Any) -> type:
    """The type Typer parses: ``X | None`` -> X; a flag or a count (``bool | int``) -> the flag (a count is
    given in a scenario file or the Python API); sequences -> comma-separated text."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = bool if set(args) == {bool, int} else args[0]
    if hint in (bool, int, float, str, Path):
        return hint
    if typing.get_origin(hint) in (Sequence, list, tuple):
        return str
    raise TypeError(f"no command-line form for a field of type {hint!r}")


#: The bank the bank commands and add / negate / generate read when none is given: the default scenario's,
#: fine-tuned in the recipe's default mode.
DEFAULT_BANK = default_bank_dir(DEFAULT_SCENARIO, Recipe.mode)
BankOption = typer.Option(DEFAULT_BANK, "--bank", help="Bank directory.")

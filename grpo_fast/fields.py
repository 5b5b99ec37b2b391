"""Declared, checked dataclass fields: `key(default, help, rule, choices)` declares a field with its one line of
help, its range and its allowed values; `check_keys(instance)`, called by the dataclass's __post_init__, checks
every field's type, finiteness, range and choices, with errors that name the field. The library's option groups
(`LossConfig`) and every section of the trainer's config are declared this way, so both refuse the same values
with the same words.

A leaf: it imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from dataclasses import field
from typing import NamedTuple


class Rule(NamedTuple):
    """A numeric key's range: `text` completes "<key> must be ...", `test` says whether a value is in it."""
    text: str
    test: typing.Callable


POSITIVE, NON_NEGATIVE = Rule("> 0", lambda v: v > 0), Rule(">= 0", lambda v: v >= 0)
FRACTION, ANY = Rule("in (0, 1]", lambda v: 0 < v <= 1), Rule("", lambda v: True)
AT_LEAST_ONE = Rule(">= 1", lambda v: v >= 1)
UNIT_INTERVAL = Rule("in [0, 1)", lambda v: 0 <= v < 1)


def key(default, help: str, rule: typing.Optional[Rule] = None, choices: typing.Optional[tuple] = None):
    """A section field: its default, one line of help (keys_help), and for a number its Rule (checked after "is
    finite"; an Optional key's None is not checked), for a name its choices."""
    metadata = {"help": help, "rule": rule, "choices": None if choices is None else tuple(choices)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def one_of(values) -> str:
    return ", ".join(values)


@functools.cache
def hints(cls) -> dict:
    """{field name: type} of a dataclass, its string annotations resolved."""
    return typing.get_type_hints(cls)


def base(kind) -> tuple:
    """(X, optional) for X and Optional[X]."""
    if typing.get_origin(kind) is typing.Union:
        return next(arg for arg in typing.get_args(kind) if arg is not type(None)), True
    return kind, False


def type_name(kind) -> str:
    kind, optional = base(kind)
    name = str(kind).replace("typing.", "") if typing.get_origin(kind) else kind.__name__
    return f"{name} or None" if optional else name


def is_number(value) -> bool:
    """A real number (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class FieldTypeError(TypeError, ValueError):
    """A field given a value of the wrong type: a TypeError, and a ValueError as the trainer's other config
    errors (the CLI prints those on one line)."""


def _label(name: str, owner) -> str:
    return f"{owner}.{name}" if owner else f"config key {name!r}"


def check_type(name: str, value, kind, owner: typing.Optional[str] = None) -> None:
    """The value has the field's type (a float field takes an int too; numpy's numbers count). owner: the class
    named in the error (`LossConfig.beta expects ...`); None: a trainer key (`config key 'beta' expects ...`)."""
    kind_base, optional = base(kind)
    if value is None and optional:
        return
    origin = typing.get_origin(kind_base) or kind_base
    fits = {bool: lambda: isinstance(value, bool),
            int: lambda: isinstance(value, numbers.Integral) and not isinstance(value, bool),
            float: lambda: is_number(value)}.get(origin, lambda: isinstance(value, origin))()
    if not fits:
        raise FieldTypeError(f"{_label(name, owner)} expects {type_name(kind)}, got {value!r}")


def check_value(name: str, value, kind, rule: typing.Optional[Rule] = None, choices=None,
                owner: typing.Optional[str] = None) -> None:
    """The type, range and choices of one field's value; the errors name the field as `name` (and `owner`'s,
    e.g. "(LossConfig.beta)", when given)."""
    check_type(name, value, kind, owner)
    where = f" ({owner}.{name})" if owner else ""
    if rule is not None and value is not None:
        if not (math.isfinite(value) and rule.test(value)):   # NaN fails every comparison, inf is not finite
            number = "a finite number " if base(kind)[0] is float else ""
            raise ValueError(f"{name} must be {number}{rule.text}".rstrip() + f"{where}, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {choices}{where}, got {value!r}")


def check_keys(section, owner: typing.Optional[str] = None) -> None:
    """Every field of a dataclass declared with `key` against its type, Rule and choices. owner: the class name
    the errors give beside the field's (the library's option groups); None for the trainer's sections."""
    kinds = hints(type(section))
    for item in dataclasses.fields(section):
        check_value(item.name, getattr(section, item.name), kinds[item.name], item.metadata.get("rule"),
                    item.metadata.get("choices"), owner)

"""The keys of a trainer config section: `key(default, help, rule, choices)` declares one with its one line of help,
its range and its allowed values; `check_keys(section)`, called by each section's __post_init__, checks them all
with errors that name the key. grpo_fast.train.config composes the sections into TrainConfig and reads them from
YAML and the command line (`convert`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_type(name: str, value, kind) -> None:
    """For a section built in code: the value has the field's type (a float key takes an int too)."""
    kind_base, optional = base(kind)
    if value is None and optional:
        return
    origin = typing.get_origin(kind_base) or kind_base
    fits = {bool: lambda: isinstance(value, bool), int: lambda: isinstance(value, int) and not isinstance(value, bool),
            float: lambda: is_number(value)}.get(origin, lambda: isinstance(value, origin))()
    if not fits:
        raise ValueError(f"config key {name!r} expects {type_name(kind)}, got {value!r}")


def check_value(name: str, value, kind, rule: typing.Optional[Rule] = None, choices=None) -> None:
    """The type, range and choices of one key's value; the errors name the key as `name`."""
    check_type(name, value, kind)
    if rule is not None and value is not None:
        if not (math.isfinite(value) and rule.test(value)):   # NaN fails every comparison, inf is not finite
            number = "a finite number " if base(kind)[0] is float else ""
            raise ValueError(f"{name} must be {number}{rule.text}".rstrip() + f", got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_keys(section) -> None:
    """Every field of a section dataclass against its type, Rule and choices (see `key`)."""
    kinds = hints(type(section))
    for item in dataclasses.fields(section):
        check_value(item.name, getattr(section, item.name), kinds[item.name], item.metadata.get("rule"),
                    item.metadata.get("choices"))


def convert(name: str, text, kind, choices=None):
    """A command-line or YAML value as the field's type, with an error naming the key."""
    kind, optional = base(kind)
    if isinstance(text, str) and text.strip().lower() == "none" and "none" in (choices or ()):
        return "none"                   # one of the key's choices (importance_sampling, scale_rewards), not a null
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "null")):
        if optional:
            return None
        # otherwise a str key would hold the text "None" (output_dir: ~ trained into ./None)
        raise ValueError(f"config key {name!r} expects {type_name(kind)} and cannot be null, got {text!r}")
    if typing.get_origin(kind) is list:
        items = text if isinstance(text, list) else [item.strip() for item in str(text).split(",") if item.strip()]
        item_kind = typing.get_args(kind)[0]
        try:
            return [convert(name, item, item_kind) for item in items]
        except ValueError:
            raise ValueError(f"config key {name!r} expects {type_name(kind)}, got {text!r}") from None
    if isinstance(text, kind) and not (kind is not bool and isinstance(text, bool)):
        return text
    try:
        if isinstance(text, bool) or kind is bool and isinstance(text, (int, float)) and text not in (0, 1):
            raise ValueError                       # YAML's true is no number, and 2 is no bool
        if kind is bool:
            lowered = str(text).strip().lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        if kind is int and isinstance(text, float):
            if not text.is_integer():
                raise ValueError                   # int(2.5) would be 2
            return int(text)
        return kind(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"config key {name!r} expects {kind.__name__}, got {text!r}") from None

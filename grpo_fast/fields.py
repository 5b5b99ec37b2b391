"""Declared, checked dataclass fields: `key(default, help, rule, choices)` declares a field with its one line of
help, its range and its allowed values; `check_keys(instance)`, called by the dataclass's __post_init__, checks
every field's type, finiteness, range and choices, with errors that name the field, and stores a numpy scalar as
the Python number it holds. The library's option groups (`LossConfig`) and every section of the trainer's config
are declared this way, so both refuse the same values with the same words. The bounds below (`FP32_FINITE`, ...)
are those of the numbers the loss math takes in float32.

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
    """A numeric key's range: `text` completes "<key> must be ...", `test` says whether a value is in it.
    `bound`, when set, is the interval the math can take, checked once `test` holds and named whole in its error
    ("in [0, 1e+18]"), so that a value refused for its sign keeps the words it always had."""
    text: str
    test: typing.Callable
    bound: typing.Optional["Rule"] = None


POSITIVE, NON_NEGATIVE = Rule("> 0", lambda v: v > 0), Rule(">= 0", lambda v: v >= 0)
FRACTION, ANY = Rule("in (0, 1]", lambda v: 0 < v <= 1), Rule("", lambda v: True)
AT_LEAST_ONE = Rule(">= 1", lambda v: v >= 1)
UNIT_INTERVAL = Rule("in [0, 1)", lambda v: 0 <= v < 1)


def bounded(rule: Rule, low, high, *, open_low: bool = False) -> Rule:
    """`rule`, and within [low, high] (or (low, high]): the bound of a number the math takes, named whole in the
    error of a value outside it, e.g. "beta must be a finite number in [0, 1e+18] (LossConfig.beta), got 1e+38"."""
    text = f"in {'(' if open_low else '['}{_short(low)}, {_short(high)}]"
    return rule._replace(bound=Rule(text, lambda v: (low < v if open_low else low <= v) and v <= high))


def _short(number) -> str:
    """The shortest exact spelling: 1e+08 for 100000000.0, 3.4028234663852886e+38 in full."""
    return f"{number:g}" if isinstance(number, float) and float(f"{number:g}") == number else repr(number)


# Bounds of the numbers the loss math takes in float32 (torch.clamp refuses a bound float32 cannot hold; a product
# that leaves float32 is inf, and inf - inf is NaN), one per way a number is used:
FP32_MAX = 3.4028234663852886e38        # float32's largest finite value, (2 - 2**-23) * 2**127
# a clamp bound, a comparison or an exponent whose overflow the math maps to 0 (vespo's k, lambda): any float32
FP32_FINITE = bounded(ANY, -FP32_MAX, FP32_MAX)
NON_NEGATIVE_FP32 = bounded(NON_NEGATIVE, 0, FP32_MAX)
POSITIVE_FP32 = bounded(POSITIVE, 0, FP32_MAX, open_low=True)
# a coefficient (or a divisor) of per-token terms: 1e18 * 3.4e20 = FP32_MAX, so the product stays finite while the
# term is below 3.4e20 (a KL of exp(47)), and the reciprocal 1e-18 is a normal float32 with 20 decades to spare
COEFFICIENT_MAX = 1e18
COEFFICIENT = bounded(ANY, -COEFFICIENT_MAX, COEFFICIENT_MAX)
NON_NEGATIVE_COEFFICIENT = bounded(NON_NEGATIVE, 0, COEFFICIENT_MAX)
# a length in tokens (dr_grpo divides by batch * length): int32's largest, beyond any model's context
LENGTH_MAX = 2**31 - 1
LENGTH = bounded(POSITIVE, 1, LENGTH_MAX)
# the logit transform's factors (temperature, soft-cap, |scale|) within [1e-9, 1e9]: the kernels apply
# scale / temperature, softcap / temperature and scale / softcap in float32, each then at most 1e18, and scale
# (x - row max) by scale / temperature with x floored at -1e20: at most 1e38 < FP32_MAX. A positive normal float32
# (>= 1.2e-38) as the least temperature would not do: logits / 1e-37 are inf from 40 on, and past 1.7e18 the
# floored logits overflow to -inf and the entropy is NaN. Sampling temperatures lie within [0.01, 2] (vLLM raises
# anything below 0.01 to it), and logits / 1e-9 stays finite for logits below 3.4e29.
LOGIT_FACTOR_MIN, LOGIT_FACTOR_MAX = 1e-9, 1e9
TEMPERATURE = bounded(POSITIVE, LOGIT_FACTOR_MIN, LOGIT_FACTOR_MAX)
SOFTCAP = bounded(POSITIVE, LOGIT_FACTOR_MIN, LOGIT_FACTOR_MAX)
LOGIT_SCALE = bounded(ANY, -LOGIT_FACTOR_MAX, LOGIT_FACTOR_MAX)


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


def plain(value):
    """A numpy scalar (np.float32(0.2), np.int64(3), np.bool_(True)) as the Python value it holds, anything else as
    it is: every option group stores Python numbers, whatever the caller computed them with."""
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ != "ndarray" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def is_finite(value) -> bool:
    """math.isfinite, for an int of any size too (math.isfinite(10**400) raises OverflowError)."""
    return isinstance(value, numbers.Integral) or math.isfinite(value)


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
        number = "a finite number " if base(kind)[0] is float else ""
        if not (is_finite(value) and rule.test(value)):   # NaN fails every comparison, inf is not finite
            raise ValueError(f"{name} must be {number}{rule.text}".rstrip() + f"{where}, got {value!r}")
        if rule.bound is not None and not rule.bound.test(value):
            raise ValueError(f"{name} must be {number}{rule.bound.text}{where}, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {choices}{where}, got {value!r}")


def check_keys(section, owner: typing.Optional[str] = None) -> None:
    """Every field of a dataclass declared with `key` against its type, Rule and choices. owner: the class name
    the errors give beside the field's (the library's option groups); None for the trainer's sections."""
    kinds = hints(type(section))
    for item in dataclasses.fields(section):
        value = plain(getattr(section, item.name))
        object.__setattr__(section, item.name, value)      # frozen or not: a numpy scalar becomes a Python one
        check_value(item.name, value, kinds[item.name], item.metadata.get("rule"), item.metadata.get("choices"),
                    owner)

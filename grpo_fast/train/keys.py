"""The trainer's text values: `convert` reads a command-line or YAML value as its config key's type, with errors
that name the key. The keys themselves are declared with grpo_fast.fields (`key`, checked by `check_keys`).
"""

from __future__ import annotations

import json
import typing

from grpo_fast.fields import base, type_name


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
    if kind is dict and isinstance(text, str):      # on the command line: JSON
        try:
            text = json.loads(text)
        except ValueError:
            raise ValueError(f"config key {name!r} expects a dict (JSON on the command line), got {text!r}") \
                from None
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

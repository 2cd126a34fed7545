"""What each config field is declared as, looked up by its dotted key, and what it takes in words (for messages)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from moe_train.config import Config, optional_inner

# what a field of each type takes, in words, for error messages
EXPECTED: dict[Any, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
EXPECTED_LIST = "a list like [0, 1] ([] for none)"


def field_annotation(dotted: str) -> Any | None:
    """The declared type of a config key (`model.dense_layers[]`: of its items); None for a key that is no field
    (set_field names those)."""
    if dotted.endswith("[]"):
        outer = field_annotation(dotted[:-2])
        outer = optional_inner(outer) or outer
        return typing.get_args(outer)[0] if typing.get_origin(outer) is list else None
    annotation: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(annotation):
            return None
        annotation = typing.get_type_hints(annotation).get(part)
    return annotation


def field_kind(annotation: Any) -> str:
    """What a field of this type takes, in words, for messages."""
    annotation = optional_inner(annotation) or annotation
    if typing.get_origin(annotation) is list:
        return EXPECTED_LIST
    if dataclasses.is_dataclass(annotation):
        return "a mapping of its fields"
    return EXPECTED.get(annotation, "a value")

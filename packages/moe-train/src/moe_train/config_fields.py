"""What each config field is declared as, looked up by its dotted key, what it takes in words (for messages), and
the one spelling of a number or boolean typed as text (the command line, a YAML string)."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from moe_train.config import Config, optional_inner

# the words YAML 1.1 reads as booleans (any case), and 1 / 0
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NULL_WORDS = ("~", "null", "none")  # YAML's null, and Python's spelling of it


# The text a number field takes from the command line, or as a string from a YAML file (README "Config"): decimal
# ASCII only. YAML (and Python's int() and float()) would also take 0x10, 0b101, 1_000 and full-width digits (５):
# one spelling per number keeps a typo from becoming a value. A whole number in e-notation (1e3) is an integer, as a
# whole float in a file is. The words for inf and nan reach validate, which names them as not finite.
NUMBER_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
NON_FINITE_TEXT = re.compile(r"[+-]?\.?(inf|infinity|nan)", re.IGNORECASE)
# what such text must be, in words (bool: TRUE_WORDS / FALSE_WORDS, any case: -0 or 0x1 is no boolean)
TEXT_EXPECTED: dict[Any, str] = {
    int: "an integer in decimal ASCII digits with an optional sign (1000, -3; 1e3 is 1000)",
    float: "a number in decimal ASCII notation (0.003, 3e-3, 2)",
    bool: "true or false (or yes/no, on/off, 1/0)",
}


def text_fits(annotation: Any, text: str) -> bool:
    """Whether `text` is written as the number or boolean field of this type takes it (README "Config")."""
    if annotation is bool:
        return text.lower() in TRUE_WORDS + FALSE_WORDS
    if annotation is float and NON_FINITE_TEXT.fullmatch(text):
        return True
    return NUMBER_TEXT.fullmatch(text) is not None


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

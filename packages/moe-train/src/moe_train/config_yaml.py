"""YAML read strictly for configs: what yaml.safe_load accepts without a word but a config must not (a key twice,
YAML 1.1's octal and base-60 numbers, an unquoted scalar read as a number, boolean or date where the field is a
string, an empty value), refused naming the key, the file or override and the line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from moe_train.config import ConfigError, optional_inner
from moe_train.config_fields import TEXT_EXPECTED, field_annotation, field_kind, text_fits

# integers YAML 1.1 reads in a base nobody means in a config: 0710 (octal 456), 12:30 (base 60: 750)
_YAML_1_1_NUMBER = re.compile(r"[-+]?0[0-7_]+|[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")
_YAML_READ_AS = {"tag:yaml.org,2002:int": "the number", "tag:yaml.org,2002:float": "the number",
                 "tag:yaml.org,2002:bool": "the boolean", "tag:yaml.org,2002:timestamp": "the date"}


def _refuse_yaml_1_1_number(loader: yaml.SafeLoader, node: yaml.ScalarNode, dotted: str) -> None:
    raise ConfigError(f"{dotted}: YAML 1.1 reads {node.value} as {loader.construct_object(node)} (octal or base 60); "
                      "write the number in decimal digits")


def _refuse_silent_rewrites(loader: yaml.SafeLoader, node: yaml.Node, dotted: str, where: str, seen: set[int],
                            typed_root: str | None = None) -> None:
    """What yaml.safe_load accepts without a word but a config must not, in the value `node` of config key
    `dotted` ("" for a whole file; where: the file or override named in errors): a key twice in one mapping
    (the last would win), and an unquoted scalar YAML 1.1 reads as a number, boolean or date where the field
    is a string (`run_dir: 0710` is the octal 456, `12:30` the sexagesimal 750, `1.50` is 1.5), or as an
    octal or base-60 number where it is a number. typed_root: the key of a command-line override, whose numbers
    and booleans inside a list or mapping are held to the spelling the override's own value is (TEXT_EXPECTED)."""
    if isinstance(node, yaml.ScalarNode):
        if dotted:  # checked at each key it stands for (an alias may stand for fields of two types)
            _refuse_silent_scalar(loader, node, dotted, where, typed_root)
        return
    if id(node) in seen:  # an alias of a list or mapping: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            if isinstance(item, yaml.ScalarNode):
                _refuse_silent_scalar(loader, item, f"{dotted}[]", where, typed_root)
            else:
                _refuse_silent_rewrites(loader, item, f"{dotted}[]", where, seen, typed_root)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    prefix = f"{dotted}." if dotted else ""
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden by the keys beside it
            _refuse_silent_rewrites(loader, value_node, dotted, where, seen, typed_root)
            continue
        key, line = str(key_node.value), key_node.start_mark.line + 1
        if isinstance(key_node, yaml.ScalarNode):
            if key in lines:
                raise ConfigError(f"{where}: duplicate key {prefix + key!r} at line {line} (first at line "
                                  f"{lines[key]}): YAML would keep only the last; delete one")
            lines[key] = line
        _refuse_silent_rewrites(loader, value_node, f"{prefix}{key}", where, seen, typed_root)


_YAML_NULL_TAG, _YAML_BOOL_TAG, _YAML_DATE_TAG = (f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "timestamp"))


def _refuse_silent_scalar(loader: yaml.SafeLoader, node: yaml.ScalarNode, dotted: str, where: str,
                          typed_root: str | None = None) -> None:
    """Also an empty value, a YAML boolean or a date where the field takes none of them, named as typed: the
    error would show the value YAML made of it (`train.steps=None` for an empty `steps:`, `train.steps=True` for
    `steps: yes`, `datetime.date(2024, 1, 1)`). A null typed as such (`~`, `null`) is left to _coerce. Inside a
    command-line override (typed_root; its own value is read_override's to check), an unquoted number or boolean
    of a number or boolean field in another spelling than TEXT_EXPECTED's (`[0x1]`, `{top_k: 1_0}`)."""
    annotation = field_annotation(dotted)
    is_string = str in (annotation, optional_inner(annotation))
    read_as = _YAML_READ_AS.get(node.tag)
    if read_as and _YAML_1_1_NUMBER.fullmatch(node.value) and not is_string:
        _refuse_yaml_1_1_number(loader, node, dotted.removesuffix("[]"))
    # a date as typed: YAML's pattern takes 2024-13-45, which no calendar holds (constructing it raises)
    value = node.value if node.tag == _YAML_DATE_TAG else loader.construct_object(node) if read_as else None
    shown = str(value).lower() if isinstance(value, bool) else value
    if read_as and is_string:
        key = dotted.rsplit(".", 1)[-1].removesuffix("[]")
        raise ConfigError(f'{dotted}: YAML read {node.value} as {read_as} {shown}; quote it: {key}: "{node.value}"')
    if annotation is None or (node.tag == _YAML_NULL_TAG and (optional_inner(annotation) is not None
                                                              or dotted == "preset")):
        return  # a key that is no field (set_field names it), or a null where one is taken (`preset:` is tiny)
    scalar = optional_inner(annotation) or annotation
    if (typed_root is not None and dotted != typed_root and node.style is None and node.tag != _YAML_NULL_TAG
            and scalar in TEXT_EXPECTED and not text_fits(scalar, node.value)):
        raise ConfigError(f"{dotted}={node.value}: expected {TEXT_EXPECTED[scalar]} (in {where})")
    expected = field_kind(annotation)
    at = f"{where}, line {node.start_mark.line + 1}"
    if node.tag == _YAML_NULL_TAG and not node.value:
        raise ConfigError(f"{dotted}: the value is empty (YAML reads it as null; {at}); expected {expected}")
    if node.tag == _YAML_DATE_TAG:
        raise ConfigError(f"{dotted}={node.value}: expected {expected} (YAML reads it as a date; {at})")
    if node.tag == _YAML_BOOL_TAG and bool not in (annotation, optional_inner(annotation)):
        raise ConfigError(f"{dotted}={node.value}: expected {expected} (YAML reads {node.value} as the boolean {shown}; "
                          f"{at})")


def read_yaml(text: str, dotted: str, where: str, typed: bool = False) -> Any:
    """The value YAML reads from `text` (None for an empty one), after _refuse_silent_rewrites; typed: `text` is
    a command-line override's value, whose nested numbers and booleans are held to the command line's spelling."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_silent_rewrites(loader, node, dotted, where, set(), dotted if typed else None)
        try:
            return loader.construct_document(node)
        except ValueError as e:  # a scalar of YAML's date pattern no calendar holds, under a key that is no field
            raise ConfigError(f"{where}: YAML reads a value as a date and cannot ({e}); quote it if it is text") \
                from None
    finally:
        loader.dispose()


def yaml_error(where: str, e: yaml.YAMLError) -> ConfigError:
    mark = getattr(e, "problem_mark", None)
    at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
    why = getattr(e, "problem", None) or " ".join(str(e).split())
    return ConfigError(f"{where}: invalid YAML at {at}: {why}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    if str(path) == "":  # Path("") is the current folder
        raise ConfigError("config file '': expected the path of a YAML file, got an empty string")
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} " + ("is a folder: expected a YAML file" if p.is_dir() else "does not exist"))
    where = f"config file {str(p)!r}"
    try:
        data = read_yaml(p.read_text(encoding="utf-8"), "", where) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise yaml_error(where, e) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    return data

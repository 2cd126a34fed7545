"""Build a Config from a preset, YAML files and dotted overrides, with type checks per field."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from moe_train.config import REMOVED_FIELDS, Config, ConfigError, optional_inner, validate
from moe_train.presets import get_preset


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _coerce(name: str, raw: Any, annotation: Any) -> Any:
    """Convert a YAML value or an override string to the field's declared type."""
    inner = optional_inner(annotation)
    if inner is not None:
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        annotation = inner
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        if isinstance(raw, str):
            raw = yaml.safe_load(raw) if raw.strip() else []
            if isinstance(raw, int):
                raw = [raw]
        if not isinstance(raw, list):
            raise ConfigError(f"{name}={raw!r}: expected a list like [0, 1]")
        return [_coerce(f"{name}[]", v, args[0]) for v in raw]
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "false", "0", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}={raw!r}: expected true or false")
    if annotation is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{name}={raw!r}: expected an integer")
        try:
            value = float(raw) if isinstance(raw, str) else raw
            if float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        except (TypeError, ValueError, OverflowError):  # OverflowError: inf
            raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    if annotation is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={raw!r}: expected a number") from None
    if annotation is str:
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            raise ConfigError(f"{name}={raw!r}: expected a string; this field cannot be null")
        if isinstance(raw, (bool, list, dict)):
            raise ConfigError(f"{name}={raw!r}: expected a string")
        return str(raw)  # numbers and dates that YAML parsed from an unquoted scalar
    raise ConfigError(f"{name}: unsupported field type {annotation}")


def set_field(cfg: Config, dotted: str, raw: Any) -> None:
    """Set `model.router.top_k`-style keys; unknown keys raise naming the key and the valid ones."""
    if dotted in REMOVED_FIELDS:
        raise ConfigError(f"{dotted} was removed: {REMOVED_FIELDS[dotted]}")
    parts = dotted.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        if part not in names:
            prefix = ".".join(parts[:i])
            valid = ", ".join(f"{prefix}.{n}" if prefix else n for n in names)
            raise ConfigError(f"unknown config key {dotted!r}: valid keys here are {valid}")
        if i == len(parts) - 1:
            value = getattr(obj, part)
            if dataclasses.is_dataclass(value):
                if not isinstance(raw, dict):
                    raise ConfigError(f"{dotted}={raw!r}: expected a mapping of its fields")
                for k, v in raw.items():
                    set_field(cfg, f"{dotted}.{k}", v)
            else:
                setattr(obj, part, _coerce(dotted, raw, _field_types(obj)[part]))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(parts[: i + 1])} has no fields")


def apply_mapping(cfg: Config, mapping: dict[str, Any], prefix: str = "") -> None:
    for key, value in mapping.items():
        if key == "preset":
            continue
        set_field(cfg, f"{prefix}{key}", value)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        why = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ConfigError(f"config file {str(p)!r}: invalid YAML at {where}: {why}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    return data


def parse_overrides(args: list[str]) -> dict[str, str]:
    """['--model.num_experts=64', '--train.steps', '10'] -> {'model.num_experts': '64', 'train.steps': '10'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"override {arg!r}: expected --section.field=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg!r}: expected --{key}=value")
            value = args[i + 1]
            i += 1
        out[key.replace("-", "_") if "." not in key else key] = value
        i += 1
    return out


def build_config(preset: str | None = None, yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """preset (or the YAML's `preset:` key, else tiny) <- YAML <- overrides, then validate."""
    mapping = load_yaml(yaml_path) if yaml_path else {}
    name = preset or mapping.get("preset") or "tiny"
    cfg = get_preset(str(name))
    apply_mapping(cfg, mapping)
    for key, value in (overrides or {}).items():
        set_field(cfg, key, value)
    return validate(cfg)


def _without_removed(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A stored config without the keys of REMOVED_FIELDS (older checkpoints hold them)."""
    return {k: _without_removed(v, f"{prefix}{k}.") if isinstance(v, dict) else v
            for k, v in d.items() if f"{prefix}{k}" not in REMOVED_FIELDS}


def config_from_dict(d: dict[str, Any]) -> Config:
    """Rebuild a Config from Config.to_dict() output (e.g. stored in a checkpoint)."""
    cfg = Config()
    apply_mapping(cfg, _without_removed(d))
    cfg.preset = d.get("preset", cfg.preset)
    return validate(cfg)

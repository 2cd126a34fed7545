"""Build a Config from a preset, YAML files and dotted overrides, with type checks per field."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
import warnings
from typing import Any

import yaml

from moe_train.config import (
    NONE_IS_A_VALUE, REMOVED_FIELDS, Config, ConfigError, DataConfig, optional_inner, validate,
    warn_of_expert_settings_without_effect,
)
from moe_train.config_fields import (
    EXPECTED, EXPECTED_LIST, NULL_WORDS, TEXT_EXPECTED, TRUE_WORDS, field_annotation, field_kind, text_fits,
)
from moe_train.config_yaml import load_yaml, read_yaml, yaml_error
from moe_train.presets import get_preset


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _is_null(raw: Any) -> bool:
    return raw is None or (isinstance(raw, str) and raw.lower() in NULL_WORDS)


def _coerce(name: str, raw: Any, annotation: Any) -> Any:
    """Convert a value as YAML reads it (from a config file, or an override via read_override) to the
    field's declared type."""
    inner = optional_inner(annotation)
    if inner is not None:
        if _is_null(raw):
            return None
        annotation = inner
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        if not isinstance(raw, list):  # a bare 0 could mean layer 0 or no layers: neither is guessed
            raise ConfigError(f"{name}={raw!r}: expected {EXPECTED_LIST}")
        return [_coerce(f"{name}[]", v, args[0]) for v in raw]
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and text_fits(bool, raw):
            return raw.lower() in TRUE_WORDS
        expected = TEXT_EXPECTED[bool] if isinstance(raw, str) else EXPECTED[bool]
        raise ConfigError(f"{name}={raw!r}: expected {expected}")
    if annotation is int:
        return _integer(name, raw)
    if annotation is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{name}={raw!r}: expected {EXPECTED[float]}")
        if isinstance(raw, str) and not text_fits(float, raw):  # float() takes '1_0' and full-width digits
            raise ConfigError(f"{name}={raw!r}: expected {TEXT_EXPECTED[float]}")
        try:
            return float(raw)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float's range
            raise ConfigError(f"{name}={raw!r}: expected {EXPECTED[float]}") from None
    if annotation is str:
        if _is_null(raw) and not (isinstance(raw, str) and name in NONE_IS_A_VALUE):  # there, validate judges the text
            raise ConfigError(f"{name}={raw!r}: expected a string; this field cannot be null")
        if not isinstance(raw, str):  # load_yaml already refused unquoted YAML numbers, naming what was typed
            raise ConfigError(f"{name}={raw!r}: expected a string")
        return raw
    raise ConfigError(f"{name}: unsupported field type {annotation}")


def _integer(name: str, raw: Any) -> int:
    """An int stays exact (float() would round past 2**53); a float or '1e3' is taken when it is whole
    and small enough that the float holds it exactly."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):  # a quoted YAML string, or text YAML reads as none of its numbers (1e3)
        if not text_fits(int, raw):  # int() takes ' 5', '1_000' and full-width digits
            raise ConfigError(f"{name}={raw!r}: expected {TEXT_EXPECTED[int]}")
        try:
            return int(raw)
        except ValueError:
            pass
    try:
        value = float(raw) if isinstance(raw, (str, float)) else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value.is_integer()):
        raise ConfigError(f"{name}={raw!r}: expected {EXPECTED[int]}")
    if abs(value) >= 2**53:  # from here on floats step by 2 or more: the written integer may be lost
        raise ConfigError(f"{name}={raw!r}: expected an integer written in digits (a float this large is rounded)")
    return int(value)


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


def read_override(dotted: str, text: str) -> Any:
    """The value of `--dotted=text`: what a config file holding `dotted: text` gives, with the same checks
    (`~` is null, 0710 is refused, [0] is a list), except that a string field takes the text as typed (the
    shell has quoted it already: --train.run_dir=0710 is the folder "0710") and a number or boolean field takes
    only the text _text_fits (YAML's 0x10 is 16 in a file; typed on the command line it is refused)."""
    annotation = field_annotation(dotted)
    if annotation is None or str in (annotation, optional_inner(annotation)):
        return text  # a string as typed; a key that is no field is named by set_field
    where = f"override --{dotted}={text}"
    if not text.strip():  # YAML reads "" as null: the message would name a None nobody typed
        null = " (`null` for none)" if optional_inner(annotation) is not None else ""
        raise ConfigError(f"{where}: the value is empty; expected {field_kind(annotation)}{null}")
    try:
        value = read_yaml(text, dotted, where, typed=True)
    except yaml.YAMLError as e:
        raise yaml_error(where, e) from None
    # YAML's numbers beyond decimal ASCII (0x10, 0b101, 1_000) and -0 or +1 for a boolean are refused as typed;
    # a list, a mapping or a null is judged by _coerce, as in a file
    scalar = optional_inner(annotation) or annotation
    if scalar in TEXT_EXPECTED and not isinstance(value, (list, dict)) and not _is_null(value) \
            and not text_fits(scalar, text):
        shown = repr(text) if isinstance(value, str) else text  # quoted as a string is in _coerce's errors
        raise ConfigError(f"{dotted}={shown}: expected {TEXT_EXPECTED[scalar]}")
    return value


def parse_overrides(args: list[str]) -> dict[str, str]:
    """['--model.num_experts=64', '--train.steps', '10'] -> {'model.num_experts': '64', 'train.steps': '10'}.

    A key given twice is refused, as a key twice in a YAML file is: the last would win without a word."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg[2:].partition("=")
        if not arg.startswith("--") or not key:  # `--` alone, or `--=3`
            raise ConfigError(f"override {arg!r}: expected --section.field=value")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg!r}: expected --{key}=value")
            value = args[i + 1]
            if value.startswith("--"):  # `--train.run_dir --resume`: the value was forgotten, not a path "--resume"
                raise ConfigError(f"override {arg!r}: expected a value, got the option {value!r} "
                                  f"(a value starting with -- is written --{key}=VALUE)")
            i += 1
        key = key.replace("-", "_") if "." not in key else key
        if key in out:
            raise ConfigError(f"{key} is set twice ({out[key]}, then {value}): set it once")
        out[key] = value
        i += 1
    return out


def build_config(preset: str | None = None, yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """preset (or the YAML's `preset:` key, else tiny) <- YAML <- overrides, then validate.

    overrides: {dotted key: value}; a string value is read as the command line's text (read_override),
    so `--model.head_dim=~` and `model: {head_dim: ~}` give the same config, and the same errors."""
    mapping = load_yaml(yaml_path) if yaml_path is not None else {}  # "" is refused, not taken as no file
    name = preset if preset is not None else mapping.get("preset")
    name = "tiny" if name is None else name  # `preset: ""` is refused by get_preset, not taken as tiny
    cfg = get_preset(str(name))
    in_file: dict[str, tuple[str, Any]] = {}
    for key, value in mapping.items():  # `train: {steps: 5}` and `train.steps: 7` set one field
        if key != "preset":
            _refuse_a_field_twice(in_file, key, value, "{}:", f"config file {str(yaml_path)!r}: ")
    apply_mapping(cfg, mapping)
    given: dict[str, tuple[str, Any]] = {}
    for key, value in (overrides or {}).items():
        value = read_override(key, value) if isinstance(value, str) else value
        set_field(cfg, key, value)
        _refuse_a_field_twice(given, key, value, "--{}", "")  # --model.router={top_k: 3} --model.router.top_k=4
    _expand_home(cfg)
    validate(cfg)
    preset_cfg = get_preset(str(name))
    _warn_of_corpus_fields_a_data_folder_ignores(cfg, preset_cfg)
    warn_of_expert_settings_without_effect(cfg.model, preset_cfg.model)
    return cfg


# What only the embedded corpus reads (data.path=default: tokenized once into data.cache_dir); a folder made by
# prepare-data has its tokenizer, vocabulary and eval split in it already.
CORPUS_ONLY_FIELDS = ("default_vocab_size", "default_max_bytes", "cache_dir", "eval_fraction")


def _warn_of_corpus_fields_a_data_folder_ignores(cfg: Config, preset: Config) -> None:
    """A field of CORPUS_ONLY_FIELDS changed from the preset's value (in the file or on the command line) while
    data.path names a prepared folder is warned about: it is ignored. Not refused: a config file written from a whole
    config (`moe-train info`) holds every field, and one file may serve runs on either kind of data. A value equal
    to DataConfig's own default is not warned about either: import-hf's config.json holds those (no preset's), with
    default_vocab_size fitted to the model's vocabulary (DataConfig.default_vocab_size_for)."""
    if cfg.data.path == "default":
        return
    fitted = DataConfig.default_vocab_size_for(cfg.model.vocab_size)
    for name in CORPUS_ONLY_FIELDS:
        value = getattr(cfg.data, name)
        if value not in (getattr(preset.data, name), getattr(DataConfig(), name)) and \
                not (name == "default_vocab_size" and value == fitted):
            warnings.warn(f"data.{name}={value!r} is ignored: only the embedded corpus (data.path=default) reads it, "
                          f"and data.path={cfg.data.path!r} is a folder prepared by `moe-train prepare-data` (its "
                          "tokenizer, vocabulary and eval split were fixed there); drop it, or prepare the folder "
                          "again with the setting you want", stacklevel=3)


def _refuse_a_field_twice(given: dict[str, tuple[str, Any]], key: str, value: Any, spell: str, where: str) -> None:
    """Record in `given` (field -> (key, value)) the fields `key: value` sets (a section's mapping sets each of
    its fields), refusing one that an earlier key set: the last would win without a word.
    spell: how a key is written in the error ("--{}" for an override); where: the error's prefix."""
    for field, v in _leaves(key, value):
        if field in given:
            shown = [f"{x}" if k == field else f"{x} in {spell.format(k)}" for k, x in (given[field], (key, v))]
            raise ConfigError(f"{where}{field} is set twice ({shown[0]}, then {shown[1]}): set it once")
        given[field] = (key, v)


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """The fields `key: value` sets: key itself, or each field of a mapping given for a section."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [(key, value)]


def _expand_home(cfg: Config) -> None:
    """A path field starting with `~` or `~user` means that home folder, as in a shell: the shell leaves
    `--train.run_dir=~/x` as typed, and without this the run would write into a folder named `~`."""
    for section, name in (("data", "path"), ("data", "cache_dir"), ("train", "run_dir"), ("train", "init_from")):
        part = getattr(cfg, section)
        value = getattr(part, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(part, name, os.path.expanduser(value))


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


# What reading a checkpoint's weights (export-hf) takes from a stored config besides the model section:
# where the run's tokenizer is (data.path, or the embedded corpus's cache folder) and its context length.
EXPORT_DATA_FIELDS = ("path", "cache_dir", "default_vocab_size", "default_max_bytes", "seq_len")


def export_config_from_dict(d: dict[str, Any]) -> Config:
    """The stored model section and EXPORT_DATA_FIELDS as a validated Config; every other field keeps
    its default. A run written by an older release may hold training values this one refuses
    (0.3.0 took train.threads=-1), and its weights export all the same."""
    data = d.get("data") if isinstance(d.get("data"), dict) else {}
    kept = {"model": d.get("model", {}), "data": {k: v for k, v in data.items() if k in EXPORT_DATA_FIELDS}}
    if "preset" in d:
        kept["preset"] = d["preset"]
    return config_from_dict(kept)

"""Reading a run configuration: YAML files with a ``base:`` chain, ``section.key=value``
overrides, each value checked against its field's type, then the cross-field checks
(:func:`~delta_jax.config.checks.validate`)."""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from delta_jax.config.checks import validate
from delta_jax.config.sections import SECTIONS, Config, ConfigError

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _closest(name: str, choices: Sequence[str], prefix: str = "") -> str:
    choices = [prefix + c for c in choices]
    close = difflib.get_close_matches(prefix + name, choices, n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else f"; valid: {', '.join(choices)}"


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to the annotated type ``tp``, or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        named = [a for a in args if a is not type(None)]
        if len(named) > 1 and all(a is bool or typing.get_origin(a) is Literal for a in named):
            allowed = [
                *(["true", "false"] if bool in named else []),
                *(repr(v) for a in named if a is not bool for v in typing.get_args(a)),
            ]
            raise ConfigError(f"{key}={value!r} must be one of {', '.join(allowed)}")
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{key}={value!r} must be a non-empty list")
        return tuple(_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r} must be a list of {len(args)} values")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_check_value(f"{key}[{i}]", v, a) for i, (v, a) in pairs)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-6` (no dot) as a string; accept numeric strings only.
        if isinstance(value, str) and _NUMBER.match(value):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}={value!r} must be a mapping of names to values")
        # A copy: the frozen config does not change when the caller's mapping does.
        return {k: _check_value(f"{key}.{k}", copy.deepcopy(v), args[1]) for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _merge(base: dict[str, Any], override: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in override.items():
        if section not in SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}{_closest(section, SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: section {section!r} must be a mapping")
        out.setdefault(section, {}).update(values)
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'base:' chain")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base_name = raw.pop("base", None)
    merged: dict[str, Any] = {}
    if base_name is not None:
        merged = _read_yaml(path.parent / base_name, (*seen, path))
    return _merge(merged, raw, str(path))


def build_config(values: Mapping[str, Mapping[str, Any]], where: str = "config") -> Config:
    """Validate a nested mapping of section -> key -> value into a :class:`Config`."""
    sections = {}
    for section, tp in SECTIONS.items():
        given = dict(values.get(section, {}))
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for key, value in given.items():
            if key not in hints:
                raise ConfigError(
                    f"{where}: unknown key {section}.{key}{_closest(key, hints, f'{section}.')}"
                )
            kwargs[key] = _check_value(f"{section}.{key}", value, hints[key])
        sections[section] = tp(**kwargs)
    for section in values:
        if section not in SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}{_closest(section, SECTIONS)}")
    config = Config(**sections)
    validate(config)
    return config


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into its parts, the value parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    if dotted.count(".") != 1:
        raise ConfigError(f"override {text!r}: the key must be section.key (e.g. algo.loss=dapo)")
    section, key = dotted.split(".")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw  # e.g. an unbalanced bracket: the field's type check reports it
    return section, key, value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (with its ``base:`` chain) and apply ``section.key=value`` overrides.

    Args:
      path: a YAML file, or None for the built-in defaults (the CPU demo).
      overrides: strings such as ``algo.loss=dapo`` or ``run.steps=10``.

    Returns:
      The validated, frozen :class:`Config`.

    Raises:
      ConfigError: one line naming the bad key or value.
    """
    values: dict[str, Any] = {} if path is None else _read_yaml(Path(path))
    for text in overrides:
        section, key, value = parse_override(text)
        values = _merge(values, {section: {key: value}}, f"override {text!r}")
    return build_config(values, where=str(path) if path else "config")

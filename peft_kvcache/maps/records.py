"""Typed JSON records: dataclasses read from JSON (or built in Python) with every field checked against its
annotation; every problem is a `RecordError` naming the dotted field, which the caller turns into its own layer's
error (a map's config.json: `ArtifactError`; calibration options: `CalibrationError`; the vLLM connector's options:
its own)."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import MISSING, asdict, field, fields, is_dataclass
from typing import Any, Union

from ..errors import RecordError


def help_field(text: str, **kwargs) -> Any:
    """A dataclass field that carries its description in ``metadata["help"]`` (where the CLI reads its flags' help)."""
    return field(metadata={"help": text}, **kwargs)


def to_json(record) -> dict:
    """A record as JSON-ready data (nested records become dicts; json writes tuples as lists)."""
    return asdict(record)


def check_fields(record, where: str) -> None:
    """Refuse a record built in Python whose fields do not match their annotations (``top_k="2"``), with the
    same messages as `from_json`."""
    hints = typing.get_type_hints(type(record))
    for f in fields(record):
        _convert(hints[f.name], getattr(record, f.name), f"{where}.{f.name}")


def from_json(cls: type, data: Any, where: str):
    """Build record ``cls`` from JSON ``data``, checking every field against its annotation (numbers finite,
    ints not bools, nested records recursively) and refusing unknown and missing keys; then the record's own
    ``validate`` checks ranges. Every problem raises `RecordError` naming the dotted field."""
    if not isinstance(data, dict):
        raise RecordError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise RecordError(f"{where} has unknown keys {unknown}; known: {sorted(known)}")
    missing = sorted(name for name, f in known.items()
                     if name not in data and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise RecordError(f"{where} is missing keys {missing}")
    values = {name: _convert(hints[name], data[name], f"{where}.{name}") for name in known if name in data}
    try:
        record = cls(**values)  # a record that validates itself when built (__post_init__) says so here
    except RecordError as err:
        raise RecordError(f"{where}: {err}") from None
    if hasattr(record, "validate"):
        record.validate(where)
    return record


def _convert(annotation, value, where: str):
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, where)
        for option in options:
            try:
                return _convert(option, value, where)
            except RecordError:
                continue
        raise RecordError(f"{where} must be one of {options}, got {value!r}")
    if is_dataclass(annotation):
        return from_json(annotation, value, where)
    if annotation is bool:
        if type(value) is not bool:
            raise RecordError(f"{where} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if type(value) is not int:
            raise RecordError(f"{where} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise RecordError(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise RecordError(f"{where} must be a string, got {type(value).__name__}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecordError(f"{where} must be a list, got {type(value).__name__}")
        item = args[0] if args else Any
        converted = [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(converted) if origin is tuple else converted
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RecordError(f"{where} must be an object with string keys")
        return {k: _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"no JSON conversion for {annotation!r}")  # a programming error, not bad input

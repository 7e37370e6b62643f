"""The field machinery of :mod:`dflash_ipc.config`: walking a TOML table against a Config
dataclass, coercing each value to its declared type, and the errors that name the dotted key."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration problem, already phrased as ``FILE: dotted.key: what to change``.

    Made by :meth:`at`, it also holds the file, key and message apart: the probe process sends
    them back to the supervisor, which raises the same error (:mod:`dflash_ipc.runtime.probe`)."""

    source: str | None = None
    key: str | None = None
    detail: str | None = None

    @classmethod
    def at(cls, source: str, key: str, message: str) -> ConfigError:
        err = cls(f"{source}: {key}: {message}")
        err.source, err.key, err.detail = source, key, message
        return err


def require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise FieldError(key, message)


class FieldError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
        self.message = message


def build_section(cls: type, table: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        dotted = f"{prefix}.{key}"
        if key not in fields:
            raise ConfigError(f"{source}: {dotted}: unknown key{did_you_mean(key, fields)}")
        try:
            kwargs[key] = _coerce(value, hints[key], dotted)
        except FieldError as e:
            raise ConfigError(f"{source}: {e.key}: {e.message}") from None
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(f"{source}: {prefix}.{e.key}: {e.message}") from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list,):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, dotted: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise FieldError(dotted, f"must be one of {', '.join(repr(c) for c in choices)} (got {value!r})")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise FieldError(dotted, f"must be a {_type_name(tp)} (got {type(value).__name__} {value!r})")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(dotted, f"must be a table (got {type(value).__name__})")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _coerce(value, alt, dotted)
            except FieldError:
                continue
        raise FieldError(dotted, f"must be {_type_name(tp)} (got {value!r})")
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise FieldError(dotted, f"must be true or false (got {value!r})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(dotted, f"must be an integer (got {type(value).__name__} {value!r})")
        if not -(2**63) <= value < 2**63:  # tomllib reads any length; TOML's integers, like torch's, are 64-bit
            raise FieldError(dotted, f"{value} does not fit a 64-bit integer (TOML integers are 64-bit); use a smaller value")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(dotted, f"must be a number (got {type(value).__name__} {value!r})")
        if not math.isfinite(value):
            raise FieldError(dotted, f"must be a finite number (got {value!r})")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise FieldError(dotted, f"must be a string (got {type(value).__name__} {value!r})")
        return value
    raise FieldError(dotted, f"unsupported type {tp}")


def did_you_mean(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    valid_list = ", ".join(sorted(valid))
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (valid: {valid_list})"
